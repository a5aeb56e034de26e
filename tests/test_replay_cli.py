"""``kvprof replay`` against a stub server, and ``kvprof show`` of a simulated and a live run together.

The stub speaks the two things replay reads from vLLM: ``/metrics`` with vLLM 0.32's
``vllm:cache_config_info`` gauge (the line below is a real server's, shortened) and streamed
``/v1/completions`` with usage. tests/vllm/test_serve.py replays against a real server.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvprof.results import merge as merge_results
from tests.helpers import invoke

CACHE_INFO = ('vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
              'gpu_memory_utilization="0.92",kv_cache_size_tokens="1536",num_cpu_blocks="None",num_gpu_blocks="48",'
              'num_gpu_blocks_override="48",prefix_caching_hash_algo="sha256"} 1.0\n')
CACHED_PER_REQUEST = 16
PLOTS = {"hit_ratio.png", "hit_ratio.svg", "qttft.png", "qttft.svg"}


class StubServer(BaseHTTPRequestHandler):
    metrics: str | None = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n" + CACHE_INFO
    completions = 0

    def do_GET(self):
        if self.path != "/metrics" or self.metrics is None:
            self.send_error(404)
            return
        self._reply("text/plain", self.metrics.encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).completions += 1
        usage = {"prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": CACHED_PER_REQUEST}}
        chunks = [{"choices": [{"text": "x"}]}, {"choices": [], "usage": usage}]
        stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._reply("text/event-stream", stream.encode())

    def _reply(self, content_type: str, data: bytes):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    """A running stub server (``StubServer`` subclassed per test, so a test may change its metrics)."""
    handler = type("Stub", (StubServer,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


@pytest.fixture
def trace(tmp_path):
    """Twelve Bailian requests, 50 ms apart, half of them sharing a two-block prefix."""
    rows = [{"chat_id": i, "parent_chat_id": -1, "timestamp": 0.05 * i, "input_length": 60, "output_length": 4,
             "type": "text", "turn": 1,
             "hash_ids": [1, 2, 100 + i, 200 + i] if i % 2 else [300 + i, 400 + i, 500 + i, 600 + i]}
            for i in range(12)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def replay(trace, url, out, *args):
    return invoke("replay", trace, "--url", url, "--model", "m", "--rate-scale", "10", "-o", out, *args)


def test_replay_reads_capacity_from_metrics_and_writes_the_plots_of_compare(stub, trace, tmp_path):
    url, _ = stub
    result = replay(trace, url, tmp_path / "live")
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "live" / "results.json").read_text())
    run = document["runs"][0]
    assert run["capacity"] == 48 and document["config"]["capacities"] == [48]
    assert document["inputs"]["server"] == {"url": url, "model": "m", "num_gpu_blocks": 48, "block_size": 32}
    assert document["config"]["engine_block_size"] == 32
    assert document["inputs"]["trace"]["n_requests"] == 12 and document["inputs"]["trace"]["block_size"] == 16
    assert run["n_errors"] == 0 and run["cached_tokens"] == 12 * CACHED_PER_REQUEST
    assert {p.name for p in (tmp_path / "live").iterdir()} == PLOTS | {"results.json", "requests.jsonl"}


def test_capacity_option_is_recorded_over_the_servers(stub, trace, tmp_path):
    url, _ = stub
    result = replay(trace, url, tmp_path, "--capacity", "7")
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "results.json").read_text())
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
    assert handler.completions == 0 and {p.name for p in tmp_path.iterdir()} == {"results.json", "trace.jsonl"}


def test_engines_that_disagree_on_their_cache_need_a_capacity(stub, trace, tmp_path):
    url, handler = stub
    handler.metrics = CACHE_INFO + CACHE_INFO.replace('engine="0"', 'engine="1"').replace('"48"', '"40"')
    result = replay(trace, url, tmp_path)
    assert result.exit_code == 1 and "report different caches" in result.stderr and handler.completions == 0


def test_show_puts_a_simulated_sweep_beside_the_live_run(stub, trace, tmp_path):
    url, _ = stub
    sim = invoke("compare", trace, "--policies", "lru,belady", "--capacity", "8,16,48", "--block-size", "32",
                 "--eval-window", "0:", "-j", "1", "-o", tmp_path / "sim")
    assert sim.exit_code == 0, sim.output
    assert replay(trace, url, tmp_path / "live").exit_code == 0
    files = (tmp_path / "sim" / "results.json", tmp_path / "live" / "results.json")

    result = invoke("show", *files, "-o", tmp_path / "both")
    assert result.exit_code == 0, result.output
    assert "lru" in result.stdout and "belady" in result.stdout and "served (live)" in result.stdout
    assert {p.name for p in (tmp_path / "both").iterdir()} == PLOTS

    merged = json.loads(invoke("show", *files, "--json").stdout)
    assert merged["config"]["policies"] == ["lru", "belady", "served (live)"]
    assert [(r["policy"], r["capacity"]) for r in merged["runs"]][-1] == ("served (live)", 48)


def test_merged_runs_keep_one_line_per_document():
    live = {"config": {"policies": ["served"]}, "runs": [{"policy": "served", "capacity": 16, "measured": True}]}
    merged = merge_results([live, live])
    assert merged["config"]["policies"] == ["served (live)", "served (live) #2"]


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
    result = invoke("show", hp, good)
    assert result.exit_code == 2 and "only results.json files" in result.output
