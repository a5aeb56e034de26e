"""The twin of wa's long-output candidate (:class:`kvprof.policy.long_output.LongOutputLRU`): list 0
of the queue holds the blocks freed after a request whose output passed the limit, list 1 the
others, each in free order; eviction takes list 0's front first.

State: ``long_output_limit`` (tokens) and ``long_output_freeing`` (whether the last finish's
request passed it: the lists its blocks go to when freed).
"""

from __future__ import annotations

from numba import njit, types

from kvprof.core.structs import pop_front, push_back

FIELDS = [("long_output_limit", types.float64), ("long_output_freeing", types.boolean)]
COMMON = ("q",)


def lists(policy) -> tuple[int, int]:
    return 2, 0


def configure(core, policy) -> None:
    """The output limit of the reference instance."""
    set_limit(core, policy.limit)


@njit(cache=True)
def set_limit(core, limit):
    core.long_output_limit = limit


@njit(cache=True)
def init(core):
    core.long_output_limit = 0.0
    core.long_output_freeing = False


@njit(cache=True, inline="always")
def finish(core, n_output):
    """A request that generated ``n_output`` tokens (-1: unknown) finished; its free comes next."""
    core.long_output_freeing = n_output >= 0 and n_output > core.long_output_limit


@njit(cache=True)
def free_n(core, blocks, n):
    which = 0 if core.long_output_freeing else 1
    for i in range(n):
        push_back(core.q, which, blocks[i])


@njit(cache=True, inline="always")
def evict(core):
    return pop_front(core.q, 0 if core.q.count[0] else 1)
