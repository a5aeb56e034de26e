"""``kvprof replay`` against servers that misbehave, one fake server per way (issue 14): whatever happens,
what was measured is written, a server's numbers are checked, and every failure is one counted error.

The fake servers are ``test_replay_cli``'s stub with its answers changed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import invoke, one_line
from tests.test_replay_cli import (  # noqa: F401
    CACHE_INFO, N_REQUESTS, good_answer, replay, results_of, sse, stub, trace, trace_rows,
)

METRICS = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"


def open_stream(handler) -> None:
    """Start an event-stream answer of unknown length, the caller writing its body."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()


def records_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


# --- the capacity, before the first request ----------------------------------------------------------


BAD_BLOCKS = ["0", "9223372036854775808", "\u00b2", "-4", "48.0", "4_8", "\u0664\u0668"]


def test_a_capacity_the_server_reports_wrong_stops_replay_before_its_first_request(stub, trace, tmp_path):
    url, handler = stub
    for blocks in BAD_BLOCKS:
        handler.metrics = METRICS + CACHE_INFO.replace('num_gpu_blocks="48"', f'num_gpu_blocks="{blocks}"')
        result = replay(trace, url, tmp_path / "out")
        assert result.exit_code == 1, (blocks, result.output)
        assert "num_gpu_blocks must be an integer from 1" in one_line(result.stderr) and "--capacity" in result.stderr
        assert handler.bodies == [] and not (tmp_path / "out").exists()
    # with --capacity the run goes on, the server's figure recorded as unknown
    result = replay(trace, url, tmp_path / "out", "--capacity", "48")
    assert result.exit_code == 0, result.output
    assert results_of(tmp_path / "out")["inputs"]["server"]["num_gpu_blocks"] is None


# --- a server's numbers -------------------------------------------------------------------------------


def _usage(body, **overrides) -> dict:
    usage = {"prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": 16}}
    usage.update(overrides)
    return usage


ANSWERS = {
    # item 6: details without cached_tokens was counted as 0 cached
    "details without cached_tokens": (lambda body: sse({"choices": [{"text": "x"}]},
                                                       {"choices": [], "usage": _usage(body, prompt_tokens_details={})}),
                                      "prompt_tokens_details has no cached_tokens"),
    # item 8: ten times the prompt sent
    "ten times the prompt": (lambda body: sse({"choices": [{"text": "x"}]}, {
        "choices": [], "usage": _usage(body, prompt_tokens=10 * len(body["prompt"]))}),
        "the server counts 600 prompt tokens of the 60 sent"),
    # item 1: a count beyond int64 (the sums once overflowed and nothing was written)
    "a count beyond 64 bits": (lambda body: sse({"choices": [{"text": "x"}]}, {
        "choices": [], "usage": _usage(body, prompt_tokens=2**64)}), "wrong count: the server counts"),
    "choices a string": (lambda body: sse({"choices": "x"}, {"choices": [], "usage": _usage(body)}),
                         "choices is not a list of objects"),
    "choices of numbers": (lambda body: sse({"choices": [1]}, {"choices": [], "usage": _usage(body)}),
                           "choices is not a list of objects"),
    "more tokens than asked": (lambda body: sse(*[{"choices": [{"text": "x"}]}] * 10, {"choices": [], "usage": _usage(body)}),
                               "more than 5 token events for max_tokens 4"),
    "no token": (lambda body: sse({"choices": [], "usage": _usage(body)}), "no token was streamed"),
}


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_a_server_number_that_disagrees_with_what_was_sent_is_a_counted_error(stub, trace, tmp_path, case):
    url, handler = stub
    answer, words = ANSWERS[case]
    handler.respond = lambda self, body: self._reply("text/event-stream", answer(body))
    result = replay(trace, url, tmp_path)
    assert result.exit_code == 1, result.output
    run = results_of(tmp_path)["runs"][0]
    assert run["n_requests"] == run["n_errors"] == N_REQUESTS
    assert all(words in r["error"] for r in records_of(tmp_path)), records_of(tmp_path)[0]
    assert f"all {N_REQUESTS} requests failed alike" in one_line(result.stderr)
    # item 23: a request not answered counts its prompt as uncached, as a simulated run's rejected ones
    assert run["prompt_tokens"] == 60 * N_REQUESTS and run["cached_tokens"] == 0 and run["token_hit_ratio"] == 0


def test_keep_alive_comments_are_no_progress(stub, trace, tmp_path):
    """Item 7: a server that streams only ': ping' never timed out; --timeout now bounds time without a token."""
    url, handler = stub

    def pings(self, body):
        open_stream(self)
        try:
            for _ in range(100):
                self.wfile.write(b": ping\n\n")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass  # replay gave up and closed the connection

    handler.respond = pings  # 10 s of pings, then the end of a stream without usage (a bad response)
    result = replay(trace, url, tmp_path, "--timeout", "0.5", "--limit", "3", "--max-concurrency", "3")
    assert result.exit_code == 1, result.output
    run = results_of(tmp_path)["runs"][0]
    assert run["n_timeouts"] == run["n_errors"] == 3
    assert all(r["error_kind"] == "timeout" and "no token for 0.5 s" in r["error"] for r in records_of(tmp_path))


