"""The cure-fraction ("defective") exponential reuse model and its fits.

Per workload class, an access is reused with probability ``p``, after a gap ~ Exp(``lam``), and
never reused otherwise. Reuse is observed only until the trace window ends, so an access that saw
no reuse by then is right-censored at its exposure ``c`` (window end - access time), not a
never-reused access. :class:`CureExponential` fits ``(p, lam)`` by maximum likelihood with that
censoring; :func:`naive_fit` reproduces the published profiler, which drops censored accesses,
so the two can be shown side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import expit, logit

from kvprof.models.data import GAP_RESOLUTION_S, ReuseData, validate_samples
from kvprof.models.hp import ClassParams
from kvprof.models.score import reuse_probability as _reuse_probability
from kvprof.models.sessions import class_continuation_prior

# Newton iterates live in (logit p, log lam); clipping keeps p and lam strictly inside (0, 1) and
# (0, inf) while an interior optimum is approached.
_MAX_ABS_LOGIT = 36.0
_LOG_RATE_BOUNDS = (np.log(1e-12), np.log(1.0 / GAP_RESOLUTION_S))


def _dot(weight: np.ndarray, values: np.ndarray) -> float:
    """``weight @ values`` in numpy's own loop: a threaded BLAS dot is many times slower on busy cores."""
    return float(np.einsum("i,i->", weight, values))


def _clip_point(logit_p: float, log_rate: float) -> np.ndarray:
    return np.array([np.clip(logit_p, -_MAX_ABS_LOGIT, _MAX_ABS_LOGIT), np.clip(log_rate, *_LOG_RATE_BOUNDS)])


@dataclass(frozen=True)
class _Evaluation:
    """Log-likelihood, gradient, Hessian and EM update at one point ``(logit p, log lam)``."""

    point: np.ndarray
    loglik: float
    gradient: np.ndarray
    hessian: np.ndarray
    em_point: np.ndarray


class _CensoredLikelihood:
    """Weighted cure-exponential log-likelihood, reduced to what the optimiser needs.

    With ``x = logit p``, ``theta = log lam`` and, per censored access of exposure ``c``, the
    survival ``D = 1 - p + p e^(-lam c)`` and the posterior probability that the access is in the
    reused fraction ``r = p e^(-lam c) / D``::

        L         = n_u (log p + theta) - lam G + sum_c w log D
        dL/dx     = n_u + sum_c w r - p N
        dL/dtheta = n_u - lam (G + sum_c w r c)

    where ``n_u`` and ``G`` are the weighted count and sum of reuse gaps and ``N`` the total
    weight; the Hessian follows from ``dr/dx = r (1 - r)`` and ``dr/dtheta = -lam c r (1 - r)``.
    The EM update is the closed form ``p = (n_u + sum w r) / N``, ``lam = n_u / (G + sum w r c)``.
    """

    def __init__(self, gap_weight_sum: float, gap_sum: float, exposure: np.ndarray, exposure_weight: np.ndarray):
        self.n_reused = gap_weight_sum
        self.gap_sum = gap_sum
        self.exposure = exposure
        # Weights times powers of c, computed once: every moment below is then one dot product.
        self.weight = exposure_weight
        self.weight_c = exposure_weight * exposure
        self.weight_cc = self.weight_c * exposure
        self.total_weight = gap_weight_sum + float(exposure_weight.sum())

    def evaluate(self, point: np.ndarray) -> _Evaluation:
        x, theta = point
        lam = np.exp(theta)
        p, one_minus_p = expit(x), expit(-x)  # both exact, even for p within 1e-16 of 1
        reused_by_now = p * np.exp(-lam * self.exposure)
        survival = reused_by_now + one_minus_p
        r = reused_by_now / survival
        v = r * (1.0 - r)
        s_r, s_rc = _dot(self.weight, r), _dot(self.weight_c, r)
        s_v, s_vc, s_vcc = _dot(self.weight, v), _dot(self.weight_c, v), _dot(self.weight_cc, v)
        loglik = self.n_reused * (np.log(p) + theta) - lam * self.gap_sum + _dot(self.weight, np.log(survival))
        exposure_sum = self.gap_sum + s_rc
        gradient = np.array([self.n_reused + s_r - p * self.total_weight, self.n_reused - lam * exposure_sum])
        cross = -lam * s_vc
        hessian = np.array(
            [[s_v - p * one_minus_p * self.total_weight, cross], [cross, -lam * exposure_sum + lam * lam * s_vcc]]
        )
        em_p = (self.n_reused + s_r) / self.total_weight
        em_point = _clip_point(logit(em_p), np.log(self.n_reused / exposure_sum))
        return _Evaluation(np.asarray(point), float(loglik), gradient, hessian, em_point)


