"""The cure-fraction mixture of exponentials: a reuse model whose hazard decreases with idle time.

Real reuse gaps come back fast or not at all: most reuses follow within seconds, and a block idle
for long rarely returns. One exponential cannot say that (its hazard is constant, so with a reuse
probability near 1 it ignores how long a block has been idle). A mixture of ``k`` exponentials
can: each component is one time scale (a burst on a shared prompt, an agent's tool call, a
person's reply), and a block still idle at age ``a`` is ever more likely to belong to the slow
components or to never come back. Its hazard decreases in ``a``, which keeps
P(reused within H | idle for a) non-increasing in ``a`` (:func:`kvprof.models.score.mixture_reuse_probability`)
so a policy need score only the head of each LRU list.

:class:`CureMixture` fits ``p`` (the chance of any reuse), the component weights and rates by
maximum likelihood with right-censoring (EM), choosing ``k`` by BIC; ``k = 1`` is the cure
exponential of :class:`kvprof.models.exponential.CureExponential`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from kvprof.models.data import GAP_RESOLUTION_S, ReuseData, gap_bins
from kvprof.models.score import mixture_reuse_probability

# Rates stay within what a microsecond clock and a year of data can identify.
_RATE_BOUNDS = (1e-9, 1.0 / GAP_RESOLUTION_S)
_P_BOUNDS = (1e-12, 1.0)


def _merged(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The used bins of :func:`~kvprof.models.data.gap_bins` as values (each bin's weighted mean) and weights."""
    used = bins[0] > 0
    return bins[1][used] / bins[0][used], bins[0][used]


