"""Reuse models: censored fit, naive fit, diagnostics, per-class shrinkage, scores, session stats."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from kvprof.models import (
    CureExponential,
    diagnose,
    fit_classes,
    naive_fit,
    published_score,
    reuse_probability,
    session_stats,
    turn_continuation_prior,
)
from kvprof.models.exponential import GAP_RESOLUTION_S
from kvprof.profiler.trace import Trace

WINDOW_S = 3600.0


def simulate(n, p, lam, seed=0, window=WINDOW_S):
    """Accesses arriving uniformly in the window, reused w.p. p after Exp(lam), censored at the window end."""
    rng = np.random.default_rng(seed)
    arrival = rng.uniform(0.0, window, n)
    gap = rng.exponential(1.0 / lam, n)
    seen = (rng.random(n) < p) & (arrival + gap < window)
    return np.where(seen, gap, window - arrival), ~seen


def loglik(time, censored, p, lam):
    """The censored cure-exponential log-likelihood, written straight from its definition."""
    gaps, exposure = time[~censored], time[censored]
    return np.sum(np.log(p * lam) - lam * gaps) + np.sum(np.log(1 - p + p * np.exp(-lam * exposure)))


# --- censored fit ---------------------------------------------------------------------------


@pytest.mark.parametrize("p, lam", [(0.4, 1 / 600), (0.9, 1 / 3000), (0.15, 1 / 1200)])
def test_censored_fit_recovers_parameters_where_the_naive_fit_is_biased(p, lam):
    time, censored = simulate(200_000, p, lam)
    model = CureExponential().fit(time, censored)
    assert model.converged_
    assert model.p_ == pytest.approx(p, rel=0.05)
    assert model.lambda_ == pytest.approx(lam, rel=0.05)
    naive_p, naive_lam = naive_fit(time, censored)
    # Censored accesses counted as never reused: p too low; long gaps cut off: lambda too high.
    assert naive_p < 0.9 * p
    assert naive_lam > 1.1 * lam


def test_fit_is_a_maximum_of_the_likelihood():
    time, censored = simulate(20_000, 0.5, 1 / 900, seed=1)
    model = CureExponential().fit(time, censored)
    best = loglik(time, censored, model.p_, model.lambda_)
    assert model.loglik_ == pytest.approx(best, rel=1e-9)
    for dp, factor in [(0.01, 1.0), (-0.01, 1.0), (0.0, 1.01), (0.0, 0.99)]:
        assert loglik(time, censored, model.p_ + dp, model.lambda_ * factor) < best
    assert (model.n_samples_, model.n_reuses_, model.n_censored_) == (20_000, (~censored).sum(), censored.sum())


def test_integer_weights_equal_repeated_samples():
    time, censored = simulate(5_000, 0.6, 1 / 400, seed=2)
    weight = np.where(np.arange(time.size) % 3 == 0, 2.0, 1.0)
    repeat = weight.astype(int)
    weighted = CureExponential().fit(time, censored, sample_weight=weight)
    repeated = CureExponential().fit(np.repeat(time, repeat), np.repeat(censored, repeat))
    assert weighted.p_ == pytest.approx(repeated.p_, rel=1e-7)
    assert weighted.lambda_ == pytest.approx(repeated.lambda_, rel=1e-7)
    assert weighted.loglik_ == pytest.approx(repeated.loglik_, rel=1e-9)


def test_without_censoring_p_is_one_and_lambda_is_one_over_the_mean_gap():
    gaps = np.array([1.0, 4.0, 10.0])
    model = CureExponential().fit(gaps, np.zeros(3, dtype=bool))
    assert (model.p_, model.lambda_) == (1.0, pytest.approx(1 / gaps.mean()))


DEGENERATE = {
    "one reuse": ([5.0], [False]),
    "one censored": ([5.0], [True]),
    "never reused": ([10.0, 20.0, 30.0], [True, True, True]),
    "all censored at exposure 0": ([0.0, 0.0], [True, True]),
    "all gaps equal": ([3.0, 3.0, 3.0], [False, False, False]),
    "all gaps zero": ([0.0, 0.0], [False, False]),
    "reuse plus zero exposures": ([2.0, 0.0, 0.0], [False, True, True]),
}


@pytest.mark.parametrize("time, censored", DEGENERATE.values(), ids=DEGENERATE.keys())
def test_degenerate_data_gives_finite_documented_values(time, censored):
    time, censored = np.array(time), np.array(censored)
    model = CureExponential().fit(time, censored)
    assert 0.0 <= model.p_ <= 1.0 and np.isfinite(model.lambda_) and model.lambda_ >= 0
    assert np.isfinite(model.loglik_) and model.converged_
    if censored.all():
        assert (model.p_, model.lambda_) == (0.0, 0.0)
    elif not time[censored].any():
        # Reuses seen and nothing censored with positive exposure: the maximum is at p = 1.
        assert model.p_ == 1.0
        assert model.lambda_ == pytest.approx(1 / max(time[~censored].mean(), GAP_RESOLUTION_S))
    for p, lam in [naive_fit(time, censored), (model.p_, model.lambda_)]:
        assert np.isfinite([p, lam]).all()
        json.dumps(diagnose(time, censored, p, lam), allow_nan=False)


def test_zero_samples_and_bad_input_raise_clear_errors():
    with pytest.raises(ValueError, match="zero samples"):
        CureExponential().fit([], [])
    with pytest.raises(ValueError, match="zero samples"):
        CureExponential().fit([1.0], [False], sample_weight=[0.0])
    with pytest.raises(ValueError, match="finite"):
        CureExponential().fit([np.nan], [False])
    with pytest.raises(ValueError, match="same length"):
        CureExponential().fit([1.0, 2.0], [False])
    with pytest.raises(RuntimeError, match="not fitted"):
        CureExponential().cdf(1.0)


def test_cdf_is_defective_and_methods_match_the_score_function():
    model = CureExponential().fit(*simulate(10_000, 0.3, 1 / 100, seed=3))
    t = np.array([-1.0, 0.0, 50.0, np.inf])
    expected = model.p_ * (1 - np.exp(-model.lambda_ * np.maximum(t, 0)))
    np.testing.assert_allclose(model.cdf(t), expected)
    assert model.cdf(np.inf) == pytest.approx(model.p_)
    ages = np.array([0.0, 10.0, 1e9])
    np.testing.assert_array_equal(
        model.reuse_probability(ages, 30.0), reuse_probability(model.p_, model.lambda_, ages, 30.0)
    )


# --- naive fit and diagnostics --------------------------------------------------------------


def test_naive_fit_follows_the_published_profiler():
    gaps = np.array([2.0, 3.0, 7.0])
    time, censored = np.append(gaps, 100.0), np.array([False, False, False, True])
    p, lam = naive_fit(time, censored)
    assert p == 3 / 4
    # scipy's expon.fit also fits a location: scale = mean - min.
    assert lam == pytest.approx(1 / (gaps.mean() - gaps.min()))
    assert naive_fit([4.0, 4.0], [False, False]) == (1.0, pytest.approx(1 / 4.0))  # scale 0: 1 / mean
    assert naive_fit([4.0], [True]) == (0.0, 0.0)
    assert naive_fit([], []) == (1.0, 0.0)


def test_diagnostics_are_json_ready_and_match_scipy():
    time, censored = simulate(3_000, 0.5, 1 / 200, seed=4)
    lam = 1 / 180
    report = diagnose(time, censored, 0.5, lam)
    gaps = time[~censored]
    assert report["ks"] == pytest.approx(stats.kstest(gaps, "expon", args=(0, 1 / lam)).statistic)
    assert (report["n_accesses"], report["n_reuses"], report["n_censored"]) == (3_000, gaps.size, censored.sum())
    assert report["mean_gap_s"] == pytest.approx(gaps.mean())
    assert report["median_gap_s"] == pytest.approx(np.median(gaps))
    assert json.loads(json.dumps(report, allow_nan=False)) == report
    none_reused = diagnose([5.0], [True], 0.0, 0.0)
    assert none_reused["ks"] is None and none_reused["median_gap_s"] is None


# --- per-class fits with shrinkage ----------------------------------------------------------


def _classes():
    """A big class 0, a small class 1 (50 accesses), a big never-reused class 2, an empty class 3."""
    big = simulate(20_000, 0.5, 1 / 300, seed=5)
    small = simulate(50, 0.9, 1 / 30, seed=6)
    never = (np.random.default_rng(7).uniform(0, WINDOW_S, 1_000), np.ones(1_000, dtype=bool))
    time = np.concatenate([big[0], small[0], never[0]])
    censored = np.concatenate([big[1], small[1], never[1]])
    workload = np.repeat([0, 1, 2], [20_000, 50, 1_000])
    return time, censored, workload, ("text_1", "text_2", "file_1", "image_1")


def test_big_classes_keep_their_own_fit_and_empty_ones_take_the_pooled_fit():
    time, censored, workload, names = _classes()
    per_class, pooled = fit_classes(time, censored, workload, names, min_samples=200)
    own = CureExponential().fit(time[workload == 0], censored[workload == 0])
    assert per_class["text_1"].source == "fit"
    assert (per_class["text_1"].p, per_class["text_1"].lam) == (own.p_, own.lambda_)
    everything = CureExponential().fit(time, censored)
    assert pooled.source == "pooled" and (pooled.p, pooled.lam) == (everything.p_, everything.lambda_)
    empty = per_class["image_1"]
    assert (empty.source, empty.p, empty.lam) == ("pooled", pooled.p, pooled.lam)
    assert empty.diagnostics["n_accesses"] == 0 and empty.naive == {"p": 1.0, "lambda": 0.0}
    assert per_class["text_1"].naive == dict(zip(("p", "lambda"), naive_fit(time[workload == 0], censored[workload == 0])))


def test_small_classes_shrink_toward_the_pooled_fit():
    time, censored, workload, names = _classes()
    per_class, pooled = fit_classes(time, censored, workload, names, min_samples=200)
    small = per_class["text_2"]
    own = CureExponential().fit(time[workload == 1], censored[workload == 1])
    assert small.source == "shrunk"
    assert min(own.p_, pooled.p) < small.p < max(own.p_, pooled.p)
    assert min(own.lambda_, pooled.lam) < small.lam < max(own.lambda_, pooled.lam)
    assert small.p == pytest.approx((50 * own.p_ + 200 * pooled.p) / 250)
    # Many accesses but no reuse: p stays near its own 0, the rate (unidentified) is the pooled one.
    never = per_class["file_1"]
    assert never.source == "shrunk" and never.lam == pooled.lam
    assert never.p == pytest.approx(200 * pooled.p / 1_200)
    # A larger min_samples gives the prior more weight.
    heavier, _ = fit_classes(time, censored, workload, names, min_samples=2_000)
    assert abs(heavier["text_2"].p - pooled.p) < abs(small.p - pooled.p)


def test_session_prior_centres_the_shrinkage_of_turn_classes():
    time, censored, workload, names = _classes()
    sessions = {"text": {"p_next_turn": [0.7, 0.95]}}
    per_class, pooled = fit_classes(time, censored, workload, names, min_samples=200, sessions=sessions)
    own = CureExponential().fit(time[workload == 1], censored[workload == 1])
    assert per_class["text_2"].p == pytest.approx((50 * own.p_ + 200 * 0.95) / 250)
    # No session data for "file": the pooled p stays the prior.
    assert per_class["file_1"].p == pytest.approx(200 * pooled.p / 1_200)


def test_fit_classes_rejects_no_data_and_bad_codes():
    with pytest.raises(ValueError, match="zero samples"):
        fit_classes([], [], [], ("text_1",))
    with pytest.raises(ValueError, match="index names"):
        fit_classes([1.0], [False], [3], ("text_1",))


# --- scores ---------------------------------------------------------------------------------

probability = st.floats(0.0, 1.0)
rate = st.one_of(st.just(0.0), st.floats(1e-9, 1e3))
age = st.one_of(st.floats(0.0, 1e12), st.just(np.inf))
horizon = st.one_of(st.floats(1e-6, 1e6), st.just(np.inf))


@settings(max_examples=300, deadline=None)
@given(probability, rate, age, age, horizon)
def test_scores_are_probabilities_that_never_rise_with_age(p, lam, age_a, age_b, h):
    young, old = sorted([age_a, age_b])
    for score in (reuse_probability, published_score):
        values = score(p, lam, np.array([young, old]), h)
        assert np.all(np.isfinite(values)) and np.all((0.0 <= values) & (values <= 1.0))
        assert values[1] <= values[0]
    # Conditioning on still being idle can only raise the chance of being in the reused fraction.
    # (Equal at age 0, up to rounding.)
    # (scipy's expit flushes results below the normal range, ~1e-308, to 0.)
    assert reuse_probability(p, lam, old, h) >= published_score(p, lam, old, h) * (1 - 1e-12) - 1e-300


@given(rate, age, horizon)
def test_certain_reuse_is_memoryless(lam, a, h):
    expected = -np.expm1(-lam * h) if lam > 0 else 0.0
    assert reuse_probability(1.0, lam, a, h) == pytest.approx(expected)


def test_scores_match_the_formulas_and_broadcast():
    p, lam = np.array([[0.2], [0.7]]), np.array([0.01, 0.1, 1.0])
    a, h = 30.0, 5.0
    decayed = p * np.exp(-lam * a)
    window = 1 - np.exp(-lam * h)
    np.testing.assert_allclose(published_score(p, lam, a, h), decayed * window)
    np.testing.assert_allclose(reuse_probability(p, lam, a, h), decayed * window / (decayed + 1 - p))
    assert reuse_probability(p, lam, a, h).shape == (2, 3)
    assert reuse_probability(0.5, 0.0, 10.0, 5.0) == 0.0  # never decays, never comes within H


# --- sessions -------------------------------------------------------------------------------


@pytest.fixture
def session_trace():
    """Four text sessions (one began before the trace) and one single-turn file request.

    text: 10 -> 11 -> 12; 20 -> 21; 30; (40, outside) -> 41 -> 42. file: 50.
    """
    rows = [  # (timestamp, chat_id, parent_chat_id, type_code, turn), in arrival order
        (0.0, 10, -1, 0, 1),
        (1.0, 50, -1, 1, 1),
        (5.0, 20, -1, 0, 1),
        (8.0, 30, -1, 0, 1),
        (15.0, 21, 20, 0, 2),
        (20.0, 41, 40, 0, 2),
        (30.0, 11, 10, 0, 2),
        (60.0, 42, 41, 0, 3),
        (100.0, 12, 11, 0, 3),
    ]
    timestamp, chat, parent, type_code, turn = (np.array(col) for col in zip(*rows))
    n = len(rows)
    return Trace(
        timestamp=timestamp.astype(np.float64),
        input_length=np.full(n, 16, dtype=np.int64),
        output_length=np.full(n, 10, dtype=np.int64),
        chat_id=chat.astype(np.int64),
        parent_chat_id=parent.astype(np.int64),
        type_code=type_code.astype(np.int32),
        type_names=("text", "file"),
        turn=turn.astype(np.int32),
        hash_offsets=np.arange(n + 1, dtype=np.int64),
        hash_ids=np.arange(n, dtype=np.int64),
        block_size=16,
        format="bailian",
        window=(0.0, 120.0),
    )


def test_session_stats_on_a_hand_built_trace(session_trace):
    result = session_stats(session_trace)
    text = result["text"]
    # Sessions: 10, 20, 30 and 41 (its first turn precedes the trace).
    assert (text["n_requests"], text["n_sessions"]) == (8, 4)
    # Turn 1: 10 and 20 of 10, 20, 30 continue; turn 2: 11 and 41 of 11, 21, 41; turn 3: none.
    assert text["p_next_turn"] == pytest.approx([2 / 3, 2 / 3, 0.0])
    assert text["survival"] == pytest.approx([1.0, 2 / 3, 4 / 9])
    # Think times 11-10: 30, 12-11: 70, 21-20: 10, 42-41: 40.
    think = text["think_time_s"]
    assert think["mean"] == pytest.approx((30 + 70 + 10 + 40) / 4)
    assert think["median"] == pytest.approx((30 + 40) / 2)
    assert think["p90"] == pytest.approx(40 + 0.7 * (70 - 40))  # linear interpolation at rank 2.7 of 0..3
    assert result["file"] == {
        "n_requests": 1, "n_sessions": 1, "survival": [1.0], "p_next_turn": [0.0], "think_time_s": None,
    }
    json.dumps(result, allow_nan=False)


def test_turn_continuation_prior_reads_session_stats(session_trace):
    result = session_stats(session_trace)
    assert turn_continuation_prior(result, "text", 2) == pytest.approx(2 / 3)
    assert turn_continuation_prior(result, "text", 4) is None
    assert turn_continuation_prior(result, "image", 1) is None


def test_naive_fit_equal_gaps_rounding_never_gives_a_negative_rate():
    # expon.fit on equal gaps returns a scale a rounding error away from 0, negative for some values.
    for gap in (0.1, 1 / 3, 7.7, 123.456, 1e5 / 7):
        p, lam = naive_fit(np.full(31, gap), np.zeros(31, dtype=bool))
        assert p == 1.0 and lam == pytest.approx(1 / gap)
