"""The candidate eviction orders of the ``wa`` policy, each a sort key over its list heads.

``wa`` keeps evictable blocks in one LRU list per *row*: a request cell (the hp file's workload
cell) times a reuse tier (how often the block was hit, :data:`TIER_EDGES`). Every order below
picks its victim among the heads of those lists, so any of them can run on the same lists and
``wa`` can switch between them at once:

* :class:`RecencyOrder` -- plain LRU: the head freed longest ago (vLLM's order);
* :class:`SegmentedOrder` -- segmented LRU: blocks never hit go first, LRU within each segment;
* :class:`FrequencyOrder` -- LRU within tiers, a block of tier ``t`` ageing ``e^(beta t)`` times
  slower; with ``adaptive`` beta moves on ghost hits as ARC moves its target (a block evicted
  unhit and wanted again lowers it, one evicted after hits raises it);
* :class:`ModelOrder` -- the fitted reuse model: P(reused within H | row, idle age).

A key is non-decreasing in the block's stamp within a row (an older block never sorts after a
younger one of its row), which is what lets the lists be scored at their heads only.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from kvprof.cells import TIER_EDGES
from kvprof.models.score import mixture_reuse_probability

N_TIERS = len(TIER_EDGES)
_TIER_OF_HITS = [max(t for t, edge in enumerate(TIER_EDGES) if edge <= h) for h in range(TIER_EDGES[-1] + 1)]


def tier_of(hits: int) -> int:
    """Reuse tier of a block hit ``hits`` times."""
    return _TIER_OF_HITS[hits] if hits < len(_TIER_OF_HITS) else N_TIERS - 1


class Order(ABC):
    """A sort key over list heads; the lowest key is evicted first.

    ``key(row, stamp, depth, now)`` returns a tuple whose first element is equal for blocks of
    one row and one stamp (blocks freed together), whose later elements break ties toward the
    deeper block (a chain's tail first, as vLLM frees it) and then the older stamp, and which
    ends with the row, so no two list heads tie.
    """

    name: str

    @abstractmethod
    def key(self, row: int, stamp: float, depth: int, now: float) -> tuple:
        """Sort key of a block of ``row``, last accessed at ``stamp``, at ``depth`` in its chain."""

    def ghost_hit(self, tier: int, ghosts_by_tier: list[int]) -> None:
        """Content evicted from ``tier`` is wanted again; ``ghosts_by_tier`` counts the remembered contents."""


class RecencyOrder(Order):
    """LRU: the head freed longest ago goes first, the deeper block among blocks freed together."""

    name = "lru"

    def key(self, row: int, stamp: float, depth: int, now: float) -> tuple:
        return (stamp, -depth, row)


class SegmentedOrder(Order):
    """Segmented LRU (Karedla et al., IEEE Computer 1994) without a size limit on the protected
    segment: a block never hit (tier 0) goes before any block hit at least once, the one freed
    longest ago first within each segment; then the deeper block.

    On agent traffic, whose sessions come back within seconds and re-read their whole context,
    this keeps every prefix that was ever shared and spends the cache's churn on one-off tails.

    Parameters
    ----------
    n_tiers : int
        Tiers per request cell (rows are ``cell * n_tiers + tier``).
    """

    name = "segmented"

    def __init__(self, n_tiers: int = N_TIERS) -> None:
        self.n_tiers = n_tiers

    def key(self, row: int, stamp: float, depth: int, now: float) -> tuple:
        return (1.0 if row % self.n_tiers else 0.0, stamp, -depth, row)


class FrequencyOrder(Order):
    """LRU within reuse tiers: a block of tier ``t`` idle for ``a`` s competes as one idle ``a e^(-beta t)``.

    With ``adaptive``, ``beta`` moves as ARC moves its target size (Megiddo & Modha, FAST '03):
    a ghost hit on content evicted from tier 0 (never hit) says recency was undervalued and
    lowers ``beta`` by ``step * max(1, ghosts above tier 0 / ghosts of tier 0)``; one on content
    evicted from a higher tier raises it by the mirror amount. ``beta`` stays in ``[0, beta_max]``;
    ``beta = 0`` is LRU.

    Parameters
    ----------
    n_tiers : int
        Tiers per request cell (rows are ``cell * n_tiers + tier``).
    beta : float
        Initial log-ratio of ageing speeds between adjacent tiers, >= 0.
    adaptive : bool
    step : float
        Change of ``beta`` per ghost hit (scaled as above).
    beta_max : float
    """

    def __init__(self, n_tiers: int = N_TIERS, beta: float = 1.0, adaptive: bool = True, step: float = 0.01,
                 beta_max: float = 8.0) -> None:
        if not 0 <= beta <= beta_max:
            raise ValueError(f"beta must lie in [0, {beta_max}], got {beta}")
        self.n_tiers = n_tiers
        self.beta = beta
        self.adaptive = adaptive
        self.step = step
        self.beta_max = beta_max
        self.name = "frequency-adaptive" if adaptive else f"frequency-{beta:g}"

    def key(self, row: int, stamp: float, depth: int, now: float) -> tuple:
        age = now - stamp
        # 1 ms floor: blocks freed just now still order by tier.
        return (self.beta * (row % self.n_tiers) - math.log(age + 1e-3 if age > 0.0 else 1e-3), -depth, stamp, row)

    def ghost_hit(self, tier: int, ghosts_by_tier: list[int]) -> None:
        if not self.adaptive:
            return
        fresh, reused = ghosts_by_tier[0], sum(ghosts_by_tier[1:])
        if tier == 0:
            self.beta = max(0.0, self.beta - self.step * max(1.0, reused / max(fresh, 1)))
        else:
            self.beta = min(self.beta_max, self.beta + self.step * max(1.0, fresh / max(reused, 1)))


class ModelOrder(Order):
    """The fitted model: a block of ``row`` idle for ``a`` s scores P(reused within H | row, a).

    The score (:func:`~kvprof.models.score.mixture_reuse_probability`) is non-increasing in the
    age, so the head of each list is its lowest; ties go to the deeper block, then the older
    access.

    Parameters
    ----------
    p : array_like, shape (rows,)
        Probability that a block of the row is ever reused.
    weights, rates : array_like, shape (rows, k)
        Mixture components of each row (weight 0 pads rows with fewer components).
    horizon : float
        H, seconds, > 0.
    """

    name = "model"

    def __init__(self, p, weights, rates, horizon: float) -> None:
        p, weights, rates = (np.asarray(v, dtype=np.float64) for v in (p, weights, rates))
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0 seconds, got {horizon}")
        self.p, self.weights, self.rates, self.horizon = p, weights, rates, float(horizon)
        # Per row, plain floats: (p, [(weight, rate, 1 - e^(-rate H)), ...]) for the scalar path.
        within = -np.expm1(-rates * horizon)
        self._rows = [
            (float(p[r]), [(float(w), float(l), float(s)) for w, l, s in zip(weights[r], rates[r], within[r]) if w > 0])
            for r in range(p.shape[0])
        ]

    def score(self, row: int, age: float) -> float:
        """P(reused within H | row, idle ``age`` s); the scalar twin of ``mixture_reuse_probability``."""
        p, components = self._rows[row]
        if p <= 0.0 or not components:
            return 0.0
        slowest = min(rate for _, rate, _ in components)
        surviving = within = 0.0
        for weight, rate, span in components:
            share = weight * math.exp(-(rate - slowest) * age) if rate > slowest else weight  # no 0 * inf
            surviving += share
            within += share * span
        if p >= 1.0:
            return within / surviving
        exponent = (slowest * age if slowest > 0.0 else 0.0) - math.log(p) + math.log1p(-p)
        return within / (math.exp(exponent) + surviving) if exponent < 700.0 else 0.0

    def key(self, row: int, stamp: float, depth: int, now: float) -> tuple:
        age = now - stamp
        return (self.score(row, age if age > 0.0 else 0.0), -depth, stamp, row)

    def scores(self, rows, ages) -> np.ndarray:
        """Vectorised scores (tests compare the scalar path with it)."""
        rows = np.asarray(rows)
        return mixture_reuse_probability(self.p[rows], self.weights[rows], self.rates[rows], ages, self.horizon)
