"""``kvprof replay`` end to end against a stub server, and ``kvprof show`` of a simulated and a live run together.

The stub speaks what replay reads from vLLM: ``/metrics`` with vLLM 0.32's ``vllm:cache_config_info``
gauge (the line below is a real server's, shortened) and streamed ``/v1/completions`` with usage.
A test changes its answers to play a broken or hostile server. tests/vllm/test_serve.py replays
against a real one.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers import invoke, one_line

CACHE_INFO = ('vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
              'gpu_memory_utilization="0.92",kv_cache_size_tokens="1536",num_cpu_blocks="None",num_gpu_blocks="48",'
              'num_gpu_blocks_override="48",prefix_caching_hash_algo="sha256"} 1.0\n')
CACHED_PER_REQUEST = 16
PLOTS = {"hit_ratio.png", "hit_ratio.svg", "qttft.png", "qttft.svg"}
N_REQUESTS = 12


def sse(*events) -> bytes:
    """A stream of events (objects as JSON, strings as they are), then ``[DONE]``."""
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in (*events, "[DONE]"))


def good_answer(body: dict) -> bytes:
    usage = {"prompt_tokens": len(body["prompt"]),
             "prompt_tokens_details": {"cached_tokens": min(CACHED_PER_REQUEST, len(body["prompt"]))}}
    return sse({"choices": [{"text": "x"}]}, {"choices": [], "usage": usage})


class StubServer(BaseHTTPRequestHandler):
    """Answers like vLLM. ``second_event``, when set, replaces the usage event of every completion after the
    first ``good`` ones (the first is replay's test request), as the issue's srv.py does for all of them;
    ``respond(handler, body)``, when set, answers those completions itself. ``models`` is the body of
    ``/v1/models`` (None: 404, as a server without it)."""

    metrics: str | None = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n" + CACHE_INFO
    models: dict | None = None
    second_event: object = None
    respond = None
    good = 1
    seconds_per_token = 0.0
    bodies: list

    def do_GET(self):
        if self.path == "/v1/models" and self.models is not None:
            self._reply("application/json", json.dumps(self.models).encode())
            return
        if self.path != "/metrics" or self.metrics is None:
            self.send_error(404)
            return
        self._reply("text/plain", self.metrics.encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.bodies.append(body)
            late = len(cls.bodies) > self.good
        time.sleep(self.seconds_per_token * len(body["prompt"]))
        if late and self.respond is not None:
            self.respond(body)
        elif self.second_event is None or not late:
            self._reply("text/event-stream", good_answer(body))
        else:
            self._reply("text/event-stream", sse({"choices": [{"text": "x"}]}, self.second_event))

    def _reply(self, content_type: str, data: bytes, status: int = 200):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    """A running stub server (``StubServer`` subclassed per test, so a test may change its answers)."""
    handler = type("Stub", (StubServer,), {"bodies": [], "lock": threading.Lock()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def trace_rows(n=N_REQUESTS):
    """Bailian requests 50 ms apart, half of them sharing a two-block prefix."""
    return [{"chat_id": i, "parent_chat_id": -1, "timestamp": 0.05 * i, "input_length": 60, "output_length": 4,
             "type": "text", "turn": 1,
             "hash_ids": [1, 2, 100 + i, 200 + i] if i % 2 else [300 + i, 400 + i, 500 + i, 600 + i]}
            for i in range(n)]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in trace_rows()))
    return path


def replay(trace, url, out, *args):
    return invoke("replay", trace, "--url", url, "--model", "m", "--rate-scale", "10", "-o", out, *args)


def results_of(out) -> dict:
    return json.loads((out / "results.json").read_text())


def test_replay_reads_capacity_from_metrics_and_writes_the_plots_of_compare(stub, trace, tmp_path):
    url, handler = stub
    result = replay(trace, url, tmp_path / "live")
    assert result.exit_code == 0, result.output
    document = results_of(tmp_path / "live")
    run = document["runs"][0]
    assert run["capacity"] == 47 and document["config"]["capacities"] == [47]  # usable: 48 less the null block
    assert document["inputs"]["server"] == {"url": url, "model": "m", "num_gpu_blocks": 48, "block_size": 32,
                                            "max_model_len": None}
    assert document["config"]["engine_block_size"] == 32
    assert document["inputs"]["trace"]["n_requests"] == N_REQUESTS and document["inputs"]["trace"]["block_size"] == 16
    assert run["n_errors"] == 0 and run["cached_tokens"] == N_REQUESTS * CACHED_PER_REQUEST
    assert {p.name for p in (tmp_path / "live").iterdir()} >= PLOTS | {"results.json", "requests.jsonl"}
    # the test request first: two tokens, the lowest and highest id replay draws
    assert len(handler.bodies) == N_REQUESTS + 1 and handler.bodies[0]["prompt"] == [4, 999]
    assert handler.bodies[1]["vllm_xargs"] == {"type": "text", "turn": 1}


def test_capacity_option_is_recorded_over_the_servers(stub, trace, tmp_path):
    url, _ = stub
    result = replay(trace, url, tmp_path, "--capacity", "7")
    assert result.exit_code == 0, result.output
    document = results_of(tmp_path)
    assert document["runs"][0]["capacity"] == 7 and document["inputs"]["server"]["num_gpu_blocks"] == 48


@pytest.mark.parametrize("metrics", [None, "vllm:num_requests_running 0.0\n",
                                     CACHE_INFO.replace('num_gpu_blocks="48"', 'num_gpu_blocks="None"')])
def test_without_a_capacity_replay_stops_before_the_first_request(stub, trace, tmp_path, metrics):
    url, handler = stub
    handler.metrics = metrics
    (tmp_path / "results.json").write_text("{}")  # a stale file stays: nothing was replayed
    result = replay(trace, url, tmp_path)
    assert result.exit_code == 1
    assert f"{url}/metrics" in result.stderr and "pass --capacity BLOCKS" in result.stderr
    assert handler.bodies == [] and {p.name for p in tmp_path.iterdir()} == {"results.json", "trace.jsonl"}


def test_engines_that_disagree_on_their_cache_need_a_capacity(stub, trace, tmp_path):
    url, handler = stub
    handler.metrics = CACHE_INFO + CACHE_INFO.replace('engine="0"', 'engine="1"').replace('"48"', '"40"')
    result = replay(trace, url, tmp_path)
    assert result.exit_code == 1 and "report different caches" in result.stderr and handler.bodies == []


def test_an_unreachable_server_is_said_so_not_a_missing_capacity(trace, tmp_path):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    for extra in ((), ("--capacity", "4")):
        result = replay(trace, url, tmp_path / "out", *extra)
        assert result.exit_code == 1, result.output
        assert f"cannot reach the server at {url}" in result.stderr and "is it running?" in result.stderr
        assert "--capacity" not in result.stderr and not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize(
    "second_event, error",
    [
        ([1, 2], "an event that is not a JSON object: [1, 2]"),  # item 1: these were lost, exit 0
        ({"choices": [], "usage": {"prompt_tokens": "many"}}, "usage.prompt_tokens must be a non-negative integer"),
        ({"choices": [], "usage": {"prompt_tokens": 40}}, "start vLLM with --enable-prompt-tokens-details"),
        ({"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": None}},
         "start vLLM with --enable-prompt-tokens-details"),
        ({"choices": [], "usage": {"prompt_tokens": 60, "prompt_tokens_details": {"cached_tokens": 61}}},
         "61 cached tokens of a 60-token prompt"),
        ({"error": {"message": "Token id 700 is out of vocabulary", "type": "BadRequestError", "code": 400}},
         "server error: Token id 700 is out of vocabulary"),
        ("{not json", "an event that is not JSON"),
    ],
    ids=["a list", "string usage", "no details", "null details", "more cached than prompt", "error event", "not json"],
)
def test_a_bad_answer_is_one_counted_error_never_the_run(stub, trace, tmp_path, second_event, error):
    """Every request gets a record, the run is written in full, and replay exits 1 naming the error."""
    url, handler = stub
    handler.second_event = second_event
    result = replay(trace, url, tmp_path)
    assert result.exit_code == 1, result.output
    run = results_of(tmp_path)["runs"][0]
    assert run["n_requests"] == run["n_errors"] == N_REQUESTS and len(handler.bodies) == N_REQUESTS + 1
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(records) == N_REQUESTS and all(error in r["error"] for r in records)
    assert f"all {N_REQUESTS} requests failed alike" in one_line(result.stderr) and error in one_line(result.stderr)
    assert PLOTS <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize(
    "second_event, words",
    [
        ({"error": {"message": "Token id 999 is out of vocabulary"}},
         "Token id 999 is out of vocabulary; --vocab-size 1000 is more than the model's vocabulary"),
        ({"choices": [], "usage": {"prompt_tokens": 2, "prompt_tokens_details": None}},
         "start vLLM with --enable-prompt-tokens-details"),
    ],
)
def test_the_test_request_stops_a_replay_that_could_only_fail(stub, trace, tmp_path, second_event, words):
    url, handler = stub
    handler.second_event, handler.good = second_event, 0
    result = replay(trace, url, tmp_path)
    assert result.exit_code == 1 and words in one_line(result.stderr)
    assert len(handler.bodies) == 1 and not (tmp_path / "results.json").exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (("--url", "not a url"), "is not an http:// or https:// URL"),
        (("--url", "file:///etc/passwd"), "is not an http:// or https:// URL"),
        (("--vocab-size", "4"), "must be an integer from 5 to 2147483647"),
        (("--trace-block-tokens", "0"), "must be an integer from 1 to 16777216"),
        (("--rate-scale", "nan"), "must be a finite number from 1e-06 to 1e+06, written in ASCII"),
        (("--rate-scale", "1e-300"), "must be a finite number from 1e-06 to 1e+06"),
        (("--limit", "-1"), "must be an integer from 1"),
        (("--timeout", "0"), "must be a finite number > 0"),
        (("--max-concurrency", "0"), "must be an integer from 1 to 1024"),
        (("--policy", "mru"), "unknown policy 'mru'"),
        (("--window", "5:1"), "END must be greater than START"),
    ],
)
def test_usage_errors_exit_2_before_anything_is_sent(stub, trace, tmp_path, args, words):
    url, handler = stub
    result = invoke("replay", trace, "--model", "m", "--url", url, "-o", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert words in one_line(result.output) and handler.bodies == []


def test_trace_options_replay_the_slice_compare_simulates(stub, tmp_path):
    """--window, --limit, --skip-invalid and --rate-scale as in compare; the run says what the server ran."""
    url, _ = stub
    lines = [json.dumps(r) for r in trace_rows(30)]
    lines.insert(3, '{"chat_id": "bad"}')
    trace = tmp_path / "price$_$.jsonl"  # a $ in the name stays plain text in the plots
    trace.write_text("\n".join(lines) + "\n")
    hp = tmp_path / "hp.json"
    hp.write_text(json.dumps({"a": {"text_1": 0.02}, "p": {"text_1": 0.4}}))
    result = replay(trace, url, tmp_path / "live", "--window", "0.2:", "--limit", "10", "--skip-invalid",
                    "--config", hp)
    assert result.exit_code == 0, result.output
    assert "skipped 1 invalid lines" in one_line(result.stderr)
    live = results_of(tmp_path / "live")
    assert live["inputs"]["trace"]["n_requests"] == 10 and live["inputs"]["limit"] == 10
    assert live["runs"][0]["policy"] == "wa" and live["inputs"]["hp"] == {"path": str(hp)}
    sim = invoke("compare", trace, "--policies", "lru", "--capacity", "48", "--block-size", "32", "--eval-window",
                 "0.2:", "--limit", "10", "--skip-invalid", "--rate-scale", "10", "-j", "1", "-o", tmp_path / "sim")
    assert sim.exit_code == 0, sim.output
    assert "10 requests at 10x speed" in one_line(sim.stdout)
    simulated = results_of(tmp_path / "sim")
    assert simulated["inputs"]["trace"]["window"] == live["inputs"]["trace"]["window"]
    assert simulated["runs"][0]["n_requests"] == live["runs"][0]["n_requests"] == 10
    assert simulated["config"]["rate_scale"] == live["config"]["rate_scale"] == 10

    shown = invoke("show", tmp_path / "sim" / "results.json", tmp_path / "live" / "results.json", "-o", tmp_path / "both")
    assert shown.exit_code == 0, shown.output
    table = one_line(shown.stdout)
    assert "wa (live)" in table and "live, hp hp.json, rate x10" in table and "simulated, rate x10" in table
    assert {p.name for p in (tmp_path / "both").iterdir()} == PLOTS


def test_replay_fits_the_servers_cost_model_for_compare(stub, tmp_path):
    """A stub that takes 0.2 ms per prompt token: the fitted rate is near 5,000 tokens/s and compare reads it."""
    url, handler = stub
    handler.seconds_per_token = 2e-4
    rows = trace_rows(24)
    for i, row in enumerate(rows):
        n_blocks = 4 + 6 * (i % 4)
        row.update(input_length=16 * n_blocks, hash_ids=list(range(1000 * i, 1000 * i + n_blocks)), timestamp=0.5 * i)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = replay(trace, url, tmp_path / "live", "--max-concurrency", "1")
    assert result.exit_code == 0, result.output
    cost = json.loads((tmp_path / "live" / "cost.json").read_text())
    assert cost["schema"] == "kvprof.cost/1" and 2_000 < cost["prefill_tokens_per_s"] < 10_000
    assert cost["step_overhead_s"] >= 0 and cost["provenance"]["n_requests"] == 24
    assert results_of(tmp_path / "live")["config"]["calibration"]["prefill_tokens_per_s"] == cost["prefill_tokens_per_s"]
    sim = invoke("compare", trace, "--policies", "lru", "--capacity", "64", "--eval-window", ":", "-j", "1",
                 "--cost", tmp_path / "live" / "cost.json", "--json", "-o", tmp_path / "sim")
    assert sim.exit_code == 0, sim.output
    assert json.loads(sim.stdout)["config"]["cost"]["prefill_tokens_per_s"] == cost["prefill_tokens_per_s"]


def test_show_refuses_a_run_without_capacity_and_an_hp_file_among_results(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema": "kvprof.results/1", "complete": True, "config": {"policies": ["served"]},
                               "runs": [{"policy": "served", "capacity": None}]}))
    result = invoke("show", old)
    assert result.exit_code == 1 and "has no capacity" in result.stderr
    good = tmp_path / "good.json"
    good.write_text(old.read_text().replace('"capacity": null', '"capacity": 16, "n_requests": 3, "token_hit_ratio": 0.5, '
                                            '"qttft_mean_s": 1.0, "qttft_p99_s": 2.0'))
    hp = tmp_path / "hp.json"
    hp.write_text(json.dumps({"a": {"text_1": 0.02}, "p": {"text_1": 0.4}}))
    result = invoke("show", good, hp)
    assert result.exit_code == 1 and f"{hp}: not a results file (it has no schema)" in one_line(result.stderr)


def test_an_interrupt_while_replay_plots_leaves_the_last_runs_results_and_plots(stub, trace, tmp_path, monkeypatch):
    """requests.jsonl is written first; cost.json, results.json and the plots are replaced together, or
    none of them (issue 21: outputs of one run are replaced together or not at all)."""
    from kvprof.cli import plots

    url, _ = stub
    out = tmp_path / "live"
    assert replay(trace, url, out).exit_code == 0
    (out / "results.json").write_text('{"edited": "marks the old results"}')
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "requests.jsonl"}
    assert PLOTS <= set(before)
    draw = plots._plot_panel

    def draw_then_interrupt(*args):
        draw(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "_plot_panel", draw_then_interrupt)
    result = replay(trace, url, out)
    assert result.exit_code != 0
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "requests.jsonl"}
    assert after == before  # nothing of the group replaced, no temporary file left
    assert (out / "requests.jsonl").read_text().count("\n") == N_REQUESTS  # what was measured is on disk


def test_replay_sends_each_requests_client_hint_unless_told_to_ignore_them(stub, tmp_path):
    """A trace's hint fields reach the server in each request's vllm_xargs, as the plugin reads them (a
    release as JSON true, which vLLM passes on as 1); --ignore-hints sends none of them."""
    from kvprof.models.hints import HINT_FIELDS, hint_of_args

    url, handler = stub
    rows = trace_rows()
    for i, row in enumerate(rows):
        if i % 3 == 1:
            row.update(retain_s=30.0, retain_priority=70, hint_tag=2)
        elif i % 3 == 2:
            row["release"] = True
    path = tmp_path / "hinted.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert replay(path, url, tmp_path / "with").exit_code == 0
    told = [hint_of_args(body.get("vllm_xargs")) for body in handler.bodies[1:]]  # the first is the test request
    expected = [{1: (30.0, 70, False, 2), 2: (0.0, 50, True, 0)}.get(i % 3) for i in range(len(rows))]
    # requests in flight together may reach the server in either order: compare them as a multiset
    assert Counter(None if hint is None else (hint.retain_s, hint.priority, hint.release, hint.tag)
                   for hint in told) == Counter(expected)
    handler.bodies.clear()
    assert replay(path, url, tmp_path / "without", "--ignore-hints").exit_code == 0
    assert not any(name in body.get("vllm_xargs", {}) for body in handler.bodies for name in HINT_FIELDS)
    assert results_of(tmp_path / "without")["inputs"]["hinted_requests"] == 0
    assert results_of(tmp_path / "with")["inputs"]["hinted_requests"] == 2 * len(rows) // 3
