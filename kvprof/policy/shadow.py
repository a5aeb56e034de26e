"""A metadata-only replica of the cache under another eviction order: what would it have hit?

``wa`` runs one shadow per candidate order beside the real cache. A shadow sees the same
accesses and frees as the real cache but holds only block contents (hashes), never KV data, so
its hit count is what that order would have achieved on this traffic at this size; ``wa``
follows the order whose shadow hits most (:mod:`kvprof.policy.wa`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from kvprof.policy.base import EvictionPolicy

#: Contents beyond the capacity are evicted in batches, once they exceed it by ``capacity // BATCH_SHARE``.
BATCH_SHARE = 64


class ShadowCache:
    """Contents cached under ``policy``, pinned while the real cache holds them, up to ``capacity``.

    Invariant: every content in ``slot_of`` has one slot; it is either pinned (held by a request
    of the real cache: in ``pinned``) or evictable in ``policy``. Contents beyond ``capacity``
    are evicted in batches once they exceed it by ``capacity / 64``: one merge of the policy's
    lists per batch instead of per block, at the price of briefly holding 1.6 % more than the
    real cache could (a shadow whose slots are all pinned grows past it, as the real cache would
    have had to wait).

    A hit is counted as the real cache would find it: the content is held and every shallower
    block of the request's chain was a hit too (depth 0 starts a chain).

    Parameters
    ----------
    policy : EvictionPolicy
        A fresh policy; the shadow passes it slot numbers as block ids.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.capacity = 0
        self.slot_of: dict[Hashable, int] = {}
        self.content_of: list[Hashable] = []
        self.free_slots: list[int] = []  # slots whose content was evicted
        self.pinned: set[int] = set()
        self.hits = 0
        self._chain_depth = -1  # depth of the last access whose chain was all hits

    def __len__(self) -> int:
        return len(self.slot_of)

    def access(self, content: Hashable, now: float, workload: int, depth: int) -> None:
        """A request of the real cache uses ``content`` at ``depth`` of its chain, which pins it."""
        policy = self.policy
        slot = self.slot_of.get(content)
        chained = depth == 0 or depth == self._chain_depth + 1
        if slot is not None:
            if chained:
                self.hits += 1
                self._chain_depth = depth
            if slot not in self.pinned:
                policy.remove(slot)
            policy.access(slot, now, workload, depth, hit=True, content=content)
        else:
            slot = self._take_slot(now)
            self.slot_of[content] = slot
            self.content_of[slot] = content
            policy.access(slot, now, workload, depth, hit=False, content=content)
        self.pinned.add(slot)

    def release(self, contents: Iterable[Hashable], now: float) -> None:
        """The real cache freed blocks holding ``contents`` (tail first): unpin them here too."""
        freed = []
        for content in contents:
            slot = self.slot_of.get(content)
            if slot is not None and slot in self.pinned:
                self.pinned.discard(slot)
                freed.append(slot)
        if freed:
            self.policy.free(freed, now)

    def _take_slot(self, now: float) -> int:
        excess = len(self.slot_of) + 1 - self.capacity
        if excess > self.capacity // BATCH_SHARE and len(self.policy):
            victims = self.policy.evict_n(min(excess, len(self.policy)), now)
            for slot in victims:
                del self.slot_of[self.content_of[slot]]
            self.free_slots.extend(victims)
        if self.free_slots:
            return self.free_slots.pop()
        self.content_of.append(None)
        return len(self.content_of) - 1
