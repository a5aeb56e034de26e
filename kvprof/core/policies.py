"""The compiled twins of the single-structure policies: one ``Core`` struct, one ``kind`` each.

A ``Core`` holds one policy's state in arrays (per block, per content, per list) and the
functions below run its protocol (``core_access``, ``core_free``, ``core_remove``,
``core_evict_n``) with the reference classes' rules, decision for decision:

* ``LRU`` -- :class:`kvprof.policy.lru.LRUPolicy`: list 0 in free order;
* ``LFU`` -- :class:`kvprof.policy.lfu.LFUPolicy`: list ``c`` holds count ``c``'s bucket, a heap
  of counts finds the lowest;
* ``S3FIFO`` -- :class:`kvprof.policy.s3fifo.S3FIFOPolicy`: lists 0 (small) and 1 (main), ghost
  list 0 of contents;
* ``ARC`` -- :class:`kvprof.policy.arc.ARCPolicy`: lists 0 (T1) and 1 (T2), ghost lists 0 (B1)
  and 1 (B2);
* ``BELADY`` -- :class:`kvprof.policy.belady.BeladyPolicy`: a heap with lazy deletion;
* ``CLASSED`` -- :class:`kvprof.policy.classed.ClassedLRUPolicy` (``wa-paper``, and ``wa``'s
  rows, hit counts and ghost, below in this module);
* ``LEARNED`` -- :class:`kvprof.policy.learned.LearnedPolicy` (``wa``'s learned candidate): list
  ``k`` holds bucket ``k`` in free order; ``row`` is a block's cell, ``count`` its hits,
  ``stamp`` when it was freed.

Invariant of every kind: ``size`` counts the evictable blocks, exactly those the driver freed
and neither removed nor evicted since. Per-block tables grow on demand (``reserve_blocks``);
contents are dense ids >= 0, -1 for none.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.experimental import structref

from kvprof.core import structs
from kvprof.core.prefix_cache import register_pool_protocol
from kvprof.core.structs import NONE, grown, heap_pop, heap_push, holds, pop_front, push_back, unlink

LRU, LFU, S3FIFO, ARC, BELADY, CLASSED, LEARNED = range(7)

#: Row orders of a ``CLASSED`` core (:mod:`kvprof.policy.orders`, and wa-paper's published score).
ORDER_MODEL, ORDER_RECENCY, ORDER_FREQUENCY, ORDER_PAPER, ORDER_SEGMENTED = range(5)

class CoreType(structs.StructType):
    pass


class Core(structref.StructRefProxy):
    """Python handle of a compiled core."""


core_type = structs.struct(CoreType, Core, [
    ("kind", types.int64),
    ("size", types.int64),
    ("q", structs.lists_type),  # evictable blocks
    ("g", structs.lists_type),  # ghosts: contents
    ("count", types.int64[:]),  # s3fifo frequency, lfu count, wa hit count
    ("flag", types.boolean[:]),  # s3fifo: in main; arc: in T2; wa: pinned
    ("content", types.int64[:]),
    ("stamp", types.float64[:]),
    ("pushed", types.float64[:]),  # stamp a block was freed (pushed to its row) with
    ("depth", types.int64[:]),
    ("row", types.int64[:]),
    ("next_use", types.float64[:]),
    ("heap", structs.heap_type),  # belady: (-next use, -depth, free seq); lfu: counts
    ("live", types.int64[:]),  # belady: free seq of a block's live entry (0: none); lfu: count has a heap entry
    ("freed", types.int64),
    ("ghost_value", types.int64[:]),  # wa: hit count of an evicted content
    # s3fifo, arc
    ("small_ratio", types.float64), ("ghost_ratio", types.float64), ("max_freq", types.int64),
    ("most_evictable", types.int64), ("target", types.float64),
    # classed
    ("n_rows", types.int64), ("n_cells", types.int64), ("n_tiers", types.int64), ("default_row", types.int64),
    ("wa", types.boolean), ("stamps_allocation", types.boolean), ("stamps_free", types.boolean),
    ("class_follows_hits", types.boolean),
    ("order", types.int64), ("beta", types.float64), ("adaptive", types.boolean), ("step", types.float64),
    ("beta_max", types.float64), ("learns", types.boolean),
    ("model_p", types.float64[:]), ("model_k", types.int64[:]), ("model_weight", types.float64[:, :]),
    ("model_rate", types.float64[:, :]), ("model_within", types.float64[:, :]),
    ("paper_scale", types.float64[:]), ("paper_lam", types.float64[:]),
    ("tier_of", types.int64[:]), ("ghosts_by_tier", types.int64[:]), ("held", types.int64), ("most", types.int64),
    ("key0", types.float64[:]), ("key1", types.float64[:]), ("key2", types.float64[:]),
    # learned: log-odds weights per feature bin, bucket edges as log-odds
    ("learned_bias", types.float64), ("learned_cell", types.float64[:]), ("learned_tier", types.float64[:]),
    ("learned_depth", types.float64[:]), ("learned_tail", types.float64[:]), ("learned_edges", types.float64[:]),
    ("learned_credit", types.float64),
])


@njit(cache=True)
def new_core(kind, n_blocks, n_lists, n_ghost_lists):
    """A core of ``kind`` with every table empty and every parameter neutral; builders set them."""
    core = structref.new(core_type)
    core.kind = kind
    core.size = 0
    core.q = structs.new_lists(n_blocks, n_lists)
    core.g = structs.new_lists(0, n_ghost_lists)
    core.count = np.zeros(n_blocks, np.int64)
    core.flag = np.zeros(n_blocks, np.bool_)
    core.content = np.full(n_blocks, NONE, np.int64)
    core.stamp = np.full(n_blocks, -np.inf)
    core.pushed = np.full(n_blocks, -np.inf)
    core.depth = np.zeros(n_blocks, np.int64)
    core.row = np.zeros(n_blocks, np.int64)
    core.next_use = np.full(n_blocks, np.inf)
    core.heap = structs.new_heap(16)
    core.live = np.zeros(n_blocks, np.int64)
    core.freed = 0
    core.ghost_value = np.zeros(0, np.int64)
    core.small_ratio = 0.1
    core.ghost_ratio = 0.9
    core.max_freq = 3
    core.most_evictable = 0
    core.target = 0.0
    core.n_rows = n_lists
    core.n_cells = 1
    core.n_tiers = 1
    core.default_row = n_lists - 1
    core.wa = False
    core.stamps_allocation = False
    core.stamps_free = False
    core.class_follows_hits = False
    core.order = ORDER_RECENCY
    core.beta = 0.0
    core.adaptive = False
    core.step = 0.0
    core.beta_max = 0.0
    core.learns = False
    core.model_p = np.zeros(0)
    core.model_k = np.zeros(0, np.int64)
    core.model_weight = np.zeros((0, 0))
    core.model_rate = np.zeros((0, 0))
    core.model_within = np.zeros((0, 0))
    core.paper_scale = np.zeros(0)
    core.paper_lam = np.zeros(0)
    core.tier_of = np.zeros(1, np.int64)
    core.ghosts_by_tier = np.zeros(1, np.int64)
    core.held = 0
    core.most = 0
    core.key0 = np.zeros(n_lists)
    core.key1 = np.zeros(n_lists)
    core.key2 = np.zeros(n_lists)
    core.learned_bias = 0.0
    core.learned_cell = np.zeros(1)
    core.learned_tier = np.zeros(1)
    core.learned_depth = np.zeros(1)
    core.learned_tail = np.zeros(1)
    core.learned_edges = np.zeros(0)
    core.learned_credit = 0.0
    return core


@njit(cache=True)
def reserve_blocks(core, n):
    """Make the per-block tables cover blocks ``0 .. n - 1``."""
    if n <= len(core.count):
        return
    structs.reserve_ids(core.q, n)
    core.count = grown(core.count, n, 0)
    core.flag = grown(core.flag, n, False)
    core.content = grown(core.content, n, NONE)
    core.stamp = grown(core.stamp, n, -np.inf)
    core.pushed = grown(core.pushed, n, -np.inf)
    core.depth = grown(core.depth, n, 0)
    core.row = grown(core.row, n, core.default_row)
    core.next_use = grown(core.next_use, n, np.inf)
    core.live = grown(core.live, n, 0)


@njit(cache=True)
def reserve_contents(core, n):
    """Make the ghost tables cover contents ``0 .. n - 1``."""
    if n > len(core.g.where):
        structs.reserve_ids(core.g, n)
        core.ghost_value = grown(core.ghost_value, n, 0)


# -- the protocol -------------------------------------------------------------------------------
@njit(cache=True)
def core_access(core, block, now, workload, depth, hit, next_use, content):
    """``EvictionPolicy.access`` (``content`` -1 for None)."""
    if block >= len(core.count):
        reserve_blocks(core, block + 1)
    kind = core.kind
    if content >= 0 and (kind == S3FIFO or kind == ARC or kind == CLASSED):  # the kinds with ghosts
        reserve_contents(core, content + 1)
    if kind == LFU:
        core.count[block] = core.count[block] + 1 if hit else 1
    elif kind == S3FIFO:
        _s3fifo_access(core, block, hit, content)
    elif kind == ARC:
        _arc_access(core, block, hit, content)
    elif kind == BELADY:
        core.next_use[block] = next_use
        core.depth[block] = depth
    elif kind == CLASSED:
        _classed_access(core, block, now, workload, depth, hit, content)
    elif kind == LEARNED:
        core.row[block] = workload if 0 <= workload < core.n_cells else core.n_cells - 1
        core.depth[block] = depth
        core.count[block] = core.count[block] + 1 if hit else 0


@njit(cache=True)
def core_free(core, blocks, n, now):
    """``EvictionPolicy.free`` of ``blocks[:n]``, in that order."""
    kind = core.kind
    if kind == LEARNED:
        _learned_free(core, blocks, n, now)
        return
    for i in range(n):
        block = blocks[i]
        if block >= len(core.count):
            reserve_blocks(core, block + 1)
        if kind == LRU:
            push_back(core.q, 0, block)
        elif kind == LFU:
            _lfu_free(core, block)
        elif kind == S3FIFO or kind == ARC:
            push_back(core.q, 1 if core.flag[block] else 0, block)
        elif kind == BELADY:
            core.freed += 1
            core.live[block] = core.freed
            heap_push(core.heap, -core.next_use[block], -float(core.depth[block]), core.freed, block)
        else:
            if core.stamps_free:
                core.stamp[block] = now
            core.pushed[block] = core.stamp[block]
            push_back(core.q, core.row[block], block)
    core.size += n
    if kind == S3FIFO or kind == ARC:
        core.most_evictable = max(core.most_evictable, core.size)
    elif kind == CLASSED and core.wa:
        for i in range(n):
            if core.flag[blocks[i]]:
                core.flag[blocks[i]] = False
                core.held -= 1
        core.most = max(core.most, core.held + core.size)


@njit(cache=True)
def core_contains(core, block):
    if core.kind == BELADY:
        return 0 <= block < len(core.live) and core.live[block] != 0
    return holds(core.q, block)


@njit(cache=True)
def core_remove(core, block):
    """``EvictionPolicy.remove`` of an evictable block."""
    if core.kind == BELADY:
        core.live[block] = 0
        if core.heap.n > 2 * (core.size - 1) + 64:
            _belady_compact(core)
    else:
        unlink(core.q, block)
    core.size -= 1


@njit(cache=True)
def core_evict_n(core, n, now, out, at):
    """Evict ``n`` blocks into ``out[at:at + n]``, first victim first (``evict_n``)."""
    kind = core.kind
    if kind == CLASSED:
        _merge(core, n, now, out, at)
        if core.wa:
            remember(core, out, at, n)
        return
    for i in range(at, at + n):
        if kind == LRU:
            out[i] = pop_front(core.q, 0)
        elif kind == LFU:
            out[i] = _lfu_evict(core)
        elif kind == S3FIFO:
            out[i] = _s3fifo_evict(core)
        elif kind == ARC:
            out[i] = _arc_evict(core)
        elif kind == LEARNED:
            out[i] = _learned_evict(core)
        else:
            out[i] = _belady_evict(core)
        core.size -= 1


# -- LFU ----------------------------------------------------------------------------------------
@njit(cache=True)
def _lfu_free(core, block):
    count = core.count[block] if core.count[block] > 0 else 1  # never accessed: count 1
    structs.reserve_lists(core.q, count + 1)
    if count >= len(core.live):  # lfu: live[c] says whether count c's bucket is in the heap
        core.live = grown(core.live, count + 1, 0)
    if not core.live[count]:
        core.live[count] = 1
        heap_push(core.heap, float(count), 0.0, count, count)
    push_back(core.q, count, block)


@njit(cache=True)
def _lfu_evict(core):
    heap = core.heap
    while not core.q.count[heap.item[0]]:  # buckets are dropped once empty at the top
        core.live[heap_pop(heap)] = 0
    return pop_front(core.q, heap.item[0])


# -- S3-FIFO ------------------------------------------------------------------------------------
@njit(cache=True)
def _s3fifo_access(core, block, hit, content):
    if hit:
        core.count[block] = min(core.count[block] + 1, core.max_freq)
        return
    core.count[block] = 0
    core.content[block] = content
    recomputed = content >= 0 and holds(core.g, content)
    if recomputed:
        unlink(core.g, content)
    core.flag[block] = recomputed


@njit(cache=True)
def _s3fifo_evict(core):
    q, count = core.q, core.count
    while True:  # each pass evicts or moves a block; moves are bounded by the frequency cap
        small, main = q.count[0], q.count[1]
        if small and (small > core.small_ratio * (small + main) or not main):
            block = pop_front(q, 0)
            if count[block] > 0:
                count[block] = 0
                core.flag[block] = True
                push_back(q, 1, block)
                continue
            content = core.content[block]
            if content >= 0:
                if not holds(core.g, content):
                    push_back(core.g, 0, content)
                while core.g.count[0] > core.ghost_ratio * core.most_evictable:
                    pop_front(core.g, 0)
            return block
        block = pop_front(q, 1)
        if count[block] > 0:
            count[block] -= 1
            push_back(q, 1, block)
            continue
        return block


# -- ARC ----------------------------------------------------------------------------------------
@njit(cache=True)
def _arc_access(core, block, hit, content):
    if hit:
        core.flag[block] = True
        return
    core.content[block] = content
    ghost = False
    if content >= 0 and holds(core.g, content):
        b1, b2 = core.g.count[0], core.g.count[1]
        if core.g.where[content] == 0:
            core.target = min(core.target + max(1.0, b2 / b1), float(core.most_evictable))
        else:
            core.target = max(core.target - max(1.0, b1 / b2), 0.0)
        unlink(core.g, content)
        ghost = True
    core.flag[block] = ghost


@njit(cache=True)
def _arc_evict(core):
    q = core.q
    t1 = q.count[0]
    if t1 and (t1 >= int(core.target) or not q.count[1]):
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


# -- Belady -------------------------------------------------------------------------------------
@njit(cache=True)
def _belady_evict(core):
    heap, live = core.heap, core.live
    while True:
        seq, block = heap.seq[0], heap.item[0]
        heap_pop(heap)
        if live[block] == seq:
            live[block] = 0
            return block


@njit(cache=True)
def _belady_compact(core):
    heap = core.heap
    keep = np.empty(heap.n, np.bool_)
    for k in range(heap.n):
        keep[k] = core.live[heap.item[k]] == heap.seq[k]
    structs.heap_keep(heap, keep)


# -- learned ------------------------------------------------------------------------------------
@njit(cache=True)
def log_bin(value):
    """The bit length of ``value`` >= 0 (``kvprof.models.learned.log_bin`` before its cap)."""
    bits = 0
    while value > 0:
        value >>= 1
        bits += 1
    return bits


@njit(cache=True)
def _learned_free(core, blocks, n, now):
    """``LearnedPolicy.free``: each block to the bucket of its predicted log-odds."""
    deepest = 0
    for i in range(n):
        block = blocks[i]
        if block >= len(core.count):
            reserve_blocks(core, block + 1)
        deepest = max(deepest, core.depth[block])
    last_bin = len(core.learned_depth) - 1
    for i in range(n):
        block = blocks[i]
        depth = core.depth[block]
        log_odds = (core.learned_bias + core.learned_cell[core.row[block]] + core.learned_tier[tier(core, core.count[block])]
                    + core.learned_depth[min(log_bin(depth), last_bin)]
                    + core.learned_tail[min(log_bin(deepest - depth), last_bin)])
        bucket = 0
        for edge in core.learned_edges:
            if log_odds >= edge:
                bucket += 1
        core.stamp[block] = now
        push_back(core.q, bucket, block)
    core.size += n


@njit(cache=True)
def _learned_evict(core):
    """``LearnedPolicy.evict``: the head of least ``freed + bucket * credit``, the lower bucket on a tie."""
    q = core.q
    best = NONE
    best_key = 0.0
    for bucket in range(core.n_rows):
        if q.count[bucket]:
            key = core.stamp[q.head[bucket]] + bucket * core.learned_credit
            if best == NONE or key < best_key:
                best, best_key = bucket, key
    return pop_front(q, best)


# -- classed: rows, wa's hit counts and ghost ---------------------------------------------------
@njit(cache=True)
def tier(core, hits):
    """Reuse tier of ``hits`` (``orders.tier_of`` capped at the core's tiers)."""
    table = core.tier_of
    t = table[hits] if hits < len(table) else table[len(table) - 1]
    return min(t, core.n_tiers - 1)


@njit(cache=True)
def _classed_access(core, block, now, workload, depth, hit, content):
    if not core.wa:  # wa-paper
        if not 0 <= workload <= core.default_row:
            workload = core.default_row
        if hit:
            core.stamp[block] = now
            if core.class_follows_hits:
                core.row[block] = workload
        else:
            core.stamp[block] = now if core.stamps_allocation else -np.inf
            core.row[block] = workload
        core.depth[block] = depth
        return
    if not 0 <= workload < core.n_cells:
        workload = core.n_cells - 1
    if hit:
        hits = core.count[block] + 1
    else:
        hits = _recall(core, content) if content >= 0 else 0
        if content >= 0:
            core.content[block] = content
    core.count[block] = hits
    core.row[block] = workload * core.n_tiers + tier(core, hits)
    core.stamp[block] = now
    core.depth[block] = depth
    if not core.flag[block]:
        core.flag[block] = True
        core.held += 1


@njit(cache=True)
def _recall(core, content):
    """Hit count of newly allocated content: one more than when it was evicted, if remembered."""
    if not holds(core.g, content):
        return 0
    unlink(core.g, content)
    evicted = core.ghost_value[content]
    t = tier(core, evicted)
    core.ghosts_by_tier[t] -= 1
    if core.learns and core.order == ORDER_FREQUENCY and core.adaptive:
        _ghost_hit(core, t)
    return evicted + 1


@njit(cache=True)
def _ghost_hit(core, t):
    """``FrequencyOrder.ghost_hit``: move beta as ARC moves its target."""
    by_tier = core.ghosts_by_tier
    fresh = by_tier[0]
    reused = 0
    for k in range(1, len(by_tier)):
        reused += by_tier[k]
    if t == 0:
        core.beta = max(0.0, core.beta - core.step * max(1.0, reused / max(fresh, 1)))
    else:
        core.beta = min(core.beta_max, core.beta + core.step * max(1.0, fresh / max(reused, 1)))


@njit(cache=True)
def remember(core, victims, at, n):
    """Put the victims' contents in wa's ghost with their hit counts, oldest forgotten first."""
    g, by_tier = core.g, core.ghosts_by_tier
    for i in range(at, at + n):
        block = victims[i]
        content = core.content[block]
        if content < 0:
            continue
        core.content[block] = NONE
        count = core.count[block]
        if holds(g, content):
            by_tier[tier(core, core.ghost_value[content])] -= 1
            unlink(g, content)
        push_back(g, 0, content)
        core.ghost_value[content] = count
        by_tier[tier(core, count)] += 1
    while g.count[0] > core.most:
        by_tier[tier(core, core.ghost_value[pop_front(g, 0)])] -= 1


# -- classed: the merge of the row lists --------------------------------------------------------
@njit(cache=True)
def model_score(core, row, age):
    """``ModelOrder.score``: P(reused within H | row, idle ``age`` s), operation for operation."""
    p = core.model_p[row]
    k = core.model_k[row]
    if p <= 0.0 or k == 0:
        return 0.0
    rates, weights, within_h = core.model_rate[row], core.model_weight[row], core.model_within[row]
    slowest = rates[0]
    for j in range(1, k):
        slowest = min(slowest, rates[j])
    surviving = 0.0
    within = 0.0
    for j in range(k):
        share = weights[j] * math.exp(-(rates[j] - slowest) * age) if rates[j] > slowest else weights[j]
        surviving += share
        within += share * within_h[j]
    if p >= 1.0:
        return within / surviving
    exponent = (slowest * age if slowest > 0.0 else 0.0) - math.log(p) + math.log1p(-p)
    return within / (math.exp(exponent) + surviving) if exponent < 700.0 else 0.0


@njit(cache=True)
def _score(core, row, stamp, now):
    """First element of the sort key of a head of ``row`` pushed with ``stamp``."""
    order = core.order
    if order == ORDER_RECENCY:
        return stamp
    if order == ORDER_SEGMENTED:
        return 1.0 if row % core.n_tiers else 0.0
    age = now - stamp
    if order == ORDER_FREQUENCY:
        return core.beta * (row % core.n_tiers) - math.log(age + 1e-3 if age > 0.0 else 1e-3)
    if age <= 0.0:
        age = 0.0
    if order == ORDER_MODEL:
        return model_score(core, row, age)
    scale = core.paper_scale[row]
    return scale * math.exp(-core.paper_lam[row] * age) if scale else 0.0


@njit(cache=True)
def _set_key(core, row, block, score):
    core.key0[row] = score
    if core.order == ORDER_PAPER:  # (score, row): blocks freed together leave together
        core.key1[row] = 0.0
        core.key2[row] = 0.0
    elif core.order == ORDER_SEGMENTED:  # (segment, stamp, -depth, row)
        core.key1[row] = core.pushed[block]
        core.key2[row] = -float(core.depth[block])
    else:  # (score, -depth, stamp, row): the deeper block, then the older access
        core.key1[row] = -float(core.depth[block])
        core.key2[row] = core.pushed[block]


@njit(cache=True)
def _before(core, r, s):
    """Head of row ``r`` sorts before head of row ``s`` (keys end with the row)."""
    if core.key0[r] != core.key0[s]:
        return core.key0[r] < core.key0[s]
    if core.key1[r] != core.key1[s]:
        return core.key1[r] < core.key1[s]
    if core.key2[r] != core.key2[s]:
        return core.key2[r] < core.key2[s]
    return r < s


@njit(cache=True)
def _merge(core, n, now, out, at):
    """The greedy merge of the rows (``ClassFifos.merge``): ``n`` times the head with the lowest key.

    Keys are computed once per head; a run of blocks pushed with one stamp shares its score, so
    only a new stamp is scored again.
    """
    q = core.q
    for r in range(core.n_rows):
        if q.count[r]:
            head = q.head[r]
            _set_key(core, r, head, _score(core, r, core.pushed[head], now))
    need = n
    while need:
        best = second = NONE
        for r in range(core.n_rows):
            if not q.count[r]:
                continue
            if best == NONE or _before(core, r, best):
                best, second = r, best
            elif second == NONE or _before(core, r, second):
                second = r
        while True:
            block = pop_front(q, best)
            out[at] = block
            at += 1
            need -= 1
            core.size -= 1
            if not need or not q.count[best]:
                break
            head = q.head[best]
            stamp = core.pushed[head]
            score = core.key0[best] if stamp == core.pushed[block] else _score(core, best, stamp, now)
            _set_key(core, best, head, score)
            if second != NONE and not _before(core, best, second):
                break


# -- configuration (struct fields cannot be set from Python) ------------------------------------
@njit(cache=True)
def set_s3fifo(core, small_ratio, ghost_ratio, max_freq):
    core.small_ratio, core.ghost_ratio, core.max_freq = small_ratio, ghost_ratio, max_freq


@njit(cache=True)
def set_rows(core, default_row, stamps_allocation, stamps_free, class_follows_hits):
    """A ``CLASSED`` core's row rules (:class:`kvprof.policy.classed.ClassedLRUPolicy`)."""
    core.default_row = default_row
    core.row[:] = default_row
    core.stamps_allocation, core.stamps_free, core.class_follows_hits = stamps_allocation, stamps_free, class_follows_hits


@njit(cache=True)
def set_paper(core, scale, lam):
    """wa-paper's published score per class: ``scale e^(-lam age)``."""
    core.order = ORDER_PAPER
    core.paper_scale, core.paper_lam = scale, lam


@njit(cache=True)
def set_wa(core, n_cells, n_tiers, tier_of, model_p, model_k, model_weight, model_rate, model_within):
    """wa's cells, tiers and fitted model (``ModelOrder``'s per-row floats)."""
    core.wa = True
    core.n_cells, core.n_tiers = n_cells, n_tiers
    core.tier_of = tier_of
    core.ghosts_by_tier = np.zeros(n_tiers, np.int64)
    core.model_p, core.model_k = model_p, model_k
    core.model_weight, core.model_rate, core.model_within = model_weight, model_rate, model_within


@njit(cache=True)
def set_order(core, order, learns, beta, adaptive, step, beta_max):
    """The row order eviction follows, and whether it learns from this core's own ghost."""
    core.order, core.learns = order, learns
    core.beta, core.adaptive, core.step, core.beta_max = beta, adaptive, step, beta_max


@njit(cache=True)
def set_learned(core, n_cells, tier_of, bias, cell, tier_weights, depth, tail, edges, credit):
    """A ``LEARNED`` core's predictor (:class:`kvprof.models.learned.LearnedModel`, edges as log-odds)."""
    core.n_cells, core.n_tiers, core.tier_of = n_cells, len(tier_weights), tier_of
    core.default_row = n_cells - 1
    core.row[:] = n_cells - 1
    core.learned_bias, core.learned_cell, core.learned_tier = bias, cell, tier_weights
    core.learned_depth, core.learned_tail, core.learned_edges = depth, tail, edges
    core.learned_credit = credit


@njit(cache=True)
def core_size(core):
    return core.size


register_pool_protocol(CoreType, core_access, core_free, core_remove, core_evict_n, core_contains, core_size)
