"""ARC (Megiddo & Modha, FAST '03) adapted to vLLM's free-list model.

Sources: N. Megiddo and D. S. Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
FAST '03; vLLM's CPU-offload policy ``ARCCachePolicy``
(``vllm/v1/kv_offload/cpu/policies/arc.py``), whose eviction rule and ghost bounds this class
follows where the two differ; recomputed content is placed as in the paper (see the class).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from itertools import chain, islice

from kvprof.policy.base import EvictionPolicy


class ARCPolicy(EvictionPolicy):
    """LRU lists T1 (used once) and T2 (reused), balanced by ghosts of evicted contents.

    Invariant: the evictable blocks are exactly those of ``_t1`` and ``_t2`` (disjoint, each in
    free order, front evicted first); ``_b1`` and ``_b2`` hold disjoint contents, evicted from T1
    and T2 respectively, oldest first, each at most the largest number of evictable blocks seen;
    ``0 <= target <=`` that number.

    The original keeps every cached object in its lists; here the lists hold only evictable
    blocks, as in :class:`~kvprof.policy.s3fifo.S3FIFOPolicy`, because a block a running request
    holds cannot be evicted and a hit takes a block off its list (vLLM's free list works the same
    way). The adaptation:

    * A block belongs to T1 from allocation of new content, to T2 from its first prefix hit on;
      ``free`` appends it to its list's back (most recently used end), so a hit block returns to
      T2's back when its request finishes.
    * "Cache size" ``c`` is the largest number of evictable blocks seen so far, since the policy
      never learns how many blocks the tier has.
    * Allocating content found in ghost B1 raises ``target`` (T1's target size) by
      ``max(1, |B2| / |B1|)``, capped at ``c``; found in B2, lowers it by ``max(1, |B1| / |B2|)``,
      floored at 0. The content leaves the ghost and the block goes to T2, as in the paper's
      cases II and III: content computed, evicted and computed again has been used twice. vLLM's
      offload tier adapts the same way but inserts into T1, because there a store is not an
      access (a chunk moves to T2 when a request reads it back); on the GPU, allocation is the
      request's own use of the content, and T1 would offer recomputed content for eviction
      first, as if never used before (S3-FIFO's ghost sends it to its main queue for the same
      reason).
    * ``evict`` takes T1's front while ``|T1| >= int(target)`` (vLLM's rule; the paper compares
      with the real-valued target and, at equality, takes T1 only when the missed content is in
      B2), else T2's front; the other list when one is empty. The victim's content goes to the
      back of B1 (from T1) or B2 (from T2) and the oldest ghost beyond ``c`` is dropped, a bound
      per ghost as in vLLM (the paper keeps ``|T1| + |B1| <= c`` and all four lists within
      ``2c``). Eviction leaves ``target`` alone, so :meth:`order` is a walk, not a copy.
    * A driver that passes no content (``access(content=None)``; kvprof's vLLM plugin does so
      today) gets no ghost hits: ``target`` stays 0 and T1 is always evicted before T2.

    Attributes
    ----------
    target : float
        The paper's ``p``: the number of evictable blocks T1 should hold.
    """

    name = "arc"

    def __init__(self) -> None:
        self.target = 0.0
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._in_t2: dict[int, bool] = {}
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
            self._in_t2[block] = True
            return
        self._content[block] = content
        self._in_t2[block] = content is not None and self._ghost_hit(content)

    def _ghost_hit(self, content: Hashable) -> bool:
        """Adapt ``target`` and forget ``content`` if it is a ghost; whether it was one."""
        b1, b2 = self._b1, self._b2
        if content in b1:
            self.target = min(self.target + max(1.0, len(b2) / len(b1)), self._most_evictable)
            del b1[content]
        elif content in b2:
            self.target = max(self.target - max(1.0, len(b1) / len(b2)), 0.0)
            del b2[content]
        else:
            return False
        return True

    def free(self, blocks: Iterable[int], now: float) -> None:
        for block in blocks:
            (self._t2 if self._in_t2.get(block, False) else self._t1)[block] = None
        self._most_evictable = max(self._most_evictable, len(self))

    def remove(self, block: int) -> None:
        del (self._t2 if block in self._t2 else self._t1)[block]

    def evict(self, now: float) -> int:
        t1, t2 = self._t1, self._t2
        if t1 and (len(t1) >= int(self.target) or not t2):
            block, ghost, other = t1.popitem(last=False)[0], self._b1, self._b2
        elif t2:
            block, ghost, other = t2.popitem(last=False)[0], self._b2, self._b1
        else:
            raise IndexError("no evictable block")
        content = self._content.get(block)
        if content is not None:  # a content cached twice (vLLM allows it) is one ghost, where it left last
            other.pop(content, None)
            ghost.pop(content, None)
            ghost[content] = None
            if len(ghost) > self._most_evictable:
                ghost.popitem(last=False)
        return block

    def order(self, now: float, limit: int | None = None) -> list[int]:
        """T1's front while ``|T1| >= int(target)`` would hold, then T2, then the rest of T1."""
        t1 = self._t1
        k = max(len(t1) - max(int(self.target) - 1, 0), 0)
        return list(islice(chain(islice(t1, k), self._t2, islice(t1, k, None)), limit))

    def clear(self) -> None:
        for table in (self._t1, self._t2, self._b1, self._b2, self._in_t2, self._content):
            table.clear()
        self.target = 0.0
        self._most_evictable = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, block: int) -> bool:
        return block in self._t1 or block in self._t2
