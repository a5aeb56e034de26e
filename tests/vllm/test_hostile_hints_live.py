"""A hostile client's hints against a real ``vllm serve``: every malformed ``vllm_xargs`` hint gets a 400
naming its field and changes nothing for anyone else; valid hints at the fields' extremes are served,
recorded and honoured by the pool's eviction like any other."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

pytestmark = pytest.mark.vllm

#: Malformed hints, each with the field its 400 must name. JSON text, so that a number no float holds
#: and NaN arrive as a client sends them. An integer past 64 bits is vLLM's own 400, naming ``extra_args``.
MALFORMED = [
    ('{"retain_s": 1' + "0" * 400 + "}", "extra_args integers"),
    ('{"retain_s": 9223372036854775807}', "hint field 'retain_s'"),
    ('{"retain_s": NaN}', "hint field 'retain_s'"),
    ('{"retain_s": Infinity}', "hint field 'retain_s'"),
    ('{"retain_s": -1}', "hint field 'retain_s'"),
    ('{"retain_s": 31536001}', "hint field 'retain_s'"),
    ('{"retain_s": "5"}', "hint field 'retain_s'"),
    ('{"retain_s": [5]}', "hint field 'retain_s'"),
    ('{"release": 2}', "hint field 'release'"),
    ('{"release": "true"}', "hint field 'release'"),
    ('{"release": 1, "retain_s": 5}', "'release' and 'retain_s' > 0 contradict"),
    ('{"retain_s": 5, "retain_priority": 100}', "hint field 'retain_priority'"),
    ('{"retain_s": 5, "retain_priority": 5.5}', "hint field 'retain_priority'"),
    ('{"retain_s": 5, "hint_tag": 2147483648}', "hint field 'hint_tag'"),
    ('{"retain_s": 5, "hint_tag": -1}', "hint field 'hint_tag'"),
    # a misspelt hint field, which a tag would have lost without a word
    ('{"retian_s": 30}', "'retian_s' is not a hint field; did you mean 'retain_s'"),
    ('{"Retain_S": 30}', "'Retain_S' is not a hint field; did you mean 'retain_s'"),
    ('{"retain": 30}', "'retain' is not a hint field; did you mean 'retain_s'"),
    ('{"hint_foo": 1}', "'hint_foo' is not a hint field"),
]
MAX_RETAIN_S = 31536000
#: Valid hints at the extremes: the longest retention, the top and bottom priority, the largest tag.
EXTREME = [{"retain_s": MAX_RETAIN_S, "retain_priority": 99, "hint_tag": 2**31 - 1},
           {"retain_s": MAX_RETAIN_S, "retain_priority": 0, "hint_tag": 0}]
#: Unhinted prompts sent after the extreme ones: 24 full blocks, more than the 9 the retained ones leave.
N_FILLERS = 8


def _prompt(k: int) -> list[int]:
    """Prompt ``k``: 100 tokens, three full 32-token blocks, distinct for each ``k``."""
    return [3 + k] + [(7 * i + 13 * k) % 400 + 20 for i in range(99)]


def _body(k: int, xargs: str | None) -> str:
    head = json.dumps({"model": "tiny", "prompt": _prompt(k), "max_tokens": 1, "temperature": 0.0})
    return head if xargs is None else f'{head[:-1]}, "vllm_xargs": {xargs}}}'


def _cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


@pytest.fixture(scope="module")
def served(vllm_venv, tiny_model, tmp_path_factory):
    """One server (``--kv-policy lru``, a budget of half the cache per tag, tool-call tokens, a recording):
    the extreme hints, the malformed ones, unhinted prompts that overfill the cache, the extreme prompts
    again; every answer, and /metrics at the end."""
    from vllm_support import post_completion, vllm_server

    tmp = tmp_path_factory.mktemp("hostile-hints")
    rec = tmp / "rec"
    answers: dict[str, list] = {"extreme": [], "malformed": [], "fillers": [], "again": []}
    with vllm_server(vllm_venv, tiny_model, "--kv-policy", "lru", "--kv-hint-max-fraction", "0.5",
                     "--kv-tool-call-tokens", "5,7", "--kv-record", str(rec), log=tmp / "serve.log") as url:
        for k, hint in enumerate(EXTREME):
            answers["extreme"].append(post_completion(url, _body(k, json.dumps(hint))))
        for n, (xargs, _) in enumerate(MALFORMED):
            answers["malformed"].append(post_completion(url, _body(100 + n, xargs)))
        streamed = json.loads(_body(99, '{"retain_s": -1}'))
        streamed["stream"] = True
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(streamed).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answers["streamed"] = (r.status, r.read().decode())
        time.sleep(1)  # the API server has logged the refusal: the log up to here (a stop logs its own errors)
        answers["log_after_stream"] = (tmp / "serve.log").read_text()
        for k in range(N_FILLERS):
            answers["fillers"].append(post_completion(url, _body(10 + k, None)))
        for k, hint in enumerate(EXTREME):
            answers["again"].append(post_completion(url, _body(k, None)))
        time.sleep(2.5)  # a metrics snapshot and a closed frame of the recording
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            answers["metrics"] = r.read().decode()
    time.sleep(3)  # the guard finishes the recording after the engine core went
    return {**answers, "rec": rec}


def test_each_malformed_hint_gets_a_400_naming_its_field(served):
    for (xargs, named), (status, body) in zip(MALFORMED, served["malformed"]):
        assert status == 400, (xargs[:60], status, body)
        assert named in body["error"]["message"], (xargs[:60], body)


def test_a_streamed_malformed_hint_ends_its_stream_with_a_400_event_and_one_log_line(served):
    # vLLM refuses a streamed request once its stream has begun: HTTP 200, then the error as an event
    status, body = served["streamed"]
    assert status == 200 and '"code": 400' in body and "hint field 'retain_s'" in body
    log = served["log_after_stream"]
    lines = [line for line in log.splitlines() if "streamed request's hint was refused" in line]
    assert len(lines) == 1 and "WARNING" in lines[0] and "hint field 'retain_s'" in lines[0]
    assert "Traceback" not in log and "Error in completion stream generator" not in log


def test_the_server_serves_on_and_records_only_the_served_requests(served):
    from kvprof.models.hints import Hint
    from kvprof.profiler.reader import read_trace

    served_answers = served["extreme"] + served["fillers"] + served["again"]
    assert all(status == 200 for status, _ in served_answers), served_answers
    trace, _ = read_trace(served["rec"])
    assert trace.n_requests == len(served_answers)  # no refused request reached the engine
    order = trace.timestamp.argsort(kind="stable")
    hints = [trace.hints.hints()[i] for i in order]
    assert hints[:2] == [Hint(float(MAX_RETAIN_S), 99, False, 2**31 - 1), Hint(float(MAX_RETAIN_S), 0, False, 0)]
    assert hints[2:] == [None] * (len(served_answers) - 2)


def test_retentions_at_the_extremes_lapse_once_beyond_the_caches_horizon(served):
    """The two prompts retained for the longest time allowed (6 blocks, each within its tag's 7) are
    retained while the cache has not evicted yet; once it has, and time passed, their day-long retentions
    are longer than the seconds a block lives in it, so they lapse into the policy's order (counted
    beyond_horizon) instead of pinning a third of the cache: sent again after 24 blocks of other prompts
    went through it, neither is found."""
    assert [_cached(body) for _, body in served["extreme"]] == [0, 0]
    assert [_cached(body) for _, body in served["again"]] == [0, 0]
    beyond = [line for line in served["metrics"].splitlines()
              if line.startswith("kvprof_hint_blocks_total{") and 'outcome="beyond_horizon"' in line
              and 'tier="gpu"' in line]
    assert beyond and float(beyond[0].rsplit(" ", 1)[1]) >= 6, beyond


def test_tool_call_tokens_beyond_the_models_vocabulary_stop_the_server_naming_the_flag(vllm_venv, tiny_model,
                                                                                        tmp_path):
    """Qwen's ``<tool_call>`` id given to another model: no response could hold it, so every one would be
    recorded as an end of turn; vLLM does not start, and says why in one line."""
    from vllm_support import free_port, run_to_exit, serve_command

    rc, out = run_to_exit(serve_command(vllm_venv, tiny_model, free_port(), "--kv-policy", "lru",
                                        "--kv-tool-call-tokens", "5,151657"), timeout=240, cwd=tmp_path)
    expected = "tool_call_tokens (--kv-tool-call-tokens) 151657 beyond the model's vocabulary of"
    assert rc == 2, out[-3000:]
    assert "Traceback" not in out and sum(expected in line for line in out.splitlines()) == 1, out[-3000:]
