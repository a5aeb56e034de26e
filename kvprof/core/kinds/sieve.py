"""SIEVE's twin (:class:`kvprof.policy.sieve.SIEVEPolicy`): list 0 of the queue in free order, a
visited bit per block and a hand.

State: ``sieve_visited`` (per block: hit since allocation or since the hand last passed it),
``sieve_hand`` (the block the next eviction looks at first; -1: the front).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from kvprof.core.structs import NONE, grown, push_back, unlink

FIELDS = [("sieve_visited", types.boolean[:]), ("sieve_hand", types.int64)]
COMMON = ("q",)


def lists(policy) -> tuple[int, int]:
    return 1, 0



@njit(cache=True)
def init(core):
    core.sieve_visited = np.zeros(0, np.bool_)
    core.sieve_hand = NONE


@njit(cache=True)
def reserve(core, n):
    if n > len(core.sieve_visited):
        core.sieve_visited = grown(core.sieve_visited, n, False)


@njit(cache=True, inline="always")
def access(core, block, hit):
    core.sieve_visited[block] = hit


@njit(cache=True, inline="always")
def free(core, block):
    push_back(core.q, 0, block)


@njit(cache=True, inline="always")
def remove(core, block):
    if core.sieve_hand == block:
        core.sieve_hand = core.q.nxt[block]
    unlink(core.q, block)


@njit(cache=True)
def evict(core):
    q, visited = core.q, core.sieve_visited
    block = q.head[0] if core.sieve_hand == NONE else core.sieve_hand
    while visited[block]:  # at most one sweep: every pass clears a bit
        visited[block] = False
        block = q.nxt[block]
        if block == NONE:
            block = q.head[0]
    core.sieve_hand = q.nxt[block]  # -1 past the newest: the next sweep starts at the front
    unlink(q, block)
    return block
