"""The simulator's two cache tiers, compiled: :class:`kvprof.sim.cache.PrefixCache` and
:class:`kvprof.sim.cache.HostCache` with the same rules, driving a compiled policy.

Engine blocks are dense ids (``Workload.block``), so the content-to-slot maps are arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.experimental import structref

from kvprof.core import structs
from kvprof.core.policy import (
    policy_access, policy_contains, policy_evict_n, policy_free, policy_remove, policy_type,
)
from kvprof.core.structs import NONE, grown


class DeviceType(structs.StructType):
    pass


class Device(structref.StructRefProxy):
    """Python handle of a compiled GPU tier."""


class HostType(structs.StructType):
    pass


class Host(structref.StructRefProxy):
    """Python handle of a compiled CPU tier."""


device_type = structs.struct(DeviceType, Device, [
    ("policy", policy_type),
    ("limit", types.int64), ("n_live", types.int64), ("n_slots", types.int64),
    ("slot_block", types.int64[:]), ("refs", types.int64[:]),
    ("empty", types.int64[:]), ("n_empty", types.int64),
    ("retired", types.int64[:]), ("n_retired", types.int64),
    ("block_slot", types.int64[:]),
    ("evictions", types.int64), ("dropped", types.int64),
    ("scratch", types.int64[:]),
])

host_type = structs.struct(HostType, Host, [
    ("policy", policy_type),
    ("capacity", types.int64),
    ("block_slot", types.int64[:]), ("slot_block", types.int64[:]),
    ("empty", types.int64[:]), ("n_empty", types.int64),
    ("evictions", types.int64),
    ("scratch", types.int64[:]),
])


# -- GPU ----------------------------------------------------------------------------------------
@njit(cache=True)
def new_device(policy, capacity, n_contents):
    """The GPU tier (``PrefixCache``): every slot empty, the stack's top slot 0.

    Invariant (:func:`check_device`): every slot is in exactly one place: empty, retired, pinned
    (``refs > 0``) or evictable in the policy (cached content, ``refs == 0``).
    """
    gpu = structref.new(device_type)
    gpu.policy = policy
    gpu.limit = capacity
    gpu.n_live = capacity
    gpu.n_slots = capacity
    gpu.slot_block = np.full(capacity, NONE, np.int64)
    gpu.refs = np.zeros(capacity, np.int64)
    gpu.empty = np.arange(capacity - 1, -1, -1).astype(np.int64)
    gpu.n_empty = capacity
    gpu.retired = np.zeros(16, np.int64)
    gpu.n_retired = 0
    gpu.block_slot = np.full(n_contents, NONE, np.int64)
    gpu.evictions = 0
    gpu.dropped = 0
    gpu.scratch = np.zeros(64, np.int64)
    return gpu


@njit(cache=True)
def n_free(gpu):
    """Slots a new request may take: empty plus evictable."""
    return gpu.n_empty + gpu.policy.main.size


@njit(cache=True)
def cached_prefix(gpu, blocks, start, n_lookup, out):
    """Slots of the longest cached prefix into ``out`` (``PrefixCache.cached_prefix``): their
    number, and how many of them are evictable now."""
    n_evictable = 0
    n = 0
    for j in range(start, start + n_lookup):
        slot = gpu.block_slot[blocks[j]]
        if slot == NONE:
            break
        out[n] = slot
        n += 1
        if not gpu.refs[slot]:
            n_evictable += 1
    return n, n_evictable


@njit(cache=True)
def pin_hits(gpu, slots, n, now, workload, next_use, start):
    """Take hit slots for a request (``PrefixCache.pin_hits``, vLLM's ``touch``)."""
    policy = gpu.policy
    for depth in range(n):
        slot = slots[depth]
        if not gpu.refs[slot]:
            policy_remove(policy, slot)
        gpu.refs[slot] += 1
        policy_access(policy, slot, now, workload, depth, True, next_use[start + depth], gpu.slot_block[slot])


@njit(cache=True)
def allocate(gpu, blocks, next_use, start, first, n_cacheable, n_total, now, workload, out):
    """Slots for blocks ``first .. n_total - 1`` into ``out[first:n_total]`` (``PrefixCache.allocate``)."""
    n_new = n_total - first
    n_empty = min(gpu.n_empty, n_new)
    for i in range(n_empty):  # the stack's top first
        gpu.n_empty -= 1
        out[first + i] = gpu.empty[gpu.n_empty]
    if n_new > n_empty:
        at = first + n_empty
        policy_evict_n(gpu.policy, n_new - n_empty, now, out, at)
        for i in range(at, n_total):
            gpu.block_slot[gpu.slot_block[out[i]]] = NONE
        gpu.evictions += n_new - n_empty
    policy = gpu.policy
    for depth in range(first, n_total):
        slot = out[depth]
        gpu.refs[slot] = 1
        block = blocks[start + depth] if depth < n_cacheable else NONE
        if block != NONE and gpu.block_slot[block] == NONE:
            gpu.block_slot[block] = slot
            gpu.slot_block[slot] = block
            policy_access(policy, slot, now, workload, depth, False, next_use[start + depth], block)
        else:
            gpu.slot_block[slot] = NONE


@njit(cache=True)
def release(gpu, slots, n, now):
    """A request finished: unpin its slots tail-first; cached ones become evictable."""
    if n > len(gpu.scratch):
        gpu.scratch = np.zeros(max(n, 2 * len(gpu.scratch)), np.int64)
    evictable = gpu.scratch
    k = 0
    for i in range(n - 1, -1, -1):
        slot = slots[i]
        gpu.refs[slot] -= 1
        if not gpu.refs[slot]:
            if gpu.slot_block[slot] == NONE:
                push_empty(gpu, slot)
            else:
                evictable[k] = slot
                k += 1
    if k:
        policy_free(gpu.policy, evictable, k, now)
    if gpu.n_live > gpu.limit:
        _shrink(gpu, now)


@njit(cache=True)
def push_empty(gpu, slot):
    if gpu.n_empty == len(gpu.empty):
        gpu.empty = grown(gpu.empty, gpu.n_empty + 1, 0)
    gpu.empty[gpu.n_empty] = slot
    gpu.n_empty += 1


@njit(cache=True)
def set_limit(gpu, limit, now):
    """Elastic capacity: raising adds empty slots, lowering drops free ones (pinned ones later)."""
    gpu.limit = limit
    while gpu.n_live < limit:
        if gpu.n_retired:
            gpu.n_retired -= 1
            slot = gpu.retired[gpu.n_retired]
        else:
            slot = gpu.n_slots
            gpu.n_slots += 1
            if slot >= len(gpu.refs):
                gpu.refs = grown(gpu.refs, slot + 1, 0)
                gpu.slot_block = grown(gpu.slot_block, slot + 1, NONE)
        push_empty(gpu, slot)
        gpu.n_live += 1
    _shrink(gpu, now)


@njit(cache=True)
def _shrink(gpu, now):
    """Drop empty, then evictable slots (the policy's order) until within the limit or none is free."""
    victim = np.zeros(1, np.int64)
    while gpu.n_live > gpu.limit and (gpu.n_empty or gpu.policy.main.size):
        if gpu.n_empty:
            gpu.n_empty -= 1
            slot = gpu.empty[gpu.n_empty]
        else:
            policy_evict_n(gpu.policy, 1, now, victim, 0)
            slot = victim[0]
            gpu.block_slot[gpu.slot_block[slot]] = NONE
            gpu.slot_block[slot] = NONE
            gpu.dropped += 1
        if gpu.n_retired == len(gpu.retired):
            gpu.retired = grown(gpu.retired, gpu.n_retired + 1, 0)
        gpu.retired[gpu.n_retired] = slot
        gpu.n_retired += 1
        gpu.n_live -= 1


@njit(cache=True)
def check_device(gpu):
    """Raise if the GPU tier's invariant does not hold (tests; O(slots))."""
    place = np.zeros(gpu.n_slots, np.int64)
    for i in range(gpu.n_empty):
        place[gpu.empty[i]] += 1
        if gpu.slot_block[gpu.empty[i]] != NONE:
            raise AssertionError("an empty slot holds content")
    for i in range(gpu.n_retired):
        place[gpu.retired[i]] += 1
        if gpu.slot_block[gpu.retired[i]] != NONE:
            raise AssertionError("a retired slot holds content")
    n_evictable = 0
    for slot in range(gpu.n_slots):
        pinned = gpu.refs[slot] > 0
        evictable = policy_contains(gpu.policy, slot)
        place[slot] += pinned + evictable
        if evictable:
            n_evictable += 1
            if gpu.slot_block[slot] == NONE:
                raise AssertionError("an evictable slot holds no content")
        if place[slot] != 1:
            raise AssertionError("a slot is in more or fewer than one place (empty, retired, pinned, evictable)")
        block = gpu.slot_block[slot]
        if block != NONE and gpu.block_slot[block] != slot:
            raise AssertionError("block_slot and slot_block disagree")
    if n_evictable != gpu.policy.main.size:
        raise AssertionError("the policy counts other blocks than it holds")
    if gpu.n_live != gpu.n_slots - gpu.n_retired:
        raise AssertionError("live slots miscounted")
    if gpu.n_live > gpu.limit and (gpu.n_empty or gpu.policy.main.size):
        raise AssertionError("over the capacity limit with free slots")


# -- CPU ----------------------------------------------------------------------------------------
@njit(cache=True)
def new_host(policy, capacity, n_contents):
    """The CPU tier (``HostCache``). Invariant: every cached block's slot is evictable in the
    policy between calls; at most ``capacity`` blocks are cached."""
    host = structref.new(host_type)
    host.policy = policy
    host.capacity = capacity
    host.block_slot = np.full(n_contents, NONE, np.int64)
    host.slot_block = np.full(capacity, NONE, np.int64)
    host.empty = np.arange(capacity - 1, -1, -1).astype(np.int64)
    host.n_empty = capacity
    host.evictions = 0
    host.scratch = np.zeros(64, np.int64)
    return host


@njit(cache=True)
def cached_run(host, blocks, start, stop):
    """Length of the run of ``blocks[start:stop]`` cached here, from ``start``."""
    j = start
    while j < stop and host.block_slot[blocks[j]] != NONE:
        j += 1
    return j - start


@njit(cache=True)
def _scratch(host, n):
    if n > len(host.scratch):
        host.scratch = np.zeros(max(n, 2 * len(host.scratch)), np.int64)
    return host.scratch


@njit(cache=True)
def load(host, blocks, next_use, start, first, stop, now, workload):
    """Hits at depths ``first .. stop - 1`` are read back to the GPU: a touch for the host policy."""
    policy = host.policy
    touched = _scratch(host, stop - first)
    k = stop - first
    for depth in range(first, stop):
        block = blocks[start + depth]
        slot = host.block_slot[block]
        policy_remove(policy, slot)
        policy_access(policy, slot, now, workload, depth, True, next_use[start + depth], block)
        k -= 1
        touched[k] = slot  # reversed: freed tail first
    policy_free(policy, touched, stop - first, now)


@njit(cache=True)
def store(host, blocks, next_use, start, n_depths, now, workload):
    """Store blocks ``0 .. n_depths - 1`` not already here, evicting in the host policy's order."""
    policy = host.policy
    stored = _scratch(host, n_depths)
    victim = np.zeros(1, np.int64)
    k = 0
    for depth in range(n_depths):
        block = blocks[start + depth]
        if host.block_slot[block] != NONE:
            continue
        if host.n_empty:
            host.n_empty -= 1
            slot = host.empty[host.n_empty]
        elif policy.main.size:
            policy_evict_n(policy, 1, now, victim, 0)
            slot = victim[0]
            host.block_slot[host.slot_block[slot]] = NONE
            host.evictions += 1
        else:
            break  # every host slot holds this request's own blocks
        host.block_slot[block] = slot
        host.slot_block[slot] = block
        policy_access(policy, slot, now, workload, depth, False, next_use[start + depth], block)
        stored[k] = slot
        k += 1
    stored[:k] = stored[:k][::-1].copy()
    if k:
        policy_free(policy, stored, k, now)


@njit(cache=True)
def check_host(host):
    """Raise if the CPU tier's invariant does not hold (tests)."""
    n_cached = 0
    for slot in range(host.capacity):
        block = host.slot_block[slot]
        if block != NONE and host.block_slot[block] == slot:
            n_cached += 1
            if not policy_contains(host.policy, slot):
                raise AssertionError("a cached host block is not evictable")
    if n_cached != host.policy.main.size or n_cached + host.n_empty != host.capacity:
        raise AssertionError("host blocks miscounted")


@njit(cache=True)
def counts(gpu):
    """GPU evictions and drops so far."""
    return gpu.evictions, gpu.dropped


@njit(cache=True)
def counts_host(host):
    return host.evictions
