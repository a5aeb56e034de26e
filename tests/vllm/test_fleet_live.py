"""A live fleet: three real vLLM servers behind ``kvprof replay --url A --url B --url C --router R``, beside the
simulator (docs/fleet.md, "Live").

The three servers (the tests' tiny model, 16 blocks of 32 tokens each, ``--kv-record`` under one shared
``--kv-record-key``, KV events published over ZMQ) run together; the same traffic is replayed through them three times, behind
``round-robin``, ``session`` and ``prefix-precise`` (which reads their KV events), each time with
other hash ids (:func:`fleet_trace`'s ``phase``): under LRU a server's blocks from an earlier phase
are evicted before any of the phase's own and are never hit, so each phase meets its servers as
cold ones would. Per router and server the cached tokens are measured three ways:

* live, what each server reported (``DIR/replica-K/results.json``);
* ``kvprof compare`` of the server's recording on its recorded timing, the phase's window of it;
* ``kvprof fleet`` of the phase's trace behind the same router (timed by the cost model).

What the tests assert is what does not depend on the machine's speed: the recorded timing reproduces
every server's cached tokens exactly; a router that reads only the trace routes alike live and
simulated; and where a server served its requests one after another (its recording says so: none
was scheduled before the one before it finished), the cost model's timing gives it the live cached
tokens. What the machine's speed decides is reported, not asserted (``figures.json``): how live
requests overlapped on a loaded machine, and ``prefix-precise``'s live routing, which reads KV events
that lag the prefills they announce.
"""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from vllm_support import _kill_group, free_port, serve_command, server_env, wait_until_up

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPLICAS = 3
BLOCKS = 16  # 15 usable: block 0 is vLLM's null block
BS = 32
OUTPUT = 4  # generated tokens stay in the prompt's partial last block: no block holds output
SPACING_S = 0.6  # between arrivals: each request is done before the next reaches its server
ROUTERS = ("round-robin", "session", "prefix-precise")
#: Per server, how far the simulator's cached tokens may be from live ones: a share of its prompt tokens.
TOLERANCE = 0.01


