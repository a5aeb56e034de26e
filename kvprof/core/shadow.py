"""Compiled shadow caches: :class:`kvprof.policy.shadow.ShadowCache`'s twin.

A shadow is a pool of :mod:`kvprof.core.prefix_cache` over one candidate order's core, fed the
real cache's whole requests (admitted, then finished), so that ``wa`` (:mod:`kvprof.core.wa`)
can count the hits each candidate would have had at the same capacity.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.experimental import structref
from numba.typed import List

from kvprof.core import structs
from kvprof.core.policies import core_finish, core_finish_reason, core_type
from kvprof.core.prefix_cache import (
    allocate, cached_prefix, init_pool, make_room, n_free, pin_hits, pool_fields, release, reserve_contents,
)
from kvprof.core.seats import seat_slots
from kvprof.core.structs import NONE, grown


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


@njit(cache=True)
def shadow_admit(shadow, seat, contents, n_lookup, n_blocks, now, workload, never):
    """``ShadowCache.admit``: the real cache admits the request of ``seat`` with chain ``contents``."""
    top = -1
    for content in contents:
        top = max(top, content)
    reserve_contents(shadow, top + 1)
    if seat >= len(shadow.seat_n):
        shadow.seat_n = grown(shadow.seat_n, seat + 1, 0)
        shadow.seat_workload = grown(shadow.seat_workload, seat + 1, 0)
    slots = seat_slots(shadow.seats, seat, n_blocks)
    n_hits, n_hit_evictable = cached_prefix(shadow, contents, 0, n_lookup, slots)
    short = n_blocks - n_hits - (n_free(shadow) - n_hit_evictable)
    if short > 0:
        make_room(shadow, short, now)
    pin_hits(shadow, slots, n_hits, now, workload, never, 0)
    allocate(shadow, contents, never, 0, n_hits, len(contents), n_blocks, now, workload, slots)
    shadow.seat_n[seat] = n_blocks
    shadow.seat_workload[seat] = workload
    shadow.hits += n_hits


@njit(cache=True)
def shadow_finish(shadow, seat, now, contents, n_blocks, n_output, never, code=0):
    """``ShadowCache.finish``: the request of ``seat`` (which generated ``n_output`` tokens, -1:
    unknown, and ended as ``code`` says, 0: unknown) is told to the core, caches what it filled since admission (``contents``, its whole
    chain now, may be empty, ``NONE`` where a depth has no content: a replay's partial prompt
    block, never cached; it holds ``n_blocks`` now), then frees its slots tail-first."""
    held = shadow.seat_n[seat] if seat < len(shadow.seat_n) else 0
    if not held:
        return
    core_finish(shadow.policy, n_output)
    if code:
        core_finish_reason(shadow.policy, code)
    slots = shadow.seats[seat]
    workload = shadow.seat_workload[seat]
    n_full = len(contents)
    top = -1
    for content in contents:
        top = max(top, content)
    reserve_contents(shadow, top + 1)
    for depth in range(min(held, n_full)):
        slot, content = slots[depth], contents[depth]
        # NONE would index the highest content's entry: a hole stays empty, as the real tier leaves it
        if content != NONE and shadow.slot_block[slot] == NONE and shadow.block_slot[content] == NONE:
            shadow.block_slot[content] = slot
            shadow.slot_block[slot] = content
            shadow.policy.access(slot, now, workload, depth, False, np.inf, content)
    n_blocks = max(n_blocks, n_full)
    if n_blocks > held:
        if len(slots) < n_blocks:
            slots = grown(slots, n_blocks, 0)
            shadow.seats[seat] = slots
        short = n_blocks - held - n_free(shadow)
        if short > 0:
            make_room(shadow, short, now)
        allocate(shadow, contents, never, 0, held, n_full, n_blocks, now, workload, slots)
        held = n_blocks
    release(shadow, slots, held, now)
    shadow.seat_n[seat] = 0
