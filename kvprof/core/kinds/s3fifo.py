"""S3-FIFO's twin (:class:`kvprof.policy.s3fifo.S3FIFOPolicy`): lists 0 (small) and 1 (main) of
the queue, ghost list 0 of contents.

State: ``s3fifo_freq`` (per block: hits since it entered its queue, capped at ``s3fifo_max_freq``,
so int8: at most :data:`FREQ_CAP`),
``s3fifo_in_main`` (per block: it belongs to main), the ratios of the reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from kvprof.core.structs import grown, holds, pop_front, push_back, push_back_n, unlink
from kvprof.policy.s3fifo import MAX_FREQ

#: The highest frequency cap the int8 per-block counts hold.
FREQ_CAP = 127

FIELDS = [("s3fifo_freq", types.int8[:]), ("s3fifo_in_main", types.boolean[:]),
          ("s3fifo_small_ratio", types.float64), ("s3fifo_ghost_ratio", types.float64),
          ("s3fifo_max_freq", types.int64)]


def lists(policy) -> tuple[int, int]:
    return 2, 1


def configure(core, policy) -> None:
    set_ratios(core, policy.small_ratio, policy.ghost_ratio, MAX_FREQ)


@njit(cache=True)
def set_ratios(core, small_ratio, ghost_ratio, max_freq):
    if not 0 <= max_freq <= FREQ_CAP:
        raise ValueError("s3fifo's frequency cap must be within 0 .. 127 (its counts are int8)")
    core.s3fifo_small_ratio, core.s3fifo_ghost_ratio, core.s3fifo_max_freq = small_ratio, ghost_ratio, max_freq


@njit(cache=True)
def init(core):
    core.s3fifo_freq = np.zeros(0, np.int8)
    core.s3fifo_in_main = np.zeros(0, np.bool_)
    core.s3fifo_small_ratio = 0.1
    core.s3fifo_ghost_ratio = 0.9
    core.s3fifo_max_freq = 3


@njit(cache=True)
def reserve(core, n):
    if n > len(core.s3fifo_freq):
        core.s3fifo_freq = grown(core.s3fifo_freq, n, 0)
        core.s3fifo_in_main = grown(core.s3fifo_in_main, n, False)


@njit(cache=True)
def access(core, block, hit, content):
    if hit:
        core.s3fifo_freq[block] = min(core.s3fifo_freq[block] + 1, core.s3fifo_max_freq)
        return
    core.s3fifo_freq[block] = 0
    core.content[block] = content
    recomputed = content >= 0 and holds(core.g, content)
    if recomputed:
        unlink(core.g, content)
    core.s3fifo_in_main[block] = recomputed


@njit(cache=True)
def access_n(core, blocks, contents, n, hit):
    """``access`` of ``blocks[i]`` with ``contents[i]`` for ``i < n``, in order (a hit's count: arrays read once)."""
    if not hit:
        for i in range(n):
            access(core, blocks[i], False, contents[i])
        return
    freq, cap = core.s3fifo_freq, core.s3fifo_max_freq
    for i in range(n):
        block = blocks[i]
        freq[block] = min(freq[block] + 1, cap)


@njit(cache=True)
def free_n(core, blocks, n):
    """Free ``blocks[:n]`` in order: each to the back of its queue."""
    push_back_n(core.q, blocks, n, core.s3fifo_in_main)  # list 1 (main) if in main, else 0 (small)


@njit(cache=True)
def evict(core):
    q, count = core.q, core.s3fifo_freq
    while True:  # each pass evicts or moves a block; moves are bounded by the frequency cap
        small, main = q.count[0], q.count[1]
        if small and (small > core.s3fifo_small_ratio * (small + main) or not main):
            block = pop_front(q, 0)
            if count[block] > 0:
                count[block] = 0
                core.s3fifo_in_main[block] = True
                push_back(q, 1, block)
                continue
            content = core.content[block]
            if content >= 0:
                if not holds(core.g, content):
                    push_back(core.g, 0, content)
                while core.g.count[0] > core.s3fifo_ghost_ratio * core.most_evictable:
                    pop_front(core.g, 0)
            return block
        block = pop_front(q, 1)
        if count[block] > 0:
            count[block] -= 1
            push_back(q, 1, block)
            continue
        return block
