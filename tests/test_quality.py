"""Held-out quality scored from counts equals scikit-learn's metrics asked question by question."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import brier_score_loss, log_loss

from kvprof.models.score import mixture_reuse_probability
from kvprof.profiler.quality import QUALITY_AGES, question_counts, score_counts, score_quality
from kvprof.profiler.reuse import ReuseSamples


def _samples(rng, m: int) -> ReuseSamples:
    gap = np.where(rng.random(m) < 0.5, rng.exponential(5.0, m), rng.exponential(300.0, m))
    exposure = rng.uniform(0, 2000, m)
    seen = gap < exposure
    zeros = np.zeros(m, dtype=np.int64)
    return ReuseSamples(np.where(seen, gap, exposure), ~seen, zeros.astype(np.int32), zeros, zeros, 0)


def _models(rng, n_rows: int) -> dict:
    out = {}
    for name, k in (("mixture", 3), ("single", 1)):
        weights = rng.dirichlet(np.ones(k), n_rows)
        if k > 1:  # rows of fewer components are padded with weight 0
            weights[: n_rows // 2, -1] = 0
            weights /= weights.sum(axis=1, keepdims=True)
        out[name] = (rng.uniform(0.01, 1.0, n_rows), weights, rng.exponential(0.1, (n_rows, k)))
    return out


def _one_by_one(samples, row, models, horizon):
    """The questions asked one at a time and scored by scikit-learn (the definition)."""
    picks, ages, answers = [], [], []
    for factor in QUALITY_AGES:
        age = factor * horizon
        known = (samples.time > age) & ((~samples.censored) | (samples.time >= age + horizon))
        rows = np.flatnonzero(known)
        picks.append(rows)
        ages.append(np.full(rows.size, age))
        answers.append((~samples.censored[rows]) & (samples.time[rows] <= age + horizon))
    sample, age, answer = map(np.concatenate, (picks, ages, answers))
    rows_of = row[sample]
    out = {}
    for r in np.unique(rows_of).tolist():
        mask = rows_of == r
        out[r] = {}
        for name, (p, weights, rates) in models.items():
            prediction = np.clip(mixture_reuse_probability(p[rows_of[mask]], weights[rows_of[mask]], rates[rows_of[mask]],
                                                           age[mask], horizon), 1e-6, 1 - 1e-6)
            out[r][name] = (log_loss(answer[mask], prediction, labels=[False, True]),
                            brier_score_loss(answer[mask], prediction, pos_label=True), int(mask.sum()))
    return out


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_rows=st.integers(1, 6), horizon=st.sampled_from([1.0, 60.0, 600.0]))
def test_counted_scores_equal_scikit_learn_question_by_question(seed, n_rows, horizon):
    rng = np.random.default_rng(seed)
    samples = _samples(rng, 3000)
    row = rng.integers(0, n_rows, 3000)
    models = _models(rng, n_rows)
    got = score_quality(samples, row, models, horizon)
    expected = _one_by_one(samples, row, models, horizon)
    assert sorted(got["rows"]) == sorted(expected)
    for r, by_model in expected.items():
        for name, (ll, brier, n) in by_model.items():
            measured = got["rows"][r][name]
            assert measured["n"] == n
            assert measured["log_loss"] == pytest.approx(ll, rel=1e-12)
            assert measured["brier"] == pytest.approx(brier, rel=1e-12)


def test_counts_of_shards_add_up_to_the_counts_of_the_whole():
    rng = np.random.default_rng(3)
    samples = _samples(rng, 5000)
    row = rng.integers(0, 4, 5000)
    whole = question_counts(samples, row, 4, 60.0)
    halves = [ReuseSamples(*(getattr(samples, f)[part] for f in ("time", "censored", "workload", "request", "prior")), 0)
              for part in (slice(0, 2000), slice(2000, None))]
    summed = question_counts(halves[0], row[:2000], 4, 60.0) + question_counts(halves[1], row[2000:], 4, 60.0)
    assert np.array_equal(whole, summed)
    models = _models(rng, 4)
    assert score_counts(summed, models, 60.0) == score_quality(samples, row, models, 60.0)
