"""Belady's twin (:class:`kvprof.policy.belady.BeladyPolicy`): a heap with lazy deletion.

State: ``belady_next_use`` (per block, from ``access``), ``belady_live`` (per block: the free
sequence number of its live heap entry, 0 for none), ``belady_heap`` (entries
``(-next use, -depth, free seq)``), ``belady_freed`` (blocks freed so far). The queue is unused:
``belady_live`` says which blocks are evictable.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from kvprof.core import structs
from kvprof.core.structs import grown, heap_pop, heap_push

FIELDS = [("belady_next_use", types.float64[:]), ("belady_live", types.int64[:]),
          ("belady_heap", structs.heap_type), ("belady_freed", types.int64)]
COMMON = ("depth",)


def lists(policy) -> tuple[int, int]:
    return 1, 0



@njit(cache=True)
def init(core):
    core.belady_next_use = np.zeros(0)
    core.belady_live = np.zeros(0, np.int64)
    core.belady_heap = structs.new_heap(16)
    core.belady_freed = 0


@njit(cache=True)
def reserve(core, n):
    if n > len(core.belady_live):
        core.belady_next_use = grown(core.belady_next_use, n, np.inf)
        core.belady_live = grown(core.belady_live, n, 0)


@njit(cache=True, inline="always")
def access(core, block, depth, next_use):
    core.belady_next_use[block] = next_use
    core.depth[block] = depth


@njit(cache=True)
def free(core, block):
    core.belady_freed += 1
    core.belady_live[block] = core.belady_freed
    heap_push(core.belady_heap, -core.belady_next_use[block], -float(core.depth[block]), core.belady_freed, block)


@njit(cache=True)
def contains(core, block):
    return 0 <= block < len(core.belady_live) and core.belady_live[block] != 0


@njit(cache=True)
def remove(core, block):
    core.belady_live[block] = 0
    if core.belady_heap.n > 2 * (core.size - 1) + 64:
        _compact(core)


@njit(cache=True)
def evict(core):
    heap, live = core.belady_heap, core.belady_live
    while True:
        seq, block = heap.seq[0], heap.item[0]
        heap_pop(heap)
        if live[block] == seq:
            live[block] = 0
            return block


@njit(cache=True)
def _compact(core):
    heap = core.belady_heap
    keep = np.empty(heap.n, np.bool_)
    for k in range(heap.n):
        keep[k] = core.belady_live[heap.item[k]] == heap.seq[k]
    structs.heap_keep(heap, keep)
