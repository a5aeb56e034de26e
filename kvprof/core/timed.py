"""Replays on recorded timing, compiled: :mod:`kvprof.sim.timed`'s loop over the GPU tier.

A request takes its blocks when the server first scheduled it and frees them when the server
did, so blocks stay pinned exactly as long as they did in the server. :func:`admit` and
:func:`release` are also what the live counterfactual of the vLLM plugin
(:mod:`kvprof.vllm.observe`) calls, one request at a time. :func:`replay` plays the events in
chunks, each one compiled call, so that an interrupt ends it within a chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.typed import List

from kvprof.core import tiers
from kvprof.core.interrupts import compiled_call
from kvprof.core.wa import policy_admit, policy_finish, policy_remove
from kvprof.core.seats import give_seat, new_free, take_seat
from kvprof.core.structs import NONE


def blocks_at_finish(prompt, output, n_full, n_prompt, block_size: int):
    """``(n_new, n_filled)`` of requests of ``prompt`` and ``output`` tokens (numbers or arrays) that
    took ``n_prompt`` blocks when scheduled, ``n_full`` of them full: the blocks each takes while it
    decodes, and the blocks past ``n_full`` that are full when it finishes (its prompt's partial
    last block first, filled in place, so not a new block).

    vLLM's rule (``KVCacheManager.allocate_slots``): a request holds ``ceil(computed / block)``
    blocks, ``computed // block`` of them full and cached, where ``computed = prompt + output - 1``:
    the last sampled token is never fed back, so its KV is never computed.
    """
    computed = prompt + np.maximum(output, 1) - 1
    n_new = np.maximum(-(-computed // block_size) - n_prompt, 0)
    n_filled = np.maximum(computed // block_size - n_full, 0)
    return n_new, n_filled


@njit(cache=True, nogil=True)  # nogil: the plugin's background thread calls it (kvprof.vllm.observe)
def admit(gpu, blocks, next_use, start, n_cacheable, n_lookup, n_total, now, workload, slots):
    """Give a request the blocks of its prompt: hits first, then new ones (full ones cached at
    once); their slots into ``slots[:held]``.

    Returns ``(hits, held)``: the request's prefix hits and the blocks it holds. It holds fewer
    than ``n_total`` only when the tier has no more room (pinned by running requests): the server
    had room, so this happens only when a policy's hits shared fewer blocks than the server's did.
    It holds more where it hit more than ``n_total`` (a first prefill chunk that the server's hits
    made short): its hits are held whatever the count.
    """
    n_hit, n_hit_evictable = tiers.cached_prefix(gpu, blocks, start, n_lookup, slots)
    room = tiers.n_free(gpu) - n_hit_evictable
    held = n_hit + min(max(n_total - n_hit, 0), room)
    tiers.pin_hits(gpu, slots, n_hit, now, workload, next_use, start)
    tiers.allocate(gpu, blocks, next_use, start, n_hit, n_cacheable, held, now, workload, slots)
    return n_hit, held


@njit(cache=True, nogil=True)
def grow(gpu, blocks, next_use, held, limit, now, slots):
    """A running request took a block (a decode step that started a block, or a later prefill chunk):
    it holds one more (depth ``held``), empty until the request finishes, where the tier has room and it
    holds fewer than ``limit``. Returns the blocks it holds. The live counterfactual takes the block the
    same way, not knowing yet whose it is (:meth:`kvprof.vllm.observe.Counterfactual.grow`)."""
    if held >= limit or tiers.n_free(gpu) < 1:
        return held
    tiers.allocate(gpu, blocks, next_use, 0, held, 0, held + 1, now, 0, slots)  # no content: blocks, next_use unread
    return held + 1


@njit(cache=True, nogil=True)  # nogil: the plugin's background thread calls it (kvprof.vllm.observe)
def grow_each(gpu, blocks, next_use, n, now, slots):
    """``n`` blocks a running request took at once, one after another as ``n`` calls of :func:`grow` take
    them (its ``limit`` aside: the live counterfactual learns whose they are at the request's free): their
    slots into ``slots[:taken]``. Returns ``taken``, fewer than ``n`` where the tier has no more room."""
    taken = 0
    while taken < n and tiers.n_free(gpu) >= 1:
        tiers.allocate(gpu, blocks, next_use, 0, taken, 0, taken + 1, now, 0, slots)
        taken += 1
    return taken


@njit(cache=True, nogil=True)  # nogil: the plugin's background thread calls it (kvprof.vllm.observe)
def finish(gpu, blocks, next_use, start, held, n_full, n_cacheable, n_last, now, workload, slots):
    """A request finished: cache what its output filled, as decoding did (below ``n_cacheable``):
    in place in the blocks it holds past its prompt's ``n_full`` full ones (the prompt's partial
    last block, and blocks it took while running), then in ``n_last`` new blocks (depths ``held ..``:
    those the recording does not say it took earlier); then free all of them tail first. Returns
    the blocks it held."""
    tiers.cache_filled(gpu, blocks, next_use, start, n_full, n_cacheable, held, now, workload, slots)
    more = min(n_last, tiers.n_free(gpu))
    tiers.allocate(gpu, blocks, next_use, start, held, n_cacheable, held + more, now, workload, slots)
    tiers.release(gpu, slots, held + more, now)
    return held + more


#: The kinds of events :func:`replay` plays (:meth:`kvprof.sim.recorded.RecordedTiming.events`'s).
FINISH, ADMIT, GROW = 0, 1, 2

#: Events one compiled call plays: between calls Python runs, so an interrupt (SIGINT, SIGTERM)
#: is acted on within one chunk, not when the whole replay returns.
CHUNK_EVENTS = 8192


class RecordedRequests(NamedTuple):
    """What :func:`replay` plays of each request ``r``: the arrays of
    :class:`kvprof.sim.recorded.RecordedTiming` with the workload's lookups and classes.

    Its blocks, by depth, are ``blocks[offsets[r]:offsets[r + 1]]`` (``next_use``: each one's next
    access); the first ``n_full[r]`` are its prompt's full ones (cached at admission), the others
    with a content are cached at its finish (its output filled them); ``n_prompt[r]`` are taken at
    its admission, of which the first ``n_lookup[r]`` may be prefix hits, and ``n_new[r]`` more at
    its finish (``n_first[r]`` when scheduled, one at each of its grows, ``n_last[r]`` at its finish,
    where the recording says when it took them). ``classes[r]`` is its workload class (int64),
    ``n_output[r]`` the tokens it generated, ``finish[r]`` how it ended (int64, :mod:`kvprof.models.finish`; 0: not known).
    """

    blocks: np.ndarray
    offsets: np.ndarray
    n_full: np.ndarray
    n_prompt: np.ndarray
    n_lookup: np.ndarray
    n_new: np.ndarray
    classes: np.ndarray
    next_use: np.ndarray
    n_output: np.ndarray
    finish: np.ndarray
    n_first: np.ndarray
    n_last: np.ndarray


def replay(gpu, requests: RecordedRequests, events: tuple[np.ndarray, np.ndarray, np.ndarray], *,
           check: bool = False, chunk: int = CHUNK_EVENTS):
    """Play ``events`` (``(request, kind, time)`` arrays, as
    :meth:`kvprof.sim.recorded.RecordedTiming.events` gives them) in order, each the admission, a grow
    or the finish of one of ``requests``, ``chunk`` events per compiled call; ``check`` verifies the
    tier's invariants after every event.

    Returns ``(hits, held)`` per request (int64 arrays; 0 for requests never admitted).
    """
    n = len(requests.n_prompt)
    event_request, event_kind, event_time = events
    hits = np.zeros(n, np.int64)
    held = np.zeros(n, np.int64)
    first_held = np.zeros(n, np.int64)  # the blocks each request held once admitted
    seats = List.empty_list(types.int64[::1])  # slot arrays, one per running request, reused
    seat_of = np.full(n, -1, np.int64)
    free_seats, n_free_seats = new_free(), 0
    for start in range(0, len(event_request), chunk):
        stop = min(start + chunk, len(event_request))
        free_seats, n_free_seats = compiled_call(
            _play, gpu, *requests, event_request, event_kind, event_time, check, start, stop, hits, held, first_held,
            seats, seat_of, free_seats, n_free_seats)
    return hits, held


@njit(cache=True)
def _play(gpu, blocks, offsets, n_full, n_prompt, n_lookup, n_new, classes, next_use, n_output, finish_code, n_first,
          n_last, event_request, event_kind, event_time, check, start, stop, hits, held, first_held, seats, seat_of,
          free_seats, n_free_seats):
    """Events ``start .. stop - 1`` of :func:`replay` (``blocks .. n_last``: its
    :class:`RecordedRequests`); its state in ``hits .. n_free_seats``.
    Returns ``(free_seats, n_free_seats)`` (the array may have grown)."""
    # A native list while the events play (a typed List costs a call per access), ``seats`` again after.
    local = [seats[i] for i in range(len(seats))]
    for e in range(start, stop):
        r = event_request[e]
        if event_kind[e] == ADMIT:
            seat, n_free_seats = take_seat(local, free_seats, n_free_seats, n_prompt[r] + n_new[r])
            seat_of[r] = seat
            hits[r], held[r] = admit(gpu, blocks, next_use, offsets[r], n_full[r], n_lookup[r], n_first[r],
                                     event_time[e], classes[r], local[seat])
            first_held[r] = held[r]
            policy_admit(gpu.policy, seat, blocks[offsets[r]:offsets[r] + n_full[r]], n_lookup[r], n_prompt[r],
                         event_time[e], classes[r])
        elif event_kind[e] == GROW:
            held[r] = grow(gpu, blocks, next_use, held[r], n_prompt[r] + n_new[r], event_time[e], local[seat_of[r]])
        else:
            seat = seat_of[r]
            policy_finish(gpu.policy, seat, event_time[e], blocks[offsets[r]:offsets[r + 1]], n_prompt[r] + n_new[r],
                          n_output[r], finish_code[r])
            held[r] = finish(gpu, blocks, next_use, offsets[r], held[r], min(n_full[r], first_held[r]),
                             offsets[r + 1] - offsets[r], n_last[r], event_time[e], classes[r], local[seat])
            free_seats, n_free_seats = give_seat(free_seats, n_free_seats, seat)
        if check:
            tiers.check_device(gpu)
    for i in range(len(local)):
        if i < len(seats):
            seats[i] = local[i]
        else:
            seats.append(local[i])
    return free_seats, n_free_seats


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
