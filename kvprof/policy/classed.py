"""Per-class LRU lists scored at their heads: the engine shared by ``wa`` and ``wa-paper``."""

from __future__ import annotations

import heapq
import math
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator

import numpy as np

from kvprof.models.score import published_score
from kvprof.policy.base import EvictionPolicy


class ClassedLRUPolicy(EvictionPolicy):
    """Evictable blocks in one LRU list per workload class; the lowest-scoring head goes first.

    Invariant: an evictable block sits in exactly one class list, the one its class named when it
    was freed (``_where`` records which), and each list keeps free order, front first. Victims
    only ever come off a list's front, so within a class the eviction order is free order and
    only the heads need a score: one evict costs O(classes), never O(blocks).

    Subclasses say how a block is scored and stamped and which class it keeps; that is all that
    separates ``wa`` from ``wa-paper``:

    * ``_key(cls, block, now)``: a tuple, lowest evicted first, ending with ``cls`` so that two
      heads never compare equal (this is what makes ``evict_n`` and ``order`` agree with
      repeated ``evict``).
    * ``stamps_allocation``: allocation stamps the last access with ``now``; otherwise with
      ``-inf`` ("never hit"). Hits always stamp ``now``.
    * ``stamps_free``: ``free`` stamps the last access with ``now``.
    * ``class_follows_hits``: a hit moves the block to the hitting request's class; otherwise
      the class of the request that allocated the block stays.

    Parameters
    ----------
    p : array_like, shape (classes,)
        Per-class probability that a block is ever reused, in [0, 1].
    lam : array_like, shape (classes,)
        Per-class reuse rate lambda, 1/s, >= 0.
    horizon : float
        Seconds ahead over which a reuse counts (H), > 0, may be ``inf``.

    The last class is the default one (``HpFile.table()`` puts it last): a block whose class
    index is outside the table, or that was never accessed, belongs to it.
    """

    stamps_allocation: bool
    stamps_free: bool
    class_follows_hits: bool

    def __init__(self, p, lam, horizon: float) -> None:
        p = np.asarray(p, dtype=float)
        lam = np.asarray(lam, dtype=float)
        if p.ndim != 1 or p.shape != lam.shape or p.size == 0:
            raise ValueError(f"p and lam must be equal-length 1-d arrays, got shapes {p.shape} and {lam.shape}")
        if not (np.all((p >= 0) & (p <= 1)) and np.all((lam >= 0) & np.isfinite(lam))):
            raise ValueError("each p must lie in [0, 1] and each lam be finite and >= 0")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0 seconds, got {horizon}")
        self.p = p
        self.lam = lam
        self.horizon = float(horizon)
        # Plain float lists: the per-head scalar path indexes them, numpy scalars would be slower.
        self._p = p.tolist()
        self._lam = lam.tolist()
        # 1 - e^(-lam H), the chance that a reuse still to come lands within H (lam = 0 and an
        # infinite H handled as models.score handles them).
        self._span = published_score(1.0, lam, 0.0, horizon).tolist()
        self._default = p.size - 1
        self._queues: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(p.size)]
        self._where: dict[int, int] = {}  # evictable block -> index of the list holding it
        self._class: dict[int, int] = {}
        self._stamp: dict[int, float] = {}
        self._depth: dict[int, int] = {}

    @property
    def n_classes(self) -> int:
        """Number of classes, the default one included."""
        return len(self._queues)

    @abstractmethod
    def score(self, workload: int, age: float) -> float:
        """Score of a block of class ``workload`` last accessed ``age`` seconds ago (lower goes first).

        Non-increasing in ``age``: that is what lets a class list be scored at its head only.
        """

    @abstractmethod
    def _key(self, cls: int, block: int, now: float) -> tuple:
        """Sort key of ``block`` at the head of class list ``cls``; ends with ``cls``."""

    def access(
        self,
        block: int,
        now: float,
        workload: int = 0,
        depth: int = 0,
        *,
        hit: bool = False,
        next_use: float = math.inf,
        content: Hashable | None = None,
    ) -> None:
        if not 0 <= workload < len(self._queues):
            workload = self._default
        self._stamp[block] = now if hit or self.stamps_allocation else -math.inf
        if not hit or self.class_follows_hits:
            self._class[block] = workload
        self._depth[block] = depth

    def free(self, blocks: Iterable[int], now: float) -> None:
        queues, where, class_of, stamp = self._queues, self._where, self._class, self._stamp
        default, stamps_free = self._default, self.stamps_free
        for block in blocks:  # hot loop: dict lookups and stores only, no new objects
            cls = class_of.get(block, default)
            queues[cls][block] = None
            where[block] = cls
            if stamps_free:
                stamp[block] = now

    def remove(self, block: int) -> None:
        del self._queues[self._where.pop(block)][block]

    def evict(self, now: float) -> int:
        best_key = None
        for cls, queue in enumerate(self._queues):  # O(classes): only heads are scored
            if queue:
                key = self._key(cls, next(iter(queue)), now)
                if best_key is None or key < best_key:
                    best_key = key
        if best_key is None:
            raise IndexError("no evictable block")
        block = self._queues[best_key[-1]].popitem(last=False)[0]
        del self._where[block]
        return block

    def evict_n(self, n: int, now: float) -> list[int]:
        if n > len(self._where):
            raise IndexError(f"{n} victims asked for, {len(self._where)} evictable")
        victims = []
        for block in self._merged(now):
            if len(victims) == n:
                break
            victims.append(block)
        # Deleting after the merge: the merge iterates the lists, which must not change under it.
        queues, where = self._queues, self._where
        for block in victims:
            del queues[where.pop(block)][block]
        return victims

    def order(self, now: float) -> list[int]:
        return list(self._merged(now))

    def _merged(self, now: float) -> Iterator[int]:
        """Blocks in eviction order: a k-way merge of the class lists on their head keys.

        A heap holds one entry per non-empty list; each step yields the lowest head and scores
        the next block of its list, so ``n`` victims cost O(n log classes). Once one list is
        left it is yielded as is, unscored: with one class this is plain LRU order.
        """
        heap = []
        for cls, queue in enumerate(self._queues):
            if queue:
                blocks = iter(queue)
                head = next(blocks)
                heap.append((self._key(cls, head, now), head, blocks))
        heapq.heapify(heap)
        while len(heap) > 1:
            key, head, blocks = heap[0]
            yield head
            head = next(blocks, None)
            if head is None:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (self._key(key[-1], head, now), head, blocks))
        if heap:
            _, head, blocks = heap[0]
            yield head
            yield from blocks

    def clear(self) -> None:
        for queue in self._queues:
            queue.clear()
        self._where.clear()
        self._class.clear()
        self._stamp.clear()
        self._depth.clear()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, block: int) -> bool:
        return block in self._where
