"""``kvprof fleet``: one replica is compare, the routers route as documented, and the replicas a
router reads while routing count the hits their replays count afterwards."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof import results
from kvprof.sim.config import SimConfig, SimulationError
from kvprof.sim.fleet import ROUTERS, RouterSpec, jump_hash, route, run_fleet
from kvprof.sim.sample import chain_roots
from kvprof.sim.workload import prepare_workload
from tests.helpers import invoke, one_line, synthetic
from tests.test_cli_hints import hinted_trace  # noqa: F401 (a fixture: every third request retains, every fifth releases)

WINDOWS = ("--fit-window", "0:360", "--eval-window", "360:", "-j", "1")


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    """compare's test trace: 12 minutes of bailian-a."""
    return synthetic(tmp_path_factory.mktemp("fleet"), hours=0.2, seed=5)[0]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Ten minutes of bailian-a, prepared at 128-token blocks without an hp file."""
    _, trace = synthetic(tmp_path_factory.mktemp("prepared"), hours=0.17, seed=3)
    return trace, prepare_workload(trace, None, 128)


def test_one_replica_is_compare_for_every_router(small_trace, tmp_path):
    common = ("--policies", "lru,wa", "--capacity", "64,256", *WINDOWS, "--json")
    single = invoke("compare", small_trace, *common, "-o", tmp_path / "compare")
    assert single.exit_code == 0, single.output
    expected = {(run["policy"], run["capacity"]): run["token_hit_ratio"] for run in json.loads(single.stdout)["runs"]}
    fleet = invoke("fleet", small_trace, *common, "--replicas", "1", "--router", ",".join(ROUTERS),
                   "-o", tmp_path / "fleet")
    assert fleet.exit_code == 0, fleet.output
    rows = json.loads(fleet.stdout)
    assert len(rows) == len(ROUTERS) * 2 * 2
    for row in rows:
        assert row["fleet_token_hit_ratio"] == expected[row["policy"], row["capacity"]]
        assert row["replica_token_hit_ratios"] == [row["fleet_token_hit_ratio"]]
        assert row["load_imbalance"] == 1.0
        assert row["fleet_token_hit_ratio"] <= row["belady_token_hit_ratio"]
    document = results.load(tmp_path / "fleet" / results.FILE)
    assert len(document["runs"]) == len(rows)
    assert {run["policy"] for run in document["runs"]} >= {"lru, prefix-precise x1", "wa, session x1"}
    assert (tmp_path / "fleet" / "hp.json").exists()
    assert invoke("show", tmp_path / "fleet" / results.FILE).exit_code == 0


@pytest.mark.parametrize("spec", [RouterSpec("least-loaded"), RouterSpec("prefix-precise"),
                                  RouterSpec("prefix-precise", load_weight=0.0), RouterSpec("prefix-approx")],
                         ids=lambda spec: f"{spec.name}-{spec.load_weight:g}")
@pytest.mark.parametrize("decode", [False, True])
def test_replicas_read_while_routing_hit_what_their_replays_hit(prepared, spec, decode):
    """The live pass (Python replicas run together) and the measuring pass (each replica's traffic
    replayed alone by the compiled engine) are the same replays."""
    trace, workload = prepared
    config = SimConfig(cost=SimConfig().cost.__class__(decode=decode, prefill_tokens_per_s=4000.0))
    run = run_fleet(trace, workload, None, spec, 3, "lru", 96, config)
    assert run.live_hits == tuple(replica.hits_device for replica in run.runs)
    assert sum(replica.n_requests for replica in run.runs) == trace.n_requests
    assert all(replica.token_hit_ratio <= bound.token_hit_ratio + 1e-12 for replica, bound in zip(run.runs, run.bounds))
    assert run.qttft.size == trace.n_requests - sum(replica.n_rejected for replica in run.runs)


def test_one_replica_with_hints_is_compare_with_hints(hinted_trace, tmp_path):
    """Each online policy runs also as P+hints, within the same budget as compare's, behind any router."""
    common = ("--capacity", "64,256", "--hint-max-fraction", "0.5", *WINDOWS, "--json")
    single = invoke("compare", hinted_trace, "--policies", "lru,belady", *common, "-o", tmp_path / "compare")
    assert single.exit_code == 0, single.output
    expected = {(run["policy"], run["capacity"]): run["token_hit_ratio"] for run in json.loads(single.stdout)["runs"]}
    assert expected[("lru+hints", 64)] != expected[("lru", 64)]  # the hints change something
    fleet = invoke("fleet", hinted_trace, "--policies", "lru", *common, "--replicas", "1", "--router", "round-robin,least-loaded",
                   "-o", tmp_path / "fleet")
    assert fleet.exit_code == 0, fleet.output
    rows = json.loads(fleet.stdout)
    assert sorted({row["policy"] for row in rows}) == ["lru", "lru+hints"] and len(rows) == 2 * 2 * 2
    for row in rows:
        assert row["fleet_token_hit_ratio"] == expected[row["policy"], row["capacity"]]
    document = results.load(tmp_path / "fleet" / results.FILE)
    assert document["inputs"]["hints"] == {"source": "trace", "hinted_requests": document["inputs"]["hints"][
        "hinted_requests"], "max_fraction": 0.5}
    ignored = invoke("fleet", hinted_trace, "--policies", "lru", "--capacity", "64", "--ignore-hints", *WINDOWS,
                     "--json", "--replicas", "2", "--router", "round-robin", "-o", tmp_path / "ignored")
    assert ignored.exit_code == 0, ignored.output
    assert [row["policy"] for row in json.loads(ignored.stdout)] == ["lru"]