class CureExponential:
    """Defective exponential reuse model fitted by censored maximum likelihood.

    An access is reused with probability ``p``, after a gap ~ Exp(``lam``). Reused accesses
    contribute the density ``p lam e^(-lam g)``; accesses not reused by the end of the window
    contribute the survival ``1 - p + p e^(-lam c)`` at their exposure ``c``.

    The fit is a safeguarded Newton method on ``(logit p, log lam)`` with the analytic gradient and
    Hessian; a Newton step that is not an ascent direction or does not raise the likelihood is
    replaced by the closed-form EM step, which never lowers it. Each iteration is a handful of
    vectorised passes over the censored accesses only (reused ones enter through two sums). EM
    alone would be simpler but crawls when the window is short compared with ``1/lam`` (most of
    the information is then missing); Newton converges in a few iterations there too.

    Degenerate data (documented fallbacks, always finite):

    * no samples, or all weights zero: ``fit`` raises ``ValueError``;
    * no reuse observed: ``p_ = 0`` and ``lambda_ = 0`` (the rate is unidentifiable; with
      ``p = 0`` it changes no score);
    * the maximum is at ``p = 1`` (e.g. nothing censored, or every exposure 0): ``p_ = 1`` and
      ``lambda_`` is the censored-exponential rate ``n_reuses / (sum of gaps + sum of exposures)``,
      i.e. ``1 / mean gap`` when nothing is censored;
    * gaps are floored at :data:`GAP_RESOLUTION_S`, so all-zero gaps give a finite rate.

    Parameters
    ----------
    max_iter : int
        Maximum number of Newton/EM iterations.
    tol : float
        Stop when the Newton decrement (the predicted remaining log-likelihood gain) is below
        ``tol * max(1, |loglik|)``.

    Attributes
    ----------
    p_ : float
        Probability that an access is ever reused, in [0, 1].
    lambda_ : float
        Reuse rate, 1/s, >= 0.
    n_samples_, n_reuses_, n_censored_ : int
        Accesses fitted, of which reused and right-censored.
    loglik_ : float
        Weighted log-likelihood at the fit.
    converged_ : bool
        Whether the stopping rule was met within ``max_iter``.
    n_iter_ : int
        Iterations run (0 for the closed-form cases).
    """

    def __init__(self, max_iter: int = 200, tol: float = 1e-9):
        self.max_iter = max_iter
        self.tol = tol

    def fit(self, time, censored, sample_weight=None) -> CureExponential:
        """Fit ``p_`` and ``lambda_``.

        Parameters
        ----------
        time : array_like of float, shape (m,), s
            Reuse gap for reused accesses, exposure (window end - access time) for censored ones.
        censored : array_like of bool, shape (m,)
            True where no reuse was seen before the window ended.
        sample_weight : array_like of float, shape (m,), optional
            Non-negative weights (default 1).

        Returns
        -------
        self
        """
        return self.fit_data(ReuseData.of(time, censored, sample_weight))

    def fit_data(self, data: ReuseData) -> CureExponential:
        """:meth:`fit` on samples already reduced (:class:`~kvprof.models.data.ReuseData`)."""
        if data.n_samples == 0 or data.total_weight == 0:
            raise ValueError("cannot fit a reuse model to zero samples (no block accesses, or all weights zero)")
        self.n_samples_, self.n_reuses_, self.n_censored_ = data.n_samples, data.n_reuses, data.n_censored
        n_reused, gap_sum = data.reused_weight, data.gap_sum
        if n_reused == 0:
            self.p_, self.lambda_, self.loglik_ = 0.0, 0.0, 0.0
            self.converged_, self.n_iter_ = True, 0
            return self
        exposure, exposure_weight = data.exposure, data.exposure_weight

        # Profile-likelihood slope in p at p = 1 (lam at its p = 1 optimum): if it is not negative
        # the maximum sits on the boundary and the censored-exponential rate is the answer.
        boundary_rate = n_reused / (gap_sum + _dot(exposure_weight, exposure))
        with np.errstate(over="ignore"):
            slope_at_one = n_reused - _dot(exposure_weight, np.expm1(boundary_rate * exposure))
        if slope_at_one >= 0:
            self.p_, self.lambda_ = 1.0, boundary_rate
            self.loglik_ = float(n_reused * np.log(boundary_rate) - n_reused)
            self.converged_, self.n_iter_ = True, 0
            return self

        likelihood = _CensoredLikelihood(n_reused, gap_sum, exposure, exposure_weight)
        # Start from the naive estimates: p too low, lam too high, but in the right region.
        current = likelihood.evaluate(_clip_point(logit(n_reused / likelihood.total_weight), np.log(n_reused / gap_sum)))
        self.converged_, self.n_iter_ = False, 0
        while self.n_iter_ < self.max_iter:
            self.n_iter_ += 1
            step = self._newton_step(current)
            if step is not None:
                decrement = float(current.gradient @ step)
                if decrement / 2 <= self.tol * max(1.0, abs(current.loglik)):
                    self.converged_ = True
                    break
                proposal = likelihood.evaluate(_clip_point(*(current.point + step)))
                if proposal.loglik >= current.loglik:
                    current = proposal
                    continue
            current = likelihood.evaluate(current.em_point)
        self.p_ = float(expit(current.point[0]))
        self.lambda_ = float(np.exp(current.point[1]))
        self.loglik_ = current.loglik
        return self

    @staticmethod
    def _newton_step(evaluation: _Evaluation) -> np.ndarray | None:
        """The Newton step, or None where the Hessian is not negative definite (not an ascent step)."""
        hessian = evaluation.hessian
        if not (hessian[0, 0] < 0 and np.linalg.det(hessian) > 0):
            return None
        return np.linalg.solve(hessian, -evaluation.gradient)

    def _check_fitted(self):
        if not hasattr(self, "p_"):
            raise RuntimeError("this CureExponential is not fitted yet; call fit(time, censored) first")

    def reuse_probability(self, age, horizon) -> np.ndarray:
        """P(reused within ``horizon`` s | idle for ``age`` s); see :func:`kvprof.models.score.reuse_probability`."""
        self._check_fitted()
        return _reuse_probability(self.p_, self.lambda_, age, horizon)

    def cdf(self, t) -> np.ndarray:
        """P(reused within ``t`` s of the access) ``= p (1 - e^(-lam t))``; tends to ``p``, not 1.

        Parameters
        ----------
        t : array_like of float, s

        Returns
        -------
        ndarray of float64, same shape as ``t``; 0 for ``t <= 0``
        """
        self._check_fitted()
        t = np.maximum(np.asarray(t, dtype=np.float64), 0.0)
        with np.errstate(invalid="ignore"):
            exponent = np.where(self.lambda_ == 0, 0.0, self.lambda_ * t)
        return -self.p_ * np.expm1(-exponent)