def fleet_trace(path: Path, phase: int, rounds: int = 5) -> Path:
    """A Bailian-format trace at the servers' block size, 8 requests a round, SPACING_S apart: the next
    turn of each of four chat sessions (a prefix growing by a block a turn), three API calls on a
    shared 3-block system prompt, a one-off 4-block document. Eight a round, so round robin moves
    each session from server to server (and gives each server an API call a round);
    ``phase`` shifts every hash id (no content shared across phases)."""
    base = 1_000_000 * (phase + 1)
    rows, next_id = [], base + 1000
    sessions = [([base + 10 * s], -1) for s in range(4)]  # (blocks, last chat id)

    def add(kind, turn, ids, parent=-1):
        rows.append({"chat_id": base + len(rows), "parent_chat_id": parent, "timestamp": round(SPACING_S * len(rows), 3),
                     "input_length": BS * len(ids) - 5, "output_length": OUTPUT, "type": kind, "turn": turn,
                     "hash_ids": ids})
        return rows[-1]["chat_id"]

    for turn in range(1, rounds + 1):
        for s, (ids, parent) in enumerate(sessions):
            ids = ids + [next_id]
            next_id += 1
            sessions[s] = (ids, add("chat", turn, ids, parent))
        for _ in range(3):
            add("api", 1, [base + 1, base + 2, base + 3, next_id])
            next_id += 1
        add("doc", 1, list(range(next_id, next_id + 4)))
        next_id += 4
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def kvprof(venv: Path, *args, cwd: Path) -> str:
    """kvprof's CLI from the vLLM venv, as a user runs it; its stdout."""
    proc = subprocess.run([str(venv / "bin" / "kvprof"), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=600)
    assert proc.returncode == 0, f"kvprof {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc.stdout


def invoke_ok(*args) -> str:
    """kvprof's CLI in this process (no interpreter to start: the simulator's runs are many and short)."""
    from tests.helpers import invoke

    result = invoke(*args)
    assert result.exit_code == 0, f"kvprof {' '.join(map(str, args))} failed:\n{result.output[-4000:]}"
    return result.stdout


@contextmanager
def servers(venv: Path, model: Path, tmp: Path, endpoints: list[str]):
    """``vllm serve`` once per endpoint (each recording, publishing its KV events to its endpoint): the
    first alone, which compiles kvprof's core into numba's cache, then the others together, which load it
    (three compiling at once on two cores took longer than a server may take to start); yields their URLs
    once all answer; kills each one's process group on exit."""
    procs, urls = [], []

    def start(j: int, endpoint: str) -> None:
        port = free_port()
        events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})
        cmd = serve_command(venv, model, port, "--kv-record", str(tmp / f"rec-{j}"), "--kv-record-key",
                            str(tmp / "fleet.key"), "--kv-events-config", events, blocks=BLOCKS)
        with open(tmp / f"server-{j}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                                          start_new_session=True, cwd=str(tmp)))
        urls.append(f"http://127.0.0.1:{port}")

    try:
        start(0, endpoints[0])
        wait_until_up(urls[0], procs[0], tmp / "server-0.log")
        for j in range(1, len(endpoints)):
            start(j, endpoints[j])
        for j in range(1, len(endpoints)):
            wait_until_up(urls[j], procs[j], tmp / f"server-{j}.log")
        yield urls
    finally:
        for proc in procs:
            _kill_group(proc)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, vllm_venv, tiny_model):
    """Three servers serving three phases, one per router; what each phase measured and the recordings."""
    tmp = tmp_path_factory.mktemp("fleet")
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(REPLICAS)]
    phases = {}
    started = time.monotonic()
    with servers(vllm_venv, tiny_model, tmp, endpoints) as urls:
        up = time.monotonic()
        for phase, router in enumerate(ROUTERS):
            trace = fleet_trace(tmp / f"trace-{router}.jsonl", phase)
            out = tmp / f"live-{router}"
            events = [a for e in endpoints for a in ("--kv-events", e)] if router == "prefix-precise" else []
            stdout = kvprof(vllm_venv, "replay", trace, *(a for url in urls for a in ("--url", url)),
                            "--router", router, *events, "--model", "tiny", "--trace-block-tokens", BS,
                            "--vocab-size", 500, "--max-output-tokens", OUTPUT, "--max-concurrency", 2, "-o", out,
                            cwd=tmp)
            phases[router] = {"trace": trace, "out": out, "stdout": stdout}
            time.sleep(2.0)  # the last requests recorded; a gap between the phases' windows
    (tmp / "timing.json").write_text(json.dumps({"startup_s": up - started, "total_s": time.monotonic() - started}))
    return {"tmp": tmp, "phases": phases, "venv": vllm_venv}


def live(fleet, router) -> dict:
    """The live fleet run and each server's run of the phase."""
    out = fleet["phases"][router]["out"]
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    replicas = [json.loads((out / f"replica-{j}" / "results.json").read_text())["runs"][0] for j in range(REPLICAS)]
    routing = [json.loads(line)["replica"] for line in (out / "requests.jsonl").read_text().splitlines()]
    return {"run": run, "replicas": replicas, "routing": routing}


def recorded_windows(fleet, replica: int) -> dict:
    """Per router, the START:END window of server ``replica``'s recording that holds the phase, the
    server's own cached tokens in it (recorded per request), and how many of its requests were
    scheduled before the request before them finished (requests that overlapped: the machine's speed
    decides how many)."""
    import numpy as np

    from kvprof.profiler.reader import read_trace
    from kvprof.sim.recorded import FINISHED, SCHEDULED

    trace, _ = read_trace(fleet["tmp"] / f"rec-{replica}")
    counts = [live(fleet, router)["run"]["replica_requests"][replica] for router in ROUTERS]
    assert trace.n_requests == sum(counts)  # the recording holds every request sent to it, none else
    scheduled = trace.extra[SCHEDULED].astype(float)
    busy_until = np.maximum.accumulate(trace.extra[FINISHED].astype(float))  # the latest finish so far
    overlapped = np.concatenate([[False], scheduled[1:] < busy_until[:-1]])
    out, first = {}, 0
    for router, n in zip(ROUTERS, counts):
        last = first + n
        start = float(trace.timestamp[first]) - 0.5
        end = float(trace.timestamp[last]) - 0.5 if last < trace.n_requests else None
        out[router] = (f"{start}:{'' if end is None else end}", int(trace.extra["cached_tokens"][first:last].sum()),
                       int(overlapped[first:last].sum()))
        first = last
    return out


