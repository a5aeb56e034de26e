"""The simulator's two cache tiers, compiled: :class:`kvprof.sim.cache.PrefixCache` and
:class:`kvprof.sim.cache.HostCache` with the same rules, driving a compiled policy.

The GPU tier is a pool of :mod:`kvprof.core.prefix_cache` over a whole policy; its functions
(``cached_prefix``, ``pin_hits``, ``allocate``, ``cache_filled``, ``release``, ``push_empty``,
``set_limit``, ``n_free``, ``check_device``, ``reserve_contents``) are imported from there and used from here. Engine
blocks are dense ids (numbered as the replay streams them, :mod:`kvprof.core.stream`), so the
content-to-slot maps are arrays, grown as new contents come; the numbers of contents nothing holds
any more go to new ones (:func:`recycle_contents`), so the arrays stay within a multiple of what
the tiers and their policies hold.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.experimental import structref

from kvprof.core import stream, structs
from kvprof.core.wa import (
    mark_policy, policy_access, policy_contains, policy_evict_n, policy_free, policy_remove, policy_type,
)
from kvprof.core.prefix_cache import (  # the GPU tier's rules, shared with wa's shadows; re-exported
    allocate, cache_filled, cached_prefix, check_pool as check_device, init_pool, mark_pool, n_free, pin_hits,
    pool_fields, push_empty, release, reserve_contents, set_limit,
)
from kvprof.core.structs import NONE


class DeviceType(structs.StructType):
    pass


class Device(structref.StructRefProxy):
    """Python handle of a compiled GPU tier."""


class HostType(structs.StructType):
    pass


class Host(structref.StructRefProxy):
    """Python handle of a compiled CPU tier."""


device_type = structs.struct(DeviceType, Device, pool_fields(policy_type))

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
    """The GPU tier (``PrefixCache``): ``capacity`` slots, all empty (:func:`~kvprof.core.prefix_cache.init_pool`)."""
    gpu = structref.new(device_type)
    init_pool(gpu, policy, capacity, n_contents)
    return gpu


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
def reserve_host_contents(host, n_contents):
    """Make the CPU tier's content-to-slot map cover contents ``0 .. n_contents - 1``."""
    if n_contents > len(host.block_slot):
        host.block_slot = structs.grown(host.block_slot, n_contents, NONE)


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
def recycle_contents(numbering, gpu, host, has_host, window):
    """When the numbering is due (:func:`kvprof.core.stream.due`), free the numbers of the contents
    nothing holds: not the tiers, their policies (ghosts, shadows), nor ``window`` (the numbers of
    the requests the replay may still read)."""
    if not stream.due(numbering):
        return
    live = np.zeros(numbering.top, np.bool_)
    for content in window:
        if content != NONE:
            live[content] = True
    mark_pool(gpu, live)
    mark_policy(gpu.policy, live)
    if has_host:
        for content in host.slot_block:
            if content != NONE:
                live[content] = True
        mark_policy(host.policy, live)
    stream.forget_unmarked(numbering, live)


@njit(cache=True)
def counts(gpu):
    """GPU evictions and drops so far."""
    return gpu.evictions, gpu.dropped


@njit(cache=True)
def counts_host(host):
    return host.evictions


__all__ = ["allocate", "cache_filled", "cached_prefix", "check_device", "check_host", "counts", "counts_host",
           "device_type", "host_type", "load", "n_free", "new_device", "new_host", "pin_hits", "push_empty",
           "recycle_contents", "release", "reserve_contents", "reserve_host_contents", "set_limit", "store"]
