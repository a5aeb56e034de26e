"""Sweeps on a generated Bailian trace A: policy ordering, the results document, bad setups."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvprof.policy import POLICIES, make_policy
from kvprof.classes import ClassRule
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.config import SimConfig, SimulationError
from kvprof.results import SCHEMA
from kvprof.sim.engine import simulate
from kvprof.sim.sweep import run_sweep
from kvprof.sim.workload import prepare_workload

CAPACITIES = (128, 512, 2048)


@pytest.fixture(scope="module")
def half_hour(tmp_path_factory):
    """Fit on the first 15 minutes of a synthetic bailian-a trace, evaluate on the next 15."""
    path = tmp_path_factory.mktemp("sweep") / "a.jsonl"
    write_jsonl(path, generate("bailian-a", 0.5, 1))
    trace, _ = read_trace(path)
    return trace.time_window(900.0, None), fit_trace(trace.time_window(0.0, 900.0))


@pytest.fixture(scope="module")
def every_policy(half_hour):
    trace, hp = half_hour
    return run_sweep(trace, hp, tuple(POLICIES), CAPACITIES)


def test_belady_is_the_ceiling_at_every_capacity(every_policy):
    for capacity in CAPACITIES:
        ceiling = every_policy.get("belady", capacity).token_hit_ratio
        for policy in every_policy.policies:
            assert every_policy.get(policy, capacity).token_hit_ratio <= ceiling, (policy, capacity)


def test_more_capacity_never_hurts_lru(every_policy):
    hits = [every_policy.get("lru", c).token_hit_ratio for c in CAPACITIES]
    assert hits == sorted(hits) and hits[0] < hits[-1]


def test_wa_is_never_more_than_one_percent_below_lru(every_policy):
    for capacity in CAPACITIES:
        lru = every_policy.get("lru", capacity).token_hit_ratio
        assert every_policy.get("wa", capacity).token_hit_ratio >= 0.99 * lru, capacity


def test_wa_beats_lru_at_the_small_capacities(every_policy):
    for capacity in CAPACITIES[:2]:
        lru = every_policy.get("lru", capacity).token_hit_ratio
        assert every_policy.get("wa", capacity).token_hit_ratio > lru, capacity


def test_results_document_is_complete_and_consistent(every_policy, tmp_path):
    path = every_policy.write(tmp_path / "results.json")
    document = json.loads(path.read_text())
    assert document["schema"] == SCHEMA and document["complete"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"], "no temporary file left behind"
    runs = {(r["policy"], r["capacity"]): r for r in document["runs"]}
    assert len(runs) == len(POLICIES) * len(CAPACITIES)
    for (policy, capacity), run in runs.items():
        lru, belady = runs["lru", capacity]["token_hit_ratio"], runs["belady", capacity]["token_hit_ratio"]
        assert run["hit_gain_over_lru"] == pytest.approx((run["token_hit_ratio"] - lru) / lru)
        assert run["belady_gap_closed"] == pytest.approx((run["token_hit_ratio"] - lru) / (belady - lru))
        assert run["hits_device"] + run["hits_host"] + run["misses"] == run["block_lookups"]
    assert runs["belady", 512]["belady_gap_closed"] == pytest.approx(1.0)
    assert document["inputs"]["trace"]["n_requests"] == every_policy.runs[0].n_requests


def test_parallel_sweep_matches_serial(half_hour):
    trace, hp = half_hour
    serial = run_sweep(trace, hp, ["lru", "wa"], [256, 1024], n_jobs=1)
    progress = []
    parallel = run_sweep(trace, hp, ["lru", "wa"], [256, 1024], n_jobs=2, progress=lambda d, t: progress.append((d, t)))
    assert [r.to_dict() for r in parallel.runs] == [r.to_dict() for r in serial.runs]
    assert progress[-1] == (4, 4) and len(progress) == 4


def test_cpu_tier_adds_host_hits_on_top_of_the_gpu(half_hour):
    trace, hp = half_hour
    gpu_only = run_sweep(trace, hp, ["lru"], [256]).get("lru", 256)
    tiered = run_sweep(trace, hp, ["lru"], [256], SimConfig(cpu_capacity=4096)).get("lru", 256)
    assert tiered.hits_host > 0 and gpu_only.hits_host == 0
    assert tiered.token_hit_ratio > gpu_only.token_hit_ratio
    assert tiered.hits_device + tiered.hits_host + tiered.misses == tiered.block_lookups


def test_elastic_capacity_lowering_mid_trace(half_hour):
    trace, hp = half_hour
    config = SimConfig(capacity_schedule=((0.0, 2048), (450.0, 256)))
    run = run_sweep(trace, hp, ["lru"], [2048], config).get("lru", 2048)
    low = run_sweep(trace, hp, ["lru"], [256]).get("lru", 256)
    high = run_sweep(trace, hp, ["lru"], [2048]).get("lru", 2048)
    assert run.dropped > 0 and run.n_rejected == 0
    assert low.token_hit_ratio < run.token_hit_ratio < high.token_hit_ratio


def test_bad_setups_are_clear_errors(half_hour):
    trace, hp = half_hour
    with pytest.raises(SimulationError, match="unknown policy 'fifo'"):
        run_sweep(trace, hp, ["lru", "fifo"], [256])
    with pytest.raises(SimulationError, match="> 0 blocks"):
        run_sweep(trace, hp, ["lru"], [0])
    with pytest.raises(SimulationError, match="schedule"):
        run_sweep(trace, hp, ["lru"], [256], SimConfig(capacity_schedule=((0.0, 512),)))
    with pytest.raises(SimulationError, match="fitted on 32-token blocks"):
        prepare_workload(trace, replace(hp, block_size=32))
    with pytest.raises(SimulationError, match="class rule does not fit.*tenant"):
        prepare_workload(trace, replace(hp, class_rule=ClassRule(key="field", field="tenant")))


def test_rate_scale_speeds_arrivals_and_so_the_load(half_hour):
    """replay --rate-scale's twin: arrivals (and the window) ten times as fast carry ten times the load."""
    trace, hp = half_hour
    base = run_sweep(trace, hp, ["lru"], [512]).get("lru", 512)
    fast = run_sweep(trace, hp, ["lru"], [512], SimConfig(rate_scale=10.0)).get("lru", 512)
    assert fast.offered_load == pytest.approx(10 * base.offered_load, rel=0.1)
    assert fast.qttft_mean_s > base.qttft_mean_s
    workload = prepare_workload(trace, hp, 128, rate_scale=10.0)
    assert workload.arrival[-1] == pytest.approx((trace.timestamp[-1] - trace.window[0]) / 10)
    with pytest.raises(SimulationError, match="rate x10"):
        simulate(workload, make_policy("lru"), 512, SimConfig())
    with pytest.raises(SimulationError, match="rate scale"):
        SimConfig(rate_scale=float("nan"))