def compare_recording(fleet, replica: int, window: str) -> dict:
    out = fleet["tmp"] / f"compare-{replica}-{window}"
    invoke_ok("compare", fleet["tmp"] / f"rec-{replica}", "--policies", "lru", "--eval-window", window,
              "--capacity", BLOCKS - 1, "-o", out, "-j", 1)
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    return run


def simulated_routing(fleet, router) -> list[int]:
    """Each request's replica as kvprof fleet routes the phase's trace (its routing pass, every server under lru)."""
    from kvprof.profiler.reader import read_trace
    from kvprof.sim.config import SimConfig
    from kvprof.sim.fleet import RouterSpec, route
    from kvprof.sim.workload import prepare_workload

    trace, _ = read_trace(fleet["phases"][router]["trace"], block_size=BS)
    workload = prepare_workload(trace, None, BS, 1.0)
    return route(trace, workload, None, RouterSpec(router), REPLICAS, "lru", BLOCKS - 1,
                 SimConfig(engine_block_size=BS, timing="model")).replica.tolist()


def simulated_fleet(fleet, router) -> dict:
    """``kvprof fleet`` of the phase's trace behind ``router`` (the servers' block size and capacity)."""
    out = fleet["tmp"] / f"sim-{router}"
    rows = json.loads(invoke_ok("fleet", fleet["phases"][router]["trace"], "--trace-block-tokens", BS,
                                "--block-size", BS, "--replicas", REPLICAS, "--router", router, "--policies", "lru",
                                "--capacity", BLOCKS - 1, "--eval-window", "0:", "-o", out, "-j", 1, "--json"))
    (row,) = rows
    return row


@pytest.fixture(scope="module")
def figures(fleet):
    """Per router: live, recorded-timing and fleet-simulated cached tokens per server (the report's table)."""
    windows = [recorded_windows(fleet, j) for j in range(REPLICAS)]
    table = {}
    for router in ROUTERS:
        measured = live(fleet, router)
        sim = simulated_fleet(fleet, router)
        prompt = [run["prompt_tokens"] for run in measured["replicas"]]
        table[router] = {
            "routing": measured["routing"],
            "same_routing": sum(a == b for a, b in zip(measured["routing"], simulated_routing(fleet, router))),
            "live": [run["cached_tokens"] for run in measured["replicas"]],
            "recorded": [windows[j][router][1] for j in range(REPLICAS)],
            "overlapped": [windows[j][router][2] for j in range(REPLICAS)],
            "kv_events": measured["run"].get("replica_kv_events"),
            "compare": [compare_recording(fleet, j, windows[j][router][0])["cached_tokens"] for j in range(REPLICAS)],
            "prompt": prompt,
            "fleet_sim": [round(ratio * tokens) for ratio, tokens in zip(sim["replica_token_hit_ratios"], prompt)],
            "fleet_sim_requests": sim["replica_requests"],
            "live_requests": measured["run"]["replica_requests"],
            "fleet_sim_hit_ratio": sim["fleet_token_hit_ratio"],
            "live_hit_ratio": measured["run"]["fleet_token_hit_ratio"],
        }
    (fleet["tmp"] / "figures.json").write_text(json.dumps(table, indent=1))
    print("\n[fleet live] " + json.dumps({r: {k: v for k, v in t.items() if k != "routing"} for r, t in table.items()}))
    return table


