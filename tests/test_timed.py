"""Replays on recorded timing (kvprof.sim.timed): a request holds its blocks exactly as long as the server did."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.policy import make_policy
from kvprof.sim.config import SimConfig, SimulationError
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload

from tests.helpers import make_trace


def recorded(rows, scheduled, finished, output=None, block_size=16):
    """A trace of ``rows`` with the recording's ``scheduled``/``finished`` columns."""
    trace = make_trace(rows, block_size=block_size)
    extra = {"scheduled": np.array(scheduled, dtype=object), "finished": np.array(finished, dtype=np.float64)}
    trace = dataclasses.replace(trace, extra=extra)
    if output is not None:
        trace = dataclasses.replace(trace, output_length=np.array(output, dtype=np.int64))
    return trace


def run(trace, policy="lru", capacity=4, engine=None, timing="auto"):
    config = SimConfig(engine_block_size=trace.block_size, timing=timing)
    workload = prepare_workload(trace, engine_block_size=trace.block_size)
    return simulate(workload, make_policy(policy), capacity, config, engine=engine)


def test_pinned_blocks_follow_the_recorded_times():
    # Request 0 holds blocks 1-3 from t=0 to t=100. With the modelled server it would free them
    # at once; recorded, it still pins them when request 1 (blocks 4-6) arrives, so a 4-block
    # cache has room for one of request 1's blocks at most... and request 2 (1-3 again) hits.
    rows = [(0.0, "a", 1, [1, 2, 3, 9]), (1.0, "a", 1, [4, 5, 6, 8]), (200.0, "a", 1, [1, 2, 3, 7])]
    pinned_long = recorded(rows, [0.0, 1.0, 200.0], [100.0, 2.0, 201.0], output=[1, 1, 1])
    m = run(pinned_long, capacity=8)
    assert m.hits_device == 3  # request 2 finds 1-3: request 1 took only empty blocks
    short = recorded(rows, [0.0, 1.0, 200.0], [0.5, 2.0, 201.0], output=[1, 1, 1])
    m = run(short, capacity=4)
    # Freed at 0.5, blocks 1-3 are evictable when request 1 needs 4 blocks: LRU takes them.
    assert m.hits_device == 0


def test_never_scheduled_requests_take_nothing_and_are_not_served():
    rows = [(0.0, "a", 1, [1, 2, 3]), (1.0, "a", 1, [1, 2, 3])]
    trace = recorded(rows, [0.0, None], [1.0, 1.5], output=[1, 1])
    m = run(trace, capacity=8)
    assert (m.n_requests, m.n_rejected, m.hits_device) == (2, 1, 0)


def test_finished_before_scheduled_is_refused():
    rows = [(0.0, "a", 1, [1, 2])]
    with pytest.raises(SimulationError, match="finished .* before it was scheduled"):
        run(recorded(rows, [5.0], [4.0]))


def test_recorded_timing_asked_of_a_trace_without_it():
    trace = make_trace([(0.0, "a", 1, [1, 2])])
    with pytest.raises(SimulationError, match="no recorded timing"):
        run(trace, timing="recorded")


def test_output_blocks_are_cached_and_evicted_like_the_servers():
    # A 2-block prompt + 40 output tokens of 16-token blocks: 2 more full blocks are cached, so a
    # 4-block cache is full of request 0's blocks when request 1 comes, and LRU evicts the
    # output blocks first (freed tail first) -- request 2 still hits the prompt.
    rows = [(0.0, "a", 1, [1, 2]), (10.0, "a", 1, [5, 6]), (20.0, "a", 1, [1, 2, 3])]
    trace = recorded(rows, [0.0, 10.0, 20.0], [1.0, 11.0, 21.0], output=[41, 1, 1])
    m = run(trace, capacity=4)
    assert m.hits_device == 2


@st.composite
def recordings(draw):
    ids: dict[tuple, int] = {}
    rows, scheduled, finished, t = [], [], [], 0.0
    for _ in range(draw(st.integers(1, 20))):
        symbols = draw(st.lists(st.integers(0, 2), min_size=1, max_size=8))
        chain = [ids.setdefault(tuple(symbols[: k + 1]), len(ids)) for k in range(len(symbols))]
        t += draw(st.sampled_from([0.0, 0.1, 1.0]))
        rows.append((t, draw(st.sampled_from(["a", "b"])), 1, chain))
        start = None if draw(st.integers(0, 9)) == 0 else t + draw(st.sampled_from([0.0, 0.2, 2.0]))
        scheduled.append(start)
        finished.append((t if start is None else start) + draw(st.sampled_from([0.0, 0.3, 5.0])))
    output = [draw(st.integers(0, 40)) for _ in rows]
    return recorded(rows, scheduled, finished, output=output), draw(st.integers(1, 12)), draw(
        st.sampled_from(["lru", "lfu", "s3fifo", "arc", "belady"]))


@settings(max_examples=120, deadline=None)
@given(recordings())
def test_compiled_and_python_replays_agree(case):
    trace, capacity, policy = case
    compiled = run(trace, policy, capacity, engine="compiled")
    python = run(trace, policy, capacity, engine="python")
    assert compiled.to_dict() == pytest.approx(python.to_dict(), nan_ok=True)
    assert compiled.hits_device + compiled.misses == compiled.block_lookups
    assert compiled.n_rejected == sum(v is None for v in trace.extra["scheduled"])


@settings(max_examples=60, deadline=None)
@given(recordings())
def test_every_slot_is_in_one_place_at_every_event(case):
    from kvprof.core import tiers
    from kvprof.core.build import compile_policy
    from kvprof.core.timed import replay

    trace, capacity, policy = case
    workload = prepare_workload(trace, engine_block_size=trace.block_size)
    timing = workload.timing
    gpu = tiers.new_device(compile_policy(make_policy(policy), capacity), capacity, timing.n_contents)
    hits, held = replay(gpu, timing.block, timing.offsets, timing.n_full, timing.n_prompt, workload.n_lookup,
                        timing.n_new, workload.workload.astype(np.int64), timing.next_use, *timing.events(), True)
    assert (held <= timing.n_prompt + timing.n_new).all() and (hits <= held).all()
