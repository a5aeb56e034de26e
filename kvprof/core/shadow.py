"""Compiled shadow caches: :class:`kvprof.policy.shadow.ShadowCache`'s twin.

A shadow is a pool of :mod:`kvprof.core.prefix_cache` over one candidate order's core, fed the
real cache's whole requests (admitted, then finished), so that ``wa`` (:mod:`kvprof.core.wa`)
can count the hits each candidate would have had at the same capacity.

The shadows are fed through a :data:`feed_type`: each admission and finish ``wa`` is told is
queued, and the shadows work through the queue a slice (at most
:data:`~kvprof.policy.shadow.SHADOW_SLICE` blocks) at a time, in whichever calls drain it
(:func:`feed_drain`: the vLLM pool drains a little in each of its calls, so no call on vLLM's
scheduler thread does a long request's shadow work at once). What ``wa`` reads of them, their
hits and an adaptive shadow's weight, is what they held right after the operation
:data:`~kvprof.policy.shadow.SHADOW_LAG` operations back (:func:`feed_sync`, which finishes that
operation first if a drain has not): so the same operations give the same readings whoever
drains, and when.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.experimental import structref
from numba.typed import List

from kvprof.core import structs
from kvprof.core.policies import LEARNED, core_type
from kvprof.core.prefix_cache import (
    cached_prefix, init_pool, make_room, n_free, pool_fields, push_empty, reserve_contents, set_limit,
)
from kvprof.core.seats import seat_slots
from kvprof.core.structs import NONE, grown
from kvprof.policy.shadow import SHADOW_LAG, SHADOW_SLICE


class ShadowType(structs.StructType):
    pass


class Shadow(structref.StructRefProxy):
    """Python handle of a compiled shadow cache."""


#: Slots a shadow holds per running request: ``seats[seat][:seat_n[seat]]`` (``seat_n`` 0: none).
SLOT_LIST = types.int64[:]

shadow_type = structs.struct(ShadowType, Shadow, pool_fields(core_type) + [
    ("hits", types.int64),
    ("seats", types.ListType(SLOT_LIST)),
    ("seat_n", types.int64[:]),
    ("seat_workload", types.int64[:]),
])


# -- a shadow's requests ------------------------------------------------------------------------
@njit(cache=True)
def new_shadow(core, capacity):
    """:class:`kvprof.policy.shadow.ShadowCache` over ``core`` (a fresh core; it sees slot numbers),
    ``capacity`` slots (0: none until :func:`~kvprof.core.prefix_cache.set_limit` raises it).

    Invariant: the pool's, and ``seats[s][:seat_n[s]]`` are the slots of the running request
    admitted as seat ``s``, chain order.
    """
    shadow = structref.new(shadow_type)
    init_pool(shadow, core, capacity, 0)
    shadow.hits = 0
    shadow.seats = List.empty_list(SLOT_LIST)
    shadow.seat_n = np.zeros(16, np.int64)
    shadow.seat_workload = np.zeros(16, np.int64)
    return shadow


# -- a shadow's requests, a slice at a time ------------------------------------------------------
# Each phase below does one step of prefix_cache's pin_hits / allocate / release, SHADOW_SLICE
# blocks at a time: the same calls into the core in the same order, whole evictions before any
# access as allocate makes them (a core's evict_n of a + b blocks is its evict_n of a, then of b),
# so a shadow fed a slice at a time ends exactly where one fed whole requests does.
@njit(cache=True)
def _reserve_chain(shadow, contents):
    """Make the content-to-slot map cover ``contents``; the work it cost, in blocks (growing the
    map copies it: counted so that one drain does not grow six shadows' maps)."""
    top = -1
    for content in contents:
        top = max(top, content)
    before = len(shadow.block_slot)
    reserve_contents(shadow, top + 1)
    return (len(shadow.block_slot) - before) // 256


@njit(cache=True)
def _take_empty(shadow, slots, first, n_new):
    """``allocate``'s first step: empty slots (the stack's top first) for depths ``first ..``;
    returns how many (the rest are evicted)."""
    n_empty = min(shadow.n_empty, n_new)
    for i in range(n_empty):
        shadow.n_empty -= 1
        slots[first + i] = shadow.empty[shadow.n_empty]
    return n_empty


@njit(cache=True)
def _evict_slice(shadow, slots, pos, stop, now):
    """``allocate``'s eviction, for depths ``pos .. stop - 1``."""
    shadow.policy.evict_n(stop - pos, now, slots, pos)
    for i in range(pos, stop):
        shadow.block_slot[shadow.slot_block[slots[i]]] = NONE
    shadow.evictions += stop - pos


@njit(cache=True)
def _cache_slice(shadow, contents, never, slots, pos, stop, now, workload):
    """``allocate``'s last step, for depths ``pos .. stop - 1``: pin each new slot, cache its content."""
    for depth in range(pos, stop):
        slot = slots[depth]
        shadow.refs[slot] = 1
        block = contents[depth] if depth < len(contents) else NONE
        if block != NONE and shadow.block_slot[block] == NONE:
            shadow.block_slot[block] = slot
            shadow.slot_block[slot] = block
            shadow.policy.access(slot, now, workload, depth, False, never[depth], block)
        else:
            shadow.slot_block[slot] = NONE


@njit(cache=True)
def _pin_slice(shadow, slots, pos, stop, now, workload, never):
    """``pin_hits`` of the hit slots at depths ``pos .. stop - 1``."""
    policy = shadow.policy
    for depth in range(pos, stop):
        slot = slots[depth]
        if not shadow.refs[slot]:
            policy.remove(slot)
        shadow.refs[slot] += 1
        policy.access(slot, now, workload, depth, True, never[depth], np.int64(shadow.slot_block[slot]))


@njit(cache=True)
def _allocate_slice(shadow, feed, i, contents, never, slots, now, workload, phase, pos, end):
    """Phases 2 (evictions, ``pos`` from the first depth no empty slot took) and 3 (caching,
    from the first new depth ``a``) of an allocation up to depth ``end``. Returns ``(blocks
    worked, whether the allocation is complete)``."""
    if phase == 2 and pos == end:  # no more to evict
        phase = feed.phase[i] = 3
        pos = feed.pos[i] = feed.a[i]
    stop = min(pos + SHADOW_SLICE, end)
    if phase == 2:
        _evict_slice(shadow, slots, pos, stop, now)
        feed.pos[i] = stop
        return stop - pos, False
    _cache_slice(shadow, contents, never, slots, pos, stop, now, workload)
    feed.pos[i] = stop
    return max(stop - pos, 1), stop == end


@njit(cache=True)
def _start_allocation(shadow, feed, i, slots, first, end):
    """Empty slots for depths ``first ..`` of an allocation up to ``end``; the evictions next."""
    feed.a[i] = first
    feed.phase[i] = 2
    feed.pos[i] = first + _take_empty(shadow, slots, first, end - first)


@njit(cache=True)
def _admit_slice(shadow, feed, i, r, never):
    """The next slice of shadow ``i``'s admission of queued operation ``r`` (``shadow_admit`` as
    :class:`~kvprof.policy.shadow.ShadowCache.admit`): phase 0 looks the chain up and makes room,
    1 pins the hits (``pos`` below ``a``, their number), 2 and 3 allocate the rest. Returns
    ``(blocks worked, whether the admission is complete)``."""
    seat, now, workload, n_blocks = feed.seat[r], feed.now[r], feed.workload[r], feed.n_blocks[r]
    contents = feed.contents[r][:feed.length[r]]
    phase, pos = feed.phase[i], feed.pos[i]
    if phase == 0:
        if shadow.limit < feed.limit[r]:  # no capacity given: the most blocks seen
            set_limit(shadow, feed.limit[r], now)
        grew = _reserve_chain(shadow, contents)
        if seat >= len(shadow.seat_n):
            shadow.seat_n = grown(shadow.seat_n, seat + 1, 0)
            shadow.seat_workload = grown(shadow.seat_workload, seat + 1, 0)
        slots = seat_slots(shadow.seats, seat, n_blocks)
        n_hits, n_hit_evictable = cached_prefix(shadow, contents, 0, feed.n_lookup[r], slots)
        short = n_blocks - n_hits - (n_free(shadow) - n_hit_evictable)
        if short > 0:
            make_room(shadow, short, now)
        feed.a[i] = n_hits
        feed.phase[i] = 1
        return 1 + feed.n_lookup[r] // 16 + grew, False
    slots = shadow.seats[seat]
    n_hits = feed.a[i] if phase == 1 else 0
    if phase == 1:
        stop = min(pos + SHADOW_SLICE, n_hits)
        _pin_slice(shadow, slots, pos, stop, now, workload, never)
        feed.pos[i] = stop
        if stop == n_hits:  # the hits are taken: now the empty slots, before any eviction
            _start_allocation(shadow, feed, i, slots, n_hits, n_blocks)
        return max(stop - pos, 1), False
    worked, done = _allocate_slice(shadow, feed, i, contents, never, slots, now, workload, phase, pos, n_blocks)
    if done:
        shadow.seat_n[seat] = n_blocks
        shadow.seat_workload[seat] = workload
        shadow.hits += feed.a[i]  # the first new depth: the hits
    return worked, done


@njit(cache=True)
def _finish_slice(shadow, feed, i, r, never):
    """The next slice of shadow ``i``'s finish of queued operation ``r``
    (:meth:`~kvprof.policy.shadow.ShadowCache.finish`; ``contents``, the chain now, may be empty,
    ``NONE`` where a depth has no content: a replay's partial prompt block, never cached).
    Phase 1 caches what the request filled in the ``held`` slots it held, 2 and 3 give it the
    depths up to ``b`` it did not hold, 4 unpins its slots tail first, 5 frees the cached ones to
    the core. Returns ``(blocks worked, whether the finish is complete)``."""
    seat, now = feed.seat[r], feed.now[r]
    contents = feed.contents[r][:feed.length[r]]
    n_full = len(contents)
    phase, pos = feed.phase[i], feed.pos[i]
    if phase == 0:
        held = shadow.seat_n[seat] if seat < len(shadow.seat_n) else 0
        if not held:
            return 1, True
        grew = _reserve_chain(shadow, contents)
        feed.a[i] = held
        feed.b[i] = max(feed.n_blocks[r], n_full)
        feed.phase[i] = 1
        return 1 + grew, False
    workload = shadow.seat_workload[seat]
    slots = shadow.seats[seat]
    if phase == 1:
        held, n_blocks = feed.a[i], feed.b[i]
        n_cache = min(held, n_full)
        stop = min(pos + SHADOW_SLICE, n_cache)
        for depth in range(pos, stop):
            slot, content = slots[depth], contents[depth]
            # NONE would index the highest content's entry: a hole stays empty, as the real tier leaves it
            if content != NONE and shadow.slot_block[slot] == NONE and shadow.block_slot[content] == NONE:
                shadow.block_slot[content] = slot
                shadow.slot_block[slot] = content
                shadow.policy.access(slot, now, workload, depth, False, np.inf, content)
        feed.pos[i] = stop
        if stop < n_cache:
            return stop - pos, False
        if n_blocks > held:
            if len(slots) < n_blocks:
                slots = grown(slots, n_blocks, 0)
                shadow.seats[seat] = slots
            short = n_blocks - held - n_free(shadow)
            if short > 0:
                make_room(shadow, short, now)
            _start_allocation(shadow, feed, i, slots, held, n_blocks)
        else:
            feed.phase[i], feed.b[i] = 4, held
        return max(stop - pos, 1), False
    if phase <= 3:
        worked, done = _allocate_slice(shadow, feed, i, contents, never, slots, now, workload, phase, pos, feed.b[i])
        if done:
            feed.phase[i] = 4
        return worked, False
    n_held = feed.b[i]
    if phase == 4:  # release's unpinning, tail first: emptied slots go back, cached ones are freed next
        if n_held > len(shadow.scratch):
            shadow.scratch = np.zeros(max(n_held, 2 * len(shadow.scratch)), np.int64)
        k = 0
        for j in range(n_held - 1, -1, -1):
            slot = slots[j]
            shadow.refs[slot] -= 1
            if not shadow.refs[slot]:
                if shadow.slot_block[slot] == NONE:
                    push_empty(shadow, slot)
                else:
                    shadow.scratch[k] = slot
                    k += 1
        feed.phase[i], feed.pos[i], feed.a[i] = 5, 0, k
        return 1 + n_held // 16, False
    k = feed.a[i]
    # a learned core bins the blocks freed together by their deepest: it takes them in one call
    stop = k if shadow.policy.kind == LEARNED else min(pos + SHADOW_SLICE, k)
    if stop > pos:
        shadow.policy.free(shadow.scratch[pos:stop], stop - pos, now)
    feed.pos[i] = stop
    if stop < k:
        return stop - pos, False
    if shadow.n_live > shadow.limit:  # release's shrink back to the limit
        set_limit(shadow, shadow.limit, now)
    shadow.seat_n[seat] = 0
    return max(stop - pos, 1), True


# -- the queue that feeds the shadows -----------------------------------------------------------
class FeedType(structs.StructType):
    pass


class Feed(structref.StructRefProxy):
    """Python handle of a shadows' feed."""


#: Operations held in the feed's ring: the last ``SHADOW_LAG`` ones, the one read and the one coming.
FEED_RING = SHADOW_LAG + 2
SKIP, ADMIT, FINISH = 0, 1, 2

feed_type = structs.struct(FeedType, Feed, [
    # operation k is at ring index k % FEED_RING: its kind, seat, chain (contents[r][:length[r]]) ...
    ("kind", types.int64[:]), ("seat", types.int64[:]), ("length", types.int64[:]),
    ("contents", types.ListType(SLOT_LIST)),
    ("n_lookup", types.int64[:]), ("n_blocks", types.int64[:]), ("workload", types.int64[:]),
    ("limit", types.int64[:]), ("now", types.float64[:]),
    ("n_ops", types.int64),  # operations queued so far
    # shadow i works on operation op[i], in phase[i] at pos[i] (a, b: what the operation found)
    ("op", types.int64[:]), ("phase", types.int64[:]), ("pos", types.int64[:]),
    ("a", types.int64[:]), ("b", types.int64[:]),
    # shadow i's hits and weight right after operation k: log_*[k % FEED_RING, i]
    ("log_hits", types.int64[:, :]), ("log_beta", types.float64[:, :]),
    ("visible_hits", types.int64[:]), ("visible_beta", types.float64[:]),
])


@njit(cache=True)
def new_feed(shadows):
    """An empty feed of ``shadows``.

    Invariant: every shadow has done operations ``0 .. op[i] - 1`` in order and is ``phase[i]``
    into ``op[i]`` (< ``n_ops``: queued; == ``n_ops``: idle); each operation ``k`` in the ring
    (``k > n_ops - FEED_RING``) is queued there; after :func:`feed_sync`, every
    ``op[i] > n_ops - 1 - SHADOW_LAG`` and ``visible_*`` are ``log_*`` of operation
    ``n_ops - 1 - SHADOW_LAG`` (before the first such: no hits, each shadow's starting weight).
    """
    n = len(shadows)
    feed = structref.new(feed_type)
    feed.kind = np.zeros(FEED_RING, np.int64)
    feed.seat = np.zeros(FEED_RING, np.int64)
    feed.length = np.zeros(FEED_RING, np.int64)
    feed.contents = List.empty_list(SLOT_LIST)
    for _ in range(FEED_RING):
        feed.contents.append(np.zeros(16, np.int64))
    feed.n_lookup = np.zeros(FEED_RING, np.int64)
    feed.n_blocks = np.zeros(FEED_RING, np.int64)
    feed.workload = np.zeros(FEED_RING, np.int64)
    feed.limit = np.zeros(FEED_RING, np.int64)
    feed.now = np.zeros(FEED_RING)
    feed.n_ops = 0
    feed.op = np.zeros(n, np.int64)
    feed.phase = np.zeros(n, np.int64)
    feed.pos = np.zeros(n, np.int64)
    feed.a = np.zeros(n, np.int64)
    feed.b = np.zeros(n, np.int64)
    feed.log_hits = np.zeros((FEED_RING, n), np.int64)
    feed.log_beta = np.zeros((FEED_RING, n))
    feed.visible_hits = np.zeros(n, np.int64)
    feed.visible_beta = np.zeros(n)
    for i in range(n):
        feed.visible_beta[i] = shadows[i].policy.beta
    return feed


@njit(cache=True)
def feed_push(feed, kind, seat, contents, n_lookup, n_blocks, now, workload, limit):
    """Queue an operation (``SKIP``: a request outside the shadows' sample, which only counts);
    call :func:`feed_sync` after it."""
    r = feed.n_ops % FEED_RING
    n = len(contents)
    if len(feed.contents[r]) < n:
        feed.contents[r] = np.zeros(max(n, 2 * len(feed.contents[r])), np.int64)
    feed.contents[r][:n] = contents
    feed.length[r] = n
    feed.kind[r], feed.seat[r], feed.n_lookup[r], feed.n_blocks[r] = kind, seat, n_lookup, n_blocks
    feed.now[r], feed.workload[r], feed.limit[r] = now, workload, limit
    feed.n_ops += 1


@njit(cache=True)
def _advance(feed, shadows, i, never):
    """Shadow ``i`` does the next slice of its operation; returns the blocks it worked (>= 1)."""
    r = feed.op[i] % FEED_RING
    kind = feed.kind[r]
    shadow = shadows[i]
    if kind == ADMIT:
        worked, done = _admit_slice(shadow, feed, i, r, never)
    elif kind == FINISH:
        worked, done = _finish_slice(shadow, feed, i, r, never)
    else:
        worked, done = 1, True
    if done:
        feed.log_hits[r, i] = shadow.hits
        feed.log_beta[r, i] = shadow.policy.beta
        feed.op[i] += 1
        feed.phase[i] = 0
        feed.pos[i] = 0
    return worked


@njit(cache=True)
def feed_sync(feed, shadows, never):
    """Finish operation ``n_ops - 1 - SHADOW_LAG`` in every shadow (if a drain has not) and read
    the shadows as they were right after it."""
    read = feed.n_ops - 1 - SHADOW_LAG
    if read < 0:
        return
    for i in range(len(shadows)):
        while feed.op[i] <= read:
            _advance(feed, shadows, i, never)
        feed.visible_hits[i] = feed.log_hits[read % FEED_RING, i]
        feed.visible_beta[i] = feed.log_beta[read % FEED_RING, i]


@njit(cache=True)
def feed_drain(feed, shadows, never, budget):
    """Work through queued operations, the least advanced shadow first, until about ``budget``
    blocks were worked (at most one slice more); returns whether work is left."""
    while True:
        i = 0
        for j in range(1, len(shadows)):
            if feed.op[j] < feed.op[i]:
                i = j
        if not len(shadows) or feed.op[i] >= feed.n_ops:
            return False
        if budget <= 0:
            return True
        budget -= _advance(feed, shadows, i, never)


@njit(cache=True)
def mark_feed(feed, live):
    """Mark in ``live`` the contents of the operations some shadow has not finished."""
    first = feed.n_ops
    for i in range(len(feed.op)):
        first = min(first, feed.op[i])
    for k in range(first, feed.n_ops):
        r = k % FEED_RING
        chain = feed.contents[r]
        for j in range(feed.length[r]):
            content = chain[j]
            if 0 <= content < len(live):
                live[content] = True
