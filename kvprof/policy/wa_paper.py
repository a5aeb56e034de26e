"""The workload-aware policy as published (vLLM PR #22236), defects included, for replication."""

from __future__ import annotations

import math

import numpy as np

from kvprof.models.hp import PUBLISHED_DEFAULT_LAMBDA, PUBLISHED_DEFAULT_P, PUBLISHED_HORIZON_S
from kvprof.models.score import published_score
from kvprof.policy.classed import ClassedLRUPolicy


class PublishedWorkloadAwarePolicy(ClassedLRUPolicy):
    """Per-class LRU lists scored ``p_c e^(-lam_c a) (1 - e^(-lam_c H))`` with ``H`` = 5 s.

    This reproduces what the PR's code does, not what the paper describes
    (:func:`kvprof.models.score.published_score`), including its profiler: :meth:`from_hp` takes
    the published profiler's naive estimates (``p`` = reuses / accesses, ``lam`` = 1 / the scale
    of an exponential fitted to the observed gaps, censoring ignored) that the hp file keeps
    beside kvprof's own fit. Its defects, each kept on purpose:

    * The last access is stamped only on a prefix hit. A block computed and never hit keeps a
      stale stamp (here ``-inf``, in the PR a zero timestamp against wall-clock time), so it
      scores exactly 0, and since most blocks are never hit, most decisions are ties.
    * Ties go to the first class list scanned (fixed class order, strict ``<``); the paper's
      "deeper block first" rule is not applied. Together with the stale stamps, eviction
      collapses to "first queue wins".
    * A block keeps the class of the request that allocated it, even after other classes hit it.
    * Unknown classes are scored with ``p = 1, lam = 0``, which scores 0 at every age: they are
      evicted first, whatever the hp file's default class says (:meth:`from_hp`).
    * The score is the unconditional ``p F``-window probability, not conditioned on the block
      having survived ``a`` seconds unreused, and only list heads are scored although stamps
      along a list are not in order (a never-hit block freed late sits behind hit ones).

    Parameters
    ----------
    p : array_like, shape (classes,)
        Per-class probability that a block is ever reused, in [0, 1]; the last class is the
        default one.
    lam : array_like, shape (classes,)
        Per-class reuse rate, 1/s, finite and >= 0.
    horizon : float
        Seconds ahead over which a reuse counts, > 0.
    """

    name = "wa-paper"
    stamps_allocation = False
    stamps_free = False
    class_follows_hits = False
    uniform_runs = True

    def __init__(self, p, lam, horizon: float = PUBLISHED_HORIZON_S) -> None:
        p = np.asarray(p, dtype=float)
        lam = np.asarray(lam, dtype=float)
        if p.ndim != 1 or p.shape != lam.shape or p.size == 0:
            raise ValueError(f"p and lam must be equal-length 1-d arrays, got shapes {p.shape} and {lam.shape}")
        if not (np.all((p >= 0) & (p <= 1)) and np.all((lam >= 0) & np.isfinite(lam))):
            raise ValueError("each p must lie in [0, 1] and each lam be finite and >= 0")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0 seconds, got {horizon}")
        super().__init__(p.size)
        self.p, self.lam, self.horizon = p, lam, float(horizon)
        # p (1 - e^(-lam H)) per class as plain floats: the scalar score indexes them.
        self._scale = published_score(p, lam, 0.0, horizon).tolist()
        self._lam = lam.tolist()

    @classmethod
    def from_hp(cls, hp) -> PublishedWorkloadAwarePolicy:
        """Build from a :class:`kvprof.models.hp.HpFile`: the naive estimates of its classes (its
        own parameters where a class has none, e.g. a published-format file), the 5 s window, and
        the PR's unknown-class parameters in place of the file's default class."""
        _, p, lam = hp.naive_table()
        return cls(np.append(p[:-1], PUBLISHED_DEFAULT_P), np.append(lam[:-1], PUBLISHED_DEFAULT_LAMBDA))

    def score(self, workload: int, age: float) -> float:
        """``p e^(-lam a) (1 - e^(-lam H))`` of class ``workload`` at ``age`` seconds."""
        scale = self._scale[workload]
        # lam = 0 makes the scale 0; returning early also avoids 0 * inf = nan for stale stamps.
        return scale * math.exp(-self._lam[workload] * age) if scale else 0.0

    def _key(self, cls: int, block: int, stamp: float, now: float) -> tuple:
        age = now - stamp
        return (self.score(cls, age if age > 0.0 else 0.0), cls)
