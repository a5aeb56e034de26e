"""LRU: vLLM's own free-queue order, the baseline every other policy is measured against."""

from __future__ import annotations

import math
from collections import OrderedDict
from itertools import islice
from collections.abc import Hashable, Iterable

from kvprof.policy.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts cached blocks in the order vLLM's ``FreeKVCacheBlockQueue`` does.

    Invariant: ``_queue`` holds the evictable blocks in the order they were freed, front first,
    which is the eviction order. ``free`` appends (the driver passes a finished request's blocks
    tail-first, so a chain's tail goes before its head), ``remove`` unlinks a hit block and
    ``evict`` pops the front: all O(1), like vLLM's intrusive list.

    An ``OrderedDict`` rather than a plain dict: popping a plain dict's first key leaves a dead
    slot that every later ``next(iter(d))`` walks past until the dict is resized, which made a
    steady evict/free cycle over 100k blocks cost 32 us per block instead of 0.2 us.
    """

    name = "lru"

    def __init__(self) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict()

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
        """Nothing to record: the order is set by ``free`` alone."""

    def free(self, blocks: Iterable[int], now: float) -> None:
        queue = self._queue
        for block in blocks:  # hot loop: one dict store per block
            queue[block] = None

    def remove(self, block: int) -> None:
        del self._queue[block]

    def evict(self, now: float) -> int:
        try:
            return self._queue.popitem(last=False)[0]
        except KeyError:
            raise IndexError("no evictable block") from None

    def evict_n(self, n: int, now: float) -> list[int]:
        if n > len(self._queue):
            raise IndexError(f"{n} victims asked for, {len(self._queue)} evictable")
        pop = self._queue.popitem
        return [pop(False)[0] for _ in range(n)]

    def order(self, now: float, limit: int | None = None) -> list[int]:
        return list(islice(self._queue, limit))

    def clear(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block: int) -> bool:
        return block in self._queue
