"""Reuse extraction: for every block access, when is the same block accessed next?

Everything here is vectorised: accesses are sorted once by (block, request) and neighbours in that
order are compared, so a trace of millions of block accesses takes well under a second.

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
        order = np.lexsort((request, blocks))
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
    if min_gap < 0:
        raise ValueError(f"min_gap must be >= 0 seconds, got {min_gap}")
    request = access_request_index(trace)
    runs = BlockRuns.of(trace.hash_ids, request)
    # One access per run (repeats within a request count once), in (block, request) order, so
    # an access's next use is the next entry when that entry is the same block's.
    request = request[runs.order[runs.new_run]]
    starts_block = runs.run_starts_block()
    access_time = trace.timestamp[request]
    reused = np.append(~starts_block[1:], False)
    gap = np.where(reused, np.append(access_time[1:], 0.0) - access_time, 0.0)
    concurrent = reused & (gap < min_gap)
    keep = ~concurrent
    exposure = np.maximum(trace.censor_time - access_time, 0.0)
    time = np.where(reused, gap, exposure)[keep]
    # Earlier requests of the same block, concurrent ones included: a live cache counts them as hits.
    position = np.arange(starts_block.shape[0])
    prior = (position - np.maximum.accumulate(np.where(starts_block, position, 0)))[keep]
    return ReuseSamples(
        time=time.astype(np.float64),
        censored=~reused[keep],
        workload=np.asarray(codes, dtype=np.int32)[request[keep]],
        request=request[keep],
        prior=prior.astype(np.int64),
        n_merged=int(concurrent.sum()),
    )


def ideal_hit_ratio(trace: Trace) -> float:
    """Share of block accesses whose block an earlier request already accessed (infinite cache)."""
    if trace.n_blocks == 0:
        return 0.0
    runs = BlockRuns.of(trace.hash_ids, access_request_index(trace))
    # Every access outside its block's first run is a hit.
    hits = ~runs.run_starts_block()[runs.run_of()]
    return float(np.count_nonzero(hits) / hits.shape[0])
