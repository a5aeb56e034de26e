"""How a request ended, told by a real ``vllm serve --kv-tool-call-tokens``: the recording says, per
request, the tool call, end of turn or length limit the engine saw, and ``kvprof`` reads it as the
finish codes ``wa``'s finish-reason candidate and ``kvprof fit``'s retention figures use.

The tiny model's output is arbitrary, so the test makes the engine stop where it can read how: each
request lists every ordinary token id as a stop token, so it stops at its first generated token, and
the response names that token (vLLM's ``stop_reason``); the even ids are the "tool-call tokens". A
request that stops on an even id is a tool call, on an odd one (or the end of sequence) an end of turn,
and one whose output is cut at ``max_tokens`` ended otherwise (``length``).
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tiny_model import SPECIAL, VOCAB_SIZE
from vllm_support import vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ORDINARY = range(len(SPECIAL), VOCAB_SIZE)  # the special tokens (end of sequence among them) are not tool calls
TOOL_CALL_TOKENS = [i for i in ORDINARY if i % 2 == 0]


def _complete(url: str, prompt: list[int], **sampling) -> dict:
    body = {"model": "tiny", "prompt": prompt, "temperature": 0.0, **sampling}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]


@pytest.fixture(scope="module")
def told(vllm_venv, tiny_model, tmp_path_factory):
    """Requests served by ``vllm serve --kv-policy finish-reason --kv-record --kv-tool-call-tokens``, each
    with the ``stop`` it should be recorded with; the server stopped, the recording finished."""
    tmp = tmp_path_factory.mktemp("finish-live")
    rec = tmp / "rec"
    expected = []
    with vllm_server(vllm_venv, tiny_model, "--kv-policy", "finish-reason", "--kv-record", str(rec),
                     "--kv-tool-call-tokens", ",".join(map(str, TOOL_CALL_TOKENS)), log=tmp / "serve.log") as url:
        for k in range(12):
            prompt = [len(SPECIAL) + k] + [(7 * i + k) % 400 + 20 for i in range(40)]
            choice = _complete(url, prompt, max_tokens=8, stop_token_ids=list(ORDINARY))
            assert choice["finish_reason"] == "stop", choice
            tool_call = choice.get("stop_reason") in TOOL_CALL_TOKENS
            expected.append("tool_use" if tool_call else "end_turn")
        choice = _complete(url, [len(SPECIAL) + 20] * 30, max_tokens=2, min_tokens=2, ignore_eos=True)
        assert choice["finish_reason"] == "length", choice
        expected.append("length")
        time.sleep(3)  # the writer closes a frame
    time.sleep(3)  # the guard finishes the recording after the engine core went
    return rec, expected


def test_the_recording_says_how_each_request_ended_as_the_engine_saw_it(told):
    from kvprof.models.finish import END_OF_TURN, OTHER, TOOL_CALL
    from kvprof.profiler.reader import read_trace

    rec, expected = told
    assert {"tool_use", "end_turn"} <= set(expected), expected  # both kinds met, so the check tells them apart
    trace, _ = read_trace(rec)
    order = trace.timestamp.argsort(kind="stable")
    assert [trace.extra["stop"][i] for i in order] == expected
    codes = {"tool_use": TOOL_CALL, "end_turn": END_OF_TURN, "length": OTHER}
    assert trace.finish[order].tolist() == [codes[s] for s in expected]
