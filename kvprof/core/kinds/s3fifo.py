"""S3-FIFO's twin (:class:`kvprof.policy.s3fifo.S3FIFOPolicy`): lists 0 (small) and 1 (main) of
the queue, ghost list 0 of contents.

State: ``s3fifo_freq`` (per block: hits since it entered its queue, capped at ``s3fifo_max_freq``,
so int8: at most :data:`FREQ_CAP`),
``s3fifo_in_main`` (per block: it belongs to main), the ratios of the reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from kvprof.core.structs import NONE, grown, holds, push_back_n, unlink, unlink_n
from kvprof.policy.s3fifo import MAX_FREQ

#: The highest frequency cap the int8 per-block counts hold.
FREQ_CAP = 127

FIELDS = [("s3fifo_freq", types.int8[:]), ("s3fifo_in_main", types.boolean[:]),
          ("s3fifo_small_ratio", types.float64), ("s3fifo_ghost_ratio", types.float64),
          ("s3fifo_max_freq", types.int64)]
COMMON = ("q", "content", "most_evictable")


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
    """``access`` of ``blocks[i]`` with ``contents[i]`` for ``i < n``, in order (arrays read once; the
    misses' ghost lookups in one batch first: nothing else here reads the ghost)."""
    freq = core.s3fifo_freq
    if hit:
        cap = core.s3fifo_max_freq
        for i in range(n):
            block = blocks[i]
            freq[block] = min(freq[block] + 1, cap)
        return
    recomputed = np.empty(n, np.bool_)
    unlink_n(core.g, contents, n, recomputed)  # (a content < 0 is in no list)
    content_of, in_main = core.content, core.s3fifo_in_main
    for i in range(n):
        block = blocks[i]
        freq[block] = 0
        content_of[block] = contents[i]
        in_main[block] = recomputed[i]


@njit(cache=True)
def free_n(core, blocks, n):
    """Free ``blocks[:n]`` in order: each to the back of its queue."""
    push_back_n(core.q, blocks, n, core.s3fifo_in_main)  # list 1 (main) if in main, else 0 (small)


@njit(cache=True)
def evict_n(core, n, out, at):
    """``n`` victims into ``out[at:at + n]``, taken off ``size``: each pass takes the front of small or
    main and evicts it or moves it to main's back (moves are bounded by the frequency cap); a victim
    from small leaves its content in the ghost, oldest forgotten first.

    The lists' pops and pushes are written out over their arrays, read once (a call of
    ``pop_front``/``push_back`` per pass would count a reference to each array it reads)."""
    q, g = core.q, core.g
    nxt, prv, where, head, tail, count = q.nxt, q.prv, q.where, q.head, q.tail, q.count
    g_nxt, g_prv, g_where, g_head, g_tail, g_count = g.nxt, g.prv, g.where, g.head, g.tail, g.count
    freq, in_main, content_of = core.s3fifo_freq, core.s3fifo_in_main, core.content
    small_ratio, ghost_limit = core.s3fifo_small_ratio, core.s3fifo_ghost_ratio * core.most_evictable
    i = at
    while i < at + n:
        small, main = count[0], count[1]
        which = 0 if small and (small > small_ratio * (small + main) or not main) else 1
        block = head[which]  # pop the front of `which`
        after = nxt[block]
        head[which] = after
        if after == NONE:
            tail[which] = NONE
        else:
            prv[after] = NONE
        where[block] = NONE
        count[which] -= 1
        if freq[block] > 0:  # to main's back
            if which == 0:
                freq[block] = 0
                in_main[block] = True
            else:
                freq[block] -= 1
            last = tail[1]
            prv[block] = last
            nxt[block] = NONE
            if last == NONE:
                head[1] = block
            else:
                nxt[last] = block
            tail[1] = block
            where[block] = 1
            count[1] += 1
            continue
        content = content_of[block]
        if which == 0 and content >= 0:
            if not (content < len(g_where) and g_where[content] != NONE):  # to the ghost's back
                last = g_tail[0]
                g_prv[content] = last
                g_nxt[content] = NONE
                if last == NONE:
                    g_head[0] = content
                else:
                    g_nxt[last] = content
                g_tail[0] = content
                g_where[content] = 0
                g_count[0] += 1
            while g_count[0] > ghost_limit:  # the ghost's front forgotten
                forgotten = g_head[0]
                after = g_nxt[forgotten]
                g_head[0] = after
                if after == NONE:
                    g_tail[0] = NONE
                else:
                    g_prv[after] = NONE
                g_where[forgotten] = NONE
                g_count[0] -= 1
        out[i] = block
        i += 1
    core.size -= n