def naive_fit(time, censored) -> tuple[float, float]:
    """The published profiler's estimates (vLLM PR #22236), biases kept.

    ``lam`` is ``1 / scale`` of ``scipy.stats.expon.fit`` on the reuse gaps (a location is fitted
    too, so the scale is mean - min); ``1 / mean`` if the scale is 0 or below the gap resolution (all gaps equal); 0 if nothing
    was reused. ``p`` is reuses / accesses, 1 with no data. Censored accesses count as never
    reused, which biases ``p`` down, and long gaps are cut off by the window, which biases ``lam``
    up. Unlike the PR, an all-zero gap list gives a finite rate (gaps floored at
    :data:`GAP_RESOLUTION_S`) instead of a ZeroDivisionError.

    Parameters
    ----------
    time : array_like of float, shape (m,), s
    censored : array_like of bool, shape (m,)

    Returns
    -------
    p : float
    lam : float, 1/s
    """
    return naive_of(ReuseData.of(time, censored))


def naive_of(data: ReuseData) -> tuple[float, float]:
    """:func:`naive_fit` of samples already reduced."""
    p = data.n_reuses / data.n_samples if data.n_samples else 1.0
    if data.n_reuses == 0:
        return p, 0.0
    # scipy.stats.expon.fit's maximum-likelihood estimates: location the smallest gap, scale the mean less it.
    scale = data.gaps.mean - data.gaps.smallest
    # Equal gaps give a scale of 0, or a rounding error either side of it (seen: -2e-14).
    if scale <= GAP_RESOLUTION_S:
        scale = max(data.gaps.mean, GAP_RESOLUTION_S)
    return float(p), float(1.0 / scale)


