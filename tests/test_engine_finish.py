"""What the engine core can tell of how a request ended (:mod:`kvprof.vllm.finish`), on requests shaped
as vLLM's ``Request`` is at ``_free_request`` (its status, stop reason and output token ids); the
served path is tested on real vLLM in tests/vllm/test_finish_live.py."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest

from kvprof.models.finish import END_OF_TURN, OTHER, TOOL_CALL, UNKNOWN, finish_code
from kvprof.vllm.finish import engine_finish_code, stop_value


class Status(enum.IntEnum):  # vLLM's RequestStatus names (the rule reads names only)
    RUNNING = 5
    FINISHED_STOPPED = 7
    FINISHED_LENGTH_CAPPED = 8
    FINISHED_ABORTED = 9


def ended(status, output=(), stop_reason=None):
    return SimpleNamespace(status=status, output_token_ids=list(output), stop_reason=stop_reason)


TOOLS = frozenset({900, 901})


@pytest.mark.parametrize("request_,code", [
    (ended(Status.FINISHED_STOPPED, [5, 900, 6, 2]), TOOL_CALL),  # a tool-call token in the output
    (ended(Status.FINISHED_STOPPED, [5, 6], stop_reason=901), TOOL_CALL),  # the tool-call token stopped it
    (ended(Status.FINISHED_STOPPED, [5, 6, 2]), END_OF_TURN),
    (ended(Status.FINISHED_STOPPED, [5], stop_reason="\n\n"), END_OF_TURN),  # a stop string
    (ended(Status.FINISHED_LENGTH_CAPPED, [900, 5]), OTHER),  # cut short: not a finished tool call
    (ended(Status.FINISHED_ABORTED, []), OTHER),
    (ended(Status.RUNNING, [900]), UNKNOWN),
])
def test_a_finish_is_told_by_the_models_tool_call_tokens(request_, code):
    assert engine_finish_code(request_, TOOLS) == code


def test_without_tool_call_tokens_the_engine_tells_nothing():
    assert engine_finish_code(ended(Status.FINISHED_STOPPED, [900]), frozenset()) == UNKNOWN


@pytest.mark.parametrize("code,reason", [(TOOL_CALL, "stop"), (END_OF_TURN, "stop"), (OTHER, "length"),
                                         (OTHER, "abort")])
def test_the_recorded_stop_reads_back_as_the_same_code(code, reason):
    assert finish_code(stop_value(code, reason)) == code


def test_an_unknown_finish_records_no_stop():
    assert stop_value(UNKNOWN, "stop") == "" and finish_code("") == UNKNOWN
