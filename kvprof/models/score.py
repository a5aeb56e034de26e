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
