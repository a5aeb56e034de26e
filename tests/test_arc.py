"""ARC: its adaptation of the T1 target, its lists and ghosts, the protocol, and a simulated run."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.policy import POLICIES, ARCPolicy, make_policy
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload
from tests.test_policies import OPS, PolicyPool, Scenario, check_eviction_order


def alloc(arc: ARCPolicy, *blocks: tuple[int, int | None]) -> None:
    """Allocate each ``(block, content)`` for new content."""
    for block, content in blocks:
        arc.access(block, 0.0, content=content)


def prefix_hit(arc: ARCPolicy, block: int) -> None:
    """A request hits an evictable block: vLLM's touch, then the access."""
    arc.remove(block)
    arc.access(block, 0.0, hit=True)


def check_invariants(arc: ARCPolicy, cached_contents=()) -> None:
    """The class invariant; no ghost is the content of a cached block."""
    bound = arc._most_evictable
    assert not arc._t1.keys() & arc._t2.keys()
    assert not arc._b1.keys() & arc._b2.keys()
    assert len(arc._b1) <= bound and len(arc._b2) <= bound
    assert len(arc) <= bound and 0.0 <= arc.target <= bound
    assert not (arc._b1.keys() | arc._b2.keys()) & set(cached_contents)


def test_arc_is_registered():
    assert POLICIES["arc"] is ARCPolicy and type(make_policy("arc")) is ARCPolicy


def test_free_appends_in_the_order_given_and_t1_goes_first_at_target_zero():
    arc = ARCPolicy()
    alloc(arc, (1, 11), (2, 12), (3, 13), (4, 14))
    arc.access(4, 0.0, hit=True)  # hit while its first request still holds it
    arc.free([3, 2, 1, 4], 0.0)  # tail first
    assert arc.order(0.0) == [3, 2, 1, 4] and arc.evict_n(4, 0.0) == [3, 2, 1, 4]


@pytest.mark.parametrize("access_first", [False, True])
def test_a_prefix_hit_moves_a_block_from_t1_to_t2_for_good(access_first):
    arc = ARCPolicy()
    alloc(arc, (1, 11), (2, 12), (3, 13))
    arc.free([1, 2, 3], 0.0)
    if access_first:  # the protocol allows either order
        arc.access(2, 0.0, hit=True)
        arc.remove(2)
    else:
        prefix_hit(arc, 2)
    assert 2 not in arc and len(arc) == 2
    arc.free([2], 1.0)
    assert list(arc._t1) == [1, 3] and list(arc._t2) == [2]
    prefix_hit(arc, 2)
    arc.free([2], 2.0)  # still T2, without another hit
    assert list(arc._t2) == [2] and arc.evict_n(3, 2.0) == [1, 3, 2]
    alloc(arc, (2, 99))  # reused for new content: T1 again
    arc.free([2], 3.0)
    assert list(arc._t1) == [2] and not arc._t2


