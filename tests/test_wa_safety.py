"""wa's safety net: shadow caches, the followed S3-FIFO, and a deliberately wrong profile."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.models.hp import ReuseRow
from kvprof.policy import LRUPolicy, make_policy
from kvprof.policy.shadow import ShadowCache
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload
from tests.test_policies import OPS, WA_ORDERS, PolicyPool, Scenario, wa_policy


def test_a_shadow_counts_the_hits_a_prefix_cache_would_find():
    shadow = ShadowCache(LRUPolicy())
    shadow.capacity = 3
    for depth, content in enumerate("abc"):  # a request computes a, b, c
        shadow.access(content, 0.0, 0, depth)
    assert shadow.hits == 0 and shadow.pinned == {0, 1, 2}
    shadow.release(["c", "b", "a"], 1.0)  # freed tail first
    shadow.access("a", 2.0, 0, 0)  # the next request hits a, misses x, then finds c behind the miss
    shadow.access("x", 2.0, 0, 1)
    shadow.access("c", 2.0, 0, 2)
    assert shadow.hits == 1, "c sits behind a miss: a prefix cache would not find it"
    # x needed a slot in a full cache (3 held, 0 pinned of the old ones but a): LRU gave b's.
    assert set(shadow.slot_of) == {"a", "x", "c"}


def test_a_shadow_never_evicts_what_the_real_cache_holds_and_evicts_in_batches():
    shadow = ShadowCache(LRUPolicy())
    shadow.capacity = 128
    for i in range(128):
        shadow.access(i, 0.0, 0, 0)
    shadow.access(999, 1.0, 0, 0)  # every slot pinned: the shadow grows past its size
    assert len(shadow) == 129
    shadow.release(range(129), 2.0)
    for i in range(1000, 1003):  # at most capacity / 64 beyond the size, then back to it
        shadow.access(i, 3.0, 0, 0)
    assert len(shadow) <= 128 + 128 // 64 + 1


@settings(max_examples=60, deadline=None)
@given(ops=OPS, num_blocks=st.integers(4, 24))
def test_the_followed_s3fifo_holds_exactly_the_evictable_blocks(ops, num_blocks):
    pool = PolicyPool(num_blocks, wa_policy([0.6, 0.4, 0.2, 0.3], [0.5, 0.05, 0.01, 0.02], orders=WA_ORDERS,
                                            safety_net=True))
    scenario = Scenario([pool])
    for op in ops:
        scenario.step(*op)
        followed = pool.policy._followed[0]
        assert sorted(b for b in range(num_blocks) if b in followed) == sorted(pool.evictable())


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory):
    """A synthetic bailian-a trace and an hp file fitted on its first 15 minutes, then turned
    upside down: rows that come back look never reused, and their fast components slow."""
    path = tmp_path_factory.mktemp("adversarial") / "trace.jsonl"
    write_jsonl(path, generate("bailian-a", 0.5, 3))
    trace, _ = read_trace(path)
    hp = fit_trace(trace.time_window(0, 900), max_cells=0)

    def wrong(row: ReuseRow) -> ReuseRow:
        return ReuseRow(1.0 - row.p, row.weights, tuple(rate / 1000 for rate in row.rates), row.source)

    bad = dataclasses.replace(hp, cells={name: tuple(map(wrong, tiers)) for name, tiers in hp.cells.items()},
                              default_cell=tuple(map(wrong, hp.default_cell)))
    return prepare_workload(trace.time_window(900, None), bad, 128), bad


@pytest.mark.slow
def test_with_a_wrong_profile_the_safety_net_ends_no_worse_than_lru(adversarial):
    """The issue's adversarial test: the model alone loses to LRU by far; wa does not."""
    workload, bad = adversarial
    capacity = 256
    lru = simulate(workload, LRUPolicy(), capacity, SimConfig()).token_hit_ratio
    model = simulate(workload, make_policy("wa", bad, orders=("model",), safety_net=False), capacity, SimConfig())
    wa_policy_ = make_policy("wa", bad, capacity)
    wa = simulate(workload, wa_policy_, capacity, SimConfig()).token_hit_ratio
    assert model.token_hit_ratio < 0.8 * lru, "the profile is not wrong enough to test anything"
    assert wa >= 0.99 * lru
    assert wa_policy_.order_name != "model"
