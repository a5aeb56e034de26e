"""The output-length candidate of benchmarks/bench_output_candidate.py: followed alone, ``wa`` replays
exactly the told rule of bench_online_rules over LRU, and the candidate keeps every block in one place."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.policy.lru import LRUPolicy
from kvprof.sim.oracles import AccessIndexed, replay
from kvprof.sim.workload import prepare_workload
from tests.test_sim_engine import random_replays

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_online_rules import ShortOutput  # noqa: E402
from bench_output_candidate import DemotedLRU, WithOutputRule  # noqa: E402

ONE_ROW = (np.full((1, 1), 0.5), np.ones((1, 1, 1)), np.full((1, 1, 1), 0.1))


@st.composite
def replays_with_outputs(draw):
    """random_replays' traces and settings, each request's output 1, 10 or 100 tokens (theirs are all 10)."""
    trace, capacity, config = draw(random_replays())
    outputs = draw(st.lists(st.sampled_from([1, 10, 100]), min_size=trace.n_requests, max_size=trace.n_requests))
    return dataclasses.replace(trace, output_length=np.array(outputs, dtype=np.int64)), capacity, config


@settings(max_examples=100, deadline=None)
@given(replays_with_outputs(), st.sampled_from([-1.0, 8.0, 8.0, 64.0, math.inf]))
def test_the_candidate_followed_alone_is_the_told_rule_over_lru(case, limit):
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0)
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    indexed = AccessIndexed.of(workload)
    output = workload.output_tokens.tolist()

    def outcome(policy):
        run = replay(indexed, policy, capacity, config)
        return run.token_hit_ratio, run.evictions

    candidate = WithOutputRule(*ONE_ROW, 60.0, orders=("out50",), safety_net=False, output=output,
                               limits={"out50": limit})
    assert outcome(candidate) == outcome(ShortOutput(LRUPolicy(), output, limit, "out"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["free", "remove", "evict"]), st.integers(0, 11), st.booleans()),
                max_size=80))
def test_demoted_lru_keeps_each_block_in_one_place_and_evicts_the_demoted_first(ops):
    policy, demoted, kept = DemotedLRU(), [], []
    for op, block, demote in ops:
        if op == "free" and block not in policy:
            policy.demote_next = demote
            policy.free([block], 0.0)
            (demoted if demote else kept).append(block)
        elif op == "remove" and block in policy:
            policy.remove(block)
            (demoted if block in demoted else kept).remove(block)
        elif op == "evict" and len(policy):
            expected = (demoted or kept).pop(0)
            assert policy.evict(0.0) == expected
        assert len(policy) == len(demoted) + len(kept)
        assert policy.order(0.0) == demoted + kept
