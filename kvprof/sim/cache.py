"""The two cache tiers a replay drives: vLLM's GPU block pool and an offloading CPU tier.

The GPU tier, :class:`PrefixCache`, lives in :mod:`kvprof.policy.prefix_cache` (``wa``'s shadows
run the same class) and is imported here. Blocks are slot numbers (vLLM's ``block_id``); contents are dense engine block ids from
:class:`kvprof.sim.workload.Workload`. Hot loops bind attributes to locals and allocate nothing
per block beyond the slot lists a request keeps anyway.
"""

from __future__ import annotations

from kvprof.policy.base import EvictionPolicy
from kvprof.policy.prefix_cache import NO_BLOCK, PrefixCache

__all__ = ["NO_BLOCK", "HostCache", "PrefixCache"]


class HostCache:
    """The CPU tier, as vLLM's OffloadingConnector keeps it: blocks stored from the GPU, loaded on hits.

    Invariant: every cached engine block has one slot in ``block_slot`` and that slot is
    evictable in ``policy`` between calls (loads and stores are modelled as instantaneous copies,
    so no host block stays pinned); ``len(block_slot) <= capacity``.
    """

    def __init__(self, policy: EvictionPolicy, capacity: int):
        self.policy = policy
        self.capacity = capacity
        self.block_slot: dict[int, int] = {}
        self.slot_block = [NO_BLOCK] * capacity
        self.empty = list(range(capacity - 1, -1, -1))
        self.evictions = 0

    def cached_run(self, blocks: list[int], start: int, stop: int) -> int:
        """Length of the run of ``blocks[start:stop]`` cached here, from ``start``."""
        block_slot = self.block_slot
        j = start
        while j < stop and blocks[j] in block_slot:
            j += 1
        return j - start

    def load(
        self, blocks: list[int], next_use: list[float], start: int, first: int, stop: int, now: float, workload: int
    ) -> None:
        """Hits at depths ``first..stop-1`` are read back to the GPU: a touch for the host policy."""
        policy = self.policy
        touched = []
        for depth in range(first, stop):
            block = blocks[start + depth]
            slot = self.block_slot[block]
            policy.remove(slot)
            policy.access(slot, now, workload, depth, hit=True, next_use=next_use[start + depth], content=block)
            touched.append(slot)
        touched.reverse()
        policy.free(touched, now)

    def store(
        self, blocks: list[int], next_use: list[float], start: int, depths: range, now: float, workload: int
    ) -> None:
        """Store computed blocks (those not already here), evicting in the host policy's order."""
        block_slot = self.block_slot
        slot_block = self.slot_block
        policy = self.policy
        stored = []
        for depth in depths:
            block = blocks[start + depth]
            if block in block_slot:
                continue
            if self.empty:
                slot = self.empty.pop()
            elif len(policy):
                slot = policy.evict(now)
                del block_slot[slot_block[slot]]
                self.evictions += 1
            else:
                break  # every host slot holds this request's own blocks
            block_slot[block] = slot
            slot_block[slot] = block
            policy.access(slot, now, workload, depth, hit=False, next_use=next_use[start + depth], content=block)
            stored.append(slot)
        stored.reverse()
        policy.free(stored, now)

    def check(self) -> None:
        """Assert the class invariant (tests)."""
        assert len(self.block_slot) <= self.capacity
        assert len(self.policy) == len(self.block_slot)
        assert all(slot in self.policy for slot in self.block_slot.values())
        assert not set(self.empty) & set(self.block_slot.values())
        assert len(self.empty) + len(self.block_slot) == self.capacity
