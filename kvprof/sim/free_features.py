"""The learned candidate's features of every access, read off a replay's hits: what it is trained on.

:func:`access_features` gives each access of a workload the feature bins
(:data:`kvprof.models.learned.FEATURES`) that :class:`kvprof.policy.learned.FreeFeatures` gives its
block when the request frees it, on a replay whose hits are ``hit`` (Belady's, for training): a
miss allocates the content anew (its hits, chain turn and children start over), a hit counts. It
keeps that state per content (fit time only: the live pool keeps it per block) and runs compiled,
one pass over the accesses. It differs from the pool's in what the workload does not say: a turn's
time is its request's arrival (the pool's is its free) and a request's blocks are all freed together.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvprof.core.kinds.classed import tier_table
from kvprof.core.kinds.learned import gap_bin, log_bin
from kvprof.models.learned import FEATURES, N_LOG_BINS
from kvprof.sim.workload import Workload


def access_features(workload: Workload, hit: np.ndarray, n_cells: int, n_tiers: int) -> np.ndarray:
    """Feature bins of each access (int64, (m, 7), :data:`~kvprof.models.learned.FEATURES` order)."""
    block = np.ascontiguousarray(workload.block, dtype=np.int64)
    n_contents = int(block.max()) + 1 if len(block) else 0
    return _features(block, workload.offsets.astype(np.int64), workload.arrival.astype(np.float64),
                     workload.cell.astype(np.int64), np.asarray(hit, dtype=np.bool_), tier_table(), n_cells,
                     n_tiers, n_contents)


@njit(cache=True)
def _features(block, offsets, arrival, cell, hit, tier_of, n_cells, n_tiers, n_contents):
    last_bin = N_LOG_BINS - 1
    rows = np.zeros((len(block), len(FEATURES)), np.int64)
    hits = np.zeros(n_contents, np.int64)
    turn_of = np.zeros(n_contents, np.int64)
    tail_at = np.zeros(n_contents)
    child = np.full(n_contents, -1, np.int64)
    fanout = np.zeros(n_contents, np.int64)
    for r in range(len(offsets) - 1):
        start, stop = offsets[r], offsets[r + 1]
        if stop == start:
            continue
        now = arrival[r]
        for k in range(start, stop):
            c = block[k]
            if hit[k]:
                hits[c] += 1
            else:
                hits[c], turn_of[c], child[c], fanout[c] = 0, 0, -1, 0
        previous, previous_turn = -1, 0
        for k in range(stop - 1, start - 1, -1):  # tail first, as the pool frees a chain
            if turn_of[block[k]] > previous_turn:
                previous, previous_turn = k, turn_of[block[k]]
        turn, gap = 1, -1.0
        if previous >= 0:
            turn = previous_turn + (1 if previous != stop - 1 else 0)
            gap = now - tail_at[block[previous]]
        for k in range(start, stop - 1):
            c = block[k]
            if child[c] != block[k + 1]:
                child[c] = block[k + 1]
                fanout[c] += 1
        for k in range(max(start, stop - 2), stop):  # the tail and its parent
            turn_of[block[k]], tail_at[block[k]] = turn, now
        row_cell = cell[r] if 0 <= cell[r] < n_cells else n_cells - 1
        deepest = stop - 1 - start
        for k in range(start, stop):
            c = block[k]
            h = hits[c]
            t = tier_of[h] if h < len(tier_of) else tier_of[len(tier_of) - 1]
            rows[k, 0], rows[k, 1] = row_cell, min(t, n_tiers - 1)
            rows[k, 2], rows[k, 3] = log_bin(k - start, last_bin), log_bin(deepest - (k - start), last_bin)
            rows[k, 4], rows[k, 5], rows[k, 6] = log_bin(turn, last_bin), gap_bin(gap, last_bin), log_bin(fanout[c], last_bin)
    return rows
