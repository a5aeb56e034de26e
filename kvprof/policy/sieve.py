"""SIEVE (Zhang et al., NSDI '24): one FIFO queue, a visited bit, a hand that moves from old to new."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

from kvprof.policy.base import EvictionPolicy


class SIEVEPolicy(EvictionPolicy):
    """One FIFO of the evictable blocks and a hand sweeping it from the oldest to the newest.

    The original keeps every cached object in one queue, newest at the head, and never moves an
    object on a hit: it only sets the object's visited bit. To evict, the hand (where the last
    eviction stopped, the oldest object at first) walks towards the newest: a visited object has
    its bit cleared and is passed over, the first unvisited one is evicted, and the hand stays on
    the next newer object; past the newest it starts again at the oldest. Here, as for the other
    policies, the queue holds only evictable blocks in the order they were freed, because a
    block that a running request holds cannot be evicted and a hit takes it off the queue
    (vLLM's free list works the same way). So:

    * ``free`` appends to the back (newest); ``remove`` unlinks, and a hand resting on the
      removed block moves to the next newer one.
    * A hit sets the block's visited bit, an allocation (new content) clears it: a block hit
      since it was allocated, or since the hand last passed it, survives one more sweep.

    Invariant: ``_next``/``_prev`` link exactly the evictable blocks from ``_front`` (oldest) to
    ``_back`` (newest); ``_hand`` is one of them or None (the next eviction starts at the front);
    ``_visited`` holds the blocks hit since they were allocated or last passed by the hand.
    """

    name = "sieve"

    def __init__(self) -> None:
        self._next: dict[int, int | None] = {}
        self._prev: dict[int, int | None] = {}
        self._front: int | None = None
        self._back: int | None = None
        self._hand: int | None = None
        self._visited: set[int] = set()

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
        if hit:
            self._visited.add(block)
        else:
            self._visited.discard(block)

    def free(self, blocks: Iterable[int], now: float) -> None:
        for block in blocks:
            self._prev[block], self._next[block] = self._back, None
            if self._back is None:
                self._front = block
            else:
                self._next[self._back] = block
            self._back = block

    def remove(self, block: int) -> None:
        after = self._next.pop(block)  # KeyError, nothing changed, when not evictable
        before = self._prev.pop(block)
        if self._hand == block:
            self._hand = after
        if before is None:
            self._front = after
        else:
            self._next[before] = after
        if after is None:
            self._back = before
        else:
            self._prev[after] = before

    def evict(self, now: float) -> int:
        if self._front is None:
            raise IndexError("no evictable block")
        block = self._front if self._hand is None else self._hand
        while block in self._visited:  # at most one sweep: every pass clears a bit
            self._visited.discard(block)
            following = self._next[block]
            block = self._front if following is None else following
        self._hand = self._next[block]  # None past the newest: the next sweep starts at the front
        self.remove(block)
        return block

    def clear(self) -> None:
        self.__init__()

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, block: int) -> bool:
        return block in self._next
