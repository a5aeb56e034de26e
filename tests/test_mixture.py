"""The cure-fraction mixture of exponentials: fits, degenerate data, and the score's monotonicity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvprof.models.exponential import CureExponential
from kvprof.models.mixture import CureMixture
from kvprof.models.score import mixture_reuse_probability, reuse_probability
from kvprof.policy.orders import ModelOrder


def planted(n, p, weights, means, window, seed=0):
    """Accesses at uniform times in a window, reused with probability p after a mixture gap."""
    rng = np.random.default_rng(seed)
    reused = rng.random(n) < p
    component = rng.choice(len(weights), size=n, p=weights)
    gap = rng.exponential(np.asarray(means)[component])
    exposure = rng.uniform(0, window, n)
    seen = reused & (gap < exposure)
    return np.where(seen, gap, exposure), ~seen


def test_fit_recovers_a_planted_two_scale_mixture_through_censoring():
    time, censored = planted(200_000, 0.7, [0.6, 0.4], [5.0, 300.0], 3600.0)
    model = CureMixture().fit(time, censored)
    assert model.n_components_ == 2
    assert model.p_ == pytest.approx(0.7, abs=0.01)
    np.testing.assert_allclose(model.weights_, [0.6, 0.4], atol=0.02)
    np.testing.assert_allclose(1 / model.rates_, [5.0, 300.0], rtol=0.05)


def test_one_scale_data_keep_one_component_and_agree_with_the_cure_exponential():
    time, censored = planted(100_000, 0.5, [1.0], [60.0], 1800.0, seed=1)
    mixture, single = CureMixture().fit(time, censored), CureExponential().fit(time, censored)
    assert mixture.n_components_ == 1
    assert mixture.p_ == pytest.approx(single.p_, rel=0.01)
    assert mixture.rates_[0] == pytest.approx(single.lambda_, rel=0.02)


def test_more_components_never_fit_worse_and_bic_pays_for_them():
    time, censored = planted(50_000, 0.8, [0.5, 0.5], [2.0, 200.0], 3600.0, seed=2)
    one = CureMixture(max_components=1).fit(time, censored)
    three = CureMixture(max_components=3).fit(time, censored)
    assert three.loglik_ >= one.loglik_
    assert three.bic_ <= one.bic_


def test_degenerate_data_give_documented_values():
    never = CureMixture().fit([10.0, 20.0], [True, True])
    assert never.p_ == 0.0 and never.reuse_probability(0.0, 60.0) == 0.0
    always = CureMixture().fit([1.0, 2.0, 3.0], [False, False, False])
    assert always.p_ == pytest.approx(1.0) and always.cdf(1e9) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="zero samples"):
        CureMixture().fit([], [])
    with pytest.raises(RuntimeError, match="not fitted"):
        CureMixture().survival(1.0)


def test_survival_cdf_and_score_agree():
    model = CureMixture().fit(*planted(20_000, 0.6, [0.5, 0.5], [3.0, 90.0], 1200.0, seed=3))
    ages, horizon = np.array([0.0, 5.0, 50.0, 500.0]), 30.0
    expected = 1 - model.survival(ages + horizon) / model.survival(ages)
    np.testing.assert_allclose(model.reuse_probability(ages, horizon), expected, rtol=1e-9)
    np.testing.assert_allclose(model.cdf(ages), 1 - model.survival(ages))


# --- the score --------------------------------------------------------------------------------

probability = st.floats(0.0, 1.0)
rate = st.one_of(st.just(0.0), st.floats(1e-9, 1e3))
age = st.one_of(st.floats(0.0, 1e12), st.just(np.inf))
horizon = st.one_of(st.floats(1e-6, 1e6), st.just(np.inf))
mixture = st.lists(st.tuples(st.floats(0.0, 1.0), rate), min_size=1, max_size=4).filter(
    lambda components: sum(w for w, _ in components) > 0)


def _rows(components):
    weights = np.array([w for w, _ in components])
    return weights / weights.sum(), np.array([r for _, r in components])


@settings(max_examples=400, deadline=None)
@given(probability, mixture, age, age, horizon)
def test_mixture_score_is_a_probability_that_never_rises_with_age(p, components, age_a, age_b, h):
    """Head-only scoring rests on this: within one row an older block never scores higher."""
    weights, rates = _rows(components)
    young, old = sorted([age_a, age_b])
    values = mixture_reuse_probability(p, weights, rates, np.array([young, old]), h)
    assert np.all(np.isfinite(values)) and np.all((values >= 0.0) & (values <= 1.0))
    # A few ulps of rounding; the exact function is non-increasing (log-convex survival).
    assert values[1] <= values[0] * (1 + 1e-12) + 1e-300


@settings(max_examples=300, deadline=None)
@given(probability, mixture, age, st.floats(1e-3, 1e5))
@example(p=1.0, components=[(1.0, 0.0)], a=math.inf, h=1.0)  # a zero rate at infinite age once gave NaN
def test_scalar_model_order_scores_equal_the_vectorised_function(p, components, a, h):
    weights, rates = _rows(components)
    order = ModelOrder([p], weights[None, :], rates[None, :], h)
    expected = float(mixture_reuse_probability(p, weights, rates, a, h))
    assert order.score(0, a) == pytest.approx(expected, rel=1e-9, abs=1e-300)


@given(probability, rate, age, horizon)
def test_one_component_is_the_cure_exponential_score(p, lam, a, h):
    expected = float(reuse_probability(p, lam, a, h))
    assert float(mixture_reuse_probability(p, [1.0], [lam], a, h)) == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_padding_components_change_nothing_and_rows_broadcast():
    p = np.array([0.3, 1.0])
    weights = np.array([[1.0, 0.0, 0.0], [0.2, 0.8, 0.0]])
    rates = np.array([[0.1, 0.0, 0.0], [1.0, 0.001, 0.0]])
    out = mixture_reuse_probability(p, weights, rates, np.array([5.0, 1e9]), 60.0)
    assert out[0] == pytest.approx(float(reuse_probability(0.3, 0.1, 5.0, 60.0)))
    assert out[1] == pytest.approx(-np.expm1(-0.001 * 60.0))  # only the slow component is left
