"""The regret-weighted mixture prototype of research/bench_mixture.py: one expert is that expert,
and the mixture keeps its invariants over random request streams."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.policy import S3FIFOPolicy
from tests.test_policies import LAM, OPS, P, PolicyPool, Scenario, wa_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # research/

from bench_mixture import VARIANTS, WEIGHT_FLOOR, RegretMixture  # noqa: E402


def mixture(num_blocks: int, orders, **kwargs) -> RegretMixture:
    """A mixture over the four classes of tests/test_policies.py, with the rows ``wa_policy`` gives wa."""
    model = wa_policy(P, LAM)
    return RegretMixture(model.p, model.weights, model.rates, model.horizon, orders=orders, capacity=num_blocks,
                         **kwargs)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, num_blocks=st.integers(4, 24), expert=st.sampled_from(["model", "lru", "s3fifo"]))
def test_a_mixture_of_one_expert_evicts_as_that_expert(ops, num_blocks, expert):
    alone = S3FIFOPolicy() if expert == "s3fifo" else wa_policy(P, LAM, orders=(expert,))
    pools = [PolicyPool(num_blocks, mixture(num_blocks, (expert,))), PolicyPool(num_blocks, alone)]
    scenario = Scenario(pools)
    for op in ops:
        scenario.step(*op)  # asserts that both pools hand out the same blocks
    assert pools[0].evicted == pools[1].evicted


@pytest.mark.parametrize("variant", ["lecar-random-lr0.45", "mix6-vote-lr0.005-full", "s3lru-argmax-adaptive",
                                     "mix3-random-adaptive-full", "arc3-random-lr0.45-full", "mix7-vote-adaptive"])
@settings(max_examples=40, deadline=None)
@given(ops=OPS, num_blocks=st.integers(4, 24))
def test_the_mixture_keeps_its_invariants(variant, ops, num_blocks):
    orders, choice, rate, feedback = VARIANTS[variant]
    policy = mixture(num_blocks, orders, choice=choice, learning_rate=rate, feedback=feedback)
    pool = PolicyPool(num_blocks, policy)
    scenario = Scenario([pool])
    for op in ops:
        scenario.step(*op)
        evictable = pool.evictable()
        assert len(policy) == len(evictable) and all(block in policy for block in evictable)
        for outside in policy._outside:  # ARC, kept in step
            assert sorted(b for b in range(num_blocks) if b in outside) == sorted(evictable)
        assert abs(policy.expert_weight.sum() - 1.0) < 1e-9
        assert policy.expert_weight.min() >= WEIGHT_FLOOR / (1 + len(orders) * WEIGHT_FLOOR) - 1e-12
        assert all(len(ghost) <= num_blocks for ghost in policy._ghosts)
    assert sum(policy.chosen) == len(pool.evicted)