class CureMixture:
    """Cure fraction plus a mixture of exponentials, fitted by censored maximum likelihood.

    An access is reused with probability ``p``; its gap is then drawn from component ``j``
    (probability ``weights_[j]``), ``Exp(rates_[j])``. A reused access contributes
    ``p sum_j w_j l_j e^(-l_j g)``; one not reused by the window's end contributes the survival
    ``1 - p + p sum_j w_j e^(-l_j c)`` at its exposure ``c``.

    EM (each step raises the likelihood): the E-step splits every reused access among the
    components and every censored one among the components and the never-reused class; the
    M-step is closed-form (``l_j`` = events of ``j`` / exposure of ``j``). The data are first
    compressed into geometric bins (values within a factor :data:`kvprof.models.data.BIN_RATIO` ~ 1.09
    merged at their weighted mean), so a fit costs the same for a thousand accesses or ten million.
    ``k`` runs from 1 to ``max_components`` and the one with the lowest BIC
    (``-2 loglik + 2k log n``) is kept.

    Degenerate data: no samples raises ``ValueError``; no reuse gives ``p_ = 0`` (one
    component, rate 0: it never matters); nothing censored gives ``p_ = 1``.

    Parameters
    ----------
    max_components : int
        Largest ``k`` tried, >= 1.
    max_iter : int
        EM iterations per ``k``.
    tol : float
        Stop when an iteration raises the log-likelihood by less than ``tol * max(1, |loglik|)``.

    Attributes
    ----------
    p_ : float
        Probability that an access is ever reused.
    weights_ : ndarray, shape (k,)
        Component weights, summing to 1, fastest component first.
    rates_ : ndarray, shape (k,)
        Component rates, 1/s, decreasing.
    n_components_ : int
    loglik_ : float
        Log-likelihood of the (compressed) data at the fit.
    bic_ : float
    n_samples_, n_reuses_, n_censored_ : int
    """

    def __init__(self, max_components: int = 3, max_iter: int = 500, tol: float = 1e-9):
        self.max_components = max_components
        self.max_iter = max_iter
        self.tol = tol

    def fit(self, time, censored, sample_weight=None) -> CureMixture:
        """Fit ``p_``, ``weights_`` and ``rates_``.

        Parameters
        ----------
        time : array_like of float, shape (m,), s
            Reuse gap of reused accesses, exposure (window end - access) of censored ones.
        censored : array_like of bool, shape (m,)
        sample_weight : array_like of float, shape (m,), optional

        Returns
        -------
        self
        """
        return self.fit_data(ReuseData.of(time, censored, sample_weight))

    def fit_data(self, data: ReuseData) -> CureMixture:
        """:meth:`fit` on samples already reduced (:class:`~kvprof.models.data.ReuseData`)."""
        if self.max_components < 1:
            raise ValueError(f"max_components must be >= 1, got {self.max_components}")
        if data.n_samples == 0 or data.total_weight == 0:
            raise ValueError("cannot fit a reuse model to zero samples (no block accesses, or all weights zero)")
        self.n_samples_, self.n_reuses_, self.n_censored_ = data.n_samples, data.n_reuses, data.n_censored
        gaps, gap_weight = _merged(data.gap_bins)
        exposures, exposure_weight = _merged(gap_bins(data.exposure, data.exposure_weight))
        if gap_weight.sum() == 0:
            self._set(0.0, np.ones(1), np.zeros(1), 0.0, 0.0)
            return self
        best = None
        for k in range(1, self.max_components + 1):
            p, weights, rates, loglik = self._em(gaps, gap_weight, exposures, exposure_weight, k)
            bic = -2.0 * loglik + 2 * k * math.log(max(self.n_samples_, 2))
            if best is None or bic < best[-1]:
                best = (p, weights, rates, loglik, bic)
        self._set(*best)
        return self

    def _set(self, p, weights, rates, loglik, bic) -> None:
        self.p_, self.weights_, self.rates_ = float(p), np.asarray(weights, float), np.asarray(rates, float)
        self.n_components_ = int(self.weights_.size)
        self.loglik_, self.bic_ = float(loglik), float(bic)

    def _em(self, gaps, gap_weight, exposures, exposure_weight, k):
        """EM for ``k`` components from gap quantiles; returns ``(p, weights, rates, loglik)``."""
        n_reused = gap_weight.sum()
        total = n_reused + exposure_weight.sum()
        order = np.argsort(gaps)
        cumulative = np.cumsum(gap_weight[order]) / n_reused
        quantiles = gaps[order][np.minimum(np.searchsorted(cumulative, (np.arange(k) + 0.5) / k), gaps.size - 1)]
        rates = np.clip(math.log(2.0) / np.maximum(quantiles, GAP_RESOLUTION_S), *_RATE_BOUNDS)
        weights = np.full(k, 1.0 / k)
        p = float(np.clip(n_reused / total, *_P_BOUNDS))
        p, weights, rates, loglik = _em_iterations(gaps, gap_weight, exposures, exposure_weight, p, weights, rates,
                                                   self.max_iter, self.tol, _P_BOUNDS, _RATE_BOUNDS)
        order = np.argsort(-rates)
        return p, weights[order], rates[order], loglik

    def _check_fitted(self) -> None:
        if not hasattr(self, "p_"):
            raise RuntimeError("this CureMixture is not fitted yet; call fit(time, censored) first")

    def survival(self, t) -> np.ndarray:
        """P(not reused within ``t`` s of the access) ``= 1 - p + p sum_j w_j e^(-l_j t)``."""
        self._check_fitted()
        t = np.maximum(np.asarray(t, dtype=np.float64), 0.0)
        return 1.0 - self.p_ + self.p_ * (np.exp(-np.multiply.outer(t, self.rates_)) @ self.weights_)

    def cdf(self, t) -> np.ndarray:
        """P(reused within ``t`` s of the access); tends to ``p``, not 1."""
        return 1.0 - self.survival(t)

    def reuse_probability(self, age, horizon) -> np.ndarray:
        """P(reused within ``horizon`` s | idle for ``age`` s); see :func:`~kvprof.models.score.mixture_reuse_probability`."""
        self._check_fitted()
        return mixture_reuse_probability(self.p_, self.weights_, self.rates_, age, horizon)


