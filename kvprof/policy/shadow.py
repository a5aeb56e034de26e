"""A metadata-only replica of the cache under another eviction order: what would it have hit?

``wa`` runs one shadow per candidate order beside the real cache. A shadow is told every request
the real cache admits, with the request's whole chain of block contents, and every request that
finishes; it keeps vLLM's prefix-cache rules on slots of its own (the very
:class:`~kvprof.policy.prefix_cache.PrefixCache` the simulator runs) but holds only contents
(hashes), never KV data. So its hits are what its order would have hit on this traffic at this
size; ``wa`` follows the order whose shadow hits most (:mod:`kvprof.policy.wa`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from kvprof.policy.base import EvictionPolicy
from kvprof.policy.prefix_cache import NO_BLOCK, PrefixCache


class _Never:
    """Next uses of a shadow's blocks: unknown (``inf``) at every index; only Belady reads them."""

    def __getitem__(self, index: int) -> float:
        return math.inf


NEVER = _Never()


class ShadowCache(PrefixCache):
    """A prefix cache of contents under ``policy``, fed whole requests when the real cache admits and frees them.

    Invariant: :class:`~kvprof.policy.prefix_cache.PrefixCache`'s, and ``held`` maps every admitted,
    unfinished request to its slots, chain order (``workload`` to its workload). ``hits`` counts the blocks its lookups found.

    It differs from a real cache in one way: it admits every request the real cache admitted, at
    the real cache's time, even when its own slots are all pinned (it then grows past its size
    and shrinks back as requests finish, where a real cache would have made the request wait).
    So the shadow of the order the real cache follows, at the real cache's size, counts exactly
    the real cache's hits; another order's shadow counts that order's hits but for the timing:
    how long requests queue and run depends on the real cache's hits.

    Parameters
    ----------
    policy : EvictionPolicy
        A fresh policy; the shadow passes it slot numbers as block ids.
    capacity : int
        Slots, as the real cache's; 0 until :meth:`set_limit` raises it.
    """

    def __init__(self, policy: EvictionPolicy, capacity: int = 0) -> None:
        super().__init__(policy, capacity)
        self.held: dict[Hashable, list[int]] = {}
        self.workload: dict[Hashable, int] = {}
        self.hits = 0

    def admit(self, request: Hashable, contents: Sequence[Hashable], now: float, workload: int, n_lookup: int,
              n_blocks: int) -> int:
        """The real cache admits ``request``: look up its chain, pin the hits, allocate the rest.

        ``contents`` are its full blocks', shallowest first; the first ``n_lookup`` may hit; it
        holds ``n_blocks`` slots (``>= len(contents)``: the partial tail is allocated, never
        cached). Returns the hits.
        """
        slots: list[int] = []
        n_hit_evictable = self.cached_prefix(contents, 0, n_lookup, slots)
        n_hits = len(slots)
        short = n_blocks - n_hits - (self.n_free - n_hit_evictable)
        if short > 0:
            self.make_room(short, now)
        self.pin_hits(slots, now, workload, NEVER, 0)
        self.allocate(contents, NEVER, 0, n_hits, len(contents), n_blocks, now, workload, slots)
        self.held[request] = slots
        self.workload[request] = workload
        self.hits += n_hits
        return n_hits

    def finish(self, request: Hashable, now: float, contents: Sequence[Hashable] = (), n_blocks: int = 0) -> None:
        """``request`` finished: its slots are freed tail-first (unknown requests are ignored).

        With ``contents`` (its whole chain now), the blocks it filled since admission are cached
        first, as vLLM caches each block once full: a held slot without content takes its
        depth's content in place, and it gets slots for the depths up to ``n_blocks`` it did not
        hold (cached below ``len(contents)``).
        """
        slots = self.held.pop(request, None)
        if slots is None:
            return
        workload = self.workload.pop(request)
        held = len(slots)
        for depth in range(min(held, len(contents))):
            slot, content = slots[depth], contents[depth]
            if self.slot_block[slot] == NO_BLOCK and content not in self.block_slot:
                self.block_slot[content] = slot
                self.slot_block[slot] = content
                self.policy.access(slot, now, workload, depth, hit=False, next_use=math.inf, content=content)
        n_blocks = max(n_blocks, len(contents))
        if n_blocks > held:
            short = n_blocks - held - self.n_free
            if short > 0:
                self.make_room(short, now)
            self.allocate(contents, NEVER, 0, held, len(contents), n_blocks, now, workload, slots)
        self.release(slots, now)
