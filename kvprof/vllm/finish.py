"""How a request ended, as vLLM's engine core can tell it: the finish code its policy and its recording get.

The engine core sees token ids, never parsed text: it knows that a request stopped (end of sequence, a
stop string or token), hit its length limit or was aborted, but a tool call and a final answer both
just stop. A model marks a tool call with tokens of its own (Hermes-style ``<tool_call>`` in Qwen 2.5
and 3, ``<|python_tag|>`` in Llama 3.1, ``[TOOL_CALLS]`` in Mistral); given their ids
(``--kv-tool-call-tokens``), a stopped request whose output holds one is a tool call and any other
stopped request an end of turn. Without them the engine tells no code (0) for a stop: the
finish-reason candidate is then plain LRU, as for a trace without ``stop``.
"""

from __future__ import annotations

from kvprof.models.finish import END_OF_TURN, OTHER, TOOL_CALL, UNKNOWN

#: The ``stop`` value a recording writes for each code (a trace's own names, :mod:`kvprof.models.finish`);
#: for :data:`OTHER`, vLLM's finish reason (``length``, ``abort``) is written instead.
STOP_VALUES = {TOOL_CALL: "tool_use", END_OF_TURN: "end_turn"}


def engine_finish_code(request, tool_call_tokens: frozenset[int]) -> int:
    """The finish code of a finished vLLM ``Request``: :data:`~kvprof.models.finish.TOOL_CALL` where it
    stopped with one of ``tool_call_tokens`` in its output (or as the stop token that ended it),
    :data:`~kvprof.models.finish.END_OF_TURN` where it stopped otherwise, :data:`~kvprof.models.finish.OTHER`
    where it ended another way (length, abort, error), :data:`~kvprof.models.finish.UNKNOWN` without
    tokens to tell a tool call by, or for a request not finished."""
    if not tool_call_tokens:
        return UNKNOWN
    status = request.status.name
    if status == "FINISHED_STOPPED":
        if request.stop_reason in tool_call_tokens or not tool_call_tokens.isdisjoint(request.output_token_ids):
            return TOOL_CALL
        return END_OF_TURN
    return OTHER if status.startswith("FINISHED_") else UNKNOWN


def stop_value(code: int, reason) -> str:
    """A recording's ``stop`` for ``code``: the trace name of a tool call or an end of turn, vLLM's
    finish reason ``reason`` otherwise (empty where there is none)."""
    return STOP_VALUES.get(code) or ("" if reason is None or code == UNKNOWN else str(reason))
