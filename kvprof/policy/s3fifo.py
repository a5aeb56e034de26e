"""S3-FIFO (Yang et al., SOSP '23) adapted to vLLM's free-list model."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable

from kvprof.policy.base import EvictionPolicy

#: Frequency cap: two bits, as in the paper.
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    """A small FIFO that filters one-hit blocks, a main FIFO with reinsertion, a ghost of contents.

    The original keeps every cached object in its queues; here the queues hold only evictable
    blocks, in free order, because a block a running request holds cannot be evicted and a hit
    takes a block off its queue (vLLM's free list works the same way). The adaptation:

    * A block belongs to the small queue S from allocation until S promotes it, to the main
      queue M after; ``free`` appends it to its queue. Allocating content that is in the ghost
      puts the block in M at once.
    * "Cache size" is the number of evictable blocks: S is evicted from while it holds more
      than ``small_ratio`` of them (or M is empty).
    * A hit raises the block's frequency, capped at 3; allocation sets it to 0.
    * Evicting from S: the front block, if hit since it entered S, moves to M's back with its
      frequency cleared; otherwise it is evicted and its content remembered in the ghost.
      Evicting from M: the front block with frequency > 0 moves to the back one lower;
      otherwise it is evicted.
    * The ghost holds contents (``access(content=...)``, the block hash) in FIFO order, at most
      ``ghost_ratio`` times the largest number of evictable blocks seen so far. A driver that
      passes no content gets no ghost hits.

    Parameters
    ----------
    small_ratio : float
        Share of the evictable blocks the small queue may hold, in (0, 1).
    ghost_ratio : float
        Ghost size relative to the largest number of evictable blocks seen, >= 0.
    """

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1, ghost_ratio: float = 0.9) -> None:
        if not 0 < small_ratio < 1 or not ghost_ratio >= 0:
            raise ValueError(f"need 0 < small_ratio < 1 and ghost_ratio >= 0, got {small_ratio}, {ghost_ratio}")
        self.small_ratio = small_ratio
        self.ghost_ratio = ghost_ratio
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[int, int] = {}
        self._in_main: dict[int, bool] = {}
        self._content: dict[int, Hashable] = {}
        self._most_evictable = 0

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
            self._freq[block] = min(self._freq.get(block, 0) + 1, MAX_FREQ)
            return
        self._freq[block] = 0
        self._content[block] = content
        recomputed = content is not None and content in self._ghost
        if recomputed:
            del self._ghost[content]
        self._in_main[block] = recomputed

    def free(self, blocks: Iterable[int], now: float) -> None:
        for block in blocks:
            (self._main if self._in_main.get(block, False) else self._small)[block] = None
        self._most_evictable = max(self._most_evictable, len(self))

    def remove(self, block: int) -> None:
        del (self._main if block in self._main else self._small)[block]

    def evict(self, now: float) -> int:
        small, main, freq = self._small, self._main, self._freq
        while small or main:  # each pass evicts or moves a block; moves are bounded by MAX_FREQ
            if small and (len(small) > self.small_ratio * len(self) or not main):
                block = small.popitem(last=False)[0]
                if freq.get(block, 0) > 0:
                    freq[block] = 0
                    self._in_main[block] = True
                    main[block] = None
                    continue
                self._remember(block)
                return block
            block = main.popitem(last=False)[0]
            if freq.get(block, 0) > 0:
                freq[block] -= 1
                main[block] = None
                continue
            return block
        raise IndexError("no evictable block")

    def _remember(self, block: int) -> None:
        """Put an evicted small-queue block's content in the ghost, dropping the oldest beyond its size."""
        content = self._content.get(block)
        if content is None:
            return
        self._ghost[content] = None
        while len(self._ghost) > self.ghost_ratio * self._most_evictable:
            self._ghost.popitem(last=False)

    def clear(self) -> None:
        for table in (self._small, self._main, self._ghost, self._freq, self._in_main, self._content):
            table.clear()
        self._most_evictable = 0

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, block: int) -> bool:
        return block in self._small or block in self._main
