"""The ``learned`` candidate's predictor: P(Belady keeps a block until its next use | features at its free).

A logistic regression over one-hot binned features is, once fitted, one weight per feature bin:
the log-odds of a freed block is ``bias + cell[c] + tier[t] + depth[d] + tail[s] + turn[n] +
gap[g] + fanout[f]``, a lookup and seven additions, cheap enough for the live pool's free path and
trivially compiled. The features are what the pool knows when a request frees its blocks, nothing
from the future, kept per block (no history of contents that left the pool):

* ``c`` -- the cell of the request that touched the block last (the hp file's cells, default last);
* ``t`` -- the reuse tier of its hits since it was allocated (:data:`~kvprof.cells.TIER_EDGES`);
* ``d`` -- its depth in the chain, log2-binned (:func:`log_bin`);
* ``s`` -- its distance from the deepest block of the same free call (the freed chain's tail), log2-binned;
* ``n`` -- the freed chain's turn: how many times it has been extended (its previous tail is a block of
  the call that an earlier free left as its tail or the tail's parent: a prompt's last block is
  usually partial, so the next turn continues past the parent), log2-binned; 1 for a chain first seen;
* ``g`` -- the gap since the free that left that previous tail (the chain's last turn), in seconds,
  :func:`gap_bin`; 0 for a chain first seen;
* ``f`` -- the block's fan-out: how many times a free found a different block continuing past it (a
  shared prefix branches), log2-binned.

The fitted policy puts a freed block in bucket ``k`` = how many of ``edges`` its probability
reaches and evicts, among the buckets' oldest blocks, the one freed longest ago counting a
block of bucket ``k`` as freed ``k * credit_s`` later (:class:`kvprof.policy.learned.LearnedPolicy`):
a block predicted friendly that stays unused longer than the friendly ones were (the credit is a
high quantile of their reuse gaps under Belady) was mispredicted and ages out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: Bins of the depth and tail-distance features: 0, 1, 2-3, 4-7, ... and the last one for the rest.
N_LOG_BINS = 12


#: A gap's bins are quarter-seconds, log2-binned: bin 1 below 0.25 s, then one per doubling up to 2^9 s.
GAP_UNITS_PER_S = 4.0
#: The weight tables one bin per :data:`N_LOG_BINS` (the cell and tier tables are sized by the hp file).
LOG_BINNED = ("depth", "tail", "turn", "gap", "fanout")
#: The features of a free, in the order of a feature row and of :meth:`LearnedModel.tables`.
FEATURES = ("cell", "tier") + LOG_BINNED


def log_bin(value: int) -> int:
    """Bin of a non-negative integer: its bit length, capped at ``N_LOG_BINS - 1``."""
    return min(int(value).bit_length(), N_LOG_BINS - 1)


def gap_bin(seconds: float) -> int:
    """Bin of a chain's gap since its last turn: 0 for none (negative: a chain first seen), else
    1 + the log bin of whole quarter-seconds, capped at ``N_LOG_BINS - 1``."""
    if seconds < 0.0:
        return 0
    return min(1 + log_bin(int(min(seconds, 1e9) * GAP_UNITS_PER_S)), N_LOG_BINS - 1)


@dataclass(frozen=True)
class LearnedModel:
    """One weight per feature bin (see the module docstring) and the bucket edges.

    Attributes
    ----------
    bias : float
    cell, tier, depth, tail, turn, gap, fanout : tuple of float
        Log-odds weight per cell, reuse tier, depth bin, tail-distance bin, chain-turn bin, gap bin and
        fan-out bin (the last three all zero by default: a model fitted without them).
    edges : tuple of float
        Increasing probabilities in (0, 1): a block goes to the bucket of the edges it reaches.
    credit_s : float
        Seconds of idle time each bucket above the lowest is credited, >= 0 and finite.
    quality : dict
        How the model was fitted and how well it predicted held-out frees (free-form numbers).
    """

    bias: float
    cell: tuple[float, ...]
    tier: tuple[float, ...]
    depth: tuple[float, ...]
    tail: tuple[float, ...]
    turn: tuple[float, ...] = (0.0,) * N_LOG_BINS
    gap: tuple[float, ...] = (0.0,) * N_LOG_BINS
    fanout: tuple[float, ...] = (0.0,) * N_LOG_BINS
    edges: tuple[float, ...] = (0.5,)
    credit_s: float = 1e9
    quality: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        weights = (self.bias, *self.cell, *self.tier, *(w for name in LOG_BINNED for w in getattr(self, name)))
        if not all(math.isfinite(w) for w in weights):
            raise ValueError("learned weights must be finite")
        if any(len(getattr(self, name)) != N_LOG_BINS for name in LOG_BINNED) or not self.cell or not self.tier:
            raise ValueError(f"learned model needs cell and tier weights and {N_LOG_BINS} bins of each of "
                             f"{', '.join(LOG_BINNED)}")
        if not self.edges or any(not 0.0 < e < 1.0 for e in self.edges) or list(self.edges) != sorted(set(self.edges)):
            raise ValueError("learned bucket edges must be distinct increasing probabilities in (0, 1)")
        if not 0.0 <= self.credit_s <= 1e9:
            raise ValueError(f"learned credit must be from 0 to 1e9 s, got {self.credit_s}")

    @property
    def n_buckets(self) -> int:
        return len(self.edges) + 1

    def log_odds_edges(self) -> np.ndarray:
        """The edges as log-odds, so a bucket is found without an exponential."""
        edges = np.asarray(self.edges, dtype=np.float64)
        return np.log(edges) - np.log1p(-edges)

    def tables(self) -> tuple[tuple[float, ...], ...]:
        """The weight tables in :data:`FEATURES` order."""
        return tuple(getattr(self, name) for name in FEATURES)

    def log_odds(self, rows: np.ndarray) -> np.ndarray:
        """Vectorised log-odds of feature-bin rows ((n, 7), columns in :data:`FEATURES` order)."""
        rows = np.asarray(rows, dtype=np.int64)
        return self.bias + sum(np.asarray(table)[rows[:, j]] for j, table in enumerate(self.tables()))

    def to_dict(self) -> dict:
        out = {"bias": self.bias, **{name: list(table) for name, table in zip(FEATURES, self.tables())},
               "edges": list(self.edges), "credit_s": self.credit_s}
        if self.quality:
            out["quality"] = dict(self.quality)
        return out
