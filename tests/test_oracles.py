"""The oracles of kvprof.sim.oracles: their facts about the future, their order, and Belady's decisions."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings

from kvprof.policy import make_policy
from kvprof.policy.lru import LRUPolicy
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.oracles import (
    ORACLES,
    AccessIndexed,
    BeladyRecorder,
    Continues,
    Future,
    Shared,
    ToldPolicy,
    When,
    infer_sessions,
    make_oracle,
    reference,
    replay,
    sessions_of,
)
from kvprof.sim.workload import prepare_workload
from tests.helpers import make_trace
from tests.test_sim_engine import random_replays

# Two conversations sharing block 1: A = r0, r2 and B = r1, r3 (chat ids 0-3, parents given).
CONVERSATIONS = [
    (0.0, "a", 1, [1, 2], 0, -1),
    (1.0, "a", 1, [1, 5], 1, -1),
    (5.0, "a", 2, [1, 2, 3], 2, 0),
    (9.0, "a", 2, [1, 5, 6], 3, 1),
]


def _future(rows):
    trace = make_trace(rows)
    workload = prepare_workload(trace, engine_block_size=16)
    return trace, workload, Future.of(workload, sessions_of(trace, workload))


def test_future_of_two_conversations_sharing_a_prefix():
    _, workload, future = _future(CONVERSATIONS)
    assert future.session.tolist() == [0, 1, 0, 1]
    assert future.next_arrival.tolist() == [5.0, 9.0, math.inf, math.inf]
    assert future.owner.tolist() == [0, 0, 1, 1, 2, 2, 2, 3, 3, 3]
    # accesses: r0 [1, 2], r1 [1, 5], r2 [1, 2, 3], r3 [1, 5, 6]
    assert future.next_use.tolist() == [1.0, 5.0, 5.0, 9.0, 9.0] + [math.inf] * 5
    # block 1 is used later by the other conversation after r0, r1 and r2; block 2 and 5 only by their own
    assert future.shared.tolist() == [True, False, True, False, True, False, False, False, False, False]
    assert np.array_equal(future.next_use, workload.next_use)


def test_sessions_are_inferred_from_chains_without_parents():
    rows = [(float(t), "a", 1, chain) for t, chain in
            enumerate([[1, 2], [1, 5], [1, 2, 3], [1, 5, 6], [1, 2, 7], [1, 2, 3, 8], []])]
    trace, workload, future = _future(rows)
    # r2 extends r0, r3 extends r1, r4 forks r0 (already continued by r2): a session of its own,
    # r5 extends r2; r6 has no full block
    assert infer_sessions(workload).tolist() == [0, 1, 0, 1, 4, 0, 6]
    assert future.session.tolist() == [0, 1, 0, 1, 4, 0, 6]
    assert future.next_arrival.tolist() == [2.0, 3.0, 5.0, math.inf, math.inf, math.inf, math.inf]


def test_sessions_from_parents_agree_with_the_chains_on_linear_conversations():
    trace, workload, future = _future(CONVERSATIONS)
    roots = future.session
    inferred = infer_sessions(workload)
    assert [roots[i] == roots[j] for i in range(4) for j in range(4)] == \
           [inferred[i] == inferred[j] for i in range(4) for j in range(4)]


def test_verdicts_read_the_future_they_are_told():
    _, _, future = _future(CONVERSATIONS)
    soon, late = Continues(LRUPolicy(), future, horizon=2.0), When(LRUPolicy(), future)
    assert soon.verdict(0, 0, now=4.0) is None  # r0's session sends r2 at 5 <= 4 + 2
    assert soon.verdict(0, 0, now=2.0) is not None  # 5 > 2 + 2
    assert soon.verdict(7, 3, now=9.5) is not None  # r3's session ends
    assert late.verdict(0, 0, now=5.0) is None  # already arrived
    assert late.verdict(0, 0, now=2.0) == -5.0 and late.verdict(7, 3, now=9.5) == -math.inf
    shared = Shared(LRUPolicy(), future)
    assert [shared.verdict(k, 0, 0.0) is None for k in range(10)] == future.shared.tolist()


class _Demote(ToldPolicy):
    """Demotes odd blocks, key = -block (the largest first)."""

    def verdict(self, access, request, now):
        return None if access % 2 == 0 else -access


def test_told_policy_evicts_demoted_blocks_first_then_the_base_order():
    policy = _Demote(LRUPolicy(), "demote-odd")
    for block in range(6):
        policy.access(block, 0.0, next_use=block)
    policy.free([4, 3, 2, 1, 0, 5], 1.0)
    assert len(policy) == 6 and 3 in policy and 4 in policy
    policy.remove(3)
    policy.remove(4)
    assert 3 not in policy and 4 not in policy and len(policy) == 4
    assert policy.evict_n(4, 2.0) == [5, 1, 2, 0]  # demoted 5, 1 (3 was taken back), then LRU: 2, 0


def test_belady_on_access_indices_is_belady_and_told_its_evictions_replays_it():
    trace = make_trace([(0.5 * i, "a", 1, [100 + i % 3, 200 + i % 7, 300 + i % 11, 400 + i]) for i in range(60)])
    config = SimConfig(engine_block_size=16)
    workload = prepare_workload(trace, engine_block_size=16)
    future = Future.of(workload, sessions_of(trace, workload))
    indexed = AccessIndexed.of(workload)
    ref = reference(indexed, future, 6, config)
    for engine in ("python", "compiled"):  # the recorder is Belady: the same replay as the simulator's own
        assert simulate(workload, make_policy("belady"), 6, config, engine=engine).token_hit_ratio == ref.belady
    assert 0 < ref.belady < 1.0 and (ref.evicted_seq >= 0).any()
    exact = replay(indexed, make_oracle("belady-exact", LRUPolicy(), future, ref), 6, config)
    assert exact.token_hit_ratio == ref.belady


@settings(max_examples=60, deadline=None)
@given(random_replays())
def test_belady_exact_reproduces_belady_and_no_oracle_evicts_a_pinned_block(case):
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0)
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    future = Future.of(workload, sessions_of(trace, workload))
    indexed = AccessIndexed.of(workload)
    ref = reference(indexed, future, capacity, config)
    belady = replay(indexed, BeladyRecorder(future.next_use), capacity, config)
    assert belady.token_hit_ratio == ref.belady
    assert (ref.evicted_seq >= 0).sum() == belady.evictions + belady.dropped  # one record per victim
    for name in ORACLES:
        policy = make_oracle(name, LRUPolicy(), future, ref)
        pools = []
        evict = policy.evict

        def checked_evict(now, evict=evict, pools=pools):
            slot = evict(now)
            assert not pools or pools[0].refs[slot] == 0, "a pinned block was evicted"
            return slot

        policy.evict = checked_evict

        def observe(gpu, host, pools=pools):
            pools[:] = [gpu]
            gpu.check()  # each slot empty, pinned or evictable, never two; the policy holds the evictable ones
            pinned = sum(1 for r in gpu.refs if r)
            assert gpu.n_live <= max(gpu.limit, pinned)

        run = simulate(indexed, policy, capacity, config, observer=observe, engine="python")
        assert 0.0 <= run.token_hit_ratio <= 1.0
        if name == "belady-exact":
            assert run.token_hit_ratio == ref.belady
            assert (run.hits_device, run.evictions, run.dropped) == (belady.hits_device, belady.evictions,
                                                                     belady.dropped)
            assert run.qttft_mean_s == pytest.approx(belady.qttft_mean_s, nan_ok=True)  # the same timeline
