"""A metadata-only replica of the cache under another eviction order: what would it have hit?

``wa`` runs one shadow per candidate order beside the real cache. A shadow is told every request
the real cache admits, with the request's whole chain of block contents, and every request that
finishes; it keeps vLLM's prefix-cache rules on slots of its own (the very
:class:`~kvprof.policy.prefix_cache.PrefixCache` the simulator runs) but holds only contents
(hashes), never KV data. So its hits are what its order would have hit on this traffic at this
size; ``wa`` follows the order whose shadow hits most (:mod:`kvprof.policy.wa`).

The shadows may run on a spatial sample of the traffic (:class:`ChainSample`, SHARDS-style): only
the requests of sampled conversations, in caches scaled to the sample. Every shadow sees the same
sample, so they rank the candidates on the same traffic at a fraction of the cost.

Its compiled twin is :mod:`kvprof.core.shadow`.
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


#: splitmix64's finalizer: a full-avalanche mix of chain numbers (small counters) into 64 bits.
MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_BITS = (1 << 64) - 1


def mixed(number: int) -> int:
    """``number`` mixed into 64 bits (splitmix64's finalizer; :func:`kvprof.core.wa.mixed` is its twin)."""
    z = number & _BITS
    z = ((z ^ (z >> 30)) * MIX[0]) & _BITS
    z = ((z ^ (z >> 27)) * MIX[1]) & _BITS
    return z ^ (z >> 31)


#: :class:`ChainSample` remembers the contents of the last this many real caches' worth of blocks
#: admitted (a content not admitted since is forgotten: long evicted from any cache of that size).
CHAIN_MEMORY_CAPACITIES = 8


def chain_memory(size: int) -> int:
    """How many of the latest contents admitted :class:`ChainSample` remembers for a real cache of ``size`` blocks."""
    return CHAIN_MEMORY_CAPACITIES * max(size, 1)


def sample_threshold(rate: float) -> int:
    """Mixed chain numbers below this are in a sample of ``rate``."""
    return min(int(rate * 2.0**64), _BITS)


def scaled_size(size: int, rate: float) -> int:
    """A cache of ``size`` blocks scaled to a sample of ``rate`` (rounded up, so never 0 for a cache)."""
    return size if rate >= 1.0 else int(math.ceil(size * rate))


class ChainSample:
    """Which admitted requests the shadows see: the requests of a spatial sample of conversations.

    A policy is not told conversations, only each request's chain of contents, so chains are
    numbered from those: a request whose first new content (one no request was admitted with
    before) continues a content no other request continued belongs to that content's chain (the
    next turn of a conversation extends the previous turn's prompt); one whose first new content
    branches off a content another request continued (a new conversation under a shared system
    prompt), or that has no known content before it, starts a new chain, numbered in order; a
    request with no new content belongs to its last content's chain. A chain is in the sample
    when its mixed number (:func:`mixed`) falls below ``rate`` of 2**64, so a conversation's
    requests are in or out together, and conversations that share only a system prompt are
    drawn independently. Numbers depend only on the order of admissions and on which contents
    are equal, so every implementation that sees the same requests draws the same sample.

    Memory is bounded by the real cache's size: a content is remembered while it is among the
    last :func:`chain_memory` contents admitted (each content of each request counts; a content
    forgotten is new again, so a conversation that comes back after that much other traffic is
    drawn again, as a new chain).

    Invariant: ``n_admitted`` contents were admitted, ``admitted[c]`` is the index of content
    ``c``'s last admission; ``c`` is remembered exactly when that is ``>= horizon`` (which only
    grows), and then ``chain[c]`` is the chain that had it first since it was last forgotten and
    ``c in continued`` says whether some request had a new content after it since then;
    ``n_chains`` chains were numbered. Forgotten entries are dropped once they are as many as the
    remembered ones could be.
    """

    def __init__(self, rate: float = 1.0) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"a shadow sample rate must lie in (0, 1], got {rate}")
        self.rate = float(rate)
        self.threshold = sample_threshold(self.rate)
        self.chain: dict[Hashable, int] = {}
        self.admitted: dict[Hashable, int] = {}
        self.continued: set[Hashable] = set()
        self.n_chains = self.n_admitted = self.horizon = 0

    def admits(self, contents: Sequence[Hashable], size: int) -> bool:
        """Number the chain of a request admitted with ``contents`` to a real cache of ``size``
        blocks; whether it is in the sample."""
        if self.rate >= 1.0:
            return True
        chain_of, admitted, continued = self.chain, self.admitted, self.continued
        self.horizon = max(self.horizon, self.n_admitted - chain_memory(size))
        chain = None
        for depth, content in enumerate(contents):
            known = admitted.get(content, self.horizon - 1) >= self.horizon
            admitted[content] = self.n_admitted
            self.n_admitted += 1
            if known:
                continue
            if chain is None:
                parent = contents[depth - 1] if depth else None
                chain = chain_of[parent] if depth and parent not in continued else self._new_chain()
            if depth:
                continued.add(contents[depth - 1])
            chain_of[content] = chain
            continued.discard(content)
        if chain is None:
            chain = chain_of[contents[-1]] if len(contents) else self._new_chain()
        if len(admitted) > 2 * chain_memory(size):
            self._drop_forgotten()
        return mixed(chain) < self.threshold

    def _drop_forgotten(self) -> None:
        for content in [c for c, at in self.admitted.items() if at < self.horizon]:
            del self.admitted[content], self.chain[content]
            self.continued.discard(content)

    def _new_chain(self) -> int:
        self.n_chains += 1
        return self.n_chains - 1


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

    The prefix cache's slot tables (three lists of ``capacity`` entries) are made the first time
    something reads them, as :class:`PrefixCache` would have made them at construction: a shadow
    only compiled, never fed (the reference a :class:`~kvprof.core.twin.CompiledTwin` keeps, whose
    compiled shadows are what run), reads only ``policy`` and ``limit`` and holds no slot.

    Parameters
    ----------
    policy : EvictionPolicy
        A fresh policy; the shadow passes it slot numbers as block ids.
    capacity : int
        Slots, as the real cache's; 0 until :meth:`set_limit` raises it.
    """

    def __init__(self, policy: EvictionPolicy, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
        self.policy = policy
        self.limit = capacity
        self._unmade = capacity  # the slots PrefixCache.__init__ makes, until something reads them
        self.held: dict[Hashable, list[int]] = {}
        self.workload: dict[Hashable, int] = {}
        self.hits = 0

    def __getattr__(self, name: str):
        """The prefix cache's state (Python asks here only for an attribute not set yet): made on
        first use, with the slots of the capacity given and the limit as it is now."""
        if name.startswith("__") or "_unmade" not in self.__dict__:
            raise AttributeError(name)
        capacity, limit = self.__dict__.pop("_unmade"), self.limit
        PrefixCache.__init__(self, self.policy, capacity)
        self.limit = limit  # a set_limit may have come first: it reads the slots after setting it
        return object.__getattribute__(self, name)

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

    def finish(self, request: Hashable, now: float, contents: Sequence[Hashable] = (), n_blocks: int = 0,
               n_output: int | None = None, finish: int | None = None) -> None:
        """``request`` finished: its policy is told (``n_output``: the tokens it generated, ``finish``: how
        its response ended, :mod:`kvprof.models.finish`), then its
        slots are freed tail-first (unknown requests are ignored).

        With ``contents`` (its whole chain now), the blocks it filled since admission are cached
        first, as vLLM caches each block once full: a held slot without content takes its
        depth's content in place, and it gets slots for the depths up to ``n_blocks`` it did not
        hold (cached below ``len(contents)``). A depth whose content is ``NO_BLOCK`` (a replay on
        recorded timing leaves the partial prompt block so) is cached nowhere, as in the real tier.
        """
        slots = self.held.pop(request, None)
        if slots is None:
            return
        workload = self.workload.pop(request)
        self.policy.finish(request, now, n_output=n_output, finish=finish)
        held = len(slots)
        for depth in range(min(held, len(contents))):
            slot, content = slots[depth], contents[depth]
            if content != NO_BLOCK and self.slot_block[slot] == NO_BLOCK and content not in self.block_slot:
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
