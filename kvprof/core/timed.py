"""Replays on recorded timing, compiled: :mod:`kvprof.sim.timed`'s loop over the GPU tier.

A request takes its blocks when the server first scheduled it and frees them when the server
did, so blocks stay pinned exactly as long as they did in the server. :func:`admit` and
:func:`release` are also what the live counterfactual of the vLLM plugin
(:mod:`kvprof.vllm.observe`) calls, one request at a time.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvprof.core import structs, tiers
from kvprof.core.policy import policy_admit, policy_finish, policy_remove
from kvprof.core.structs import NONE


@njit(cache=True, nogil=True)  # nogil: the plugin's background thread calls it (kvprof.vllm.observe)
def admit(gpu, blocks, next_use, start, n_cacheable, n_lookup, n_total, now, workload, slots):
    """Give a request the blocks of its prompt: hits first, then new ones (full ones cached at
    once); their slots into ``slots[:held]``.

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


@njit(cache=True, nogil=True)  # nogil: the plugin's background thread calls it (kvprof.vllm.observe)
def finish(gpu, blocks, next_use, start, held, n_cacheable, n_new, now, workload, slots):
    """A request finished: give it the blocks its output filled (depths ``held ..``, cached below
    ``n_cacheable``), as decoding did, then free all of them tail first. Returns the blocks it held."""
    more = min(n_new, tiers.n_free(gpu))
    tiers.allocate(gpu, blocks, next_use, start, held, n_cacheable, held + more, now, workload, slots)
    tiers.release(gpu, slots, held + more, now)
    return held + more


@njit(cache=True)
def replay(gpu, blocks, offsets, n_full, n_prompt, n_lookup, n_new, classes, next_use, event_request, event_admits,
           event_time, check):
    """Play the events in order, each the admission or the finish of one request (the arrays of
    :class:`kvprof.sim.timed.RecordedTiming`).

    Returns ``(hits, held)`` per request (int64 arrays; 0 for requests never admitted).
    """
    n = len(n_prompt)
    hits = np.zeros(n, np.int64)
    held = np.zeros(n, np.int64)
    seats = [np.zeros(0, np.int64) for _ in range(0)]  # slot arrays, one per running request, reused
    free_seats = np.zeros(16, np.int64)
    n_free_seats = 0
    seat_of = np.full(n, -1, np.int64)
    for e in range(len(event_request)):
        r = event_request[e]
        if event_admits[e]:
            if n_free_seats:
                n_free_seats -= 1
                seat = free_seats[n_free_seats]
            else:
                seat = len(seats)
                seats.append(np.zeros(0, np.int64))
            if len(seats[seat]) < n_prompt[r] + n_new[r]:
                seats[seat] = np.zeros(max(n_prompt[r] + n_new[r], 2 * len(seats[seat])), np.int64)
            seat_of[r] = seat
            hits[r], held[r] = admit(gpu, blocks, next_use, offsets[r], n_full[r], n_lookup[r], n_prompt[r],
                                     event_time[e], classes[r], seats[seat])
            policy_admit(gpu.policy, seat, blocks[offsets[r]:offsets[r] + n_full[r]], n_lookup[r], n_prompt[r],
                         event_time[e], classes[r])
        else:
            seat = seat_of[r]
            policy_finish(gpu.policy, seat, event_time[e], blocks[offsets[r]:offsets[r + 1]], n_prompt[r] + n_new[r])
            held[r] = finish(gpu, blocks, next_use, offsets[r], held[r], offsets[r + 1] - offsets[r], n_new[r],
                             event_time[e], classes[r], seats[seat])
            if n_free_seats == len(free_seats):
                free_seats = structs.grown(free_seats, n_free_seats + 1, 0)
            free_seats[n_free_seats] = seat
            n_free_seats += 1
        if check:
            tiers.check_device(gpu)
    return hits, held


@njit(cache=True, nogil=True)  # nogil: the plugin's background thread calls it (kvprof.vllm.observe)
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