def test_errors_are_grouped_by_kind_not_by_message(stub, trace, tmp_path):
    """Item 24: three too-long prompts were three different errors; markup in a server's message stays text."""
    url, handler = stub

    def refuse_some(self, body):
        n = len(self.bodies)
        if n % 3 == 0:
            self._reply("text/event-stream", good_answer(body))
            return
        message = f"[bold]max context[/] is 50 tokens; you asked for {n} tokens"
        self._reply("application/json", json.dumps({"error": {"message": message}}).encode(), status=400)

    handler.respond = refuse_some
    result = replay(trace, url, tmp_path)
    assert result.exit_code == 1
    line = one_line(result.stderr)
    failed = results_of(tmp_path)["runs"][0]["n_errors"]
    assert 0 < failed < N_REQUESTS and f"{failed} of {N_REQUESTS} requests failed alike: HTTP 400:" in line
    assert "[bold]max context[/] is 50 tokens" in line
    kinds = {r["error_kind"] for r in records_of(tmp_path) if r["error"]}
    assert kinds == {"HTTP 400"}


# --- the server's context (item 24) -------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["skip", "clip"])
def test_prompts_beyond_the_servers_context_are_skipped_or_clipped_by_choice(stub, trace, tmp_path, choice):
    url, handler = stub
    handler.models = {"object": "list", "data": [{"id": "other", "max_model_len": 4096},
                                                 {"id": "m", "max_model_len": 50}]}
    result = replay(trace, url, tmp_path, "--too-long", choice)
    document = results_of(tmp_path)
    run, records = document["runs"][0], records_of(tmp_path)
    assert document["inputs"]["server"]["max_model_len"] == 50 and document["config"]["too_long"] == choice
    if choice == "skip":
        assert result.exit_code == 0 and run["n_skipped"] == N_REQUESTS and run["n_requests"] == 0
        assert len(handler.bodies) == 1  # the test request only
        assert all("exceed the server's max_model_len 50" in r["skipped"] for r in records)
        assert "--too-long clip" in one_line(result.stderr)
    else:
        assert result.exit_code == 0 and run["n_skipped"] == 0 and run["n_requests"] == N_REQUESTS
        assert {len(body["prompt"]) for body in handler.bodies[1:]} == {50 - 4}
        assert all(r["prompt_tokens"] == 46 and r["trace_tokens"] == 60 for r in records)


@pytest.mark.parametrize("models", [{"data": "x"}, {"data": [{"id": "m", "max_model_len": "many"}]}, [1, 2]])
def test_a_models_list_that_says_nothing_usable_is_no_limit_or_an_error_before_sending(stub, trace, tmp_path, models):
    url, handler = stub
    handler.models = models
    result = replay(trace, url, tmp_path)
    if type(models) is dict and type(models["data"]) is list:
        assert result.exit_code == 1 and "max_model_len must be an integer" in one_line(result.stderr)
        assert handler.bodies == []
    else:
        assert result.exit_code == 0, result.output


# --- every way a replay ends writes what it measured (item 1) -----------------------------------------


def test_an_error_while_sending_still_writes_what_was_measured(stub, trace, tmp_path, monkeypatch):
    """A bug in the sending (not a server's answer) keeps its traceback, after the answered requests are written."""
    from kvprof.replay import runner

    url, _ = stub
    real_send = runner._send
    calls = []

    def fails_once(server, request, *args):
        calls.append(request.chat_id)
        if request.chat_id == 5:
            raise RuntimeError("a bug")
        return real_send(server, request, *args)

    monkeypatch.setattr(runner, "_send", fails_once)
    result = replay(trace, url, tmp_path, "--max-concurrency", "1")
    assert isinstance(result.exception, RuntimeError)
    document = results_of(tmp_path)
    assert document["complete"] is False and document["runs"][0]["n_requests"] == len(records_of(tmp_path)) >= 5
    assert invoke("show", tmp_path / "results.json").exit_code == 0


