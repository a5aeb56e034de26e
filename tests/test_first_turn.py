"""The first-turn candidate (:class:`kvprof.policy.first_turn.FirstTurnLRU`) and its twin: each request's
session start is inferred from the chains freed so far, as :func:`kvprof.sim.oracles.infer_sessions` infers
it from the trace; the twin decides as the reference, open tails forgotten included."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.twin import CompiledTwin
from kvprof.policy.first_turn import FirstTurnLRU
from kvprof.policy.wa import FIRST_TURN_ORDERS
from kvprof.sim.engine import simulate
from kvprof.sim.oracles import infer_sessions
from kvprof.sim.workload import prepare_workload
from tests.test_long_output import ONE_ROW, LoggedWa
from tests.test_sim_engine import random_replays


@st.composite
def chain_trees(draw):
    """Request chains as hash chains are: each a prefix of an earlier chain (possibly empty) plus new contents."""
    chains, fresh = [], iter(range(10**6))
    for _ in range(draw(st.integers(1, 25))):
        base = draw(st.sampled_from(chains)) if chains and draw(st.booleans()) else []
        prefix = base[:draw(st.integers(0, len(base)))]
        chains.append(prefix + [next(fresh) for _ in range(draw(st.integers(0 if prefix else 1, 3)))])
    return chains


def play(policy, chains):
    """Each chain on fresh blocks, one request at a time, freed tail first; per request, whether its
    blocks went to the demoted list (each block's place read from the order: demoted blocks lead it)."""
    block, freed = 0, []
    for chain in chains:
        blocks = list(range(block, block + len(chain)))  # fresh blocks: what is demoted depends on the request alone
        block += len(chain)
        for depth, (b, content) in enumerate(zip(blocks, chain)):
            policy.access(b, 0.0, depth=depth, content=content)
        policy.free(reversed(blocks), 0.0)
        freed.append(blocks)
        assert all(b in policy for b in blocks) and len(policy) == block
    return freed


def demoted_requests(reference: FirstTurnLRU, freed) -> list[bool]:
    demoted = set(reference._demoted)
    assert not demoted & set(reference._kept)  # each block in one list
    return [bool(blocks) and all(b in demoted for b in blocks) for blocks in freed]


@settings(max_examples=200, deadline=None)
@given(chain_trees())
def test_requests_one_at_a_time_are_demoted_exactly_when_they_begin_a_session(chains):
    reference = FirstTurnLRU()
    freed = play(reference, chains)
    workload = SimpleNamespace(n_requests=len(chains), offsets=np.cumsum([0] + [len(c) for c in chains]),
                               block=np.array(sum(chains, []), dtype=np.int64))
    began = infer_sessions(workload) == np.arange(len(chains))
    assert demoted_requests(reference, freed) == [bool(b) and bool(c) for b, c in zip(began, chains)]


def play_batched(twin: CompiledTwin, chains) -> None:
    """:func:`play` with each chain's accesses in one compiled call, as the vLLM pool makes them."""
    block = 0
    for chain in chains:
        blocks = np.arange(block, block + len(chain), dtype=np.int64)
        block += len(chain)
        twin.access_numbered(blocks, np.arange(len(chain), dtype=np.int64), twin.numbers(chain), 0.0, 0, hit=False)
        twin.free(reversed(blocks.tolist()), 0.0)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("memory", [1, 2, 65536])
@settings(max_examples=60, deadline=None)
@given(chains=chain_trees())
def test_the_twin_demotes_and_forgets_tails_as_the_reference(memory, batched, chains):
    reference, twin = FirstTurnLRU(memory), CompiledTwin(FirstTurnLRU(memory))
    play(reference, chains)
    (play_batched if batched else play)(twin, chains)
    assert twin.order(1.0) == reference.order(1.0)
    assert twin.evict_n(len(twin), 1.0) == reference.evict_n(len(reference), 1.0)


def test_first_turns_are_evicted_first_and_open_tails_are_bounded():
    policy = FirstTurnLRU(memory=1)
    for request, contents in enumerate([("a",), ("a", "b"), ("c",)]):
        blocks = [10 * request + depth for depth in range(len(contents))]
        for depth, (b, content) in enumerate(zip(blocks, contents)):
            policy.access(b, 0.0, depth=depth, content=content)
        policy.free(blocks, 0.0)
    # ("a",) and ("c",) began sessions, ("a", "b") continued the first: its blocks go last
    assert policy.order(0.0) == [0, 20, 10, 11]
    assert list(policy._open) == ["c"]  # one open tail remembered: "b" was forgotten
    assert [policy.evict(0.0) for _ in range(4)] == [0, 20, 10, 11] and len(policy) == 0


@pytest.mark.parametrize("memory", [0, -1, 2.5])
def test_the_memory_must_be_a_positive_int(memory):
    with pytest.raises(ValueError, match="memory"):
        FirstTurnLRU(memory)


@settings(max_examples=60, deadline=None)
@given(random_replays(), st.floats(0.0, 1.0))
def test_decisions_never_read_the_future(case, cut):
    """Online only: with the requests arriving from ``T`` on removed, ``wa`` over first-turn and LRU (and the
    order alone) evict the same blocks before ``T``: whether a request began its session is read from the
    chains freed before it, never from the requests after it (nor the next uses the driver passes)."""
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0)
    cut_at = float(trace.timestamp[0] + cut * (trace.timestamp[-1] - trace.timestamp[0]))

    def evictions(part, orders):
        policy = LoggedWa(*ONE_ROW, 60.0, orders=orders, capacity=capacity)
        simulate(prepare_workload(part, engine_block_size=config.engine_block_size), policy, capacity, config,
                 engine="python")
        return [entry for entry in policy.log if entry[0] < cut_at]

    earlier = trace.time_window(None, cut_at)
    if earlier.n_requests:
        for orders in (FIRST_TURN_ORDERS, ("first-turn",)):
            assert evictions(earlier, orders) == evictions(trace, orders)
