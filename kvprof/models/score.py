"""Eviction scores of an idle block from its class's or cell's reuse model.

A class ``w`` has reuse probability ``p`` and reuse rate ``lam``: a block accessed by the class is
reused with probability ``p``, after a gap ~ Exp(``lam``) (a cell's gap is a mixture of
exponentials instead, :func:`mixture_reuse_probability`). The functions below score a block that
has been idle for ``age`` seconds by its chance of reuse within the next ``horizon`` seconds (the
published policy's unconditional variant, :func:`published_score`, as published); the lowest
score is evicted first.

All are pure, vectorised and broadcast over all four arguments, so a policy can score the heads of
all its class queues in one call. They are finite for every ``p`` in [0, 1], ``lam >= 0``,
``age >= 0`` (including ``inf``) and ``horizon > 0`` (including ``inf``), and non-increasing in
``age`` within a class, which is what lets a policy score only the head of each class's LRU list.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit


def _decay_exponent(lam: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``lam * t``, with ``0 * inf`` taken as 0 (a class that never decays stays put)."""
    with np.errstate(invalid="ignore"):
        return np.where(lam == 0, 0.0, lam * t)


def _within_horizon(lam: np.ndarray, horizon: np.ndarray) -> np.ndarray:
    """``1 - exp(-lam H)``: chance a reuse known to come happens within ``H`` (expm1 keeps small ``lam H`` exact)."""
    return -np.expm1(-_decay_exponent(lam, horizon))


def published_score(p, lam, age, horizon) -> np.ndarray:
    """The published workload-aware score ``p e^(-lam a) (1 - e^(-lam H))``.

    It is the unconditional chance that an access of the class is followed by a reuse falling in
    ``[a, a + H]``; it ignores that a block still idle at age ``a`` is less likely to be in the
    reused fraction at all (see :func:`reuse_probability`).

    Parameters
    ----------
    p : array_like of float, in [0, 1]
        Probability that an access of the class is ever reused.
    lam : array_like of float, >= 0, 1/s
        Rate of the exponential reuse gap.
    age : array_like of float, >= 0, s
        Time since the block's last access.
    horizon : array_like of float, > 0, s
        Look-ahead window ``H`` (the PR hard-codes 5 s).

    Returns
    -------
    ndarray of float64, broadcast shape of the inputs, in [0, 1]
    """
    p, lam, age, horizon = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (p, lam, age, horizon)))
    return p * np.exp(-_decay_exponent(lam, age)) * _within_horizon(lam, horizon)


def reuse_probability(p, lam, age, horizon) -> np.ndarray:
    """P(reused within ``horizon`` | class, idle for ``age``), the censoring-aware score.

    By Bayes, a block still idle at age ``a`` is in the reused fraction with probability
    ``q(a) = p e^(-lam a) / (p e^(-lam a) + 1 - p)``; memorylessness then gives the reuse within
    ``H`` with probability ``1 - e^(-lam H)``, so the score is
    ``p e^(-lam a) (1 - e^(-lam H)) / (p e^(-lam a) + 1 - p)``.

    ``q`` is computed as ``expit(logit p - lam a)``: no 0/0 when ``p = 1`` and the age is huge
    (then ``q = 1``: such a block is certain to come back), no overflow of ``e^(lam a)``, and each
    floating-point step is monotone in ``a``, so the score cannot tick up with age.

    Parameters
    ----------
    p : array_like of float, in [0, 1]
        Probability that an access of the class is ever reused.
    lam : array_like of float, >= 0, 1/s
        Rate of the exponential reuse gap.
    age : array_like of float, >= 0, s
        Time since the block's last access.
    horizon : array_like of float, > 0, s
        Look-ahead window ``H``.

    Returns
    -------
    ndarray of float64, broadcast shape of the inputs, in [0, 1]
    """
    p, lam, age, horizon = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (p, lam, age, horizon)))
    with np.errstate(divide="ignore", invalid="ignore"):
        log_odds = np.log(p) - np.log1p(-p) - _decay_exponent(lam, age)
    # p = 1 makes log_odds inf - inf = NaN at infinite age; the limit is certainty of reuse.
    still_reusable = np.where(p >= 1.0, 1.0, expit(log_odds))
    return still_reusable * _within_horizon(lam, horizon)


def mixture_reuse_probability(p, weights, rates, age, horizon) -> np.ndarray:
    """P(reused within ``horizon`` | idle for ``age``) under a cure fraction and a mixture of exponentials.

    With survival ``S(t) = 1 - p + p sum_j w_j e^(-l_j t)`` the score is ``1 - S(a + H) / S(a)``:

        p sum_j w_j e^(-l_j a) (1 - e^(-l_j H)) / (1 - p + p sum_j w_j e^(-l_j a))

    ``S`` is a positive combination of exponentials, so ``log S`` is convex and the score is
    non-increasing in ``a``: a block idle for longer is ever more likely to be a slow or a
    never-reused one. One component is :func:`reuse_probability`.

    Computed relative to the slowest component (``l_min``) as
    ``N / (e^(-(logit p - l_min a)) + D)`` with ``D = sum_j w_j e^(-(l_j - l_min) a)`` and ``N``
    the same sum weighted by ``1 - e^(-l_j H)``: no term overflows, ``p = 1`` needs no special
    case (the first term is 0) and infinite ages give the limit.

    Parameters
    ----------
    p : array_like of float, in [0, 1], shape (...)
    weights : array_like of float, shape (..., k)
        Component weights, each row summing to 1.
    rates : array_like of float, >= 0, 1/s, shape (..., k)
        Components of weight 0 are ignored (they pad rows with fewer components).
    age : array_like of float, >= 0, s, shape (...)
    horizon : array_like of float, > 0, s, shape (...)

    Returns
    -------
    ndarray of float64, the broadcast shape of ``p``, ``age``, ``horizon`` and the rows
    """
    weights = np.asarray(weights, dtype=np.float64)
    rates = np.asarray(rates, dtype=np.float64)
    p, age, horizon = (np.asarray(v, dtype=np.float64)[..., None] for v in (p, age, horizon))
    # Components of weight 0 pad rows with fewer components: they must not set the slowest rate.
    slowest = np.where(weights > 0, rates, np.inf).min(axis=-1, keepdims=True)
    slowest = np.where(np.isfinite(slowest), slowest, 0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        relative = np.exp(-_decay_exponent(rates - slowest, age))
        surviving = np.where(weights > 0, weights * relative, 0.0)
        within = (surviving * _within_horizon(rates, horizon)).sum(axis=-1)
        log_odds = np.log(p) - np.log1p(-p) - _decay_exponent(slowest, age)
        never = np.where(p >= 1.0, 0.0, np.exp(-log_odds))
        return np.nan_to_num(within / (never[..., 0] + surviving.sum(axis=-1)), nan=0.0)
