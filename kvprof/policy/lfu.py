"""LFU: evict the block with the fewest accesses, a frequency baseline."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable

from kvprof.policy.base import EvictionPolicy


class LFUPolicy(EvictionPolicy):
    """Evicts the evictable block with the lowest access count; ties go to the one freed first.

    A block's count is 1 when it is allocated and grows by one per prefix hit. Counts do not
    survive eviction: a block is evicted only to be reused for new content, and allocating new
    content (``access(hit=False)``) restarts its count at 1.

    Invariant: each evictable block sits in the bucket of its count (``_where`` says which), a
    bucket keeps free order, and ``_counts`` is a heap holding each bucket's count exactly once.
    Buckets are kept when they empty, so a count is never pushed twice; ``evict`` drops empty
    buckets when they reach the top of the heap.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._count: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._counts: list[int] = []
        self._where: dict[int, int] = {}  # evictable block -> its count, the bucket holding it

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
        self._count[block] = self._count.get(block, 0) + 1 if hit else 1

    def free(self, blocks: Iterable[int], now: float) -> None:
        for block in blocks:
            count = self._count.get(block, 1)
            bucket = self._buckets.get(count)
            if bucket is None:
                bucket = self._buckets[count] = OrderedDict()
                heapq.heappush(self._counts, count)
            bucket[block] = None
            self._where[block] = count

    def remove(self, block: int) -> None:
        del self._buckets[self._where.pop(block)][block]

    def evict(self, now: float) -> int:
        if not self._where:
            raise IndexError("no evictable block")
        counts, buckets = self._counts, self._buckets
        while not buckets[counts[0]]:
            del buckets[heapq.heappop(counts)]
        block = buckets[counts[0]].popitem(last=False)[0]
        del self._where[block]
        return block

    def order(self, now: float, limit: int | None = None) -> list[int]:
        return [block for count in sorted(self._buckets) for block in self._buckets[count]][:limit]

    def clear(self) -> None:
        self._count.clear()
        self._buckets.clear()
        self._counts.clear()
        self._where.clear()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, block: int) -> bool:
        return block in self._where
