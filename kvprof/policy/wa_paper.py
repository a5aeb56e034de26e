"""The workload-aware policy as published (vLLM PR #22236), defects included, for replication."""

from __future__ import annotations

import math

import numpy as np

from kvprof.models.hp import PUBLISHED_DEFAULT_LAMBDA, PUBLISHED_DEFAULT_P, PUBLISHED_HORIZON_S
from kvprof.policy.classed import ClassedLRUPolicy


class PublishedWorkloadAwarePolicy(ClassedLRUPolicy):
    """Per-class LRU lists scored ``p_c e^(-lam_c a) (1 - e^(-lam_c H))`` with ``H`` = 5 s.

    This reproduces what the PR's code does, not what the paper describes
    (:func:`kvprof.models.score.published_score`; REFERENCE.md section 1). Its defects, each kept
    on purpose:

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
    """

    name = "wa-paper"
    stamps_allocation = False
    stamps_free = False
    class_follows_hits = False
    uniform_runs = True

    def __init__(self, p, lam, horizon: float = PUBLISHED_HORIZON_S) -> None:
        super().__init__(p, lam, horizon)

    @classmethod
    def from_hp(cls, hp) -> PublishedWorkloadAwarePolicy:
        """Build from a :class:`kvprof.models.hp.HpFile`: its classes, the 5 s window, and the
        PR's unknown-class parameters in place of the file's default class."""
        _, p, lam = hp.table()
        return cls(np.append(p[:-1], PUBLISHED_DEFAULT_P), np.append(lam[:-1], PUBLISHED_DEFAULT_LAMBDA))

    def score(self, workload: int, age: float) -> float:
        scale = self._p[workload] * self._span[workload]
        # lam = 0 makes the span 0; returning early also avoids 0 * inf = nan for stale stamps.
        return scale * math.exp(-self._lam[workload] * age) if scale else 0.0

    def _key(self, cls: int, block: int, stamp: float, now: float) -> tuple:
        age = now - stamp
        return (self.score(cls, age if age > 0.0 else 0.0), cls)
