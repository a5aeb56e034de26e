"""vLLM's block pool with prefix caching over a compiled policy: the GPU tier and ``wa``'s shadows.

The compiled :class:`kvprof.policy.prefix_cache.PrefixCache`, rule for rule. The functions take any
*pool*: a struct with the fields of :func:`pool_fields` whose ``policy`` answers the pool protocol
as methods (``access``, ``free``, ``remove``, ``evict_n``, ``holds``, ``n_evictable``; numba
``overload_method`` s, registered for a whole policy, :data:`kvprof.core.wa.policy_type`, and
for a bare core, :data:`kvprof.core.policies.core_type`). The simulator's GPU tier
(:data:`kvprof.core.tiers.device_type`) is a pool over a whole policy; each of ``wa``'s shadows
(:data:`kvprof.core.shadow.shadow_type`) is a pool over a core. Contents are dense ids >= 0, so the
content-to-slot map is an array.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload_method

from kvprof.core.structs import NONE, check_ids, grown


def register_pool_protocol(struct_class, access, access_n, free, remove, remove_n, evict_n, holds,
                           n_evictable) -> None:
    """Make structs of ``struct_class`` answer the pool protocol by calling these compiled functions:
    ``access(p, block, now, workload, depth, hit, next_use, content)``, ``access_n(p, blocks, depths,
    contents, next_uses, n, now, workload, hit)`` (``access`` of each ``i < n`` in order),
    ``free(p, blocks, n, now)``, ``remove(p, block)``, ``remove_n(p, blocks, n)`` (``remove`` of
    ``blocks[:n]``, all evictable), ``evict_n(p, n, now, out, at)``, ``holds(p, block)``, ``n_evictable(p)``."""

    @overload_method(struct_class, "access")
    def _access(p, block, now, workload, depth, hit, next_use, content):
        return lambda p, block, now, workload, depth, hit, next_use, content: access(
            p, block, now, workload, depth, hit, next_use, content)

    @overload_method(struct_class, "access_n")
    def _access_n(p, blocks, depths, contents, next_uses, n, now, workload, hit):
        return lambda p, blocks, depths, contents, next_uses, n, now, workload, hit: access_n(
            p, blocks, depths, contents, next_uses, n, now, workload, hit)

    @overload_method(struct_class, "remove_n")
    def _remove_n(p, blocks, n):
        return lambda p, blocks, n: remove_n(p, blocks, n)

    @overload_method(struct_class, "free")
    def _free(p, blocks, n, now):
        return lambda p, blocks, n, now: free(p, blocks, n, now)

    @overload_method(struct_class, "remove")
    def _remove(p, block):
        return lambda p, block: remove(p, block)

    @overload_method(struct_class, "evict_n")
    def _evict_n(p, n, now, out, at):
        return lambda p, n, now, out, at: evict_n(p, n, now, out, at)

    @overload_method(struct_class, "holds")
    def _holds(p, block):
        return lambda p, block: holds(p, block)

    @overload_method(struct_class, "n_evictable")
    def _n_evictable(p):
        return lambda p: n_evictable(p)


def pool_fields(policy_type) -> list:
    """The fields of a pool over policies of ``policy_type``."""
    return [
        ("policy", policy_type),
        ("limit", types.int64), ("n_live", types.int64), ("n_slots", types.int64),
        # per slot and per content int32: slots and content numbers are ids (kvprof.core.structs.MAX_ID);
        # the per-slot ones cover the slots handed out so far (first_size)
        ("slot_block", types.int32[:]), ("refs", types.int32[:]),
        # the stack of empty slots: the never-used ones as a range, those made empty again above them
        ("empty", types.int32[:]), ("n_empty", types.int64), ("fresh", types.int64), ("fresh_end", types.int64),
        ("retired", types.int32[:]), ("n_retired", types.int64),
        ("block_slot", types.int32[:]),
        ("evictions", types.int64), ("dropped", types.int64),
        ("scratch", types.int64[:]),
    ]


#: The fewest entries a pool's per-slot tables start with (:func:`first_size`).
MIN_SLOTS = 4096


@njit(cache=True)
def first_size(capacity):
    """Entries the per-slot tables of a pool of ``capacity`` slots start with: ``capacity / 2**k`` rounded
    up, for the largest ``k`` that leaves at least :data:`MIN_SLOTS` (``capacity`` for a smaller pool).

    Never-used slots are handed out lowest first, and a table doubles when the next one is past its
    end, so the tables cover the slots used so far (at most twice over) and, after ``k`` doublings,
    all of them with fewer than ``2**k`` to spare: a pool costs what its traffic used, not its
    capacity from the start. A policy over the slots numbered from ``first_size(capacity)`` blocks
    grows the same way (:func:`kvprof.core.policies.reserve_blocks` doubles too).
    """
    k = 0
    while capacity >> (k + 1) >= MIN_SLOTS:
        k += 1
    return -(-capacity // (1 << k))


@njit(cache=True)
def init_pool(pool, policy, capacity, n_contents):
    """Make ``pool`` (a new struct with :func:`pool_fields`) a pool of ``capacity`` slots, all empty,
    the stack's top slot 0, for contents ``0 .. n_contents - 1`` (:func:`reserve_contents` grows it).

    Invariant (:func:`check_pool`): every slot is in exactly one place: empty, retired, pinned
    (``refs > 0``) or evictable in the policy (cached content, ``refs == 0``). The ``n_empty`` empty
    slots are a stack, top last: ``fresh_end - 1, ..., fresh`` (never used: no memory per slot),
    then ``empty[:n_empty - (fresh_end - fresh)]`` (made empty again, :func:`push_empty`).
    ``slot_block`` and ``refs`` cover every slot below ``fresh`` and every slot ever added by
    :func:`set_limit`: all but never-used ones (:func:`first_size`).
    """
    pool.policy = policy
    pool.limit = capacity
    pool.n_live = capacity
    pool.n_slots = capacity
    check_ids(max(capacity, n_contents))
    pool.slot_block = np.full(first_size(capacity), NONE, np.int32)
    pool.refs = np.zeros(first_size(capacity), np.int32)
    pool.empty = np.zeros(16, np.int32)
    pool.n_empty = capacity
    pool.fresh = 0
    pool.fresh_end = capacity
    pool.retired = np.zeros(16, np.int32)
    pool.n_retired = 0
    pool.block_slot = np.full(n_contents, NONE, np.int32)
    pool.evictions = 0
    pool.dropped = 0
    pool.scratch = np.zeros(64, np.int64)


@njit(cache=True)
def reserve_contents(pool, n_contents):
    """Make the content-to-slot map cover contents ``0 .. n_contents - 1``."""
    if n_contents > len(pool.block_slot):
        check_ids(n_contents)
        pool.block_slot = grown(pool.block_slot, n_contents, NONE)


@njit(cache=True)
def n_free(pool):
    """Slots a new request may take: empty plus evictable."""
    return pool.n_empty + pool.policy.n_evictable()


@njit(cache=True)
def cached_prefix(pool, blocks, start, n_lookup, out):
    """Slots of the longest cached prefix into ``out`` (``PrefixCache.cached_prefix``): their
    number, and how many of them are evictable now."""
    n_evictable = 0
    n = 0
    for j in range(start, start + n_lookup):
        slot = pool.block_slot[blocks[j]]
        if slot == NONE:
            break
        out[n] = slot
        n += 1
        if not pool.refs[slot]:
            n_evictable += 1
    return n, n_evictable


@njit(cache=True)
def pin_hits(pool, slots, n, now, workload, next_use, start):
    """Take hit slots for a request (``PrefixCache.pin_hits``, vLLM's ``touch``): the evictable
    ones out of the policy, then every one accessed, in one policy call each (a policy's removal
    of one block and access of another read nothing of each other, so the order between them is free)."""
    if not n:
        return
    refs, slot_block = pool.refs, pool.slot_block
    taken = np.empty(n, np.int64)
    contents = np.empty(n, np.int64)
    n_taken = 0
    for depth in range(n):
        slot = slots[depth]
        if not refs[slot]:
            taken[n_taken] = slot
            n_taken += 1
        refs[slot] += 1
        contents[depth] = slot_block[slot]
    policy = pool.policy
    if n_taken:
        policy.remove_n(taken, n_taken)
    policy.access_n(slots, np.arange(n), contents, next_use[start:start + n], n, now, workload, True)


@njit(cache=True)
def allocate(pool, blocks, next_use, start, first, n_cacheable, n_total, now, workload, out):
    """Slots for blocks ``first .. n_total - 1`` into ``out[first:n_total]`` (``PrefixCache.allocate``);
    the policy accesses the newly cached ones in one call."""
    n_new = n_total - first
    n_empty = min(pool.n_empty, n_new)
    for i in range(n_empty):  # the stack's top first
        out[first + i] = pop_empty(pool)
    if n_new > n_empty:
        at = first + n_empty
        pool.policy.evict_n(n_new - n_empty, now, out, at)
        for i in range(at, n_total):
            pool.block_slot[pool.slot_block[out[i]]] = NONE
        pool.evictions += n_new - n_empty
    refs, slot_block, block_slot = pool.refs, pool.slot_block, pool.block_slot
    cached = np.empty(max(n_new, 0), np.int64)
    depths = np.empty(max(n_new, 0), np.int64)
    contents = np.empty(max(n_new, 0), np.int64)
    next_uses = np.empty(max(n_new, 0))
    n_cached = 0
    for depth in range(first, n_total):
        slot = out[depth]
        refs[slot] = 1
        block = blocks[start + depth] if depth < n_cacheable else NONE
        if block != NONE and block_slot[block] == NONE:
            block_slot[block] = slot
            slot_block[slot] = block
            cached[n_cached], depths[n_cached], contents[n_cached] = slot, depth, block
            next_uses[n_cached] = next_use[start + depth]
            n_cached += 1
        else:
            slot_block[slot] = NONE
    if n_cached:
        pool.policy.access_n(cached, depths, contents, next_uses, n_cached, now, workload, False)


@njit(cache=True)
def cache_filled(pool, blocks, next_use, start, first, n_cacheable, n_held, now, workload, slots):
    """Cache, in place, the held slots of depths ``first .. min(n_held, n_cacheable) - 1`` that have no
    content yet (``PrefixCache.cache_filled``); the policy accesses them in one call."""
    n = min(n_held, n_cacheable) - first
    if n <= 0:
        return
    slot_block, block_slot = pool.slot_block, pool.block_slot
    cached = np.empty(n, np.int64)
    depths = np.empty(n, np.int64)
    contents = np.empty(n, np.int64)
    next_uses = np.empty(n)
    n_cached = 0
    for depth in range(first, first + n):
        slot, block = slots[depth], blocks[start + depth]
        if block != NONE and slot_block[slot] == NONE and block_slot[block] == NONE:
            block_slot[block] = slot
            slot_block[slot] = block
            cached[n_cached], depths[n_cached], contents[n_cached] = slot, depth, block
            next_uses[n_cached] = next_use[start + depth]
            n_cached += 1
    if n_cached:
        pool.policy.access_n(cached, depths, contents, next_uses, n_cached, now, workload, False)


@njit(cache=True)
def release(pool, slots, n, now):
    """A request finished: unpin its slots tail-first; cached ones become evictable."""
    if n > len(pool.scratch):
        pool.scratch = np.zeros(max(n, 2 * len(pool.scratch)), np.int64)
    evictable = pool.scratch
    k = 0
    for i in range(n - 1, -1, -1):
        slot = slots[i]
        pool.refs[slot] -= 1
        if not pool.refs[slot]:
            if pool.slot_block[slot] == NONE:
                push_empty(pool, slot)
            else:
                evictable[k] = slot
                k += 1
    if k:
        pool.policy.free(evictable, k, now)
    if pool.n_live > pool.limit:
        _shrink(pool, now)


@njit(cache=True)
def push_empty(pool, slot):
    pushed = pool.n_empty - (pool.fresh_end - pool.fresh)
    if pushed == len(pool.empty):
        pool.empty = grown(pool.empty, pushed + 1, 0)
    pool.empty[pushed] = slot
    pool.n_empty += 1


@njit(cache=True, inline="always")
def pop_empty(pool):
    """The empty slot on the stack's top, taken (there is one)."""
    pool.n_empty -= 1
    pushed = pool.n_empty - (pool.fresh_end - pool.fresh)
    if pushed >= 0:
        return np.int64(pool.empty[pushed])
    slot = pool.fresh
    pool.fresh += 1
    if slot >= len(pool.refs):  # the first never-used slot past the per-slot tables: they double
        pool.refs = grown(pool.refs, slot + 1, 0)
        pool.slot_block = grown(pool.slot_block, slot + 1, NONE)
    return slot


@njit(cache=True)
def set_limit(pool, limit, now):
    """Elastic capacity: raising adds empty slots, lowering drops free ones (pinned ones later)."""
    pool.limit = limit
    while pool.n_live < limit:
        if pool.n_retired:
            pool.n_retired -= 1
            slot = pool.retired[pool.n_retired]
        else:
            slot = pool.n_slots
            pool.n_slots += 1
            if slot >= len(pool.refs):
                pool.refs = grown(pool.refs, slot + 1, 0)
                pool.slot_block = grown(pool.slot_block, slot + 1, NONE)
        push_empty(pool, slot)
        pool.n_live += 1
    _shrink(pool, now)


@njit(cache=True)
def make_room(pool, n, now):
    """``PrefixCache.make_room``: ``n`` empty slots beyond the limit, dropped again as blocks are freed."""
    limit = pool.limit
    set_limit(pool, pool.n_live + n, now)
    pool.limit = limit


@njit(cache=True)
def _shrink(pool, now):
    """Drop empty, then evictable slots (the policy's order) until within the limit or none is free."""
    victim = np.zeros(1, np.int64)
    while pool.n_live > pool.limit and (pool.n_empty or pool.policy.n_evictable()):
        if pool.n_empty:
            slot = pop_empty(pool)
        else:
            pool.policy.evict_n(1, now, victim, 0)
            slot = victim[0]
            pool.block_slot[pool.slot_block[slot]] = NONE
            pool.slot_block[slot] = NONE
            pool.dropped += 1
        if pool.n_retired == len(pool.retired):
            pool.retired = grown(pool.retired, pool.n_retired + 1, 0)
        pool.retired[pool.n_retired] = slot
        pool.n_retired += 1
        pool.n_live -= 1


@njit(cache=True)
def mark_pool(pool, live):
    """Mark in ``live`` (a flag per content number) the contents the pool's slots hold."""
    for slot in range(min(pool.n_slots, len(pool.slot_block))):  # (never-used slots hold nothing)
        content = pool.slot_block[slot]
        if content != NONE:
            live[content] = True


@njit(cache=True)
def check_pool(pool):
    """Raise if the pool's invariant does not hold (tests; O(slots))."""
    covered = len(pool.slot_block)
    if len(pool.refs) != covered or pool.fresh > covered:
        raise AssertionError("the per-slot tables do not cover the slots handed out")
    place = np.zeros(pool.n_slots, np.int64)
    pushed = pool.empty[:pool.n_empty - (pool.fresh_end - pool.fresh)].astype(np.int64)
    for slot in pushed:
        if slot >= covered:
            raise AssertionError("an empty slot made empty again is past the per-slot tables")
    for slot in np.concatenate((np.arange(pool.fresh, pool.fresh_end), pushed)):
        place[slot] += 1
        if slot < covered and pool.slot_block[slot] != NONE:
            raise AssertionError("an empty slot holds content")
    for i in range(pool.n_retired):
        place[pool.retired[i]] += 1
        if pool.retired[i] >= covered or pool.slot_block[pool.retired[i]] != NONE:
            raise AssertionError("a retired slot holds content or is past the per-slot tables")
    n_evictable = 0
    for slot in range(pool.n_slots):
        pinned = slot < covered and pool.refs[slot] > 0
        evictable = pool.policy.holds(slot)
        block = pool.slot_block[slot] if slot < covered else NONE
        place[slot] += pinned + evictable
        if evictable:
            n_evictable += 1
            if block == NONE:
                raise AssertionError("an evictable slot holds no content")
        if place[slot] != 1:
            raise AssertionError("a slot is in more or fewer than one place (empty, retired, pinned, evictable)")
        if block != NONE and pool.block_slot[block] != slot:
            raise AssertionError("block_slot and slot_block disagree")
    if n_evictable != pool.policy.n_evictable():
        raise AssertionError("the policy counts other blocks than it holds")
    if pool.n_live != pool.n_slots - pool.n_retired:
        raise AssertionError("live slots miscounted")
    if pool.n_live > pool.limit and (pool.n_empty or pool.policy.n_evictable()):
        raise AssertionError("over the capacity limit with free slots")