def diagnose(time, censored, p, lam) -> dict:
    """Goodness-of-fit summary of one class, JSON-ready (ints, floats, None; never NaN).

    Parameters
    ----------
    time : array_like of float, shape (m,), s
    censored : array_like of bool, shape (m,)
    p : float
        Reuse probability of the model; accepted so a fitted ``(p, lam)`` pair is passed as is, but
        the statistics below depend on ``lam`` only (censored accesses carry no gap to test).
    lam : float, 1/s
        Rate the reuse gaps are tested against.

    Returns
    -------
    dict
        ``n_accesses``, ``n_reuses``, ``n_censored`` (int); ``ks``: Kolmogorov-Smirnov statistic
        of the reuse gaps against Exp(``lam``), the reuse-time distribution given reuse (1.0 when
        ``lam = 0``: all its mass is at infinity); ``mean_gap_s``, ``median_gap_s`` of the reuse
        gaps. The last three are None when nothing was reused.
    """
    return diagnose_of(ReuseData.of(time, censored), lam)


def diagnose_of(data: ReuseData, lam: float) -> dict:
    """:func:`diagnose` of samples already reduced."""
    return data.diagnose((lambda t: -np.expm1(-lam * t)) if lam > 0 else None)


def _class_params(data: ReuseData, p: float, lam: float, source: str) -> ClassParams:
    """ClassParams for one class's data, with the naive estimates and diagnostics beside the chosen fit."""
    naive_p, naive_lam = naive_of(data)
    return ClassParams(p=p, lam=lam, source=source, naive={"p": naive_p, "lambda": naive_lam},
                       diagnostics=diagnose_of(data, lam))