def test_eviction_takes_t1_while_it_holds_at_least_the_truncated_target():
    arc = ARCPolicy()
    alloc(arc, (1, 11), (2, 12), (3, 13), (4, 14), (5, 15))
    for block in (4, 5):
        arc.access(block, 0.0, hit=True)
    arc.free([1, 2, 3, 4, 5], 0.0)  # T1 = [1, 2, 3], T2 = [4, 5]
    arc.target = 2.5  # compared as 2, as vLLM does
    assert arc.order(0.0) == [1, 2, 4, 5, 3]  # |T1| 3 and 2 >= 2, then |T1| 1 < 2: T2, then T1 once T2 is empty
    assert copy.deepcopy(arc).evict_n(5, 0.0) == [1, 2, 4, 5, 3]
    arc.target = 4.0
    assert arc.order(0.0) == [4, 5, 1, 2, 3]  # |T1| below target from the start
    arc.target = 1.0
    assert arc.order(0.0) == arc.order(0.0, 99) == [1, 2, 3, 4, 5]  # target 1 and 0 alike: T1 empties first
    assert arc.order(0.0, 2) == [1, 2]
    assert [arc.evict(0.0) for _ in range(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(IndexError):
        arc.evict(0.0)


def test_a_b1_ghost_hit_raises_the_target_by_the_ghost_ratio_capped_at_the_cache_size():
    arc = ARCPolicy()
    alloc(arc, *[(block, 10 + block) for block in range(7)])
    for block in range(5):
        arc.access(block, 0.0, hit=True)
    arc.free([5, 6, 0, 1, 2, 3, 4], 0.0)  # T1 = [5, 6], T2 = [0, ..., 4]; cache size 7
    assert arc.evict_n(7, 1.0) == [5, 6, 0, 1, 2, 3, 4]
    assert list(arc._b1) == [15, 16] and list(arc._b2) == [10, 11, 12, 13, 14]
    alloc(arc, (5, 15))
    assert arc.target == 2.5  # max(1, |B2| / |B1|) = 5 / 2
    assert list(arc._b1) == [16]
    alloc(arc, (6, 16))
    assert arc.target == 7.0  # 2.5 + 5 / 1, capped at 7
    arc.free([5, 6], 2.0)
    assert list(arc._t2) == [5, 6] and not arc._t1  # recomputed content goes to T2
    check_invariants(arc)


def test_a_b2_ghost_hit_lowers_the_target_by_the_ghost_ratio_floored_at_zero():
    arc = ARCPolicy()
    alloc(arc, (0, 10), (1, 11), (2, 12), (3, 13), (4, 14))
    arc.access(0, 0.0, hit=True)
    arc.free([1, 2, 3, 4, 0], 0.0)  # T1 = [1, 2, 3, 4], T2 = [0]
    assert arc.evict_n(5, 1.0) == [1, 2, 3, 4, 0]
    alloc(arc, (1, 11))
    assert arc.target == 1.0  # max(1, 1 / 4)
    alloc(arc, (0, 10))
    assert arc.target == 0.0  # 1 - max(1, |B1| / |B2|) = 1 - 3, floored at 0
    assert not arc._b2 and list(arc._b1) == [12, 13, 14]
    arc.free([0, 1], 2.0)
    assert list(arc._t2) == [0, 1]


def test_ghosts_keep_the_newest_contents_up_to_the_cache_size():
    arc = ARCPolicy()
    for r in range(3):  # cache size 3; each round evicts three new contents from T1
        alloc(arc, *[(b, 10 * r + b) for b in range(3)])
        arc.free(range(3), float(r))
        arc.evict_n(3, float(r))
        check_invariants(arc)
    assert list(arc._b1) == [20, 21, 22]
    alloc(arc, (0, 0))  # dropped from B1: plain new content
    assert arc.target == 0.0
    alloc(arc, (1, 21))
    assert arc.target == 1.0
    arc.free([0, 1], 3.0)
    assert list(arc._t1) == [0] and list(arc._t2) == [1]


def test_a_content_is_a_ghost_once_where_its_last_copy_was_evicted_from():
    """Two blocks with one content (vLLM can cache a hash twice): the later eviction wins."""
    arc = ARCPolicy()
    alloc(arc, (1, 7), (2, 8), (3, 7), (4, 7))
    arc.access(4, 0.0, hit=True)
    arc.free([1, 2, 3, 4], 0.0)  # T1 = [1, 2, 3], T2 = [4]
    arc.evict_n(3, 0.0)
    assert list(arc._b1) == [8, 7]  # moved behind 8 by block 3's eviction
    arc.evict(0.0)
    assert list(arc._b1) == [8] and list(arc._b2) == [7]


def test_without_contents_there_are_no_ghosts():
    arc = ARCPolicy()
    alloc(arc, (1, None), (2, None))
    arc.free([1, 2], 0.0)
    arc.evict_n(2, 0.0)
    alloc(arc, (1, None))
    assert not arc._b1 and not arc._b2 and arc.target == 0.0


def test_clear_forgets_lists_ghosts_target_and_hits():
    arc = ARCPolicy()
    alloc(arc, (1, 11), (2, 12), (3, 13))
    arc.free([1, 2, 3], 0.0)
    arc.evict(0.0)
    alloc(arc, (1, 11))
    prefix_hit(arc, 2)
    assert arc.target == 1.0
    arc.clear()
    assert len(arc) == 0 and 3 not in arc and arc.order(0.0) == [] and arc.target == 0.0
    assert not arc._b1 and not arc._b2 and arc._most_evictable == 0
    with pytest.raises(IndexError):
        arc.evict(0.0)
    arc.free([2], 1.0)  # its hit was forgotten too
    assert list(arc._t1) == [2]
    with pytest.raises(KeyError):
        arc.remove(7)
    assert len(arc) == 1


@settings(max_examples=150, deadline=None)
@given(ops=OPS, num_blocks=st.integers(4, 24))
def test_arc_keeps_the_protocol_and_its_invariants(ops, num_blocks):
    """A block is in the policy exactly while the driver holds it cached and unpinned; order,
    evict and evict_n agree (on copies); lists, ghosts and target keep the class invariant."""
    pool = PolicyPool(num_blocks, ARCPolicy())
    scenario = Scenario([pool])
    for op in ops:
        if op[0] == 3:
            check_eviction_order("arc", pool, scenario.now)
        scenario.step(*op)
        evictable = pool.evictable()
        assert len(pool.policy) == len(evictable)
        assert all((block in pool.policy) == (block in evictable) for block in range(num_blocks))
        check_invariants(pool.policy, pool.cached)
    check_eviction_order("arc", pool, scenario.now)


def test_random_scenarios_move_the_target_both_ways_and_evict_from_both_lists():
    """The scenarios of the property test reach what it is meant to cover."""
    rng = random.Random(0)
    pool = PolicyPool(12, ARCPolicy())
    scenario = Scenario([pool])
    targets, t2_victims = [], 0
    for _ in range(3000):
        t2, before = set(pool.policy._t2), len(pool.evicted)
        scenario.step(rng.randrange(4), rng.randrange(10**6), rng.randrange(10**6))
        t2_victims += len(t2.intersection(pool.evicted[before:]))
        targets.append(pool.policy.target)
    assert any(b > a for a, b in zip(targets, targets[1:])) and any(b < a for a, b in zip(targets, targets[1:]))
    assert t2_victims > 0


def test_simulated_runs_keep_the_cache_invariants(tmp_path):
    """arc on the GPU and on a CPU tier through the simulator: every slot in one place at every
    step, ghosts never cached, and ghost hits adapt the target."""
    write_jsonl(tmp_path / "a.jsonl", generate("bailian-a", 0.02, 0))
    trace, _ = read_trace(tmp_path / "a.jsonl")
    config = SimConfig(engine_block_size=128, cpu_capacity=100, cpu_policy="arc")
    gpu_policy, host_policy = ARCPolicy(), ARCPolicy()
    targets = set()

    def observe(gpu, host):
        gpu.check()
        host.check()
        check_invariants(gpu.policy, gpu.block_slot)
        check_invariants(host.policy, host.block_slot)
        targets.add(gpu.policy.target)

    workload = prepare_workload(trace, engine_block_size=128)
    m = simulate(workload, gpu_policy, 300, config, host_policy=host_policy, observer=observe)
    assert m.evictions > 0 and m.hits_device > 0 and m.n_rejected == 0
    assert m.hits_device + m.hits_host + m.misses == m.block_lookups
    assert len(targets) > 1