@pytest.mark.parametrize("router", ["least-loaded", "prefix-precise"])
def test_hinted_replicas_read_while_routing_hit_what_their_replays_hit(hinted_trace, router):
    """With hints the live pass and the measuring pass are the same Python replays, budget included."""
    from kvprof.profiler.reader import read_trace

    trace = read_trace(hinted_trace)[0]
    run = run_fleet(trace, prepare_workload(trace, None, 128), None, RouterSpec(router), 3, "lru+hints", 64,
                    SimConfig(), hint_max_fraction=0.25)
    assert run.live_hits == tuple(replica.hits_device for replica in run.runs)
    plain = run_fleet(trace, prepare_workload(trace, None, 128), None, RouterSpec(router), 3, "lru", 64, SimConfig())
    assert run.live_hits != plain.live_hits  # the hints changed what the replicas cached
    assert sum(replica.n_requests for replica in run.runs) == trace.n_requests


def test_routers_that_read_only_the_trace(prepared):
    trace, workload = prepared
    config = SimConfig()
    rr = route(trace, workload, None, RouterSpec("round-robin"), 4, "lru", 64, config).replica
    assert rr.tolist() == [r % 4 for r in range(trace.n_requests)]
    session = route(trace, workload, None, RouterSpec("session"), 4, "lru", 64, config).replica
    roots = chain_roots(trace)
    for root in np.unique(roots):
        assert np.unique(session[roots == root]).size == 1, "a conversation was split"
    assert not RouterSpec("prefix-approx", load_weight=0.0).reads_replicas
    approx = route(trace, workload, None, RouterSpec("prefix-approx", load_weight=0.0), 4, "lru", 64, config)
    assert approx.live_hits is None and set(approx.replica.tolist()) <= set(range(4))


def test_least_loaded_spreads_a_burst(prepared):
    """Requests arriving together (faster than one replica serves them) go to the idle replicas."""
    trace, workload = prepared
    burst = trace.select(np.arange(trace.n_requests) < 8, window=trace.window)
    burst_workload = prepare_workload(burst, None, 128, rate_scale=1e6)
    config = SimConfig(rate_scale=1e6, cost=SimConfig().cost.__class__(prefill_tokens_per_s=10.0))
    chosen = route(burst, burst_workload, None, RouterSpec("least-loaded"), 4, "lru", 4096, config).replica
    assert np.bincount(chosen, minlength=4).tolist() == [2, 2, 2, 2]


def test_belady_cannot_run_behind_a_router_that_reads_the_replicas(prepared):
    trace, workload = prepared
    with pytest.raises(SimulationError, match="belady cannot run behind least-loaded"):
        run_fleet(trace, workload, None, RouterSpec("least-loaded"), 2, "belady", 64, SimConfig())


