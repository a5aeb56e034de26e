"""Per-class LRU lists merged on a score: the engine shared by ``wa`` and ``wa-paper``."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Hashable, Iterable

import numpy as np

from kvprof.policy.base import EvictionPolicy
from kvprof.policy.fifos import ClassFifos

#: Up to this many blocks, free pushes them one at a time in Python; above, numpy's fixed cost per
#: call pays off.
ONE_BY_ONE_FREE = 24


def _as_list(victims: list | np.ndarray) -> list[int]:
    """The merge's victims as a list (it returns one victim as a list, many as an array)."""
    return victims if isinstance(victims, list) else victims.tolist()


class ClassedLRUPolicy(EvictionPolicy):
    """Evictable blocks in one LRU list per workload class; the lowest-keyed list head goes first.

    Invariant: an evictable block sits in exactly one class list, the one its class named when it
    was freed, and each list keeps free order. Victims only ever come off a list's front, so the
    eviction order is the greedy merge of the lists: repeatedly evict the head with the lowest
    key. :meth:`kvprof.policy.fifos.ClassFifos.merge` computes it for one victim or thousands
    alike, so ``evict_n(n)`` is always ``n`` calls of ``evict()`` (a property test holds it to a
    one-head-at-a-time reference).

    Subclasses say how a block is scored and stamped and which class it keeps; that is all that
    separates ``wa`` from ``wa-paper``:

    * ``_key(cls, block, stamp, now)``: a block's full sort key, ``(score, ..., cls)``, given its
      last-access stamp; the class index last, so no two heads are equal. Ages are
      ``max(now - stamp, 0)``: a stamp after ``now`` (a clock that stepped back) counts as an
      access just now.
    * ``stamps_allocation``: allocation stamps the last access with ``now``; otherwise with
      ``-inf`` ("never hit"). Hits always stamp ``now``.
    * ``stamps_free``: ``free`` stamps the last access with ``now``.
    * ``class_follows_hits``: a hit moves the block to the hitting request's class; otherwise
      the class of the request that allocated the block stays.

    Parameters
    ----------
    n_rows : int
        Number of class lists, >= 1. The last is the default one: a block whose class index is
        outside ``[0, n_rows)``, or that was never accessed, belongs to it. Blocks are small
        non-negative ints (vLLM block ids, simulator slots): per-block state lives in arrays
        indexed by block id.
    """

    stamps_allocation: bool
    stamps_free: bool
    class_follows_hits: bool
    #: Whether ``_key`` depends on a block's class and stamp only, so that blocks freed together
    #: have equal keys and leave together even when their score ties another list's.
    uniform_runs: bool = False

    def __init__(self, n_rows: int) -> None:
        if n_rows < 1:
            raise ValueError(f"a classed policy needs at least one class list, got {n_rows}")
        self._n_rows = n_rows
        self._default = n_rows - 1
        # The class a hit by class c gives the block (with class_follows_hits): c unless a
        # subclass keeps hit blocks in rows of their own.
        self._hit_class = list(range(n_rows))
        self._fifos = ClassFifos(n_rows)
        self._class = np.zeros(0, dtype=np.int64)
        self._stamp = np.zeros(0, dtype=np.float64)
        self._depth = np.zeros(0, dtype=np.int64)

    @property
    def n_classes(self) -> int:
        """Number of class lists, the default one included."""
        return self._n_rows

    @abstractmethod
    def _key(self, cls: int, block: int, stamp: float, now: float) -> tuple:
        """Sort key of ``block`` (last access ``stamp``) at the head of class list ``cls``; ends with ``cls``."""

    def _grow(self, block: int) -> None:
        have = len(self._stamp)
        size = max(block + 1, 2 * have, 64)
        self._class = np.concatenate([self._class, np.full(size - have, self._default, dtype=np.int64)])
        self._stamp = np.concatenate([self._stamp, np.full(size - have, -math.inf)])
        self._depth = np.concatenate([self._depth, np.zeros(size - have, dtype=np.int64)])
        self._fifos.reserve(size)

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
        if block >= len(self._stamp):
            self._grow(block)
        if not 0 <= workload <= self._default:
            workload = self._default
        if hit:
            self._stamp[block] = now
            if self.class_follows_hits:
                self._class[block] = self._hit_class[workload]
        else:
            self._stamp[block] = now if self.stamps_allocation else -math.inf
            self._class[block] = workload
        self._depth[block] = depth

    def free(self, blocks: Iterable[int], now: float) -> None:
        blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
        if len(blocks) <= ONE_BY_ONE_FREE:
            stamp_table, class_table, push_one = self._stamp, self._class, self._fifos.push_one
            for block in blocks:
                if block >= len(stamp_table):
                    self._grow(block)
                    stamp_table, class_table = self._stamp, self._class
                if self.stamps_free:
                    stamp_table[block] = now
                    push_one(block, class_table.item(block), now)
                else:
                    push_one(block, class_table.item(block), stamp_table.item(block))
            return
        blocks = np.array(blocks, dtype=np.int64)
        top = int(blocks.max())
        if top >= len(self._stamp):
            self._grow(top)
        if self.stamps_free:
            self._stamp[blocks] = now
        self._fifos.push(blocks, self._class[blocks], now if self.stamps_free else self._stamp[blocks])

    def remove(self, block: int) -> None:
        self._fifos.remove(block)

    def evict(self, now: float) -> int:
        if not len(self._fifos):
            raise IndexError("no evictable block")
        return self.evict_n(1, now)[0]

    def evict_n(self, n: int, now: float) -> list[int]:
        return _as_list(self._fifos.merge(n, self._key, now, self.uniform_runs))

    def evict_n_array(self, n: int, now: float) -> np.ndarray:
        return np.asarray(self._fifos.merge(n, self._key, now, self.uniform_runs), dtype=np.int64)

    def order(self, now: float, limit: int | None = None) -> list[int]:
        n = len(self._fifos) if limit is None else min(limit, len(self._fifos))
        if not n:
            return []
        return _as_list(self._fifos.merge(n, self._key, now, self.uniform_runs, take=False))

    def clear(self) -> None:
        self._fifos.clear()
        self._class[:] = self._default
        self._stamp[:] = -math.inf
        self._depth[:] = 0

    def __len__(self) -> int:
        return len(self._fifos)

    def __contains__(self, block: int) -> bool:
        return block in self._fifos
