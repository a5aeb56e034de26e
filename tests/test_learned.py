"""wa's learned candidate: Belady's labels, the fitted predictor, and the policy that follows it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.models.learned import LOG_BINNED, N_LOG_BINS, LearnedModel, log_bin
from kvprof.policy.learned import FreeFeatures, LearnedPolicy
from kvprof.sim.learn import LabellingBelady, fit_learned

FLAT = (0.0,) * N_LOG_BINS


def test_labels_are_what_belady_did_at_the_next_access():
    policy = LabellingBelady(n_cells=2, n_tiers=4)
    for block, next_use in ((0, 5.0), (1, math.inf), (2, 3.0)):
        policy.access(block, 0.0, 0, block, next_use=next_use)
    policy.free([2, 1, 0], 1.0)
    assert policy.evict(1.5) == 1  # never used again: evicted first, cache-averse
    policy.remove(2)
    policy.access(2, 3.0, 1, 2, hit=True, next_use=math.inf)  # kept until its next use: friendly
    assert policy.labels == [1, 0, -1]  # block 0's fate is unknown when the replay ends
    # Features at the free: the cell, the tier of hits, the depth bin, the distance from the call's deepest block.
    # Then the chain's turn (1: first seen), its gap (none) and each block's fan-out (the tail has no child).
    chain = (log_bin(1), 0)
    assert policy.rows == [(0, 0, log_bin(2), 0, *chain, 0), (0, 0, log_bin(1), 1, *chain, 1),
                           (0, 0, 0, log_bin(2), *chain, 1)]


def test_hits_since_allocation_set_the_tier_and_an_unknown_cell_is_the_default():
    features = FreeFeatures(n_cells=3, n_tiers=4)
    features.access(7, workload=9, depth=4, hit=False)
    for _ in range(3):
        features.access(7, workload=1, depth=4, hit=True)
    assert features.of_free([7], 1.0)[0][:4] == (1, 2, log_bin(4), 0)  # 3 hits: tier 2 (edges 0, 1, 2, 4)
    features.access(7, workload=-1, depth=0, hit=False)  # reallocated: hits start over
    assert features.of_free([7], 2.0)[0][:4] == (2, 0, 0, 0)


def test_the_fit_finds_a_planted_rule_and_says_how_well_it_predicts_held_out_frees():
    rng = np.random.default_rng(0)
    n = 6000
    rows = np.column_stack([rng.integers(0, 3, n), rng.integers(0, 4, n),
                            *(rng.integers(0, N_LOG_BINS, n) for _ in LOG_BINNED)])
    kept = (rows[:, 1] >= 2) ^ (rng.random(n) < 0.05)  # hit blocks are kept, 5 % noise
    model = fit_learned(rows, kept.astype(np.int64), n_cells=3, n_tiers=4)
    assert model.tier[2] - model.tier[1] > 3 and abs(model.cell[0] - model.cell[1]) < 0.5
    quality = model.quality
    assert quality["holdout_window"] == 0.0 and quality["holdout_accuracy"] > 0.9
    assert quality["holdout_log_loss"] < 0.5 * quality["holdout_base_log_loss"]
    assert fit_learned(rows, np.zeros(n, np.int64), 3, 4) is None  # one class: nothing to learn


def test_predicted_averse_blocks_go_first_each_bucket_in_free_order():
    model = LearnedModel(0.0, cell=(0.0,), tier=(-2.0, 2.0, 2.0, 2.0), depth=FLAT, tail=FLAT)
    policy = LearnedPolicy(model)
    for block in range(4):
        policy.access(block, 0.0, 0, block)
    policy.access(1, 0.5, 0, 1, hit=True)
    policy.access(3, 0.5, 0, 3, hit=True)
    policy.free([3, 2], 1.0)
    policy.free([1, 0], 2.0)
    assert policy.order(3.0) == [2, 0, 3, 1]
    policy.remove(0)
    assert policy.evict_n(3, 3.0) == [2, 3, 1] and len(policy) == 0
    with pytest.raises(IndexError):
        policy.evict(3.0)


@settings(max_examples=60, deadline=None)
@given(bias=st.floats(-3, 3), tier=st.lists(st.floats(-3, 3), min_size=4, max_size=4),
       depths=st.lists(st.integers(0, 5000), min_size=1, max_size=20, unique=True))
def test_a_block_is_in_the_bucket_its_predicted_probability_reaches(bias, tier, depths):
    model = LearnedModel(bias, cell=(0.3,), tier=tuple(tier), depth=tuple(np.linspace(-1, 1, N_LOG_BINS)),
                         tail=tuple(np.linspace(1, -1, N_LOG_BINS)), edges=(0.2, 0.5, 0.8))
    policy = LearnedPolicy(model)
    for block, depth in enumerate(depths):
        policy.access(block, 0.0, 0, depth)
    policy.free(list(range(len(depths))), 1.0)
    deepest = max(depths)
    for block, depth in enumerate(depths):
        # A chain first seen (turn 1, no gap), each block continued past once or, at the tail, never.
        fanout = 0 if depth == deepest else int(depth + 1 in depths)
        row = [0, 0, log_bin(depth), log_bin(deepest - depth), log_bin(1), 0, log_bin(fanout)]
        log_odds = model.log_odds(np.array([row]))[0]
        probability = 1 / (1 + math.exp(-log_odds))
        expected = sum(probability >= edge + 1e-9 for edge in model.edges)
        if all(abs(probability - edge) > 1e-6 for edge in model.edges):
            assert policy._bucket[block] == expected
    # Eviction walks the buckets from the lowest, each in free order.
    order = policy.order(2.0)
    assert sorted(order) == list(range(len(depths)))
    assert [policy._bucket[b] for b in order] == sorted(policy._bucket[b] for b in order)


def test_a_friendly_block_idle_past_its_credit_goes_before_a_fresher_averse_one():
    model = LearnedModel(0.0, cell=(0.0,), tier=(-2.0, 2.0, 2.0, 2.0), depth=FLAT, tail=FLAT, credit_s=10.0)
    policy = LearnedPolicy(model)
    policy.access(0, 0.0, 0, 0)
    policy.access(0, 0.5, 0, 0, hit=True)  # friendly
    policy.access(1, 0.0, 0, 0)  # averse
    policy.access(2, 0.0, 0, 0)  # averse
    policy.free([0], 1.0)  # counts as freed at 11
    policy.free([1], 5.0)
    policy.free([2], 20.0)
    assert policy.order(30.0) == [1, 0, 2]
    assert policy.evict_n(3, 30.0) == [1, 0, 2]


def test_the_credit_is_a_high_quantile_of_the_friendly_frees_reuse_gaps():
    rng = np.random.default_rng(1)
    rows = np.column_stack([np.zeros(1000, np.int64), rng.integers(0, 4, 1000), np.zeros((1000, len(LOG_BINNED)), np.int64)])
    labels = (rows[:, 1] >= 2).astype(np.int64)
    gaps = np.where(labels == 1, rng.uniform(0, 100, 1000), np.nan)
    model = fit_learned(rows, labels, 1, 4, gaps)
    assert model.credit_s == pytest.approx(np.quantile(gaps[labels == 1], 0.9))