@settings(max_examples=200, deadline=None)
@given(key=st.integers(-2**63, 2**64 - 1), buckets=st.integers(1, 64))
def test_jump_hash_moves_a_key_only_to_a_new_bucket(key, buckets):
    before, after = jump_hash(key, buckets), jump_hash(key, buckets + 1)
    assert 0 <= before < buckets
    assert after in (before, buckets)


@pytest.mark.parametrize("args, words", [
    (["--replicas", "0"], "--replicas"),
    (["--replicas", "4,4"], "given twice"),
    (["--router", "random"], "unknown router 'random'"),
    (["--policies", "nope"], "unknown policy"),
    (["--capacity", "0"], "--capacity"),
    (["--load-weight", "-1"], "--load-weight"),
    (["--index-blocks", "0"], "--index-blocks"),
])
def test_bad_options_exit_2_before_reading_the_trace(tmp_path, args, words):
    result = invoke("fleet", tmp_path / "missing.jsonl", "-o", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert words in one_line(result.output)
    assert not (tmp_path / "out").exists()


def test_belady_behind_least_loaded_is_a_usage_error(small_trace, tmp_path):
    result = invoke("fleet", small_trace, "--router", "least-loaded", "--policies", "belady", "--capacity", "64",
                    *WINDOWS, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "belady cannot run behind least-loaded" in one_line(result.output)
    assert not (tmp_path / "out").exists()


def test_a_sweep_gives_the_same_rows_on_joblib_workers_and_on_ray(small_trace, tmp_path):
    common = ("--replicas", "1,3", "--router", "least-loaded,session", "--policies", "lru,wa", "--capacity", "64",
              "--fit-window", "0:360", "--eval-window", "360:", "--json")
    one = invoke("fleet", small_trace, *common, "-j", "1", "-o", tmp_path / "one")
    two = invoke("fleet", small_trace, *common, "-j", "2", "-o", tmp_path / "two")
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    assert json.loads(one.stdout) == json.loads(two.stdout)
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        remote = invoke("fleet", small_trace, *common, "--ray", "auto", "-o", tmp_path / "ray")
    finally:
        ray.shutdown()
    assert remote.exit_code == 0, remote.output
    assert json.loads(remote.stdout) == json.loads(one.stdout)


def test_hp_per_replica_of_one_replica_is_the_fleets_and_of_three_is_fitted_on_each_share(small_trace, tmp_path):
    common = ("--router", "session", "--policies", "lru,wa", "--capacity", "64", "--hp-per-replica", *WINDOWS,
              "--json")
    one = invoke("fleet", small_trace, *common, "--replicas", "1", "-o", tmp_path / "one")
    assert one.exit_code == 0, one.output
    rows = {(row["policy"], row["hp"]): row for row in json.loads(one.stdout)}
    assert set(rows) == {("lru", "fleet"), ("wa", "fleet"), ("wa", "per-replica")}  # lru reads no hp file
    assert rows["wa", "per-replica"]["fleet_token_hit_ratio"] == rows["wa", "fleet"]["fleet_token_hit_ratio"]
    three = invoke("fleet", small_trace, *common, "--replicas", "3", "-o", tmp_path / "three")
    assert three.exit_code == 0, three.output
    document = results.load(tmp_path / "three" / results.FILE)
    assert "wa, session x3, hp per-replica" in document["config"]["policies"]
    per_replica = [row for row in json.loads(three.stdout) if row["hp"] == "per-replica"]
    assert len(per_replica) == 1 and len(per_replica[0]["replica_token_hit_ratios"]) == 3
    for k in range(3):  # fit --replica K writes the file the fleet ran on replica K
        written = tmp_path / "three" / f"hp-session-x3-c64-replica-{k}.json"
        fitted = invoke("fit", small_trace, *FIT, "--replicas", "3", "--router", "session", "--replica", k,
                        "-o", tmp_path / f"fit-{k}.json")
        assert fitted.exit_code == 0, fitted.output
        assert _parameters(tmp_path / f"fit-{k}.json") == _parameters(written)
        assert json.loads(written.read_text())["provenance"]["routed"] == {
            "router": "session", "load_weight": 1.0, "index_blocks": None, "replicas": 3, "replica": k}
    assert (tmp_path / "one" / "hp-session-x1-c64-replica-0.json").exists()
    plain = invoke("fit", small_trace, *FIT, "-o", tmp_path / "plain.json")
    assert plain.exit_code == 0, plain.output
    for router, knobs in (("round-robin", []), ("session", []), ("prefix-approx", ["--load-weight", "0"])):
        alone = invoke("fit", small_trace, *FIT, "--replicas", "1", "--router", router, *knobs,
                       "--replica", "0", "-o", tmp_path / "alone.json")
        assert alone.exit_code == 0, alone.output
        assert _parameters(tmp_path / "alone.json", held_out=False) == _parameters(tmp_path / "plain.json",
                                                                                  held_out=False)


FIT = ("--window", "0:360", "--capacity", "64", "-j", "1")


def _parameters(path, held_out: bool = True) -> dict:
    """An hp file's fitted and tuned parameters: all of it but when it was made and which replica it is for
    (and without ``held_out``, the held-out quality, which a replica's fit does not measure)."""
    data = json.loads(path.read_text())
    for key in ("created", "routed"):
        data["provenance"].pop(key, None)
    if not held_out:
        for tiers in data.get("cells", {}).values():
            for row in tiers:
                row.get("diagnostics", {}).pop("holdout", None)
    return data


NO_CAPACITY = "(no --capacity)"


@pytest.mark.parametrize("args, words", [
    (["--replicas", "3", "--router", "session", "--replica", "3"], "replica 3 is not one of --replicas 3 (numbered 0 to 2)"),
    (["--replicas", "3", "--router", "least-loaded", "--replica", "0"],
     "fit --replica routes only from the trace, behind round-robin, session or prefix-approx --load-weight 0"),
    (["--replicas", "3", "--router", "prefix-approx", "--replica", "0"], "kvprof fleet --hp-per-replica -o DIR"),
    (["--replicas", "3", "--router", "prefix-precise", "--load-weight", "0", "--replica", "0"], "their loads or caches"),
    (["--replicas", "3", "--router", "random", "--replica", "0"], "unknown router 'random'"),
    (["--replicas", "3", "--replica", "0"], "give --router R too"),
    (["--replicas", "3", "--router", "session"], "give it with --replica"),
    (["--replicas", "3", "--router", "session", "--replica", "0", NO_CAPACITY], "give --capacity"),
    (["--replicas", "3", "--router", "session", "--replica", "0", "--sharded"], "without --sharded"),
    (["--replicas", "3", "--router", "prefix-approx", "--load-weight", "0", "--replica", "0", "--capacity", "64,128"],
     "give one capacity or --index-blocks"),
])
def test_fit_replica_refuses_what_it_cannot_fit_before_reading_the_trace(tmp_path, args, words):
    capacity = [] if {"--capacity", "--sharded", NO_CAPACITY} & set(args) else ["--capacity", "64"]
    args = [arg for arg in args if arg is not NO_CAPACITY]
    result = invoke("fit", tmp_path / "missing.jsonl", "-o", tmp_path / "hp.json", *capacity, *args)
    assert result.exit_code == 2, result.output
    assert words in one_line(result.output)
    assert list(tmp_path.iterdir()) == []


def test_fit_replica_the_router_sends_nothing_is_an_error_and_writes_nothing(small_trace, tmp_path):
    result = invoke("fit", small_trace, "--window", "0:2", "--capacity", "64", "--replicas", "4096", "--router",
                    "round-robin", "--replica", "4095", "-o", tmp_path / "hp.json")
    assert result.exit_code == 1, result.output
    assert "round-robin sends replica 4095 of 4096 none of the fit window's" in one_line(result.output)
    assert not (tmp_path / "hp.json").exists()


def test_fleet_writes_its_replicas_hp_files_with_its_other_outputs_or_none(small_trace, tmp_path, monkeypatch):
    """An interrupt while plotting (the last output) leaves none of the run's files, hp files included."""
    import kvprof.cli.plots

    calls = []

    def interrupted(*args, **kwargs):
        calls.append(args)
        raise KeyboardInterrupt

    monkeypatch.setattr(kvprof.cli.plots, "plot_results", interrupted)
    result = invoke("fleet", small_trace, "--router", "round-robin", "--replicas", "2", "--policies", "wa",
                    "--capacity", "64", "--hp-per-replica", *WINDOWS, "-o", tmp_path / "out")
    assert result.exit_code != 0 and len(calls) == 1
    assert not (tmp_path / "out").exists()  # nothing in it, and the run that made it removed it


def test_replicas_with_their_own_hp_files_hit_while_routing_what_their_replays_hit(prepared):
    from kvprof.profiler.fit import fit_trace
    from kvprof.sim.fleet import fit_per_replica

    trace, _ = prepared
    fit_part, evaluated = trace.time_window(None, 300.0), trace.time_window(300.0, None)
    hp = fit_trace(fit_part)
    hps = fit_per_replica(fit_part, RouterSpec("least-loaded"), 2, 64, SimConfig(), hp, fit_trace)
    assert len(hps) == 2 and hps[0] is not hps[1] and all(one.tuning for one in hps)
    run = run_fleet(evaluated, prepare_workload(evaluated, hp, 128), hp, RouterSpec("prefix-precise"), 2, "wa", 64,
                    SimConfig(), hps)
    assert run.hp_per_replica and run.to_dict()["hp"] == "per-replica"
    assert run.live_hits == tuple(replica.hits_device for replica in run.runs)


# --- a fleet of recordings: kvprof fleet DIR1 DIR2 ... ---------------------------------------------


def _server(directory, t0, n, *, system, block_size=None, model=None, offset=0.0, rank=0, key_file=None):
    """A recording of one server that received ``n`` requests from ``t0`` on, every other one
    behind the shared ``system`` prompt, each held 2 s (its recorded timing); its block ids keyed
    by ``key_file`` (None: a key of its own)."""
    from tests.test_recording import BS, START, Clock, request
    from kvprof.vllm.record import Recorder

    recorder = Recorder(directory, block_size=block_size or BS, start={**START, "model": model or START["model"], "rank": rank},
                        clock=Clock(t0), guard=False, key_file=key_file).begin()
    for i in range(n):
        chain = system + [f"q{i}".encode()] if i % 2 else [f"{directory.name}-d{i}-{k}".encode() for k in range(3)]
        r = request(t0 + offset + 5 * i, [])
        r.block_hashes, r.num_prompt_tokens = chain, BS * len(chain) + 1
        recorder.submit(r, t0 + offset + 5 * i + 0.1, 0, t0 + offset + 5 * i + 2)
    recorder.close()
    return directory


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    """Two servers' recordings, started 100 s apart (so their origins differ)."""
    base = tmp_path_factory.mktemp("servers")
    return (_server(base / "a", 1_000_000.0, 40, system=[b"sys-a", b"sys-b"]),
            _server(base / "b", 1_000_100.0, 30, system=[b"sys-a", b"sys-b", b"sys-c"]))


def test_recorded_routing_replays_each_servers_traffic_as_compare_of_its_recording(recordings, tmp_path):
    common = ("--capacity", "6", "--eval-window", "0:", "-j", "1", "--json")
    fleet = invoke("fleet", *recordings, "--policies", "lru,s3fifo", *common, "-o", tmp_path / "fleet")
    assert fleet.exit_code == 0, fleet.output
    rows = json.loads(fleet.stdout)
    assert {row["router"] for row in rows} == {"recorded", *ROUTERS}  # the default: every router that applies
    recorded = [row for row in rows if row["router"] == "recorded"]
    assert [row["replicas"] for row in rows] == [2] * len(rows)  # the recorded servers' count
    assert {row["timing"] for row in recorded} == {"recorded"}
    assert {row["timing"] for row in rows if row["router"] != "recorded"} == {"model"}
    assert "drew its own key" in one_line(fleet.stderr)  # the union's ids of different servers never match
    for row in recorded:
        assert row["replica_requests"] == [40, 30]
        for k, directory in enumerate(recordings):
            single = invoke("compare", directory, *common, "--policies", row["policy"], "-o", tmp_path / f"c{k}")
            assert single.exit_code == 0, single.output
            (run,) = json.loads(single.stdout)["runs"]
            assert json.loads(single.stdout)["config"]["timing"] == "recorded"
            assert row["replica_token_hit_ratios"][k] == run["token_hit_ratio"]
            assert row["replica_belady_token_hit_ratios"][k] == pytest.approx(
                _belady(directory, tmp_path / f"b{k}", common))
    assert all(row["cached_tokens"] > 0 for row in recorded)


def _belady(directory, out, common):
    result = invoke("compare", directory, *common, "--policies", "belady", "-o", out)
    return json.loads(result.stdout)["runs"][0]["token_hit_ratio"]


def test_recordings_join_on_one_clock_with_their_replicas(recordings):
    from kvprof.profiler.reader import read_trace
    from kvprof.recording import load_recording
    from kvprof.sim.recorded import REPLICA, fleet_trace

    parts = [(str(d), read_trace(d)[0], load_recording(d)) for d in recordings]
    fleet = fleet_trace(parts)
    trace = fleet.trace
    assert fleet.replicas == tuple(map(str, recordings)) and trace.n_requests == 70
    assert np.all(np.diff(trace.timestamp) >= 0)
    replica = trace.extra[REPLICA]
    assert np.bincount(replica).tolist() == [40, 30]
    assert trace.timestamp[replica == 1].min() == pytest.approx(100.0)  # b's origin is 100 s after a's
    assert np.allclose(trace.extra["scheduled"] - trace.timestamp, 0.1)  # its recorded times moved with it
    assert len(set(trace.chat_id.tolist())) == 70  # chat ids kept apart
    parents = trace.parent_chat_id[trace.parent_chat_id >= 0]
    assert set(parents.tolist()) <= set(trace.chat_id.tolist())


@pytest.mark.parametrize("kind", ["block size", "model", "twice"])
def test_mismatched_recordings_are_refused_naming_the_file(recordings, tmp_path, kind):
    other = {"block size": lambda: _server(tmp_path / "c", 1_000_000.0, 4, system=[b"s"], block_size=8),
             "model": lambda: _server(tmp_path / "c", 1_000_000.0, 4, system=[b"s"], model="other"),
             "twice": lambda: recordings[0]}[kind]()
    result = invoke("fleet", recordings[0], other, "--router", "recorded", "--eval-window", "0:", "--capacity", "6",
                    "-j", "1", "-o", tmp_path / "out")
    text = one_line(result.output)
    assert result.exit_code == 1, result.output
    assert f"{other}/recording.json" in text
    assert {"block size": "at block_size: 8-token blocks", "model": "at starts[0].model: the server served 'other'",
            "twice": "again"}[kind] in text
    assert not (tmp_path / "out").exists()


def test_several_inputs_are_a_fleet_only_as_recordings(recordings, small_trace, tmp_path):
    result = invoke("fleet", recordings[0], small_trace, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "only as vLLM recording directories" in one_line(result.output)
    result = invoke("fleet", small_trace, "--router", "recorded", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "recorded: for vLLM recordings" in one_line(result.output)
    assert not (tmp_path / "out").exists()


def test_each_rank_of_a_data_parallel_recording_is_a_replica(recordings, tmp_path):
    from kvprof.profiler.reader import read_trace
    from kvprof.recording import load_recording
    from kvprof.sim.recorded import REPLICA, fleet_trace

    dp = tmp_path / "dp"
    for rank, count in ((0, 6), (1, 8)):
        _server(dp, 1_000_050.0, count, system=[b"s"], rank=rank)
    parts = [(str(d), read_trace(d)[0], load_recording(d)) for d in (dp, recordings[1])]
    fleet = fleet_trace(parts)
    assert fleet.replicas == (f"{dp} rank 0", f"{dp} rank 1", str(recordings[1]))
    assert np.bincount(fleet.trace.extra[REPLICA]).tolist() == [6, 8, 30]
    result = invoke("fleet", dp, "--router", "recorded", "--eval-window", "0:", "-j", "1", "--json", "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert row["replicas"] == 2 and row["replica_requests"] == [6, 8] and row["capacity"] == 63  # the servers' blocks


def test_recordings_under_one_shared_key_are_routed_exactly(recordings, tmp_path):
    """With --kv-record-key the servers' ids of a shared system prompt are equal, so the union is one
    trace any router replays exactly: no warning, and the servers' common prefix hits across them."""
    from kvprof.profiler.reader import read_trace
    from kvprof.recording import load_recording
    from kvprof.sim.recorded import fleet_trace

    key = str(tmp_path / "fleet.key")
    shared = (_server(tmp_path / "a", 1_000_000.0, 40, system=[b"sys-a", b"sys-b"], key_file=key),
              _server(tmp_path / "b", 1_000_100.0, 30, system=[b"sys-a", b"sys-b", b"sys-c"], key_file=key))
    mixed = (shared[0], _server(tmp_path / "c", 1_000_100.0, 30, system=[b"sys-a", b"sys-b", b"sys-c"],
                                key_file=str(tmp_path / "other.key")))
    facts = {}
    for name, dirs in (("own", recordings), ("shared", shared), ("mixed", mixed)):
        fleet = fleet_trace([(str(d), read_trace(d)[0], load_recording(d)) for d in dirs])
        trace = fleet.trace
        ids = [set(np.concatenate([trace.blocks_of(i) for i in np.flatnonzero(trace.extra["replica"] == k)]).tolist())
               for k in (0, 1)]
        result = invoke("fleet", *dirs, "--router", "round-robin", "--replicas", "1", "--policies", "lru",
                        "--capacity", "6", "--eval-window", "0:", "-j", "1", "--json", "-o", tmp_path / f"o-{name}")
        assert result.exit_code == 0, result.output
        facts[name] = (fleet.unshared, one_line(result.stderr), json.loads(result.stdout)[0]["fleet_token_hit_ratio"],
                       len(ids[0] & ids[1]))
    # equal block hashes on both servers: sys-a, sys-b and the 15 questions q1, q3, ..., q29 both received
    assert facts["shared"][3] == 17 and facts["own"][3] == facts["mixed"][3] == 0
    assert facts["shared"][0] is None and "kv-record-key" not in facts["shared"][1]
    assert "drew its own key" in facts["own"][0] and "drew its own key" in facts["own"][1]
    assert "different --kv-record-key files" in facts["mixed"][1]
    assert facts["shared"][2] > facts["own"][2] == facts["mixed"][2]  # b's system prompt hits a's blocks


def test_fit_replica_behind_the_recorded_router_is_what_fleet_fits_on_that_server(recordings, tmp_path):
    """kvprof fit DIR1 DIR2 --replica K --router recorded fits and tunes on what server K received:
    the file kvprof fleet --hp-per-replica runs there."""
    fleet = invoke("fleet", *recordings, "--router", "recorded", "--policies", "wa", "--capacity", "6",
                   "--hp-per-replica", "--fit-window", "0:", "--eval-window", "0:", "-j", "1", "-o", tmp_path / "f")
    assert fleet.exit_code == 0, fleet.output
    for k in range(2):
        fitted = invoke("fit", *recordings, "--router", "recorded", "--replica", k, "--window", "0:", "--capacity",
                        "6", "-j", "1", "-o", tmp_path / f"fit-{k}.json")
        assert fitted.exit_code == 0, fitted.output
        written = tmp_path / "f" / f"hp-recorded-x2-c6-replica-{k}.json"
        assert _parameters(tmp_path / f"fit-{k}.json") == _parameters(written)
        assert json.loads(written.read_text())["provenance"]["routed"]["replica"] == k
        assert json.loads(written.read_text())["provenance"]["n_requests"] == (40, 30)[k]
    union = invoke("fit", *recordings, "--window", "0:", "-j", "1", "--json", "-o", tmp_path / "union.json")
    assert union.exit_code == 0, union.output  # without --replica: the fleet's file, tuned for the servers' size
    assert json.loads(union.stdout)["provenance"]["n_requests"] == 70
    assert [row["capacity"] for row in json.loads(union.stdout)["tuning"]] == [63]
    alone = invoke("fit", recordings[1], "--window", "0:", "--capacity", "6", "-j", "1", "-o", tmp_path / "b.json")
    assert alone.exit_code == 0, alone.output  # server 1's own recording, fitted alone: the same traffic
    assert _parameters(tmp_path / "fit-1.json", held_out=False)["classes"] == \
        _parameters(tmp_path / "b.json", held_out=False)["classes"]


@pytest.mark.parametrize("args, code, words", [
    (["--replica", "2"], 2, "replica 2 is not one of the recordings' 2 (numbered 0 to 1"),
    (["--replica", "0", "--replicas", "3"], 2, "the recordings hold 2 replicas (servers and their data-parallel ranks), not 3"),
    (["--replica", "0", "--load-weight", "0"], 2, "is a knob of the prefix routers"),
    (["--replica", "0", "--index-blocks", "8"], 2, "is a knob of the prefix routers"),
    (["--replica", "0", "--rank", "0"], 2, "reads one input"),
    (["--replica", "0", "--rank", "0", "ONE"], 2, "each rank a replica of its own: pick it with --replica"),
    (["--replica", "0", "--sharded"], 2, "reads one input"),
    (["--replica", "1", "--window", "0:50"], 1, "recorded sends replica 1 of 2 none of the fit window's"),
])
def test_fit_replica_behind_the_recorded_router_refuses_what_it_cannot_fit(recordings, tmp_path, args, code, words):
    inputs = recordings[:1] if "ONE" in args else recordings
    args = [arg for arg in args if arg != "ONE"]
    result = invoke("fit", *inputs, "--router", "recorded", "--capacity", "6", *args, "-o", tmp_path / "hp.json")
    assert result.exit_code == code, result.output
    assert words in one_line(result.output)
    assert not (tmp_path / "hp.json").exists()


def test_fit_routes_recorded_only_recordings(recordings, small_trace, tmp_path):
    result = invoke("fit", small_trace, "--router", "recorded", "--replica", "0", "--capacity", "6", "-o",
                    tmp_path / "hp.json")
    assert result.exit_code == 2 and "give the recording directories of a fleet's servers" in one_line(result.output)
    result = invoke("fit", recordings[0], small_trace, "-o", tmp_path / "hp.json")
    assert result.exit_code == 2 and "only as vLLM recording directories" in one_line(result.output)
    assert not (tmp_path / "hp.json").exists()


def test_fit_replica_of_recordings_under_unshared_keys_warns_as_fleet_does(recordings, tmp_path):
    """Routing the servers' traffic anew (here round-robin) over recordings whose servers drew keys of their
    own treats a prefix they all received as different contents: fit says so, as fleet does; behind the
    recorded router it does not."""
    warnings = {}
    for router in ("round-robin", "recorded"):
        routed = ("--replicas", "2") if router != "recorded" else ()
        result = invoke("fit", *recordings, "--router", router, *routed, "--replica", "0",
                        "--window", "0:", "--capacity", "6", "-j", "1", "-o", tmp_path / f"fit-{router}.json")
        assert result.exit_code == 0, result.output
        warnings[router] = one_line(result.stderr)
    assert "kv-record-key" in warnings["round-robin"] and "drew its own key" in warnings["round-robin"]
    assert "kv-record-key" not in warnings["recorded"]


def test_fleet_refuses_replicas_only_the_recorded_router_would_ignore(recordings, tmp_path):
    result = invoke("fleet", *recordings, "--router", "recorded", "--replicas", "5", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "leave --replicas out" in one_line(result.output)
    assert not (tmp_path / "out").exists()


def test_fit_replica_defaults_the_count_as_fleet_does(small_trace, tmp_path):
    """fit --router session --replica 0 without --replicas said to give --router, which was given."""
    result = invoke("fit", small_trace, "--window", "0:360", "--capacity", "64", "--router", "session", "--replica",
                    "0", "-o", tmp_path / "hp.json")
    assert result.exit_code == 0, result.output
    assert "replica 0 of 4 behind session" in one_line(result.output)
