"""Eviction scores of an idle block from its class's cure-exponential reuse model.

A class ``w`` has reuse probability ``p`` and reuse rate ``lam``: a block accessed by the class is
reused with probability ``p``, after a gap ~ Exp(``lam``). Both functions below score a block that
has been idle for ``age`` seconds by its chance of reuse within the next ``horizon`` seconds; the
lowest score is evicted first.

Both are pure, vectorised and broadcast over all four arguments, so a policy can score the heads of
all its class queues in one call. They are finite for every ``p`` in [0, 1], ``lam >= 0``,
``age >= 0`` (including ``inf``) and ``horizon > 0`` (including ``inf``), and non-increasing in
``age`` within a class, which is what lets a policy score only the head of each class's LRU list.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

_LARGEST = np.finfo(np.float64).max


def _decay_exponent(lam: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``lam * t``, with ``0 * inf`` taken as 0 (a class that never decays stays put)."""
    return lam * np.where(lam == 0, 0.0, t)


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
    return reuse_probability_from(log_odds(p), lam, age, _within_horizon(lam, horizon))


def log_odds(p) -> np.ndarray:
    """``log(p / (1 - p))``, ``-inf`` at 0 and ``inf`` at 1."""
    with np.errstate(divide="ignore"):
        return np.log(p) - np.log1p(-p)


def reuse_probability_from(log_odds_p, lam, age, span) -> np.ndarray:
    """:func:`reuse_probability` from its per-class parts, ``log_odds(p)`` and the span
    ``1 - e^(-lam H)``, so that a policy scoring many blocks computes them once per class."""
    # Capping the decay at the largest float keeps p = 1 at infinite age from inf - inf = NaN:
    # the limit there is certainty of reuse, and for p < 1 the capped value still gives 0.
    return expit(log_odds_p - np.minimum(_decay_exponent(lam, age), _LARGEST)) * span
