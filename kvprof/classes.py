"""Workload classes: which class a request belongs to.

One pure function, :func:`workload_class`, decides it. The profiler applies it to every request of
a trace (:func:`kvprof.profiler.classes.classify_trace`) and the live policy (simulator or vLLM
plugin) applies it to every incoming request, so a class means the same thing on both sides. The
module sits below the profiler and the models and imports neither (nor numpy), so the hp file's
loader and the vLLM plugin can use the rule without the profiler.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Class name used when a trace has no request types (e.g. Mooncake).
SINGLE_CLASS = "all"

CLASS_KEYS = ("type_turn", "type", "field", "none")

#: Largest turn cap: a trace's turns are int32, and the vectorised classifier takes the cap as one.
MAX_TURN_CAP = 2**31 - 1


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
        E.g. ``"text_1"``, ``"text_5+"``, ``"file"``, or ``"all"`` when there is nothing to key on.
    """
    if rule.key == "none":
        return SINGLE_CLASS
    if rule.key == "field":
        return SINGLE_CLASS if value is None or value == "" else str(value)
    if not type_name:
        return SINGLE_CLASS
    if rule.key == "type":
        return type_name
    turn = 1 if turn is None else int(turn)
    return f"{type_name}_{rule.turn_cap}+" if turn >= rule.turn_cap else f"{type_name}_{max(turn, 1)}"