def fit_classes(
    time,
    censored,
    workload,
    names,
    min_samples: int = 200,
    *,
    min_reuses: int = 5,
    sessions: dict | None = None,
) -> tuple[dict[str, ClassParams], ClassParams]:
    """Censored fit per workload class, small classes shrunk toward the pooled fit.

    A class with at least ``min_samples`` accesses and ``min_reuses`` reuses keeps its own fit
    (``source="fit"``). A smaller one is shrunk (``source="shrunk"``) by treating the pooled fit
    as a conjugate prior worth ``min_samples`` accesses and ``min_reuses`` reuses and taking the
    posterior means::

        p   = (n p_class + min_samples p_prior) / (n + min_samples)          # Beta prior
        lam = (r + min_reuses) / (r / lam_class + min_reuses / lam_pooled)  # Gamma prior

        (n accesses and r reuses of the class; r / lam_class is its effective exposure)

    These are the exact posterior means when nothing is censored, and they move smoothly from
    the pooled values (no data) to the class's own (much data), so one noisy reuse gap cannot
    set a class's rate. ``p_prior`` is the pooled ``p``, or, when ``sessions`` is given and the
    class is a ``<type>_<turn>`` class with session data, P(another turn after that turn): a
    conversation's blocks are reused mainly when it continues. A class with no accesses takes
    the pooled fit as is (``source="pooled"``).

    Parameters
    ----------
    time : array_like of float, shape (m,), s
        Reuse gap, or exposure for censored accesses.
    censored : array_like of bool, shape (m,)
    workload : array_like of int, shape (m,)
        Class code of each access, an index into ``names``.
    names : sequence of str
        Class names by code.
    min_samples : int
        Accesses below which a class is shrunk; also the prior's weight in accesses.
    min_reuses : int
        Reuses below which a class is shrunk; also the prior's weight in reuses.
    sessions : dict, optional
        :func:`kvprof.models.sessions.session_stats` output, to centre the ``p`` prior of turn classes.

    Returns
    -------
    per_class : dict of str to ClassParams
        One entry per name, each with naive estimates and diagnostics.
    pooled : ClassParams
        The fit on all accesses (``source="pooled"``), the natural default class.

    Raises
    ------
    ValueError
        With no accesses at all (nothing to pool), or a workload code outside ``names``.
    """
    time, censored, _ = validate_samples(time, censored)
    workload = np.asarray(workload)
    if workload.shape != time.shape:
        raise ValueError(f"workload must have shape {time.shape}, got {workload.shape}")
    if time.size and (workload.min() < 0 or workload.max() >= len(names)):
        raise ValueError(f"workload codes must index names (0..{len(names) - 1})")
    # One sort, then contiguous slices: the classes together cost one pass over the data.
    order = np.argsort(workload, kind="stable")
    bounds = np.searchsorted(workload[order], np.arange(len(names) + 1))
    rows = [order[bounds[code]:bounds[code + 1]] for code in range(len(names))]
    per_class = {name: ReuseData.of(time[r], censored[r]) for name, r in zip(names, rows)}
    return fit_classes_of(per_class, ReuseData.of(time, censored), min_samples, min_reuses=min_reuses,
                          sessions=sessions)


def fit_classes_of(per_class: dict[str, ReuseData], everything: ReuseData, min_samples: int = 200, *,
                   min_reuses: int = 5, sessions: dict | None = None) -> tuple[dict[str, ClassParams], ClassParams]:
    """:func:`fit_classes` of each class's samples already reduced, and of all of them (``everything``)."""
    pooled_model = CureExponential().fit_data(everything)
    pooled = _class_params(everything, pooled_model.p_, pooled_model.lambda_, "pooled")
    out = {}
    for name, data in per_class.items():
        if data.n_samples == 0:
            out[name] = _class_params(data, pooled.p, pooled.lam, "pooled")
            continue
        model = CureExponential().fit_data(data)
        n, r = model.n_samples_, model.n_reuses_
        if n >= min_samples and r >= min_reuses:
            out[name] = _class_params(data, model.p_, model.lambda_, "fit")
            continue
        prior_p = class_continuation_prior(sessions, name) if sessions else None
        prior_p = pooled.p if prior_p is None else prior_p
        p = (n * model.p_ + min_samples * prior_p) / (n + min_samples)
        # r > 0 implies pooled.lam > 0 (the pooled data contain these reuses).
        lam = pooled.lam if r == 0 else (r + min_reuses) / (r / model.lambda_ + min_reuses / pooled.lam)
        out[name] = _class_params(data, p, lam, "shrunk")
    return out, pooled