KVPROF = [sys.executable, "-c", "from kvprof.cli.app import main; main()"]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_replay_writes_the_answered_requests_as_an_incomplete_run(stub, tmp_path, signum, code):
    url, handler = stub
    handler.seconds_per_token = 0.3 / 60  # 0.3 s a request, one at a time: 40 requests take 12 s
    rows = [{"chat_id": i, "parent_chat_id": -1, "timestamp": 0.01 * i, "input_length": 60, "output_length": 4,
             "type": "text", "turn": 1, "hash_ids": [1, 2, 100 + i, 200 + i]} for i in range(40)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    # SIGINT as a terminal sends it: a shell's background job would start the child with it ignored
    process = subprocess.Popen([*KVPROF, "replay", str(path), "--url", url, "--model", "m", "--max-concurrency", "1",
                                "-o", str(out)], stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while len(handler.bodies) < 6:
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signum)
    assert process.wait(timeout=60) == code
    stderr = one_line(process.stderr.read().decode())
    document = results_of(out)
    answered = document["runs"][0]["n_requests"]
    assert document["complete"] is False and 4 <= answered < 40 and len(records_of(out)) == answered
    assert f"interrupted after {answered} of 40 requests" in stderr and "complete: false" in stderr
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())
    shown = invoke("show", out / "results.json")
    assert shown.exit_code == 0 and "incomplete" in shown.stdout


# --- what a run says of itself ------------------------------------------------------------------------


def test_requests_carry_their_workload_and_class_and_show_counts_the_failed_ones(stub, trace, tmp_path):
    """Item 22 (show had no error column) and 26 (requests.jsonl carried no class)."""
    url, handler = stub
    handler.second_event = {"error": {"message": "overloaded"}}
    hp = tmp_path / "hp.json"
    hp.write_text(json.dumps({"a": {"text_1": 0.02}, "p": {"text_1": 0.4}}))
    result = replay(trace, url, tmp_path / "live", "--config", hp)
    assert result.exit_code == 1
    record = records_of(tmp_path / "live")[0]
    assert record["workload"] == {"type": "text", "turn": 1} and record["workload_class"] == "text_1"
    assert record["error_kind"] == "server error" and record["wait_s"] >= 0
    shown = invoke("show", tmp_path / "live" / "results.json")
    assert shown.exit_code == 0 and f"{N_REQUESTS} failed" in shown.stdout
    assert "counts all its prompt tokens as uncached" in one_line(shown.stdout)


def test_a_server_that_falls_behind_is_said_so(stub, trace, tmp_path):
    """Item 26: replay did not warn when the server could not keep up (QTTFT then measures the queue)."""
    url, handler = stub
    handler.seconds_per_token = 0.3 / 60  # 0.3 s a request, one at a time, requests due every 5 ms
    result = replay(trace, url, tmp_path, "--max-concurrency", "1")
    assert result.exit_code == 0, result.output
    assert "the server fell behind" in one_line(result.stderr) and "--max-concurrency 1" in one_line(result.stderr)


# --- a server that sends without end ------------------------------------------------------------------


def test_answers_are_read_up_to_a_bound_never_into_all_memory(stub, trace, tmp_path, monkeypatch):
    """A stream that never ends an event, an error body or a /metrics page without end: each is cut at a
    bound (here made small) and counted as an error, instead of growing in memory for --timeout seconds."""
    from kvprof.replay import server

    monkeypatch.setattr(server, "MAX_STREAM_BYTES", 64 << 10)
    monkeypatch.setattr(server, "MAX_PAGE_BYTES", 64 << 10)
    url, handler = stub

    def endless(self, body):
        open_stream(self)
        try:
            self.wfile.write(b"data: " + b"x" * (200 << 10))  # one event that never ends
        except OSError:
            pass

    handler.respond = endless
    result = replay(trace, url, tmp_path / "a", "--limit", "2")
    assert result.exit_code == 1 and "a stream of more than 65,536 bytes" in one_line(result.stderr)
    assert all("a stream of more than" in r["error"] for r in records_of(tmp_path / "a"))

    def long_error(self, body):
        self._reply("text/plain", b"[bold]" + b"e" * (1 << 20), status=500)

    handler.respond = long_error
    handler.bodies.clear()  # the next test request is answered well again
    result = replay(trace, url, tmp_path / "b", "--limit", "2")
    assert result.exit_code == 1 and "HTTP 500: [bold]eee" in one_line(result.stderr)
    assert all(len(r["error"]) < 1000 for r in records_of(tmp_path / "b"))

    handler.metrics = METRICS + CACHE_INFO + "# " + "m" * (100 << 10) + "\n"
    result = replay(trace, url, tmp_path / "c", "--limit", "2")
    assert result.exit_code == 1 and "/metrics sent more than" in result.stderr and not (tmp_path / "c").exists()


def test_a_tag_holding_a_lone_surrogate_is_sent_escaped(stub, tmp_path):
    """A trace's string may hold a lone surrogate (JSON reads one; such a value is a class of its own, printed
    escaped): replay sends its request as ASCII JSON, where the surrogate is an escape, and writes everything."""
    url, handler = stub
    rows = [dict(row, hint_session="\ud800", type="t\udfff") for row in trace_rows()]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = replay(path, url, tmp_path / "live")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    sent = handler.bodies[-1]["vllm_xargs"]
    assert sent["hint_session"] == "\ud800" and sent["type"] == "t\udfff"
    assert len(records_of(tmp_path / "live")) == len(rows)
