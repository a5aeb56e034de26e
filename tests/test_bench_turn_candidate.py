"""The first-turn candidate of benchmarks/bench_turn_candidate.py: it infers each request's session start
from the chains it sees freed, as the told rule's :func:`~kvprof.sim.oracles.infer_sessions` does from
the trace, and keeps each block in one list."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_online_rules import began_session  # noqa: E402
from bench_turn_candidate import FirstTurnLRU, continuation_by_turn  # noqa: E402


@st.composite
def chain_trees(draw):
    """Request chains as hash chains are: each a prefix of an earlier chain (possibly empty) plus new contents."""
    chains, fresh = [], iter(range(10**6))
    for _ in range(draw(st.integers(1, 25))):
        base = draw(st.sampled_from(chains)) if chains and draw(st.booleans()) else []
        prefix = base[:draw(st.integers(0, len(base)))]
        chains.append(prefix + [next(fresh) for _ in range(draw(st.integers(0 if prefix else 1, 3)))])
    return chains


@settings(max_examples=200, deadline=None)
@given(chain_trees())
def test_requests_one_at_a_time_are_demoted_exactly_when_they_begin_a_session(chains):
    policy, block, lists = FirstTurnLRU(), 0, []
    for chain in chains:
        blocks = list(range(block, block + len(chain)))  # fresh blocks: what is demoted depends on the request alone
        block += len(chain)
        for depth, (b, content) in enumerate(zip(blocks, chain)):
            policy.access(b, 0.0, depth=depth, content=content)
        policy.free(reversed(blocks), 0.0)
        lists.append([b in policy._long for b in blocks])
        assert all(b in policy for b in blocks) and len(policy) == block
        assert not set(policy._long) & set(policy._kept)  # each block in one list
    offsets = np.cumsum([0] + [len(c) for c in chains])
    workload = SimpleNamespace(n_requests=len(chains), offsets=offsets, block=np.array(sum(chains, []), dtype=np.int64))
    expected = began_session(workload).tolist()
    assert [all(demoted) and len(demoted) == len(chain) for demoted, chain in zip(lists, chains)] == \
        [began and bool(chain) for began, chain in zip(expected, chains)]


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


def test_the_profile_counts_next_turns_within_the_horizon_by_how_the_request_stood():
    # sessions: 0 -> 1 -> 3 (10 s, then 50 s later); 2 begins and is never continued; 4 is too close to the end
    chains = [[1], [1, 2], [7], [1, 2, 3], [9]]
    offsets = np.cumsum([0] + [len(c) for c in chains])
    workload = SimpleNamespace(n_requests=len(chains), offsets=offsets, block=np.array(sum(chains, []), dtype=np.int64),
                               arrival=np.array([0.0, 10.0, 20.0, 60.0, 100.0]))
    got = continuation_by_turn(workload, horizons=(30.0,))
    assert got["requests"] == 5 and got["began"] == 3 / 5
    # known (arrival <= 70): began 0 (next in 10 s), 2 (never); continued 1 (next in 50 s), 3 (none)
    assert got["rates"][30.0] == [0.5, 0.0]
