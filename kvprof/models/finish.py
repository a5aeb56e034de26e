"""How a request's response ended, as the client saw it: a trace's ``stop`` field as a small integer.

An agent runtime knows, when a response arrives, whether it is a tool call (the runtime runs the tool
and sends the result as the session's next request, usually within seconds) or a final answer (the
next request, if any, waits for a person). Traces of agent traffic carry it per request in ``stop``
(weka-agents-dev: ``tool_use``, ``end_turn``, or empty); the reader keeps the field and
:func:`finish_codes` turns it into one code per request:

========  ================  ====================================================================
code      name              values of ``stop``
========  ================  ====================================================================
0         ``unknown``       absent, ``null`` or ``""``
1         ``tool_call``     ``tool_use`` (Anthropic), ``tool_calls`` and ``function_call`` (OpenAI)
2         ``end_turn``      ``end_turn`` (Anthropic), ``stop`` (OpenAI: a natural end, not a tool call)
3         ``other``         any other string (``length``, ``max_tokens``, ``stop_sequence``, ...)
========  ================  ====================================================================

Values are matched exactly (they are API constants, lower case). vLLM's own finish reason, which a
recording keeps as ``finish_reason``, is not read as one: its engine says ``stop`` for a tool call and
a final answer alike (tool calls are parsed later, by the OpenAI front end).
"""

from __future__ import annotations

import numpy as np

#: The trace field that says how a request's response ended.
FINISH_FIELD = "stop"

UNKNOWN, TOOL_CALL, END_OF_TURN, OTHER = 0, 1, 2, 3
#: Names of the codes, indexed by code.
FINISH_NAMES = ("unknown", "tool_call", "end_turn", "other")

#: ``stop`` values with a code other than :data:`OTHER` (the empty string: not recorded).
_CODES = {
    "": UNKNOWN,
    "tool_use": TOOL_CALL,
    "tool_calls": TOOL_CALL,
    "function_call": TOOL_CALL,
    "end_turn": END_OF_TURN,
    "stop": END_OF_TURN,
}


def finish_code(value: str | None) -> int:
    """The code of one ``stop`` value (None: absent)."""
    return UNKNOWN if value is None else _CODES.get(value, OTHER)


def finish_codes(column: np.ndarray | None, n: int) -> np.ndarray:
    """Each request's code (int8, shape ``(n,)``) from the trace's ``stop`` column (None: the trace has none).

    Raises
    ------
    ValueError
        A value other than a string or None (the reader refuses such lines, naming them).
    """
    if column is None:
        return np.zeros(n, dtype=np.int8)
    distinct: dict = {}  # value -> its index among the distinct values (a few, against a row per request)
    rows = np.fromiter((distinct.setdefault(v, len(distinct)) for v in column), dtype=np.int64, count=n)
    bad = next((v for v in distinct if v is not None and type(v) is not str), None)
    if bad is not None:
        raise ValueError(f"the {FINISH_FIELD!r} field must hold strings, got {type(bad).__name__} {bad!r:.40}")
    return np.array([finish_code(v) for v in distinct], dtype=np.int8)[rows]
