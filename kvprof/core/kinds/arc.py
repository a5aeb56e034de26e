"""ARC's twin (:class:`kvprof.policy.arc.ARCPolicy`): lists 0 (T1) and 1 (T2) of the queue,
ghost lists 0 (B1) and 1 (B2) of contents.

State: ``arc_in_t2`` (per block: it belongs to T2), ``arc_target`` (T1's target size).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from kvprof.core.structs import grown, holds, pop_front, push_back, unlink

FIELDS = [("arc_in_t2", types.boolean[:]), ("arc_target", types.float64)]
COMMON = ("q", "content", "most_evictable")


def lists(policy) -> tuple[int, int]:
    return 2, 2



@njit(cache=True)
def init(core):
    core.arc_in_t2 = np.zeros(0, np.bool_)
    core.arc_target = 0.0


@njit(cache=True)
def reserve(core, n):
    if n > len(core.arc_in_t2):
        core.arc_in_t2 = grown(core.arc_in_t2, n, False)


@njit(cache=True)
def access(core, block, hit, content):
    if hit:
        core.arc_in_t2[block] = True
        return
    core.content[block] = content
    ghost = False
    if content >= 0 and holds(core.g, content):
        b1, b2 = core.g.count[0], core.g.count[1]
        if core.g.where[content] == 0:
            core.arc_target = min(core.arc_target + max(1.0, b2 / b1), float(core.most_evictable))
        else:
            core.arc_target = max(core.arc_target - max(1.0, b1 / b2), 0.0)
        unlink(core.g, content)
        ghost = True
    core.arc_in_t2[block] = ghost


@njit(cache=True, inline="always")
def free(core, block):
    push_back(core.q, 1 if core.arc_in_t2[block] else 0, block)


@njit(cache=True)
def evict(core):
    q = core.q
    t1 = q.count[0]
    if t1 and (t1 >= int(core.arc_target) or not q.count[1]):
        block, ghost = pop_front(q, 0), 0
    else:
        block, ghost = pop_front(q, 1), 1
    content = core.content[block]
    if content >= 0:  # a content cached twice is one ghost, where it left last
        if holds(core.g, content):
            unlink(core.g, content)
        push_back(core.g, ghost, content)
        if core.g.count[ghost] > core.most_evictable:
            pop_front(core.g, ghost)
    return block
