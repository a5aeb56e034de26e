"""How a request ended, told by a real ``vllm serve --kv-tool-call-tokens``: the recording says, per
request, the tool call, end of turn or length limit the engine saw, and ``kvprof`` reads it as the
finish codes ``wa``'s finish-reason candidate and ``kvprof fit``'s retention figures use.

The served ``finish-reason`` policy hears the same codes at each free: its hits are what ``kvprof compare``
replays from the recording, and differ from LRU's.

The tiny model's output is arbitrary, so the test makes the engine stop where it can read how: each
request lists every ordinary token id as a stop token, so it stops at its first generated token, and
the response names that token (vLLM's ``stop_reason``); the even ids are the "tool-call tokens". A
request that stops on an even id is a tool call, on an odd one (or the end of sequence) an end of turn,
and one whose output is cut at ``max_tokens`` ended otherwise (``length``).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest

from tiny_model import SPECIAL, VOCAB_SIZE
from vllm_support import vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ORDINARY = range(len(SPECIAL), VOCAB_SIZE)  # the special tokens (end of sequence among them) are not tool calls
TOOL_CALL_TOKENS = [i for i in ORDINARY if i % 2 == 0]


def _complete(url: str, prompt: list[int], **sampling) -> tuple[dict, int]:
    """The response's choice and the prompt tokens vLLM found cached."""
    body = {"model": "tiny", "prompt": prompt, "temperature": 0.0, **sampling}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        response = json.load(r)
    return response["choices"][0], (response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


@pytest.fixture(scope="module")
def told(vllm_venv, tiny_model, tmp_path_factory):
    """Requests served by ``vllm serve --kv-policy finish-reason --kv-record --kv-tool-call-tokens``: twelve
    prompts of three full blocks each sent twice (twice the usable cache in all, so the second round's hits
    depend on what the policy evicted), then one cut at its length limit; each with the ``stop`` it should
    be recorded with and the prompt tokens it found cached. The server stopped, the recording finished."""
    tmp = tmp_path_factory.mktemp("finish-live")
    rec = tmp / "rec"
    expected, cached = [], []
    with vllm_server(vllm_venv, tiny_model, "--kv-policy", "finish-reason", "--kv-record", str(rec),
                     "--kv-tool-call-tokens", ",".join(map(str, TOOL_CALL_TOKENS)), log=tmp / "serve.log") as url:
        for k in list(range(12)) * 2:
            prompt = [len(SPECIAL) + k] + [(7 * i + 13 * k) % 400 + 20 for i in range(99)]
            choice, hit = _complete(url, prompt, max_tokens=8, stop_token_ids=list(ORDINARY))
            assert choice["finish_reason"] == "stop", choice
            expected.append("tool_use" if choice.get("stop_reason") in TOOL_CALL_TOKENS else "end_turn")
            cached.append(hit)
        choice, hit = _complete(url, [len(SPECIAL) + 20] * 30, max_tokens=2, min_tokens=2, ignore_eos=True)
        assert choice["finish_reason"] == "length", choice
        expected.append("length")
        cached.append(hit)
        time.sleep(3)  # the writer closes a frame
    time.sleep(3)  # the guard finishes the recording after the engine core went
    return {"rec": rec, "expected": expected, "cached": cached, "tmp": tmp, "venv": vllm_venv}


def test_the_recording_says_how_each_request_ended_as_the_engine_saw_it(told):
    from kvprof.models.finish import END_OF_TURN, OTHER, TOOL_CALL
    from kvprof.profiler.reader import read_trace

    expected = told["expected"]
    assert {"tool_use", "end_turn"} <= set(expected), expected  # both kinds met, so the check tells them apart
    trace, _ = read_trace(told["rec"])
    order = trace.timestamp.argsort(kind="stable")
    assert [trace.extra["stop"][i] for i in order] == expected
    codes = {"tool_use": TOOL_CALL, "end_turn": END_OF_TURN, "length": OTHER}
    assert trace.finish[order].tolist() == [codes[s] for s in expected]


def _replayed(told, policy: str) -> int:
    """Cached prompt tokens of ``kvprof compare`` replaying the recording under ``policy`` (recorded timing)."""
    out = told["tmp"] / f"compare-{policy}"
    proc = subprocess.run([str(told["venv"] / "bin" / "kvprof"), "compare", str(told["rec"]), "--policies", policy,
                           "--eval-window", "0:", "-o", str(out), "-j", "1"], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    return run["cached_tokens"]


def test_the_served_policy_evicted_by_the_codes_as_the_simulator_does(told):
    """The server's finish-reason policy heard each finish's code: its hits are the simulator's under the
    recorded codes, and not LRU's, which the same policy would have matched without them."""
    live = sum(told["cached"])
    assert live == _replayed(told, "finish-reason")
    assert live != _replayed(told, "lru")
