"""The replay engine: hand-checked hits, vLLM details, and invariants over random traces."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.policy.base import EvictionPolicy
from kvprof.sim.cache import NO_BLOCK
from kvprof.sim.config import CostModel, SimConfig, SimulationError, parse_schedule
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload
from tests.helpers import make_trace


class TinyLRU(EvictionPolicy):
    """Least recently freed first; records what the driver does so tests can check the protocol."""

    name = "tiny-lru"

    def __init__(self):
        self.free_order: OrderedDict[int, None] = OrderedDict()
        self.pool = None  # the PrefixCache, attached by the checking observer
        self.victims: list[int] = []

    def access(self, block, now, workload=0, depth=0, *, hit=False, next_use=math.inf, content=None):
        assert block not in self.free_order, "access to an evictable block without remove"

    def free(self, blocks, now):
        for block in blocks:
            assert block not in self.free_order
            self.free_order[block] = None

    def remove(self, block):
        del self.free_order[block]

    def evict(self, now):
        block, _ = self.free_order.popitem(last=False)
        if self.pool is not None:
            assert self.pool.refs[block] == 0, "a pinned block was chosen"
        self.victims.append(block)
        return block

    def clear(self):
        self.free_order.clear()

    def __len__(self):
        return len(self.free_order)

    def __contains__(self, block):
        return block in self.free_order


FAST = SimConfig(engine_block_size=32, cost=CostModel(prefill_tokens_per_s=1e9, step_overhead_s=0.0))


def hand_trace():
    # 16-token trace blocks, 32-token engine blocks: engine block k is identified by hash 2k+1.
    return make_trace(
        [
            (0.0, "text", 1, [1, 2, 3, 4, 5]),  # 80 tokens: full engine blocks {2, 4} + a tail
            (10.0, "text", 2, [1, 2, 3, 4, 9, 10]),  # 96 tokens: hits 2, 4; computes 10
            (20.0, "file", 1, [7, 8, 11, 12, 13, 14, 15]),  # 112 tokens: no shared prefix, 4 blocks
            (30.0, "text", 1, [1, 2, 3, 4]),  # 64 tokens: may hit 2 only (last token is recomputed)
        ]
    )


@pytest.mark.parametrize(
    "capacity, expected_hit_blocks",
    [
        # 4 slots: request 2 needs 4 blocks, evicting 10, 4, 2 (tail-first LRU order) -> request 3
        # misses and takes request 2's empty tail slot plus one eviction.
        (4, 2),
        # 8 slots: nothing is evicted, request 3 hits block 2.
        (8, 3),
    ],
)
def test_hits_by_hand(capacity, expected_hit_blocks):
    workload = prepare_workload(hand_trace(), engine_block_size=32)
    assert workload.n_lookup.tolist() == [2, 2, 3, 1]
    assert workload.blocks_needed(decode=False).tolist() == [3, 3, 4, 2]
    policy = TinyLRU()
    m = simulate(workload, policy, capacity, FAST)
    assert m.hits_device == expected_hit_blocks
    assert m.cached_tokens == expected_hit_blocks * 32
    assert m.token_hit_ratio == pytest.approx(expected_hit_blocks * 32 / (80 + 96 + 112 + 64))
    assert m.block_lookups == 8 and m.misses == 8 - expected_hit_blocks
    assert m.evictions == (4 if capacity == 4 else 0)


def test_concurrent_requests_share_in_flight_blocks():
    trace = make_trace([(0.0, "a", 1, [1, 2, 3, 4, 5]), (0.0, "a", 1, [1, 2, 3, 4, 6])])
    slow = SimConfig(engine_block_size=32, cost=CostModel(prefill_tokens_per_s=10.0))
    m = simulate(prepare_workload(trace, engine_block_size=32), TinyLRU(), 6, slow)
    # Both arrive together; the second hits the first's two full blocks while they are computed.
    assert m.hits_device == 2
    assert m.evictions == 0


def test_fully_cached_prompt_still_recomputes_its_last_block():
    trace = make_trace([(0.0, "a", 1, [1, 2]), (5.0, "a", 1, [1, 2])])
    m = simulate(prepare_workload(trace, engine_block_size=32), TinyLRU(), 4, FAST)
    assert m.hits_device == 0 and m.block_lookups == 0


def test_requests_queue_when_the_cache_is_pinned_full():
    # Each request pins 2 blocks of a 2-block cache, so the second waits for the first.
    trace = make_trace([(0.0, "a", 1, [1, 2, 3, 4]), (0.0, "b", 1, [5, 6, 7, 8])])
    cost = CostModel(prefill_tokens_per_s=64.0, step_overhead_s=0.0)
    config = SimConfig(engine_block_size=32, cost=cost)
    m = simulate(prepare_workload(trace, engine_block_size=32), TinyLRU(), 2, config)
    # 64 tokens at 64 tokens/s: the first token after 1 s, the second request's after 2 s.
    assert m.qttft_p50_s == pytest.approx(1.5) and m.makespan_s == pytest.approx(2.0)
    assert m.n_rejected == 0


def test_a_request_larger_than_the_cache_is_rejected_not_hung():
    trace = make_trace([(0.0, "a", 1, [1, 2, 3, 4, 5, 6]), (1.0, "a", 1, [1, 2])])
    m = simulate(prepare_workload(trace, engine_block_size=32), TinyLRU(), 2, FAST)
    assert m.n_rejected == 1 and m.n_requests == 2


def test_host_tier_serves_what_the_gpu_evicted():
    trace = make_trace(
        [
            (0.0, "a", 1, [1, 2, 3, 4, 5]),
            (10.0, "b", 1, [11, 12, 13, 14, 15]),  # evicts the first chain from a 3-block GPU
            (20.0, "a", 2, [1, 2, 3, 4, 5]),
        ]
    )
    config = SimConfig(engine_block_size=32, cost=FAST.cost, cpu_capacity=16)
    m = simulate(prepare_workload(trace, engine_block_size=32), TinyLRU(), 3, config, host_policy=TinyLRU())
    assert (m.hits_device, m.hits_host) == (0, 2)
    assert m.hits_device + m.hits_host + m.misses == m.block_lookups


def test_elastic_lowering_drops_free_blocks_and_waits_for_pinned_ones():
    rows = [(float(i), "a", 1, [100 * i + k for k in range(8)]) for i in range(6)]
    schedule = ((0.0, 8), (2.5, 4))
    config = SimConfig(engine_block_size=32, cost=FAST.cost, capacity_schedule=schedule)
    sizes = []

    def observe(gpu, host):
        gpu.check()
        sizes.append((gpu.limit, gpu.n_live))

    m = simulate(prepare_workload(make_trace(rows), engine_block_size=32), TinyLRU(), 0, config, observer=observe)
    assert m.capacity == 8 and m.dropped > 0
    assert all(live <= limit for limit, live in sizes)
    assert sizes[-1] == (4, 4)


def test_mismatched_block_sizes_are_clear_errors():
    with pytest.raises(SimulationError, match="multiple of the trace's block size"):
        prepare_workload(hand_trace(), engine_block_size=24)
    with pytest.raises(SimulationError, match="no requests"):
        prepare_workload(hand_trace().time_window(100.0, None), engine_block_size=32)
    with pytest.raises(ValueError, match="seconds:blocks"):
        parse_schedule("0:4096,later")


def test_next_use_is_the_next_later_request_arrival():
    workload = prepare_workload(hand_trace(), engine_block_size=32)
    per_request = np.split(workload.next_use, workload.offsets[1:-1])
    assert per_request[0].tolist() == [10.0, 10.0]  # blocks 2 and 4, next used by request 1
    assert per_request[1].tolist() == [30.0, 30.0, math.inf]  # request 3 uses blocks 2 and 4
    assert np.isinf(per_request[2]).all()


# ---- properties over random traces -------------------------------------------------------------


@st.composite
def random_replays(draw):
    """Small traces with prefix-chained hashes (shared prefixes are common) and random settings."""
    ids: dict[tuple, int] = {}
    rows, t = [], 0.0
    for _ in range(draw(st.integers(1, 25))):
        symbols = draw(st.lists(st.integers(0, 2), min_size=1, max_size=10))
        chain = [ids.setdefault(tuple(symbols[: k + 1]), len(ids)) for k in range(len(symbols))]
        t += draw(st.sampled_from([0.0, 0.05, 0.5, 3.0]))
        rows.append((t, draw(st.sampled_from(["a", "b"])), 1, chain))
    trace = make_trace(rows)
    engine_block_size = draw(st.sampled_from([16, 32]))
    capacity = draw(st.integers(1, 12))
    schedule = ()
    if draw(st.booleans()):
        schedule = ((0.0, capacity), (draw(st.floats(0.1, 20.0)), draw(st.integers(1, 12))))
    cost = CostModel(
        prefill_tokens_per_s=draw(st.sampled_from([50.0, 500.0])),
        max_batched_tokens=draw(st.sampled_from([16, 64, 1024])),
        max_num_seqs=draw(st.integers(1, 4)),
        decode=draw(st.booleans()),
        time_per_output_token_s=0.01,
    )
    config = SimConfig(
        engine_block_size=engine_block_size,
        cost=cost,
        cpu_capacity=draw(st.sampled_from([0, 3, 10])),
        capacity_schedule=schedule,
    )
    return trace, capacity, config


def _replay(trace, capacity, config, observer=None):
    policy = TinyLRU()
    host = TinyLRU() if config.cpu_capacity else None
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    return policy, simulate(workload, policy, capacity, config, host_policy=host, observer=observer)


@settings(max_examples=150, deadline=None)
@given(random_replays())
def test_invariants_hold_at_every_step(replay):
    trace, capacity, config = replay
    steps = []

    def observe(gpu, host):
        gpu.policy.pool = gpu
        gpu.check()  # every slot empty, pinned or evictable; occupancy within the limit once free
        if host is not None:
            host.check()
        pinned = sum(1 for r in gpu.refs if r)
        steps.append((gpu.n_live, gpu.limit, pinned))

    policy, m = _replay(trace, capacity, config, observe)
    assert steps or m.n_rejected == m.n_requests, "the observer ran for every admission"
    # Above the limit only while pinned blocks alone exceed it (an elastic lowering in progress).
    assert all(live <= max(limit, pinned) for live, limit, pinned in steps)
    assert m.hits_device + m.hits_host + m.misses == m.block_lookups
    assert m.cached_tokens == (m.hits_device + m.hits_host) * config.engine_block_size
    assert 0.0 <= m.token_hit_ratio <= 1.0
    assert m.evictions == len(policy.victims) - m.dropped
    if not config.cpu_capacity:
        assert m.hits_host == 0
    served = m.n_requests - m.n_rejected
    assert served == 0 or m.qttft_p50_s >= 0.0


@settings(max_examples=40, deadline=None)
@given(random_replays())
def test_replay_is_deterministic(replay):
    trace, capacity, config = replay
    (_, first), (_, second) = _replay(trace, capacity, config), _replay(trace, capacity, config)
    assert first.to_dict() == pytest.approx(second.to_dict(), nan_ok=True)


@settings(max_examples=40, deadline=None)
@given(random_replays())
def test_every_block_is_back_in_one_place_at_the_end(replay):
    trace, capacity, config = replay
    pools = []
    _, m = _replay(trace, capacity, config, lambda gpu, host: pools.append(gpu))
    if not pools:
        assert m.n_rejected == m.n_requests
        return
    gpu = pools[-1]
    assert not any(gpu.refs), "no request still holds blocks"
    assert len(gpu.empty) + len(gpu.policy) == gpu.n_live
    assert all(gpu.slot_block[s] != NO_BLOCK for s in gpu.block_slot.values())
