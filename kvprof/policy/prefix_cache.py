"""vLLM's block pool with prefix caching, over any eviction policy: the simulator's GPU tier and ``wa``'s shadows.

:class:`PrefixCache` keeps the rules of vLLM's ``BlockPool`` (lookup of the longest cached prefix,
pinning, lazy eviction, tail-first frees) on slot numbers and drives an
:class:`~kvprof.policy.base.EvictionPolicy` through its protocol. The simulator's Python engine
runs one per GPU tier (:mod:`kvprof.sim.cache`); ``wa`` runs one per candidate order as a shadow
fed whole requests (:class:`kvprof.policy.shadow.ShadowCache`), so a shadow's hits are counted by
the very rules that count the real cache's. Contents are any hashable ids (the simulator's dense
engine block ids, vLLM's block hashes). Hot loops bind attributes to locals and allocate nothing
per block beyond the slot lists a request keeps anyway.
"""

from __future__ import annotations

from kvprof.policy.base import EvictionPolicy

#: ``slot_block`` value of a slot whose content is not cached (never was, lost it, or duplicate).
NO_BLOCK = -1


class PrefixCache:
    """The GPU tier: a pool of block slots with vLLM's prefix-cache semantics (``BlockPool``).

    Invariant (checked by :meth:`check`): every live slot is in exactly one place:

    * empty -- on the ``empty`` stack, no content, reused before any eviction (vLLM prepends
      never-cached blocks to its free queue);
    * pinned -- ``refs[slot] > 0``, held by running requests (cached content or not);
    * evictable -- ``refs[slot] == 0`` with cached content, owned by ``policy``.

    ``block_slot`` maps every cached engine block to its slot and ``slot_block`` is its inverse.
    Live slots never exceed ``limit`` while some slot is empty or evictable: lowering the limit
    drops free slots at once and pinned slots over it are dropped as their requests free them.
    Dropped slot numbers wait in ``retired`` and are reused when the limit rises again.
    """

    def __init__(self, policy: EvictionPolicy, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
        self.policy = policy
        self.limit = capacity
        self.n_live = capacity
        self.slot_block = [NO_BLOCK] * capacity
        self.refs = [0] * capacity
        self.empty = list(range(capacity - 1, -1, -1))
        self.retired: list[int] = []
        self.block_slot: dict[int, int] = {}
        self.evictions = 0
        self.dropped = 0

    @property
    def n_free(self) -> int:
        """Slots a new request may take: empty plus evictable."""
        return len(self.empty) + len(self.policy)

    def cached_prefix(self, blocks: list[int], start: int, n_lookup: int, out: list[int]) -> int:
        """Append the slots of the longest cached prefix to ``out``; return how many are evictable now.

        ``blocks[start:start + n_lookup]`` is the request's chain; the walk stops at the first
        miss, as vLLM's ``find_longest_cache_hit`` does. A slot pinned by another running request
        is a hit too (shared), including one allocated but not yet computed.
        """
        get = self.block_slot.get
        refs = self.refs
        n_evictable = 0
        for j in range(start, start + n_lookup):
            slot = get(blocks[j])
            if slot is None:
                break
            out.append(slot)
            if not refs[slot]:
                n_evictable += 1
        return n_evictable

    def pin_hits(self, slots: list[int], now: float, workload: int, next_use: list[float], start: int) -> None:
        """Take hit slots (chain order, depth = position) for a request: vLLM's ``touch``."""
        refs = self.refs
        slot_block = self.slot_block
        policy = self.policy
        access = policy.access
        for depth, slot in enumerate(slots):
            if not refs[slot]:
                policy.remove(slot)
            refs[slot] += 1
            access(slot, now, workload, depth, hit=True, next_use=next_use[start + depth], content=slot_block[slot])

    def allocate(
        self,
        blocks: list[int],
        next_use: list[float],
        start: int,
        first: int,
        n_cacheable: int,
        n_total: int,
        now: float,
        workload: int,
        out: list[int],
    ) -> None:
        """Allocate blocks ``first..n_total-1`` of a request, append their slots to ``out``.

        Blocks below ``n_cacheable`` are full: they are cached (hash registered) at once, so a
        later request hits them even while this one computes them -- vLLM caches full blocks when
        it schedules them. A full block whose content is already cached elsewhere (it sits behind
        the first miss) and the partial tail stay uncached and go back empty on free.
        Slots come from the empty stack first, then from one ``policy.evict_n`` (lazy eviction,
        all victims at once like vLLM's ``get_new_blocks``). The caller has checked that
        ``n_free`` covers the request.
        """
        empty = self.empty
        block_slot = self.block_slot
        slot_block = self.slot_block
        n_new = n_total - first
        n_empty = min(len(empty), n_new)
        new = empty[len(empty) - n_empty :]
        del empty[len(empty) - n_empty :]
        new.reverse()  # stack order: last freed first
        if n_new > n_empty:
            victims = self.policy.evict_n(n_new - n_empty, now)
            for slot in victims:
                del block_slot[slot_block[slot]]
            self.evictions += len(victims)
            new += victims
        refs = self.refs
        access = self.policy.access
        depth = first
        for slot in new:  # hot loop: one dict probe and one policy call per block
            refs[slot] = 1
            block = blocks[start + depth] if depth < n_cacheable else NO_BLOCK
            if block != NO_BLOCK and block not in block_slot:
                block_slot[block] = slot
                slot_block[slot] = block
                access(slot, now, workload, depth, hit=False, next_use=next_use[start + depth], content=block)
            else:
                slot_block[slot] = NO_BLOCK
            depth += 1
        out += new

    def cache_filled(self, blocks: list[int], next_use: list[float], start: int, first: int, n_cacheable: int,
                     slots: list[int], now: float, workload: int) -> None:
        """Cache, in place, the held ``slots`` of depths ``first .. min(len(slots), n_cacheable) - 1``
        that have no content yet: blocks a request filled while it ran (its prompt's partial last
        block, which its output completes), cached once full as vLLM's ``cache_full_blocks`` does,
        without a new slot. A content cached elsewhere, or ``NO_BLOCK``, leaves its slot uncached."""
        block_slot, slot_block = self.block_slot, self.slot_block
        access = self.policy.access
        for depth in range(first, min(len(slots), n_cacheable)):
            slot, block = slots[depth], blocks[start + depth]
            if block != NO_BLOCK and slot_block[slot] == NO_BLOCK and block not in block_slot:
                block_slot[block] = slot
                slot_block[slot] = block
                access(slot, now, workload, depth, hit=False, next_use=next_use[start + depth], content=block)

    def release(self, slots: list[int], now: float) -> None:
        """A request finished: unpin its slots tail-first; cached ones become evictable."""
        refs = self.refs
        slot_block = self.slot_block
        empty = self.empty
        evictable = []
        for slot in reversed(slots):
            refs[slot] -= 1
            if not refs[slot]:
                if slot_block[slot] == NO_BLOCK:
                    empty.append(slot)
                else:
                    evictable.append(slot)
        if evictable:
            self.policy.free(evictable, now)
        if self.n_live > self.limit:
            self._shrink(now)

    def set_limit(self, limit: int, now: float) -> None:
        """Elastic capacity: raise adds empty slots, lowering drops free ones (pinned ones later)."""
        self.limit = limit
        while self.n_live < limit:
            if self.retired:
                slot = self.retired.pop()
            else:
                slot = len(self.refs)
                self.refs.append(0)
                self.slot_block.append(NO_BLOCK)
            self.empty.append(slot)
            self.n_live += 1
        self._shrink(now)

    def make_room(self, n: int, now: float) -> None:
        """Add ``n`` empty slots beyond the limit; they are dropped again as requests free blocks.

        For a shadow, which must admit every request the real cache admitted even when its own
        slots are pinned (the real cache, in its place, would have made the request wait).
        """
        limit = self.limit
        self.set_limit(self.n_live + n, now)
        self.limit = limit

    def _shrink(self, now: float) -> None:
        """Drop empty, then evictable slots (policy's order) until within the limit or none is free."""
        while self.n_live > self.limit and (self.empty or len(self.policy)):
            if self.empty:
                slot = self.empty.pop()
            else:
                slot = self.policy.evict(now)
                del self.block_slot[self.slot_block[slot]]
                self.slot_block[slot] = NO_BLOCK
                self.dropped += 1
            self.retired.append(slot)
            self.n_live -= 1

    def check(self) -> None:
        """Assert the class invariant (tests; O(slots))."""
        empty = set(self.empty)
        retired = set(self.retired)
        assert len(empty) == len(self.empty) and len(retired) == len(self.retired)
        assert not empty & retired
        for slot in range(len(self.refs)):
            places = [
                slot in empty,
                slot in retired,
                self.refs[slot] > 0,
                slot in self.policy,
            ]
            assert sum(places) == 1, f"slot {slot} is in {places} (empty, retired, pinned, evictable)"
            if slot in empty or slot in retired:
                assert self.slot_block[slot] == NO_BLOCK
            if slot in self.policy:
                assert self.slot_block[slot] != NO_BLOCK
        assert self.n_live == len(self.refs) - len(retired)
        assert len(self.policy) == sum(1 for s in range(len(self.refs)) if s in self.policy)
        assert {b: s for s, b in enumerate(self.slot_block) if b != NO_BLOCK} == self.block_slot
        assert self.n_live <= self.limit or not (self.empty or len(self.policy))
