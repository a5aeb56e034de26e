"""Workload classes: which class a request belongs to.

One pure function, :func:`workload_class`, decides it. The profiler applies it to every request of
a trace and the live policy (simulator or vLLM plugin) applies it to every incoming request, so a
class means the same thing on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Class name used when a trace has no request types (e.g. Mooncake).
SINGLE_CLASS = "all"

CLASS_KEYS = ("type_turn", "type", "field", "none")


@dataclass(frozen=True)
class ClassRule:
    """How a request maps to its workload class.

    Parameters
    ----------
    key : {"type_turn", "type", "field", "none"}
        ``type_turn`` gives ``text_1`` ... ``text_5+`` (turns capped at ``turn_cap``), ``type``
        gives ``text``, ``field`` uses the value of ``field``, ``none`` puts everything in one class.
    turn_cap : int
        Turns at or above this are pooled as ``<type>_<cap>+``.
    field : str or None
        Trace field to key on when ``key == "field"``.
    """

    key: str = "type_turn"
    turn_cap: int = 5
    field: str | None = None

    def __post_init__(self):
        if self.key not in CLASS_KEYS:
            raise ValueError(f"class key {self.key!r} is not one of {', '.join(CLASS_KEYS)}")
        if self.turn_cap < 1:
            raise ValueError(f"turn cap must be >= 1, got {self.turn_cap}")
        if (self.key == "field") != (self.field is not None):
            raise ValueError("a field name is given exactly when the class key is 'field'")

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


def classify_trace(trace, rule: ClassRule) -> tuple[np.ndarray, tuple[str, ...]]:
    """Class of every request of a trace, vectorised.

    :func:`workload_class` is called once per distinct (type, turn) pair, never per request, so
    the names are exactly those the live policy computes.

    Returns
    -------
    codes : int32 array, shape (n_requests,)
        Index into ``names`` for each request.
    names : tuple of str
        Distinct class names, sorted.
    """
    if rule.key == "field":
        if rule.field not in trace.extra and rule.field not in ("type", "turn"):
            known = ", ".join(sorted(trace.extra)) or "none"
            raise ValueError(f"class field {rule.field!r} is not in the trace (other fields: {known})")
        column = {"type": trace.types, "turn": trace.turn}.get(rule.field, trace.extra.get(rule.field))
        values, inverse = np.unique(np.asarray(column).astype(str), return_inverse=True)
        per_value = [workload_class(rule, value=v) for v in values]
    else:
        turns = np.minimum(np.maximum(trace.turn, 1), rule.turn_cap).astype(np.int64)
        pair = trace.type_code.astype(np.int64) * (rule.turn_cap + 1) + turns
        values, inverse = np.unique(pair, return_inverse=True)
        per_value = [
            workload_class(rule, trace.type_names[v // (rule.turn_cap + 1)], int(v % (rule.turn_cap + 1)))
            for v in values
        ]
    names = tuple(sorted(set(per_value)))
    index = {name: i for i, name in enumerate(names)}
    value_code = np.array([index[name] for name in per_value], dtype=np.int32)
    return value_code[inverse.reshape(-1)], names