def test_every_request_was_answered_and_recorded(fleet):
    for router in ROUTERS:
        measured = live(fleet, router)
        assert measured["run"]["n_errors"] == 0 and measured["run"]["n_skipped"] == 0
        assert set(measured["routing"]) == set(range(REPLICAS)), f"{router} must use every server"
        assert f"{router} x3: replica 0:" in fleet["phases"][router]["stdout"]


@pytest.mark.parametrize("router", ROUTERS)
def test_compare_of_each_recording_gives_the_live_cached_tokens(figures, router):
    """The simulator on each server's recorded timing: token for token what that server hit, behind any router."""
    row = figures[router]
    assert row["compare"] == row["recorded"] == row["live"], row


@pytest.mark.parametrize("router", ["round-robin", "session"])
def test_kvprof_fleet_routes_and_hits_as_the_live_fleet(figures, router):
    """Behind a router that reads only the trace, kvprof fleet sends each server the requests it got live;
    on a server that served them one after another (as the cost model times them), its cached tokens are
    within TOLERANCE of the server's prompt tokens of live ones. Where requests overlapped live (a loaded
    machine), the recorded timing accounts for them (the test above)."""
    row = figures[router]
    assert row["same_routing"] == len(row["routing"])
    assert row["fleet_sim_requests"] == row["live_requests"]
    for live_cached, sim_cached, prompt, overlapped in zip(row["live"], row["fleet_sim"], row["prompt"],
                                                           row["overlapped"]):
        if not overlapped:
            assert abs(sim_cached - live_cached) <= TOLERANCE * prompt, row
    assert sum(row["live"]) > 0


def test_session_affinity_hits_more_than_round_robin_simulated(figures):
    """Deterministic: both fleets simulated on the cost model's timing (live, the same holds unless requests
    overlap on a loaded machine; figures.json has both)."""
    assert figures["session"]["fleet_sim_hit_ratio"] > figures["round-robin"]["fleet_sim_hit_ratio"]


def test_prefix_precise_reads_every_servers_kv_events(figures):
    """prefix-precise live heard every server's KV events (the replay reports how many), and in kvprof fleet,
    reading the simulated caches, hits at least what session affinity hits. Live, its routing follows events
    that lag the prefills they announce, so how often it agrees with the simulated router depends on the
    machine's speed: figures.json reports it (same_routing, live and simulated hit ratios), not asserted."""
    row = figures["prefix-precise"]
    assert row["kv_events"] is not None and len(row["kv_events"]) == REPLICAS
    assert all(n > 0 for n in row["kv_events"]), row
    assert row["fleet_sim_hit_ratio"] >= figures["session"]["fleet_sim_hit_ratio"]


def test_servers_sharing_a_record_key_record_a_prefix_alike(fleet):
    """Under one --kv-record-key (the first server created it, the others read it) the three servers gave
    the shared system prompt of a phase the same ids, so kvprof fleet of their recordings needs no warning."""
    from kvprof.profiler.reader import read_trace
    from kvprof.recording import load_recording

    recordings = [fleet["tmp"] / f"rec-{j}" for j in range(REPLICAS)]
    assert oct((fleet["tmp"] / "fleet.key").stat().st_mode & 0o777) == "0o600"
    keys = {start.key_id for directory in recordings for start in load_recording(directory).starts}
    assert len(keys) == 1 and None not in keys
    prefixes = []
    for directory in recordings:
        trace, _ = read_trace(directory)
        prefixes.append({tuple(trace.blocks_of(i)[:3].tolist()) for i in range(trace.n_requests)
                         if trace.types[i] == "api"})
    assert all(prefixes)  # round robin gave every server API calls
    assert len(set().union(*prefixes)) == len(ROUTERS)  # one system prompt a phase, whichever server got it
    from tests.helpers import invoke

    result = invoke("fleet", *recordings, "--router", "recorded,round-robin", "--policies", "lru", "--eval-window",
                    "0:", "-j", "1", "--json", "-o", fleet["tmp"] / "fleet-of-recordings")
    assert result.exit_code == 0, result.output
    assert "lower bound" not in result.stderr
