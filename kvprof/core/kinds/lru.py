"""LRU's twin (:class:`kvprof.policy.lru.LRUPolicy`): list 0 of the core's queue, in free order.

No state of its own: the queue is the order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvprof.core.structs import pop_front, push_back_n

FIELDS: list = []
COMMON = ("q",)

NO_LISTS = np.zeros(0, np.int32)  # push_back_n: every block to list 0


def lists(policy) -> tuple[int, int]:
    """Evictable lists and ghost lists of its core."""
    return 1, 0



@njit(cache=True)
def free_n(core, blocks, n):
    """Free ``blocks[:n]`` in order: to the back of the list."""
    push_back_n(core.q, blocks, n, NO_LISTS)


@njit(cache=True, inline="always")
def evict(core):
    return pop_front(core.q, 0)
