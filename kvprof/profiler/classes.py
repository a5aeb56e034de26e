"""Workload classes of a whole trace, vectorised over :func:`kvprof.classes.workload_class`."""

from __future__ import annotations

import numpy as np

from kvprof.classes import ClassRule, workload_class


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
        values, inverse = np.unique(field_texts(column), return_inverse=True)
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


def field_texts(column) -> np.ndarray:
    """A field's values as text, ``""`` where a request has none (as a live request without the tag,
    never ``"None"``), so the profiler names the classes and features the live policy does."""
    column = np.asarray(column)
    if column.dtype == object:
        column = np.where(column == None, "", column)  # noqa: E711 - elementwise
    return column.astype(str)
