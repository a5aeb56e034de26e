"""Reuse extraction: for every block access, when is the same block accessed next?

Accesses are sorted once by (block, request) and neighbours in that order are compared (vectorised,
or in one compiled pass for the fit's samples), so a trace of millions of block accesses takes
well under a second.

Two decisions, both documented in the README:

* Repeated ids inside one request (a prompt that repeats a block) count as one access: reuse is
  about a *later* request finding the block cached.
* Concurrency floor ``min_gap`` (default 0.3 s, as in the published profiler): a next access
  sooner than this is concurrent use (two requests in flight on the same prefix, the shared
  system prompt of a burst). Every policy serves such a hit, because the block is still pinned or
  was just freed, so it says nothing about eviction. The earlier access of such a pair is merged
  into the later one (dropped, counted in ``n_merged``); the later one carries the block's next
  idle reuse. Dropping the pair entirely, as the published profiler does with such gaps, would
  instead count the burst's blocks as accesses that were never reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from kvprof.profiler.trace import Trace


@dataclass(frozen=True)
class ReuseSamples:
    """Reuse observations, one per block access, for fitting.

    Attributes
    ----------
    time : float64 array, shape (m,)
        Seconds to the next access when reused; exposure (censor time - access time) when censored.
    censored : bool array, shape (m,)
        True when no later access of the block falls inside the window.
    workload : int32 array, shape (m,)
        Class code of the accessing request.
    request : int64 array, shape (m,)
        Row of the accessing request in the trace.
    prior : int64 array, shape (m,)
        How many earlier requests accessed the block (concurrent ones too, as a cache counts its
        hits): with
        an infinite cache this access is a prefix hit when > 0. Such blocks (shared system
        prompts, documents asked about again) come back far sooner than fresh ones, so the fit
        models them apart, by reuse tier.
    n_merged : int
        Accesses merged into a concurrent later access (gap below ``min_gap``).
    """

    time: np.ndarray
    censored: np.ndarray
    workload: np.ndarray
    request: np.ndarray
    prior: np.ndarray
    n_merged: int

    def __len__(self) -> int:
        return int(self.time.shape[0])

    @property
    def repeat(self) -> np.ndarray:
        """True where an earlier request already accessed the block, shape (m,)."""
        return self.prior > 0

    def subset(self, rows: np.ndarray) -> ReuseSamples:
        """The samples at ``rows`` (indices or a mask); ``n_merged`` stays the window's."""
        return ReuseSamples(self.time[rows], self.censored[rows], self.workload[rows], self.request[rows],
                            self.prior[rows], self.n_merged)


def access_request_index(trace: Trace) -> np.ndarray:
    """Row of the request owning each entry of ``trace.hash_ids``, shape (n_blocks,)."""
    return np.repeat(np.arange(trace.n_requests, dtype=np.int64), trace.n_blocks_per_request)


@dataclass(frozen=True)
class BlockRuns:
    """Accesses sorted once by (block, request), with the boundaries every question here reads.

    A *run* is the accesses of one block by one request (a prompt can repeat a block); runs of a
    block follow each other in request order, so a run's next access is the next run, when that
    run does not start a new block.

    Attributes
    ----------
    order : int64 array, shape (m,)
        Stable sort of the accesses by (block, request).
    new_block, new_run : bool arrays, shape (m,)
        In sorted order: the access starts a block's accesses / a (block, request) run.
    """

    order: np.ndarray
    new_block: np.ndarray
    new_run: np.ndarray

    @classmethod
    def of(cls, blocks: np.ndarray, request: np.ndarray) -> BlockRuns:
        order = sorted_accesses(blocks, request)
        sorted_blocks, sorted_requests = blocks[order], request[order]
        new_block = np.ones(order.shape[0], dtype=bool)
        new_block[1:] = sorted_blocks[1:] != sorted_blocks[:-1]
        new_run = new_block.copy()
        new_run[1:] |= sorted_requests[1:] != sorted_requests[:-1]
        return cls(order, new_block, new_run)

    def run_of(self) -> np.ndarray:
        """Run number of each sorted access, shape (m,)."""
        return np.cumsum(self.new_run) - 1

    def run_starts_block(self) -> np.ndarray:
        """Per run: whether it is its block's first run (no earlier request used the block)."""
        return self.new_block[self.new_run]


def sorted_accesses(blocks: np.ndarray, request: np.ndarray) -> np.ndarray:
    """Stable order of the accesses by (block, request): one stable sort by block when the
    accesses come in request order already, as a trace's do."""
    if request.size < 2 or np.all(request[1:] >= request[:-1]):
        return np.argsort(blocks, kind="stable")
    return np.lexsort((request, blocks))


