"""Real ``vllm serve`` with kvprof's plugin against vLLM's own LRU, on a tiny local Llama.

One server of each kind is started (never two at once); each runs the same workload-tagged
request sequence, whose best eviction differs from LRU: a "hot" prefix is followed by enough
"cold" prompts to push it out of a 15-block cache under LRU, then comes back. The cached tokens
vLLM reports for every request must equal what kvprof's policy predicts when driven through the
same operations (tests/vllm/predict.py), and greedy outputs must be identical token for token.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import urllib.request

import pytest

from kvprof.policy import make_policy
from kvprof.models.hp import HpFile
from kvprof.vllm.spec import PolicySpec

from vllm_support import HP_TEST, Req, completion, free_port, predict_cached_tokens, run_to_exit, serve_command, vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCKS = 16  # 15 usable: block 0 is vLLM's null block
BS = 32
MAX_TOKENS = 8


def _tokens(seed: int, n_blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 4 for i in range(BS * n_blocks)]


def sequence() -> list[tuple[list[int], dict]]:
    hot = _tokens(1, 4)
    cold = [_tokens(10 + i, 4) for i in range(4)]
    seq = [(hot, {"type": "hot", "turn": 1})]
    seq += [(c, {"workload": "cold_1"}) for c in cold[:2]]
    seq += [(c, {"type": "cold", "turn": 1}) for c in cold[2:]]
    seq += [(hot, {"type": "hot", "turn": 1}), (cold[0], {"workload": "cold_1"}), (hot, {})]
    # distinct 4-token tails: every prompt is 4 full blocks + a partial one
    return [(p + [100 + 4 * j + k for k in range(4)], x) for j, (p, x) in enumerate(seq)]


def run_sequence(url: str) -> list[dict]:
    out = []
    for prompt, xargs in sequence():
        r = completion(url, prompt, xargs=xargs, max_tokens=MAX_TOKENS)
        out.append({
            "cached": (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "tokens": r["choices"][0].get("token_ids"),
            "text": r["choices"][0]["text"],
        })
    return out


def predicted(policy_name: str) -> list[int]:
    hp = HpFile.from_dict(HP_TEST)
    spec = PolicySpec(policy=policy_name, config=None, hp=hp, class_names=tuple(hp.table()[0]))
    policy = make_policy(policy_name, hp=hp)
    reqs = [Req(p, spec.class_index(x), MAX_TOKENS) for p, x in sequence()]
    return predict_cached_tokens(policy, reqs, BLOCKS, BS)


@pytest.fixture(scope="module")
def served_hp(tmp_path_factory):
    """The wa server's own hp file (its reloads rewrite it)."""
    path = tmp_path_factory.mktemp("served-hp") / "hp.json"
    path.write_text(json.dumps(HP_TEST))
    return path


