"""Replays on recorded timing, compiled: :mod:`kvprof.sim.timed`'s loop over the GPU tier.

A request takes its blocks when the server first scheduled it and frees them when the server
did, so blocks stay pinned exactly as long as they did in the server. :func:`admit` and
:func:`release` are also what the live counterfactual of the vLLM plugin
(:mod:`kvprof.vllm.observe`) calls, one request at a time.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvprof.core import tiers
from kvprof.core.policy import policy_remove
from kvprof.core.structs import NONE


@njit(cache=True)
def admit(gpu, blocks, next_use, start, n_cacheable, n_lookup, n_total, now, workload, slots):
    """Give a request its blocks: hits first, then new ones (cached at once); ``slots[:held]``.

    Returns ``(hits, held)``: the request's prefix hits and the blocks it holds. It holds fewer
    than ``n_total`` only when the tier has no more room (pinned by running requests): the server
    had room, so this happens only when a policy's hits shared fewer blocks than the server's did.
    """
    n_hit, n_hit_evictable = tiers.cached_prefix(gpu, blocks, start, n_lookup, slots)
    room = tiers.n_free(gpu) - n_hit_evictable
    held = n_hit + min(n_total - n_hit, room)
    tiers.pin_hits(gpu, slots, n_hit, now, workload, next_use, start)
    tiers.allocate(gpu, blocks, next_use, start, n_hit, n_cacheable, held, now, workload, slots)
    return n_hit, held


@njit(cache=True)
def replay(gpu, blocks, offsets, n_cacheable, n_lookup, n_total, classes, next_use, event_request, event_admits,
           event_time, check):
    """Play the events in order: each admits or releases one request.

    Returns ``(hits, held)`` per request (int64 arrays; 0 for requests never admitted).
    """
    n = len(n_total)
    hits = np.zeros(n, np.int64)
    held = np.zeros(n, np.int64)
    slot_offsets = np.zeros(n + 1, np.int64)
    for r in range(n):
        slot_offsets[r + 1] = slot_offsets[r] + n_total[r]
    slots = np.zeros(slot_offsets[n], np.int64)
    for e in range(len(event_request)):
        r = event_request[e]
        mine = slots[slot_offsets[r]:slot_offsets[r + 1]]
        if event_admits[e]:
            hits[r], held[r] = admit(gpu, blocks, next_use, offsets[r], n_cacheable[r], n_lookup[r], n_total[r],
                                     event_time[e], classes[r], mine)
        else:
            tiers.release(gpu, mine, held[r], event_time[e])
        if check:
            tiers.check_device(gpu)
    return hits, held


@njit(cache=True)
def forget(gpu, block):
    """Make content ``block`` uncached (its number is about to name another content): an
    evictable slot goes back empty, a pinned one goes back empty when its request frees it."""
    slot = gpu.block_slot[block]
    if slot == NONE:
        return
    gpu.block_slot[block] = NONE
    gpu.slot_block[slot] = NONE
    if not gpu.refs[slot]:
        policy_remove(gpu.policy, slot)
        tiers.push_empty(gpu, slot)