def next_access(blocks: np.ndarray, request: np.ndarray) -> np.ndarray:
    """Index of the next access of the same block by a later request.

    Parameters
    ----------
    blocks : int array, shape (m,)
        Block id of each access.
    request : int array, shape (m,)
        Request order of each access (non-decreasing in time; equal for one request's accesses).

    Returns
    -------
    int64 array, shape (m,)
        Index into the inputs of the next access with the same block and a larger request, -1 if
        there is none. Repeated ids within one request all point at the same next access.
    """
    runs = BlockRuns.of(blocks, request)
    m = runs.order.shape[0]
    run_starts = np.flatnonzero(runs.new_run)
    following = np.append(run_starts[1:], m)[runs.run_of()]
    has_next = following < m
    has_next[has_next] = ~runs.new_block[following[has_next]]
    result_sorted = np.full(m, -1, dtype=np.int64)
    result_sorted[has_next] = runs.order[following[has_next]]
    result = np.empty(m, dtype=np.int64)
    result[runs.order] = result_sorted
    return result


def extract_reuse(trace: Trace, codes: np.ndarray, *, min_gap: float = 0.3) -> ReuseSamples:
    """Reuse gap or censored exposure of every block access in the trace's window.

    Parameters
    ----------
    trace : Trace
        Censoring happens at ``trace.censor_time`` (the window's end).
    codes : int array, shape (n_requests,)
        Workload class of each request (``classify_trace``).
    min_gap : float
        Concurrency floor in seconds; see the module docstring.

    Returns
    -------
    ReuseSamples
    """
    return reuse_of_accesses(trace.hash_ids, access_request_index(trace), trace.timestamp, trace.censor_time, codes,
                             min_gap=min_gap)


def reuse_of_accesses(blocks: np.ndarray, request: np.ndarray, timestamp: np.ndarray, censor_time: float,
                      codes: np.ndarray, *, min_gap: float = 0.3) -> ReuseSamples:
    """:func:`extract_reuse` of some accesses of a window: all the accesses of some blocks (a
    shard of a trace's blocks gives that shard's samples).

    Parameters
    ----------
    blocks, request : int arrays, shape (m,)
        Block and request row of each access.
    timestamp : float array, shape (n_requests,)
        Arrival of every request of the window.
    censor_time : float
        The window's end.
    codes : int array, shape (n_requests,)
        Workload class of each request.

    Returns
    -------
    ReuseSamples
        In (block, request) order.
    """
    if min_gap < 0:
        raise ValueError(f"min_gap must be >= 0 seconds, got {min_gap}")
    time, censored, request, prior, n_merged = _samples_of_runs(
        np.asarray(blocks), np.asarray(request, dtype=np.int64), sorted_accesses(blocks, request),
        np.asarray(timestamp, dtype=np.float64), float(censor_time), float(min_gap))
    return ReuseSamples(time=time, censored=censored, workload=np.asarray(codes, dtype=np.int32)[request],
                        request=request, prior=prior, n_merged=int(n_merged))


@njit(cache=True)
def _samples_of_runs(blocks, request, order, timestamp, censor_time, min_gap):
    """One pass over the accesses in (block, request) ``order``: a sample per run (one request's
    accesses of a block, repeats counted once), its gap to the block's next run or its exposure,
    concurrent runs merged into the next; returns ``(time, censored, request, prior, n_merged)``."""
    m = order.size
    time = np.empty(m, np.float64)
    censored = np.empty(m, np.bool_)
    owner = np.empty(m, np.int64)
    prior = np.empty(m, np.int64)
    n = n_merged = earlier = 0
    i = 0
    while i < m:
        block, r = blocks[order[i]], request[order[i]]
        j = i + 1
        while j < m and blocks[order[j]] == block and request[order[j]] == r:
            j += 1
        arrival = timestamp[r]
        if j < m and blocks[order[j]] == block:
            gap = timestamp[request[order[j]]] - arrival
            if gap < min_gap:  # concurrent use: merged into the next run, which carries the reuse
                n_merged += 1
            else:
                time[n], censored[n], owner[n], prior[n] = gap, False, r, earlier
                n += 1
            earlier += 1  # earlier requests of the block, concurrent ones included (a cache counts them)
        else:
            time[n], censored[n], owner[n], prior[n] = max(censor_time - arrival, 0.0), True, r, earlier
            n += 1
            earlier = 0
        i = j
    return time[:n].copy(), censored[:n].copy(), owner[:n].copy(), prior[:n].copy(), n_merged


def ideal_hit_ratio(trace: Trace) -> float:
    """Share of block accesses whose block an earlier request already accessed (infinite cache)."""
    if trace.n_blocks == 0:
        return 0.0
    runs = BlockRuns.of(trace.hash_ids, access_request_index(trace))
    # Every access outside its block's first run is a hit.
    hits = ~runs.run_starts_block()[runs.run_of()]
    return float(np.count_nonzero(hits) / hits.shape[0])
