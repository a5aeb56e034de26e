"""kvprof's workload-aware policy: evict the block least likely to be reused within the horizon."""

from __future__ import annotations

import math

from kvprof.policy.classed import ClassedLRUPolicy


class WorkloadAwarePolicy(ClassedLRUPolicy):
    """Per-class LRU lists scored by the probability of a reuse within the next ``horizon`` seconds.

    A block of class ``c`` last accessed ``a`` seconds ago scores

        p_c e^(-lam_c a) (1 - e^(-lam_c H)) / (p_c e^(-lam_c a) + 1 - p_c)

    (:func:`kvprof.models.score.reuse_probability`): the cure-fraction model's chance that it is
    reused within ``H``, given that it has not been reused for ``a`` seconds. The lowest-scoring
    class head goes first; ties go to the deeper block (a chain's tail before its head), then to
    the older last access, then to the lower class index.

    Unlike the published policy (``wa-paper``) every access counts: allocation, each hit and the
    free stamp the last access, so a block computed and never hit ages from its last use instead
    of scoring 0, and a block takes the class of the request that touched it last.

    A block whose last access was a prefix hit is scored with its class's reused row
    (``reused_row[c]``, the hp file's ``<class>@reused`` entry): blocks that requests already
    share (system prompts, documents asked about again) come back far sooner than fresh ones,
    and one set of parameters for both made the policy evict shared prefixes before stale tails.

    Parameters
    ----------
    p, lam, horizon
        As :class:`~kvprof.policy.classed.ClassedLRUPolicy`.
    reused_row : array_like of int, shape (classes,), optional
        Row used for a block of class ``c`` after a hit; default: ``c`` itself.
    """

    name = "wa"
    stamps_allocation = True
    stamps_free = True
    class_follows_hits = True

    @classmethod
    def from_hp(cls, hp, horizon: float | None = None) -> WorkloadAwarePolicy:
        """Build from a :class:`kvprof.models.hp.HpFile`: its classes, default class and horizon.

        ``horizon`` (seconds) overrides the file's, e.g. for a sweep over H.
        """
        _, p, lam = hp.table()
        return cls(p, lam, hp.horizon if horizon is None else horizon, reused_row=hp.reused_rows())

    def __init__(self, p, lam, horizon: float, reused_row=None) -> None:
        super().__init__(p, lam, horizon)
        rows = range(self.n_classes) if reused_row is None else [int(r) for r in reused_row]
        if len(rows) != self.n_classes or not all(0 <= r < self.n_classes for r in rows):
            raise ValueError(f"reused_row must give a row in [0, {self.n_classes}) for each of the {self.n_classes} classes")
        self._hit_class = list(rows)

    def score(self, workload: int, age: float) -> float:
        p = self._p[workload]
        decayed = p * math.exp(-self._lam[workload] * age)
        if decayed == 0.0:
            # p = 0, or e^(-lam a) underflowed: the limit is the span when p = 1 (the block is
            # sure to be reused, and the exponential is memoryless), else 0.
            return self._span[workload] if p == 1.0 else 0.0
        return self._span[workload] * decayed / (decayed + (1.0 - p))  # 1 - p first: exact at p = 1

    def _key(self, cls: int, block: int, stamp: float, now: float) -> tuple:
        age = now - stamp
        return (self.score(cls, age if age > 0.0 else 0.0), -self._depth.item(block), stamp, cls)
