"""Belady's MIN: the offline optimum, the hit-ratio ceiling for the other policies."""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable

from kvprof.policy.base import EvictionPolicy


class BeladyPolicy(EvictionPolicy):
    """Evicts the evictable block whose next use is farthest in the future.

    The next use is the ``next_use`` the driver passed with the block's latest ``access`` (the
    simulator computes it from the trace; the policy never reads one). Ties go to the deeper
    block, then to the block freed first. Blocks held by running requests are not in the policy,
    so they are never candidates. On a prefix tree a parent is never used later than its child,
    so MIN needs no prefix rule.

    Invariant: each evictable block has exactly one live heap entry, the one carrying the free
    sequence number ``_live[block]``. ``remove`` only forgets the number (lazy deletion); dead
    entries are skipped when they reach the top, and the heap is rebuilt once they outnumber
    the live ones, so it stays O(evictable blocks).
    """

    name = "belady"
    offline = True

    def __init__(self) -> None:
        self._next_use: dict[int, float] = {}
        self._depth: dict[int, int] = {}
        self._heap: list[tuple[float, int, int, int]] = []  # (-next use, -depth, free seq, block)
        self._live: dict[int, int] = {}  # evictable block -> free seq of its live entry
        self._freed = 0

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
        self._next_use[block] = next_use
        self._depth[block] = depth

    def free(self, blocks: Iterable[int], now: float) -> None:
        heap, live = self._heap, self._live
        for block in blocks:
            self._freed += 1
            live[block] = self._freed
            entry = (-self._next_use.get(block, math.inf), -self._depth.get(block, 0), self._freed, block)
            heapq.heappush(heap, entry)

    def remove(self, block: int) -> None:
        del self._live[block]
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [entry for entry in self._heap if self._live.get(entry[3]) == entry[2]]
            heapq.heapify(self._heap)

    def evict(self, now: float) -> int:
        heap, live = self._heap, self._live
        while heap:
            _, _, seq, block = heapq.heappop(heap)
            if live.get(block) == seq:
                del live[block]
                return block
        raise IndexError("no evictable block")

    def order(self, now: float, limit: int | None = None) -> list[int]:
        return [entry[3] for entry in sorted(self._heap) if self._live.get(entry[3]) == entry[2]][:limit]

    def clear(self) -> None:
        self._next_use.clear()
        self._depth.clear()
        self._heap.clear()
        self._live.clear()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block: int) -> bool:
        return block in self._live