@njit(cache=True)
def _em_iterations(gaps, gap_weight, exposures, exposure_weight, p, weights, rates, max_iter, tol, p_bounds,
                   rate_bounds):
    """EM from ``(p, weights, rates)`` until the log-likelihood gains less than ``tol`` (relative),
    ``p`` and the rates kept within their ``(low, high)`` bounds (arguments, not globals: numba's
    cache would not see a change to them in another module); returns ``(p, weights, rates, loglik)``.
    Compiled: the binned data are small (<= 2 x 240 values) and the loop runs hundreds of times
    per row, so numpy's per-call cost was all of it.

    E-step: each reuse gap's responsibilities over the components; each censored exposure's over
    the components and, last, the never-reused class. M-step: ``p`` from the reused share, the
    weights from each component's events and censored share, the rates from its events over its
    time at risk.
    """
    k = rates.size
    n_reused = gap_weight.sum()
    total = n_reused + exposure_weight.sum()
    share = np.empty(k)
    events = np.empty(k)
    censored_in = np.empty(k)
    time_in = np.empty(k)
    previous = -np.inf
    loglik = -np.inf
    for _ in range(max_iter):
        log_p = math.log(p)
        log_never = math.log1p(-p) if p < 1.0 else -np.inf
        log_weights = np.log(weights)
        log_rates = np.log(rates)
        events[:] = 0.0
        censored_in[:] = 0.0
        time_in[:] = 0.0
        loglik = 0.0
        for i in range(gaps.size):
            top = -np.inf
            for j in range(k):
                share[j] = log_weights[j] + log_rates[j] - gaps[i] * rates[j]
                top = max(top, share[j])
            mass = 0.0
            for j in range(k):
                share[j] = math.exp(share[j] - top)
                mass += share[j]
            loglik += gap_weight[i] * (log_p + top + math.log(mass))
            for j in range(k):
                responsibility = gap_weight[i] * share[j] / mass
                events[j] += responsibility
                time_in[j] += responsibility * gaps[i]
        for i in range(exposures.size):
            top = log_never
            for j in range(k):
                share[j] = log_p + log_weights[j] - exposures[i] * rates[j]
                top = max(top, share[j])
            mass = math.exp(log_never - top)
            for j in range(k):
                share[j] = math.exp(share[j] - top)
                mass += share[j]
            loglik += exposure_weight[i] * (top + math.log(mass))
            for j in range(k):
                responsibility = exposure_weight[i] * share[j] / mass
                censored_in[j] += responsibility
                time_in[j] += responsibility * exposures[i]
        p = min(max((n_reused + censored_in.sum()) / total, p_bounds[0]), p_bounds[1])
        weights = np.maximum(events + censored_in, 1e-300)
        weights /= weights.sum()
        rates = np.minimum(np.maximum(events / np.maximum(time_in, 1e-300), rate_bounds[0]), rate_bounds[1])
        if loglik - previous < tol * max(1.0, abs(loglik)):
            break
        previous = loglik
    return p, weights, rates, loglik


def diagnose_mixture(time, censored, model: CureMixture) -> dict:
    """Goodness-of-fit summary of one row, JSON-ready: counts, the KS statistic of the reuse gaps
    against the mixture's gap distribution given reuse, mean and median gap (None without reuse)."""
    return diagnose_mixture_of(ReuseData.of(time, censored), model)


def diagnose_mixture_of(data: ReuseData, model: CureMixture) -> dict:
    """:func:`diagnose_mixture` of samples already reduced."""
    weights, rates = model.weights_, model.rates_
    cdf = (lambda t: -np.expm1(-np.multiply.outer(t, rates)) @ weights) if rates.max() > 0 else None
    summary = data.diagnose(cdf)
    return {**{k: summary[k] for k in ("n_accesses", "n_reuses", "n_censored")}, "components": model.n_components_,
            **{k: summary[k] for k in ("ks", "mean_gap_s", "median_gap_s")}}
