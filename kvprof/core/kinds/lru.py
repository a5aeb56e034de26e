"""LRU's twin (:class:`kvprof.policy.lru.LRUPolicy`): list 0 of the core's queue, in free order.

No state of its own: the queue is the order.
"""

from __future__ import annotations

from numba import njit

from kvprof.core.structs import pop_front, push_back

FIELDS: list = []


def lists(policy) -> tuple[int, int]:
    """Evictable lists and ghost lists of its core."""
    return 1, 0



@njit(cache=True, inline="always")
def free(core, block):
    push_back(core.q, 0, block)


@njit(cache=True, inline="always")
def evict(core):
    return pop_front(core.q, 0)
