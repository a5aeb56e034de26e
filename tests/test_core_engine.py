"""The compiled replay against the Python one: identical metrics, and the tiers' invariants at every step."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.engine import run
from kvprof.models.hp import ReuseRow
from kvprof.policy import POLICIES, make_policy
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.config import CostModel, SimConfig, SimulationError
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload
from tests.helpers import make_trace
from tests.test_policies import build
from tests.test_sim_engine import TinyLRU, random_replays

NAMES = [*sorted(POLICIES), "wa+shadows"]


def same_metrics(a, b) -> bool:
    """Field by field, NaN equal to NaN (QTTFT of a run that served nothing)."""
    return all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
               for x, y in zip(a.to_dict().values(), b.to_dict().values()))


def both_engines(workload, make, capacity, config, make_host=None):
    def one(engine):
        host = make_host() if config.cpu_capacity else None
        return simulate(workload, make(), capacity, config, host_policy=host, engine=engine)

    return one("python"), one("compiled")


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(replay=random_replays(), host_name=st.sampled_from(NAMES))
def test_both_engines_measure_the_same_on_random_traces(name, replay, host_name):
    trace, capacity, config = replay
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    python, compiled = both_engines(workload, lambda: build(name), capacity, config, lambda: build(host_name))
    assert same_metrics(python, compiled), (python, compiled)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(replay=random_replays())
def test_the_compiled_tiers_keep_their_invariants_at_every_step(name, replay):
    """Every slot in one place, no pinned block evicted, occupancy within the limit once free."""
    trace, capacity, config = replay
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    schedule = list(config.capacity_schedule) or [(0.0, capacity)]
    host = build(name) if config.cpu_capacity else None
    outcome = run(workload, build(name), host, config, schedule, check=True)  # raises on a broken invariant
    assert outcome["hits_device"] + outcome["hits_host"] <= int(workload.n_lookup.sum())


@pytest.fixture(scope="module")
def bailian():
    """Five minutes of synthetic bailian-a, an hp file fitted on it, and one with its profile
    turned upside down (the model alone then loses, so wa's shadows switch leader)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        write_jsonl(path, generate("bailian-a", 0.1, 1))
        trace, _ = read_trace(path)
    hp = fit_trace(trace)

    def wrong(row: ReuseRow) -> ReuseRow:
        return ReuseRow(1.0 - row.p, row.weights, tuple(rate / 1000 for rate in row.rates), row.source)

    bad = dataclasses.replace(hp, cells={name: tuple(map(wrong, tiers)) for name, tiers in hp.cells.items()},
                              default_cell=tuple(map(wrong, hp.default_cell)))
    return trace, hp, bad


CONFIGS = {
    "prefill only": SimConfig(engine_block_size=16),
    "decode, cpu tier": SimConfig(engine_block_size=16, cost=CostModel(decode=True), cpu_capacity=1500),
    "schedule, 128-token blocks": SimConfig(capacity_schedule=((0.0, 200), (60.0, 80), (150.0, 400))),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_both_engines_measure_the_same_on_a_synthetic_trace(bailian, name, config):
    trace, hp, _ = bailian
    if config.cpu_capacity:  # the CPU tier runs the same policy
        config = dataclasses.replace(config, cpu_policy=name)
    workload = prepare_workload(trace, hp, config.engine_block_size)
    capacity = 1000 if config.engine_block_size == 16 else 200
    python, compiled = both_engines(workload, lambda: make_policy(name, hp, capacity), capacity, config,
                                    lambda: make_policy(config.cpu_policy, hp, config.cpu_capacity))
    assert python == compiled
    assert python.evictions > 0


def test_the_twin_switches_leader_as_the_reference_does(bailian):
    trace, _, bad = bailian
    workload = prepare_workload(trace, bad, 16)
    references = [make_policy("wa", bad, 500) for _ in range(2)]
    python = simulate(workload, references[0], 500, SimConfig(engine_block_size=16), engine="python")
    compiled = simulate(workload, references[1], 500, SimConfig(engine_block_size=16), engine="compiled")
    assert python == compiled
    assert references[0].order_name != "model", "the wrong profile should have lost its lead"
    assert references[1].order_name == references[0].order_name
    assert references[1].shadow_hits() == references[0].shadow_hits()


@pytest.mark.parametrize("rate", [0.5, 0.2])
def test_the_twin_samples_the_shadows_as_the_reference_does(bailian, rate):
    trace, hp, _ = bailian
    workload = prepare_workload(trace, hp, 16)
    references = [make_policy("wa", hp, 500, shadow_sample=rate) for _ in range(2)]
    python = simulate(workload, references[0], 500, SimConfig(engine_block_size=16), engine="python")
    compiled = simulate(workload, references[1], 500, SimConfig(engine_block_size=16), engine="compiled")
    assert python == compiled
    assert references[1].order_name == references[0].order_name
    assert references[1].shadow_hits() == references[0].shadow_hits()
    assert 0 < sum(references[0].shadow_hits().values()) < 6 * python.hits_device, "a sample sees less"


def test_the_engine_is_chosen_by_the_policies_and_the_observer():
    workload = prepare_workload(make_trace([(0.0, "a", 1, [1, 2, 3]), (1.0, "a", 1, [1, 2, 4])]), engine_block_size=16)
    with pytest.raises(SimulationError, match="compiled twins"):
        simulate(workload, TinyLRU(), 4, SimConfig(engine_block_size=16), engine="compiled")
    with pytest.raises(SimulationError, match="compiled twins"):
        simulate(workload, build("lru"), 4, SimConfig(engine_block_size=16), engine="compiled",
                 observer=lambda gpu, host: None)
    with pytest.raises(SimulationError, match="engine must be"):
        simulate(workload, build("lru"), 4, SimConfig(engine_block_size=16), engine="fast")
