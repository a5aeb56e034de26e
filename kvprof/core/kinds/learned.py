"""The twin of wa's learned candidate (:class:`kvprof.policy.learned.LearnedPolicy`): list ``k`` of
the queue holds bucket ``k`` in free order; eviction takes the head of least ``freed + k * credit``.

State: ``learned_hits`` (per block: hits since allocation), the predictor's log-odds weights per
feature bin and its bucket edges as log-odds. A block's ``row`` is its cell and its ``stamp``
when it was freed; its reuse tier comes from the cells and tiers of
:mod:`~kvprof.core.kinds.classed` (``n_cells``, ``n_tiers``, ``tier_of``), set here.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from kvprof.core.kinds.classed import tier, tier_table
from kvprof.core.structs import NONE, grown, pop_front, push_back

FIELDS = [
    ("learned_hits", types.int64[:]),
    ("learned_bias", types.float64), ("learned_cell", types.float64[:]), ("learned_tier", types.float64[:]),
    ("learned_depth", types.float64[:]), ("learned_tail", types.float64[:]), ("learned_edges", types.float64[:]),
    ("learned_credit", types.float64),
]


def lists(policy) -> tuple[int, int]:
    return policy.model.n_buckets, 0


def configure(core, policy) -> None:
    """The predictor (:class:`kvprof.models.learned.LearnedModel`, edges as log-odds)."""
    model = policy.model
    set_learned(core, len(model.cell), tier_table(), model.bias,
                *(np.array(w, dtype=np.float64) for w in (model.cell, model.tier, model.depth, model.tail)),
                model.log_odds_edges(), float(model.credit_s))


@njit(cache=True)
def set_learned(core, n_cells, tier_of, bias, cell, tier_weights, depth, tail, edges, credit):
    core.n_cells, core.n_tiers, core.tier_of = n_cells, len(tier_weights), tier_of
    core.default_row = n_cells - 1
    core.row[:] = n_cells - 1
    core.learned_bias, core.learned_cell, core.learned_tier = bias, cell, tier_weights
    core.learned_depth, core.learned_tail, core.learned_edges = depth, tail, edges
    core.learned_credit = credit


@njit(cache=True)
def init(core):
    core.learned_hits = np.zeros(0, np.int64)
    core.learned_bias = 0.0
    core.learned_cell = np.zeros(1)
    core.learned_tier = np.zeros(1)
    core.learned_depth = np.zeros(1)
    core.learned_tail = np.zeros(1)
    core.learned_edges = np.zeros(0)
    core.learned_credit = 0.0


@njit(cache=True)
def reserve(core, n):
    if n > len(core.learned_hits):
        core.learned_hits = grown(core.learned_hits, n, 0)


@njit(cache=True, inline="always")
def access(core, block, workload, depth, hit):
    core.row[block] = workload if 0 <= workload < core.n_cells else core.n_cells - 1
    core.depth[block] = depth
    core.learned_hits[block] = core.learned_hits[block] + 1 if hit else 0


@njit(cache=True)
def log_bin(value):
    """The bit length of ``value`` >= 0 (``kvprof.models.learned.log_bin`` before its cap)."""
    bits = 0
    while value > 0:
        value >>= 1
        bits += 1
    return bits


@njit(cache=True)
def free(core, blocks, n, now):
    """``LearnedPolicy.free``: each block to the bucket of its predicted log-odds (tables reserved)."""
    deepest = 0
    for i in range(n):
        deepest = max(deepest, core.depth[blocks[i]])
    last_bin = len(core.learned_depth) - 1
    for i in range(n):
        block = blocks[i]
        depth = core.depth[block]
        log_odds = (core.learned_bias + core.learned_cell[core.row[block]]
                    + core.learned_tier[tier(core, core.learned_hits[block])]
                    + core.learned_depth[min(log_bin(depth), last_bin)]
                    + core.learned_tail[min(log_bin(deepest - depth), last_bin)])
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
