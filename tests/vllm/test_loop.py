"""The loop on a user's own server, end to end on real vLLM: record -> inspect -> fit -> shadow -> enforce ->
refit -> reload (README, "On your own server").

Three servers run one after another (never two at once), each with 16 blocks of 32 tokens and the
same replayed traffic (API calls sharing a system prompt, bursts of one-off documents, chat sessions
growing their prefix: see :func:`traffic_trace`) at two requests at a time:

* A records only (``--kv-record``): vLLM's eviction (LRU) is untouched;
* ``kvprof fit`` on A's recording gives the hp file, tuned for A's cache size from recording.json;
* C runs that file in shadow mode (``--kv-policy-mode shadow``): vLLM's eviction is untouched and the
  metrics say what ``wa`` would have hit;
* B enforces it (``--kv-policy-config``), then reloads a refit of its own recording and a broken file
  while requests flow.

Every command a user runs goes through vLLM's and kvprof's own CLIs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from vllm_support import completion, vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCKS = 16  # 15 usable: block 0 is vLLM's null block
BS = 32
OUTPUT = 4


def traffic_trace(path: Path, steps: int = 45) -> Path:
    """A Bailian-format trace at the server's block size, ~220 requests over 45 s: each second an API call on
    a shared 3-block system prompt, then a burst of three one-off 6-block documents (more than the cache
    holds: LRU loses the system prompt to them, a policy fitted on this traffic keeps it), every other second
    a second API call before the burst (what LRU does hit), and every third second the next turn of a chat
    session whose prefix grows."""
    rows, next_id = [], 1000

    def add(t, kind, turn, ids, parent=-1):
        rows.append({"chat_id": len(rows), "parent_chat_id": parent, "timestamp": round(t, 3),
                     "input_length": BS * len(ids) - 5, "output_length": OUTPUT, "type": kind, "turn": turn,
                     "hash_ids": ids})
        return len(rows) - 1

    session = None  # (last chat id, its blocks, its turn)
    for step in range(steps):
        t = float(step)
        add(t, "api", 1, [1, 2, 3, next_id])
        next_id += 1
        if step % 2 == 0:  # a second call before the burst: the one hit LRU keeps
            add(t + 0.15, "api", 1, [1, 2, 3, next_id])
            next_id += 1
        for k in range(3):
            add(t + 0.3 + 0.15 * k, "doc", 1, list(range(next_id, next_id + 6)))
            next_id += 6
        if step % 3 == 2:
            if session is None or len(session[1]) >= 5:
                session = (-1, [next_id], 0)
                next_id += 1
            parent, ids, turn = session
            ids = ids + [next_id]
            next_id += 1
            session = (add(t + 0.8, "chat", turn + 1, ids, parent), ids, turn + 1)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def kvprof(venv: Path, *args, cwd: Path) -> str:
    """Run kvprof's CLI from the vLLM venv; return its stdout."""
    proc = subprocess.run([str(venv / "bin" / "kvprof"), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=900)
    assert proc.returncode == 0, f"kvprof {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc.stdout


def replay(url: str, trace_path: Path, out: Path) -> dict:
    from kvprof.profiler.reader import read_trace
    from kvprof.replay import Pacing, ReplaySettings, run_replay

    trace, _ = read_trace(trace_path, block_size=BS)
    settings = ReplaySettings(url=url, model="tiny", timeout_s=120, policy="lru",
                              pacing=Pacing(rate_scale=1.0, max_concurrency=2, max_output_tokens=OUTPUT, block_tokens=BS,
                                            vocab_size=500))
    out.mkdir()
    document = run_replay(trace, settings, out).document
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return {"document": document, "requests": requests}


def metrics(url: str) -> dict[str, float]:
    """kvprof's samples on the server's /metrics, keyed by ``name{labels}`` without the engine's labels
    (``engine``, ``rank``: one engine core here)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvprof_"):
            key, value = line.rsplit(" ", 1)
            out[re.sub(r',?(engine|rank)="[^"]*"', "", key).replace("{,", "{").replace("{}", "")] = float(value)
    return out


def outputs(url: str) -> list:
    """Greedy outputs of fixed prompts (the same on every server unless kvprof changed what vLLM computes)."""
    prompts = [[(7 * i + j) % 400 + 5 for i in range(70)] for j in range(3)]
    return [completion(url, p, max_tokens=6, xargs={"type": "chat", "turn": 1})["choices"][0]["token_ids"]
            for p in prompts]


def serve(venv, model, tmp, name, *extra):
    return vllm_server(venv, model, "--kv-log-interval", "3", *extra, log=tmp / f"{name}.log", blocks=BLOCKS)


@pytest.fixture(scope="module")
def work(tmp_path_factory, vllm_venv):
    tmp = tmp_path_factory.mktemp("loop")
    return {"tmp": tmp, "trace": traffic_trace(tmp / "traffic.jsonl"), "venv": vllm_venv}


@pytest.fixture(scope="module")
def server_a(work, tiny_model):
    tmp = work["tmp"]
    with serve(work["venv"], tiny_model, tmp, "a", "--kv-record", str(tmp / "rec-a")) as url:
        run = replay(url, work["trace"], tmp / "replay-a")
        run["outputs"] = outputs(url)
        time.sleep(4)  # one more snapshot and log line
        run["metrics"] = metrics(url)
    run["log"] = (tmp / "a.log").read_text()
    return run


@pytest.fixture(scope="module")
def hp_file(work, server_a):
    tmp = work["tmp"]
    kvprof(work["venv"], "inspect", tmp / "rec-a", cwd=tmp)
    kvprof(work["venv"], "fit", tmp / "rec-a", "--window", "-3600:", "-o", tmp / "hp.json", "-j", "1", cwd=tmp)
    return tmp / "hp.json"


@pytest.fixture(scope="module")
def server_c(work, tiny_model, hp_file):
    tmp = work["tmp"]
    with serve(work["venv"], tiny_model, tmp, "c", "--kv-policy-config", str(hp_file), "--kv-policy-mode", "shadow",
               "--kv-record", str(tmp / "rec-c")) as url:
        run = replay(url, work["trace"], tmp / "replay-c")
        time.sleep(4)
        run["metrics"] = metrics(url)
    run["log"] = (tmp / "c.log").read_text()
    return run


@pytest.fixture(scope="module")
def server_b(work, tiny_model, hp_file, server_c):  # after C: one server at a time
    tmp = work["tmp"]
    served = tmp / "hp-served.json"
    shutil.copy(hp_file, served)
    with serve(work["venv"], tiny_model, tmp, "b", "--kv-policy-config", str(served), "--kv-record",
               str(tmp / "rec-b"), "--kv-policy-reload-interval", "1") as url:
        run = replay(url, work["trace"], tmp / "replay-b")
        time.sleep(4)  # the background thread counts the last finishes, then a snapshot
        run["metrics_before"] = metrics(url)
        # Requests keep flowing while the hp file changes under the server: a refit of the last
        # hour of its own recording (atomic, as kvprof writes), then a broken file.
        failures, stop = [], threading.Event()

        def load():
            while not stop.is_set():
                try:
                    completion(url, [(11 * i) % 400 + 5 for i in range(90)], max_tokens=2, xargs={"type": "api"})
                except Exception as err:  # noqa: BLE001 - counted
                    failures.append(repr(err))

        flow = threading.Thread(target=load)
        flow.start()
        try:
            kvprof(work["venv"], "fit", tmp / "rec-b", "--window", "-3600:", "-o", served, "-j", "1", cwd=tmp)
            time.sleep(4)
            broken = json.loads(served.read_text())
            broken["horizon_s"] = "soon"
            (tmp / "broken.json").write_text(json.dumps(broken))
            os.replace(tmp / "broken.json", served)
            time.sleep(4)
        finally:
            stop.set()
            flow.join()
        run["failures"] = failures
        run["outputs"] = outputs(url)
        run["metrics"] = metrics(url)
    run["log"] = (tmp / "b.log").read_text()
    return run


def compare(work, recording, policy, hp=None, limit=None) -> dict:
    out = work["tmp"] / f"compare-{recording}-{policy}"
    args = ["compare", work["tmp"] / recording, "--policies", policy, "--eval-window", "0:", "-o", out, "-j", "1"]
    if limit is not None:
        args += ["--limit", limit]
    if hp is not None:
        args += ["--config", hp]
    kvprof(work["venv"], *args, cwd=work["tmp"])
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    return run


def live_cached(run) -> int:
    return sum(r["cached_tokens"] for r in run["requests"] if r["error"] is None)


# -- A: recording ---------------------------------------------------------------------------------
def test_recording_has_the_prefix_structure_of_the_traffic(work, server_a):
    from kvprof.profiler.reader import read_trace

    assert all(r["error"] is None for r in server_a["requests"])
    source, _ = read_trace(work["trace"], block_size=BS)
    everything, report = read_trace(work["tmp"] / "rec-a")
    assert report.recording.block_size == BS and report.recording.num_gpu_blocks == BLOCKS
    # the traffic, then the three prompts of outputs(): all recorded; replay's two-token test request is not (tagged)
    assert everything.n_requests == source.n_requests + 3
    recorded = everything.select(np.arange(source.n_requests))
    # Two requests sent at one instant may reach the server in either order: compare what does not depend on it.
    assert prefix_tree(recorded) == prefix_tree(source)  # the same requests sharing the same prefixes
    assert sorted(zip(recorded.types, recorded.turn.tolist())) == sorted(zip(source.types, source.turn.tolist()))
    assert (recorded.parent_chat_id == -1).sum() == (source.parent_chat_id == -1).sum()  # sessions linked
    # the server's own cached tokens, per request, are in the recording
    assert sorted(zip(recorded.input_length.tolist(), recorded.extra["cached_tokens"].tolist())) == sorted(
        (r["prompt_tokens"], r["cached_tokens"]) for r in server_a["requests"])


def prefix_tree(trace):
    """The requests' full-block chains as a tree whose nodes are blocks, equal ids one node, in a canonical
    form that does not depend on the ids or the requests' order: equal exactly when the traces have the
    same requests (full-block count and partial tail length) sharing prefixes of the same lengths."""
    root: dict = {}
    for i in range(trace.n_requests):
        node = root
        for block in trace.blocks_of(i)[: int(trace.input_length[i]) // BS].tolist():
            node = node.setdefault(block, {})
        node.setdefault(("ends", int(trace.input_length[i]) % BS), 0)
        node[("ends", int(trace.input_length[i]) % BS)] += 1

    def canonical(node):
        return tuple(sorted((repr(key) if isinstance(key, tuple) else "", value if isinstance(key, tuple)
                             else canonical(value)) for key, value in node.items()))

    return canonical(root)


def recorded_cached(work, recording, limit=None) -> int:
    from kvprof.profiler.reader import read_trace

    trace, _ = read_trace(work["tmp"] / recording)
    return int(trace.extra["cached_tokens"][:limit].sum())


def test_compare_of_the_recording_gives_the_live_lru_hits(work, server_a):
    run = compare(work, "rec-a", "lru")
    assert run["capacity"] == BLOCKS - 1
    assert run["cached_tokens"] == recorded_cached(work, "rec-a") > 0  # token for token: same timing, same eviction


def test_lru_replayed_beside_the_server_hits_what_it_hit(server_a):
    m = server_a["metrics"]
    real = sum(v for k, v in m.items() if k.startswith("kvprof_cached_blocks_total"))
    assert real == live_cached(server_a) // BS > 0
    assert m['kvprof_counterfactual_cached_blocks_total{policy="lru"}'] == real
    (info,) = [k for k in m if k.startswith("kvprof_info")]
    assert 'mode="record"' in info and 'policy="none"' in info and "rec-a" in info
    assert m['kvprof_records_total{result="written"}'] >= len(server_a["requests"])
    assert "vLLM's own eviction hit" in server_a["log"] and "lru replayed beside it" in server_a["log"]
    assert "compiled core ready in" in server_a["log"]


def test_recording_only_does_not_change_vllms_outputs(server_a, server_b):
    assert server_a["outputs"] == server_b["outputs"]


def test_fit_of_the_recording_is_tuned_for_its_server(hp_file):
    hp = json.loads(hp_file.read_text())
    assert hp["block_size"] == BS
    assert [entry["capacity"] for entry in hp["tuning"]] == [BLOCKS - 1]
    assert {"api_1", "chat_1", "doc_1"} <= set(hp["classes"])


# -- C: shadow mode -------------------------------------------------------------------------------
def test_shadow_mode_leaves_vllms_eviction_alone(work, server_c):
    assert all(r["error"] is None for r in server_c["requests"])
    assert compare(work, "rec-c", "lru")["cached_tokens"] == recorded_cached(work, "rec-c") == live_cached(server_c)
    assert "in shadow mode" in server_c["log"] and "wa would have hit" in server_c["log"]
    from kvprof.recording import load_recording

    assert load_recording(work["tmp"] / "rec-c").starts[-1].policy == "vllm-lru"  # what evicted: vLLM's LRU


# -- B: enforce, reload ---------------------------------------------------------------------------
def test_compare_of_the_recording_gives_the_live_wa_hits(work, server_b, hp_file):
    from kvprof.recording import load_recording

    assert all(r["error"] is None for r in server_b["requests"])
    assert load_recording(work["tmp"] / "rec-b").starts[0].policy == "wa"  # what evicted
    n = len(server_b["requests"])  # the traffic before the hp file changed (replay's test request is not recorded)
    run = compare(work, "rec-b", "wa", hp=hp_file, limit=n)
    live = recorded_cached(work, "rec-b", n)
    assert live == live_cached(server_b)
    assert abs(run["cached_tokens"] - live) <= 0.005 * run["prompt_tokens"], (run["cached_tokens"], live)


def test_shadow_mode_predicts_the_real_wa(work, server_b, server_c, hp_file):
    m_c, m_b = server_c["metrics"], server_b["metrics_before"]
    lookups_c = sum(v for k, v in m_c.items() if k.startswith("kvprof_prompt_blocks_total"))
    shadow_hits = m_c['kvprof_counterfactual_cached_blocks_total{policy="wa"}']
    # what the live counterfactual found is what compare of the shadow server's recording finds
    assert shadow_hits * BS == compare(work, "rec-c", "wa", hp=hp_file)["cached_tokens"]
    predicted = shadow_hits / lookups_c
    lookups_b = sum(v for k, v in m_b.items() if k.startswith("kvprof_prompt_blocks_total"))
    real = sum(v for k, v in m_b.items() if k.startswith("kvprof_cached_blocks_total")) / lookups_b
    assert abs(predicted - real) <= 0.01, (predicted, real)


def test_the_fitted_policy_beats_lru_live(server_a, server_b):
    """On this traffic LRU loses the system prompt to every burst of documents; wa, fitted on the
    server's own recording, keeps it (in the real server, not only in simulation)."""
    assert live_cached(server_b) > live_cached(server_a) + 10 * BS


def test_reloads_keep_serving(server_b):
    assert server_b["failures"] == []
    m = server_b["metrics"]
    assert m['kvprof_reloads_total{result="ok"}'] == 1
    assert m['kvprof_reloads_total{result="error"}'] == 1
    log = server_b["log"]
    lines = "\n".join(line for line in log.splitlines() if "kvprof" in line)
    assert "kvprof: reloaded" in log, lines
    assert "not reloading" in log and "the running policy stays" in log and "horizon_s" in log, lines
    assert "wa hit" in log and "lru would have hit" in log
