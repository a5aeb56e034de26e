"""Workload classes: which class a request belongs to.

One pure function, :func:`workload_class`, decides it. The profiler applies it to every request of
a trace (:func:`kvprof.profiler.classes.classify_trace`) and the live policy (simulator or vLLM
plugin) applies it to every incoming request, so a class means the same thing on both sides. The
module sits below the profiler and the models and imports neither (nor numpy), so the hp file's
loader and the vLLM plugin can use the rule without the profiler.

A class name taken from trace text (a type, a field's value) cannot collide with a name kvprof
derives: the characters derived names are built with (``%@<>,=``), control characters and lone
surrogates are percent-encoded (:func:`name_text`: ``text@reused`` becomes ``text%40reused``,
``<default>`` becomes ``%3Cdefault%3E``), and a value spelling the no-value class ``all`` becomes
``%61ll``. Ordinary names (letters, digits, ``_-.+/:`` and spaces) are unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Class name used when a trace has no request types (e.g. Mooncake).
SINGLE_CLASS = "all"

CLASS_KEYS = ("type_turn", "type", "field", "none")

#: Largest turn cap: a trace's turns are int32, and the vectorised classifier takes the cap as one.
MAX_TURN_CAP = 2**31 - 1

#: What :func:`name_text` percent-encodes: the escape itself, the characters of derived names
#: (``<class>@reused``, ``<default>``, cells' ``class=x,turn<=4``), controls and lone surrogates.
_ENCODED = re.compile(r"[%@<>,=\x00-\x1f\x7f\ud800-\udfff]")


def name_text(value) -> str | None:
    """A trace value as text in a class or feature name, or None for no value (None or empty).

    Percent-encodes what derived names are built with (see the module notes), so distinct values
    give distinct names and none equals a derived one. Python scalars give their ``str``
    (``7``, ``1.5``, ``True``).
    """
    if value is None:
        return None
    text = value if type(value) is str else str(value)
    if not text:
        return None
    if _ENCODED.search(text):
        text = _ENCODED.sub(lambda m: f"%{ord(m.group()):02X}" if ord(m.group()) < 256 else f"%u{ord(m.group()):04X}",
                            text)
    return text


@dataclass(frozen=True)
class ClassRule:
    """How a request maps to its workload class.

    Parameters
    ----------
    key : {"type_turn", "type", "field", "none"}
        ``type_turn`` gives ``text_1`` ... ``text_5+`` (turns capped at ``turn_cap``), ``type``
        gives ``text``, ``field`` uses the value of ``field``, ``none`` puts everything in one class.
    turn_cap : int
        Turns at or above this are pooled as ``<type>_<cap>+``; from 1 to :data:`MAX_TURN_CAP`.
    field : str or None
        Trace field to key on when ``key == "field"``: a non-empty name.
    """

    key: str = "type_turn"
    turn_cap: int = 5
    field: str | None = None

    def __post_init__(self):
        if self.key not in CLASS_KEYS:
            raise ValueError(f"class key {self.key!r} is not one of {', '.join(CLASS_KEYS)}")
        if not 1 <= self.turn_cap <= MAX_TURN_CAP:
            raise ValueError(f"turn cap must be from 1 to {MAX_TURN_CAP}, got {self.turn_cap}")
        if (self.key == "field") != (self.field is not None):
            raise ValueError("a field name is given exactly when the class key is 'field'")
        if self.field == "":
            raise ValueError("the class field's name is empty")

    def to_dict(self) -> dict:
        out = {"key": self.key, "turn_cap": self.turn_cap}
        if self.field is not None:
            out["field"] = self.field
        return out

    @classmethod
    def from_dict(cls, data: dict) -> ClassRule:
        return cls(key=data["key"], turn_cap=int(data.get("turn_cap", 5)), field=data.get("field"))


def is_name_text(text: str) -> bool:
    """Whether ``text`` can be (part of) a name :func:`name_text` writes: not empty, and none of the
    characters it encodes but ``%`` itself."""
    return bool(text) and not _ENCODED.search(text.replace("%", ""))


def workload_class(rule: ClassRule, type_name: str | None = None, turn: int | None = None, value=None) -> str:
    """The class of one request.

    Parameters
    ----------
    rule : ClassRule
    type_name : str or None
        Request type (``text``, ``file`` ...); empty or None when the trace has none.
    turn : int or None
        1-based turn; None counts as turn 1.
    value : object
        The keyed field's value when ``rule.key == "field"``.

    Returns
    -------
    str
        E.g. ``"text_1"``, ``"text_5+"``, ``"file"``, or ``"all"`` when there is nothing to key on;
        trace text in it is encoded by :func:`name_text`.
    """
    if rule.key == "none":
        return SINGLE_CLASS
    name = name_text(value if rule.key == "field" else type_name)
    if name is None:
        return SINGLE_CLASS
    if rule.key in ("field", "type"):
        return "%61ll" if name == SINGLE_CLASS else name  # the value "all" is not the no-value class
    turn = 1 if turn is None else int(turn)
    return f"{name}_{rule.turn_cap}+" if turn >= rule.turn_cap else f"{name}_{max(turn, 1)}"
