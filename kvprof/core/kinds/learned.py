"""The twin of wa's learned candidate (:class:`kvprof.policy.learned.LearnedPolicy`): list ``k`` of
the queue holds bucket ``k`` in free order; eviction takes the head of least ``freed + k * credit``.

State per block: ``learned_hits`` (hits since allocation), ``learned_turn`` and ``learned_tail_at``
(the turn and time of the latest free that left it a chain's tail or the tail's parent, turn 0: none),
``learned_child`` and ``learned_fanout`` (the block last found one deeper in its free call, and
how often that changed), all reset when the block is allocated anew; the predictor's log-odds
weights as one table per feature (rows in :data:`kvprof.models.learned.FEATURES` order, zero-padded)
and its bucket edges as log-odds. A block's ``row`` is its cell and its ``stamp`` when it was
freed; its reuse tier comes from the cells and tiers of :mod:`~kvprof.core.kinds.classed`
(``n_cells``, ``n_tiers``, ``tier_of``), set here.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from kvprof.core.kinds.classed import tier, tier_table
from kvprof.core.structs import NONE, grown, pop_front, push_back
from kvprof.models.learned import FEATURES, GAP_UNITS_PER_S, N_LOG_BINS

FIELDS = [
    ("learned_hits", types.int64[:]), ("learned_turn", types.int64[:]), ("learned_tail_at", types.float64[:]),
    ("learned_child", types.int64[:]), ("learned_fanout", types.int64[:]),
    ("learned_bias", types.float64), ("learned_tables", types.float64[:, :]), ("learned_edges", types.float64[:]),
    ("learned_credit", types.float64),
]
COMMON = ("q", "stamp", "depth", "row")


def lists(policy) -> tuple[int, int]:
    return policy.model.n_buckets, 0


def configure(core, policy) -> None:
    """The predictor (:class:`kvprof.models.learned.LearnedModel`, edges as log-odds)."""
    model = policy.model
    weights = model.tables()
    tables = np.zeros((len(FEATURES), max(len(w) for w in weights)))  # a row per feature, zero-padded
    for row, w in enumerate(weights):
        tables[row, :len(w)] = w
    set_learned(core, len(model.cell), tier_table(), len(model.tier), model.bias, tables,
                model.log_odds_edges(), float(model.credit_s))


@njit(cache=True)
def set_learned(core, n_cells, tier_of, n_tiers, bias, tables, edges, credit):
    core.n_cells, core.n_tiers, core.tier_of = n_cells, n_tiers, tier_of
    core.default_row = n_cells - 1
    core.row[:] = n_cells - 1
    core.learned_bias, core.learned_tables, core.learned_edges = bias, tables, edges
    core.learned_credit = credit


@njit(cache=True)
def init(core):
    core.learned_hits = np.zeros(0, np.int64)
    core.learned_turn = np.zeros(0, np.int64)
    core.learned_tail_at = np.zeros(0)
    core.learned_child = np.zeros(0, np.int64)
    core.learned_fanout = np.zeros(0, np.int64)
    core.learned_bias = 0.0
    core.learned_tables = np.zeros((len(FEATURES), 1))
    core.learned_edges = np.zeros(0)
    core.learned_credit = 0.0


@njit(cache=True)
def reserve(core, n):
    if n > len(core.learned_hits):
        core.learned_hits = grown(core.learned_hits, n, 0)
        core.learned_turn = grown(core.learned_turn, n, 0)
        core.learned_tail_at = grown(core.learned_tail_at, n, 0.0)
        core.learned_child = grown(core.learned_child, n, NONE)
        core.learned_fanout = grown(core.learned_fanout, n, 0)


@njit(cache=True, inline="always")
def access(core, block, workload, depth, hit):
    core.row[block] = workload if 0 <= workload < core.n_cells else core.n_cells - 1
    core.depth[block] = depth
    if hit:
        core.learned_hits[block] += 1
    else:  # allocated anew: what the block's former content did is forgotten
        core.learned_hits[block] = 0
        core.learned_turn[block] = 0
        core.learned_child[block] = NONE
        core.learned_fanout[block] = 0


@njit(cache=True)
def log_bin(value, last_bin):
    """``kvprof.models.learned.log_bin``: the bit length of ``value`` >= 0, capped at ``last_bin``."""
    bits = 0
    while value > 0 and bits < last_bin:
        value >>= 1
        bits += 1
    return bits


@njit(cache=True)
def gap_bin(seconds, last_bin):
    """``kvprof.models.learned.gap_bin``."""
    if seconds < 0.0:
        return 0
    return min(1 + log_bin(np.int64(min(seconds, 1e9) * GAP_UNITS_PER_S), last_bin), last_bin)


@njit(cache=True)
def count_children(core, blocks, n):
    """``FreeFeatures._count_children``: a block's child is its neighbour in the call one deeper."""
    for i in range(n):
        block = blocks[i]
        wanted = core.depth[block] + 1
        for j in (i - 1, i + 1):
            if 0 <= j < n and core.depth[blocks[j]] == wanted:
                if core.learned_child[block] != blocks[j]:
                    core.learned_child[block] = blocks[j]
                    core.learned_fanout[block] += 1
                break


@njit(cache=True)
def free_n(core, blocks, n, now):
    """``LearnedPolicy.free``: each block to the bucket of its predicted log-odds (tables reserved)."""
    if n == 0:
        return
    deepest = core.depth[blocks[0]]
    tail = blocks[0]
    previous, previous_turn = NONE, 0
    for i in range(n):
        block = blocks[i]
        if core.depth[block] > deepest:
            deepest, tail = core.depth[block], block
        if core.learned_turn[block] > previous_turn:
            previous, previous_turn = block, core.learned_turn[block]
    turn, gap = 1, -1.0
    if previous != NONE:
        turn = previous_turn + (1 if previous != tail else 0)
        gap = now - core.learned_tail_at[previous]
    count_children(core, blocks, n)
    for i in range(n):  # the tail and its parent (FreeFeatures.of_free)
        if core.depth[blocks[i]] >= deepest - 1:
            core.learned_turn[blocks[i]], core.learned_tail_at[blocks[i]] = turn, now
    tables = core.learned_tables
    last_bin = N_LOG_BINS - 1
    chain = tables[4, log_bin(turn, last_bin)]
    for i in range(n):
        block = blocks[i]
        depth = core.depth[block]
        log_odds = (core.learned_bias + tables[0, core.row[block]]
                    + tables[1, tier(core, core.learned_hits[block])]
                    + tables[2, log_bin(depth, last_bin)] + tables[3, log_bin(deepest - depth, last_bin)]
                    + chain + tables[5, gap_bin(gap, last_bin)] + tables[6, log_bin(core.learned_fanout[block], last_bin)])
        bucket = 0
        for edge in core.learned_edges:
            if log_odds >= edge:
                bucket += 1
        core.stamp[block] = now
        push_back(core.q, bucket, block)


@njit(cache=True)
def evict(core):
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
