"""The twin of the finish-reason candidate (:class:`kvprof.policy.finish_reason.FinishReasonLRU`): list 0
of the queue holds the blocks freed after a request whose response ended its turn, list 1 the others,
each in free order; eviction takes list 0's front first.

State: ``finish_reason_freeing`` (whether the last finish's request ended its turn: the list its
blocks go to when freed). A finish first tells the output (``finish``: the code is not known yet),
then, where the driver knows it, the code (``finish_reason``); a driver that never tells a code
(a server that cannot tell) so keeps every block in LRU order, as the reference does with none.
"""

from __future__ import annotations

from numba import njit, types

from kvprof.core.kinds.long_output import evict  # noqa: F401 (the same two lists: dispatched from here)
from kvprof.core.structs import push_back
from kvprof.models.finish import END_OF_TURN

FIELDS = [("finish_reason_freeing", types.boolean)]
COMMON = ("q",)


def lists(policy) -> tuple[int, int]:
    return 2, 0


@njit(cache=True)
def init(core):
    core.finish_reason_freeing = False


@njit(cache=True, inline="always")
def finish(core):
    """A request finished; how its response ended is not known (yet)."""
    core.finish_reason_freeing = False


@njit(cache=True, inline="always")
def finish_reason(core, code):
    """The request just finished ended with ``code`` (:mod:`kvprof.models.finish`; 0: unknown)."""
    core.finish_reason_freeing = code == END_OF_TURN


@njit(cache=True)
def free_n(core, blocks, n):
    which = 0 if core.finish_reason_freeing else 1
    for i in range(n):
        push_back(core.q, which, blocks[i])