@pytest.fixture(scope="module")
def wa_run(vllm_venv, tiny_model, served_hp, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-wa") / "vllm.log"
    with vllm_server(vllm_venv, tiny_model, "--kv-policy-config", str(served_hp), "--kv-policy-reload-interval", "0.5",
                     log=log, blocks=BLOCKS) as url:
        at_start = wait_for_metric(url, "kvprof_info")
        results = run_sequence(url)
        replay_dir = tmp_path_factory.mktemp("replay")
        replay = replay_against(url, replay_dir)  # shares this server: one start, not two
        reloads = reload_sequence(url, served_hp, log)  # last: it changes the policy
    return {"results": results, "log": log.read_text(), "replay": replay, "replay_out": replay_dir / "out",
            "at_start": at_start, "reloads": reloads}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return r.read().decode()


def wait_for_metric(url: str, name: str, condition=lambda text: True, seconds: float = 30.0) -> str:
    """``/metrics`` once it shows ``name`` (an engine core writes its snapshot once a second) and ``condition``."""
    deadline = time.monotonic() + seconds
    while True:
        text = scrape(url)
        if f"\n{name}{{" in text and condition(text):
            return text
        assert time.monotonic() < deadline, f"{name} not on /metrics as expected:\n{text[-3000:]}"
        time.sleep(0.5)


def info_sha256(text: str) -> set[str]:
    return set(re.findall(r'^kvprof_info\{[^}]*hp_sha256="([0-9a-f]+)"', text, re.M))


def wait_for_log(log, text: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"not logged: {text}"
        time.sleep(0.2)


def reload_sequence(url, hp_path, log) -> dict:
    """On the idle server: a reload that waits for the scheduler's next step, then the file replaced
    again before any request. What the request then runs under is the newest file, and /metrics
    never says a file is in force before it is."""
    from kvprof.atomic import atomic_write_text

    texts = [json.dumps(dict(HP_TEST, horizon_s=h)) for h in (30.0, 90.0)]
    sha = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    in_force = hashlib.sha256(hp_path.read_bytes()).hexdigest()
    atomic_write_text(hp_path, texts[0])
    wait_for_log(log, f"reloaded {hp_path} (sha256 {sha[0][:12]}), in force from the scheduler's next step")
    time.sleep(2.5)  # two snapshots later
    pending = info_sha256(scrape(url))
    atomic_write_text(hp_path, texts[1])
    wait_for_log(log, f"reloaded {hp_path} (sha256 {sha[1][:12]}), in force from the scheduler's next step")
    completion(url, [5] * 40, max_tokens=2)  # the scheduler's next step swaps the newest file in
    wait_for_log(log, f"{hp_path} (sha256 {sha[1][:12]}) is in force")
    after = wait_for_metric(url, "kvprof_info", lambda text: info_sha256(text) == {sha[1]})
    return {"in_force": in_force, "while_pending": pending, "after": after, "sha": sha}


def replay_against(url, out_dir):
    """``kvprof replay`` of a short synthetic trace against the running server (see test_replay_*)."""
    try:
        from kvprof.replay import Pacing, ReplaySettings, run_replay
    except ImportError as err:  # the replay extra is missing: reported by its own test
        return {"error": repr(err)}
    from kvprof.profiler.reader import read_trace

    trace, _ = read_trace(synthetic_trace(out_dir / "trace.jsonl"), block_size=32)
    settings = ReplaySettings(url=url, model="tiny", timeout_s=60, policy="wa",
                              pacing=Pacing(rate_scale=1.0, max_concurrency=2, max_output_tokens=4, block_tokens=32,
                                            vocab_size=500))
    (out_dir / "out").mkdir()
    return run_replay(trace, settings, out_dir / "out").document


def synthetic_trace(path):
    """12 requests, two sessions of a 'hot' type sharing a 3-block prefix, and one-off 'cold' ones."""
    rows = []
    for i in range(12):
        hot = i % 2 == 0
        ids = [1, 2, 3, 100 + i] if hot else [200 + 3 * i, 201 + 3 * i]
        rows.append({"chat_id": i, "parent_chat_id": -1, "timestamp": 0.05 * i, "input_length": 32 * len(ids) - 5,
                     "output_length": 4, "type": "hot" if hot else "cold", "turn": 1, "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_replay_against_real_server(wa_run):
    res = wa_run["replay"]
    assert "error" not in res, res
    assert res["schema"] == "kvprof.results/1" and res["complete"]
    run = res["runs"][0]
    assert run["n_requests"] == 12 and run["n_errors"] == 0
    # hot requests 2..10 (after the first) can hit the shared 3 blocks: at least some of them do
    assert run["cached_tokens"] >= 3 * 32
    assert 0 < run["token_hit_ratio"] < 1 and run["qttft_mean_s"] > 0
    # no --capacity given: read from the server's /metrics, as it was started
    assert run["capacity"] == BLOCKS - 1 and res["inputs"]["server"]["num_gpu_blocks"] == BLOCKS  # less the null block
    assert res["inputs"]["server"]["block_size"] == BS == res["config"]["engine_block_size"]
    assert run["policy"] == "wa" and "calibration" in res["config"]
    written = {p.name for p in wa_run["replay_out"].iterdir()}
    assert written >= {"results.json", "requests.jsonl"}


@pytest.fixture(scope="module")
def lru_run(vllm_venv, tiny_model, tmp_path_factory, wa_run):  # after wa_run: one server at a time
    log = tmp_path_factory.mktemp("serve-lru") / "vllm.log"
    with vllm_server(vllm_venv, tiny_model, log=log, blocks=BLOCKS) as url:
        results = run_sequence(url)
    return {"results": results, "log": log.read_text()}


def test_prediction_differs_from_lru():
    wa, lru = predicted("wa"), predicted("lru")
    assert wa != lru, (wa, lru)
    assert wa[5] == 4 * BS and lru[5] < wa[5]  # the hot prefix survives the cold burst only under wa


def test_every_kvprof_series_is_on_metrics_from_the_start(wa_run):
    text = wa_run["at_start"]
    for line in ('kvprof_reloads_total{engine="', 'result="ok"} 0.0', 'result="error"} 0.0',
                 'kvprof_prompt_blocks_total{class="hot_1"', 'kvprof_cached_blocks_total{class="<default>"',
                 'kvprof_unclassified_requests_total{engine="', 'kvprof_evictions_total{engine="'):
        assert line in text, line
    assert re.search(r'^kvprof_info\{.*rank="0"', text, re.M)
    # up once the compiled core is loaded; the policy takes over at the first request's step, once
    assert re.search(r'^kvprof_core_ready\{[^}]*\} 1\.0', text, re.M)
    assert re.search(r'^kvprof_handovers_total\{[^}]*\} 0\.0', text, re.M)
    assert re.search(r'^kvprof_handovers_total\{[^}]*\} 1\.0', wa_run["reloads"]["after"], re.M)


def test_the_newest_hp_file_wins_over_a_pending_reload(wa_run):
    reloads = wa_run["reloads"]
    assert reloads["while_pending"] == {reloads["in_force"]}  # waiting is not in force
    assert info_sha256(reloads["after"]) == {reloads["sha"][1]}
    assert 'kvprof_reloads_total{engine="' in reloads["after"]
    assert re.search(r'^kvprof_reloads_total\{[^}]*result="ok"\} 2\.0', reloads["after"], re.M)


def test_startup_log_names_policy_file_and_classes(wa_run, served_hp):
    log = wa_run["log"]
    assert f"kvprof eviction policy 'wa' in force from {served_hp}: 2 fitted classes + default" in log
    # the engine core says what runs at its own cache size: wa's horizon and first candidate
    assert "horizon 60 s, starting on order 'model' (not tuned: fitted defaults)" in log
    assert "GPU tier: 16 blocks; vLLM's own order serves until the compiled core is loaded" in log
    assert "compiled core ready in" in log
    assert "wa is in force from this step on; vLLM's own order served until now" in log


def test_wa_cached_tokens_match_kvprof_prediction(wa_run):
    got = [r["cached"] for r in wa_run["results"]]
    assert got == predicted("wa")


def test_lru_cached_tokens_match_lru_prediction(lru_run):
    got = [r["cached"] for r in lru_run["results"]]
    assert got == predicted("lru")
    assert "kvprof eviction policy" not in lru_run["log"]  # no config: the plugin changes nothing


def test_policy_changes_cache_hits_not_outputs(wa_run, lru_run):
    wa, lru = wa_run["results"], lru_run["results"]
    assert [r["cached"] for r in wa] != [r["cached"] for r in lru]
    for a, b in zip(wa, lru):
        assert a["tokens"] is not None and len(a["tokens"]) == MAX_TOKENS
        assert a["tokens"] == b["tokens"] and a["text"] == b["text"]


@pytest.mark.parametrize(
    "case,expected",
    [
        ("missing", "kvprof kv_policy: cannot use hp file"),
        ("invalid", "kvprof kv_policy: cannot use hp file"),
        ("no-prefix-caching", "kvprof kv_policy: prefix caching is off"),
        ("belady", "kvprof kv_policy: policy 'belady' needs the future"),
        ("record-not-a-directory", "kvprof kv_policy: --kv-record"),
        ("record-corrupt", "kvprof kv_policy: --kv-record"),
        ("bad-mode", "kvprof kv_policy: mode (--kv-policy-mode) must be one of enforce, shadow, got 'loud'"),
        ("fifo", "it is a FIFO or pipe, not a regular file"),
        ("rotate-alone", "record_rotate_s (--kv-record-rotate) is about a recording: it needs --kv-record DIR"),
        ("huge-interval", "log_interval_s (--kv-log-interval) must be 0 (off) or a finite number from 1 to 1e+09"),
        ("nul-in-path", "config (--kv-policy-config) must be a path (non-empty, no NUL byte)"),
        ("other-block-size", "the hp file was fitted on 16-token blocks, and this server caches 32-token blocks"),
        ("unknown-policy", "kvprof kv_policy: unknown policy 'nope'; live policies: lru, wa, wa-paper, lfu, s3fifo, arc"),
    ],
)
def test_startup_fails_closed(case, expected, vllm_venv, tiny_model, hp_file, tmp_path):
    corrupt = tmp_path / "rec"
    corrupt.mkdir()
    os.mkfifo(tmp_path / "hp.fifo")
    _write(corrupt / "recording.json", '{"schema": "kvprof.recording/1", "block_size": -3}')
    extra = {
        "missing": ["--kv-policy-config", str(tmp_path / "nope.json")],
        "invalid": ["--kv-policy-config", str(_write(tmp_path / "bad.json", '{"schema": "kvprof.hp/1", "classes": 3}'))],
        "no-prefix-caching": ["--kv-policy-config", str(hp_file), "--no-enable-prefix-caching"],
        "belady": ["--kv-policy-config", str(hp_file), "--kv-policy", "belady"],
        "record-not-a-directory": ["--kv-record", str(_write(tmp_path / "file", "x") / "rec")],
        "record-corrupt": ["--kv-record", str(corrupt)],
        "bad-mode": ["--kv-policy-config", str(hp_file), "--kv-policy-mode", "loud"],
        "unknown-policy": ["--kv-policy-config", str(hp_file), "--kv-policy", "nope"],
        "fifo": ["--kv-policy-config", str(tmp_path / "hp.fifo")],
        "rotate-alone": ["--kv-record-rotate", "60"],
        "huge-interval": ["--additional-config", json.dumps({"kv_policy": {"config": str(hp_file),
                                                                           "log_interval_s": int("9" * 400)}})],
        "nul-in-path": ["--additional-config", json.dumps({"kv_policy": {"config": "hp\0.json"}})],
        "other-block-size": ["--kv-policy-config", str(_write(tmp_path / "hp16.json", json.dumps(dict(HP_TEST,
                                                                                              block_size=16))))],
    }[case]
    rc, out = run_to_exit(serve_command(vllm_venv, tiny_model, free_port(), *extra), timeout=240, cwd=tmp_path)
    assert rc == 2, out[-3000:]
    assert expected in out, out[-3000:]
    # one line says what is wrong; no traceback buries it
    assert "Traceback" not in out and sum(expected in line for line in out.splitlines()) == 1, out[-3000:]
    assert "Application startup complete" not in out


def _write(path, text):
    path.write_text(text)
    return path


def test_help_states_each_default_once(vllm_venv, tmp_path):
    rc, out = run_to_exit([str(vllm_venv / "bin" / "vllm"), "serve", "--help=kvprof"], timeout=240, cwd=tmp_path)
    text = " ".join(out.split())
    assert rc == 0 and "--kv-log-interval SECONDS" in text, out[-3000:]
    assert "(default: None)" not in text and "(default 300; 0: never)." in text


@pytest.fixture(scope="module")
def data_parallel_run(vllm_venv, tiny_model, tmp_path_factory):
    """Two API servers (vLLM then serves /metrics from prometheus_client's multiprocess registries)
    in front of two data-parallel engine cores, each with its own kvprof policy; the CPU build runs it."""
    from kvprof.atomic import atomic_write_text

    tmp = tmp_path_factory.mktemp("serve-dp")
    hp_path, log = tmp / "hp.json", tmp / "vllm.log"
    hp_path.write_text(json.dumps(HP_TEST))
    with vllm_server(vllm_venv, tiny_model, "--kv-policy-config", str(hp_path), "--kv-policy-reload-interval", "0.5",
                     "--api-server-count", "2", "--data-parallel-size", "2", log=log, blocks=BLOCKS) as url:
        scrapes = [wait_for_metric(url, "kvprof_info", lambda text: len(info_sha256_by_rank(text)) == 2)
                   for _ in range(4)]  # each scrape may be answered by either API server
        changed = json.dumps(dict(HP_TEST, horizon_s=30.0))
        atomic_write_text(hp_path, changed)
        sha = hashlib.sha256(changed.encode()).hexdigest()
        deadline = time.monotonic() + 120
        while set(info_sha256_by_rank(scrape(url)).values()) != {sha}:  # each rank swaps at its next step
            assert time.monotonic() < deadline, scrape(url)[-3000:]
            completion(url, [5] * 40, max_tokens=2)
            time.sleep(0.5)
    return {"scrapes": scrapes, "log": log.read_text(), "sha": sha}


def info_sha256_by_rank(text: str) -> dict[str, str]:
    """rank -> the sha256 of the hp file in force there, from ``kvprof_info`` on /metrics."""
    out = {}
    for line in text.splitlines():
        if line.startswith("kvprof_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            out[labels["rank"]] = labels["hp_sha256"]
    return out


def test_two_api_servers_serve_every_rank_s_metrics(data_parallel_run):
    for text in data_parallel_run["scrapes"]:
        assert sorted(info_sha256_by_rank(text)) == ["0", "1"]
        assert re.search(r'^kvprof_reloads_total\{[^}]*rank="1",result="ok"\} 0\.0', text, re.M)
        assert 'vllm:' in text  # vLLM's own metrics are still there


def test_a_reload_reaches_every_rank(data_parallel_run):
    log = data_parallel_run["log"]
    for rank in (0, 1):
        assert re.search(rf"EngineCore_DP{rank}.*kvprof: reloaded .*sha256 {data_parallel_run['sha'][:12]}", log)


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_stop_by_signal_leaves_a_finished_recording(signal_name, vllm_venv, tiny_model, tmp_path):
    """``kill -INT`` / ``kill -TERM`` of ``vllm serve --kv-record`` under vLLM's default shutdown
    (abort, timeout 0: the engine core is SIGKILLed right after SIGTERM): the recording is finished
    by the recorder's guard, with counts that match its files."""
    import signal
    import subprocess
    import time

    from kvprof.profiler.reader import read_trace
    from kvprof.recording import load_recording, trace_files
    from vllm_support import server_env, wait_until_up

    rec = tmp_path / "rec"
    log = tmp_path / "serve.log"
    port = free_port()
    with open(log, "w") as fh:
        proc = subprocess.Popen(serve_command(vllm_venv, tiny_model, port, "--kv-record", str(rec)), stdout=fh,
                                stderr=subprocess.STDOUT, env=server_env(), start_new_session=True, cwd=str(tmp_path))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(url, proc, log)
        sent = run_sequence(url)
        time.sleep(3)  # past the writer's flush interval (2 s): what is flushed is what must survive
        proc.send_signal(getattr(signal, signal_name))  # the API server only, as `kill` or `docker stop` sends it
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 60
    while any(still_open for _, still_open in trace_files(rec)) and time.monotonic() < deadline:
        time.sleep(0.5)
    files = trace_files(rec)
    assert files and not any(still_open for _, still_open in files), (files, log.read_text()[-3000:])
    trace, report = read_trace(rec)
    start = load_recording(rec).starts[0]
    assert trace.n_requests == len(sent) == start.written, (trace.n_requests, start, log.read_text()[-3000:])
    assert report.cut_frames == report.truncated == report.missing == 0

