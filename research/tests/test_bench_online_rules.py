"""The online demotion rules of research/bench_online_rules.py: what they count, and that a rule that
demotes nothing is its base order."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings

from kvprof.policy import make_policy
from kvprof.policy.lru import LRUPolicy
from kvprof.sim.oracles import AccessIndexed, replay
from kvprof.sim.workload import prepare_workload
from tests.test_sim_engine import random_replays

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # research/

from bench_online_rules import FirstTurn, RootSeen, ShortOutput, began_session, roots_seen_before  # noqa: E402


def test_roots_are_counted_before_each_request():
    chains = [[5, 6], [5, 7], [], [8], [5], [8, 9]]
    offsets = np.cumsum([0] + [len(c) for c in chains])
    workload = SimpleNamespace(n_requests=len(chains), offsets=offsets, block=np.array(sum(chains, []), dtype=np.int64))
    assert roots_seen_before(workload).tolist() == [0, 1, 0, 0, 2, 1]


def test_a_request_begins_its_session_unless_it_extends_an_open_chain():
    # 1 extends 0; 2 extends 0's chain too, but 1 continued it already; 4 extends 1's chain
    chains = [[1, 2], [1, 2, 3], [1, 2, 4], [5], [1, 2, 3, 6], []]
    offsets = np.cumsum([0] + [len(c) for c in chains])
    workload = SimpleNamespace(n_requests=len(chains), offsets=offsets, block=np.array(sum(chains, []), dtype=np.int64))
    assert began_session(workload).tolist() == [True, False, True, True, False, True]


@settings(max_examples=40, deadline=None)
@given(random_replays())
def test_a_rule_that_demotes_nothing_is_its_base_and_one_that_demotes_everything_is_lru(case):
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0)
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    indexed = AccessIndexed.of(workload)

    def outcome(policy):
        run = replay(indexed, policy, capacity, config)
        return run.token_hit_ratio, run.evictions

    output, n = workload.output_tokens.tolist(), workload.n_requests
    lfu = outcome(make_policy("lfu"))
    assert outcome(ShortOutput(make_policy("lfu"), output, math.inf, "out")) == lfu
    assert outcome(RootSeen(make_policy("lfu"), [0] * n, 0)) == lfu
    assert outcome(FirstTurn(make_policy("lfu"), [False] * n)) == lfu
    # every freed block demoted and evicted oldest-freed first: a block is evictable only once freed, so LRU
    lru = outcome(LRUPolicy())
    assert outcome(ShortOutput(make_policy("lfu"), output, -1, "out")) == lru
    assert outcome(RootSeen(make_policy("lfu"), [0] * n, 1)) == lru
    assert outcome(FirstTurn(make_policy("lfu"), [True] * n)) == lru
