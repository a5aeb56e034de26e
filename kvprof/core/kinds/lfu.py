"""LFU's twin (:class:`kvprof.policy.lfu.LFUPolicy`): list ``c`` of the queue holds count ``c``'s
bucket in free order, a heap of counts finds the lowest non-empty one.

State: ``lfu_count`` (per block: hits since allocation, 1 on allocation; int32: the per-count
tables below, indexed up to the highest count, would be gigabytes long before a count reached 2**31),
``lfu_listed`` (per count: whether the count has an entry in ``lfu_heap``; buckets are dropped
once empty at the top).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from kvprof.core import structs
from kvprof.core.structs import grown, heap_pop, heap_push, pop_front, push_back

FIELDS = [("lfu_count", types.int32[:]), ("lfu_listed", types.int64[:]), ("lfu_heap", structs.heap_type)]
COMMON = ("q",)


def lists(policy) -> tuple[int, int]:
    return 2, 0



@njit(cache=True)
def init(core):
    core.lfu_count = np.zeros(0, np.int32)
    core.lfu_listed = np.zeros(0, np.int64)
    core.lfu_heap = structs.new_heap(16)


@njit(cache=True)
def reserve(core, n):
    if n > len(core.lfu_count):
        core.lfu_count = grown(core.lfu_count, n, 0)


@njit(cache=True, inline="always")
def access(core, block, hit):
    core.lfu_count[block] = core.lfu_count[block] + 1 if hit else 1


@njit(cache=True)
def free(core, block):
    count = core.lfu_count[block] if core.lfu_count[block] > 0 else 1  # never accessed: count 1
    structs.reserve_lists(core.q, count + 1)
    if count >= len(core.lfu_listed):
        core.lfu_listed = grown(core.lfu_listed, count + 1, 0)
    if not core.lfu_listed[count]:
        core.lfu_listed[count] = 1
        heap_push(core.lfu_heap, float(count), 0.0, count, count)
    push_back(core.q, count, block)


@njit(cache=True)
def evict(core):
    heap = core.lfu_heap
    while not core.q.count[heap.item[0]]:  # buckets are dropped once empty at the top
        core.lfu_listed[heap_pop(heap)] = 0
    return pop_front(core.q, heap.item[0])
