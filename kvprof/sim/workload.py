"""A trace turned into what the replay loop reads: engine blocks, classes and next uses per request.

Everything is computed once per (trace, hp file, engine block size), vectorised, and shared by
every run of a sweep, so the per-run loop only indexes arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvprof.profiler.classes import classify_trace
from kvprof.profiler.cells import cells_of_trace
from kvprof.profiler.reuse import next_access
from kvprof.profiler.trace import Trace
from kvprof.sim.config import SimulationError
from kvprof.sim.timed import RecordedTiming, recorded_timing


@dataclass(frozen=True, eq=False)
class Workload:
    """Per-request replay inputs at engine-block granularity.

    Invariants: request ``i``'s cacheable (full) engine blocks are
    ``block[offsets[i]:offsets[i + 1]]`` in chain order, so depth = position in that slice;
    ``n_lookup[i] <= offsets[i + 1] - offsets[i] <= n_blocks[i]``.

    Attributes
    ----------
    arrival : float64 array, shape (n,)
        Seconds since the evaluation window's start, divided by ``rate_scale``.
    prompt_tokens, output_tokens : int64 arrays, shape (n,)
    n_blocks : int64 array, shape (n,)
        Engine blocks the request allocates: ``ceil(prompt / engine_block_size)`` (plus its output
        tokens when the cost model decodes; see :meth:`blocks_needed`).
    n_lookup : int64 array, shape (n,)
        Leading full blocks that may be prefix hits: ``(prompt - 1) // engine_block_size``, because
        vLLM always recomputes the prompt's last token.
    offsets : int64 array, shape (n + 1,)
        CSR offsets into ``block`` and ``next_use``.
    block : int64 array, shape (m,)
        Dense engine block id (0..n_distinct-1) of each full block: identified by the trace hash
        of its last trace block, as hashes are prefix-chained.
    next_use : float64 array, shape (m,)
        Arrival (seconds since window start) of the next later request using the same engine
        block, ``inf`` if none in the window. Belady reads it.
    workload : int32 array, shape (n,)
        Class index of each request into ``class_names`` (the hp file's ``table()`` order).
    cell : int32 array, shape (n,)
        Cell index of each request (the hp file's ``cell_names()`` order): what policies keyed
        by cells (``keyed_by == "cell"``) are told instead of the class.
    class_names : tuple of str
    engine_block_size : int
        Tokens per engine block.
    duration : float
        Length of the evaluation window, seconds (divided by ``rate_scale``).
    rate_scale : float
        How many times as fast as in the trace requests arrive.
    timing : RecordedTiming or None
        When the server held each request's blocks, for a trace recorded by ``vllm serve
        --kv-record`` read at the server's block size and rate (:mod:`kvprof.sim.timed`).
    """

    arrival: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    n_blocks: np.ndarray
    n_lookup: np.ndarray
    offsets: np.ndarray
    block: np.ndarray
    next_use: np.ndarray
    workload: np.ndarray
    cell: np.ndarray
    class_names: tuple[str, ...]
    engine_block_size: int
    duration: float
    rate_scale: float = 1.0
    timing: RecordedTiming | None = None

    @property
    def n_requests(self) -> int:
        return int(self.arrival.shape[0])

    @property
    def n_accesses(self) -> int:
        """Full engine-block accesses (the blocks a request looks up or caches)."""
        return int(self.block.shape[0])

    def codes_for(self, policy) -> np.ndarray:
        """What ``policy.access`` is told a request's workload is: its cell or its class."""
        return self.cell if policy.keyed_by == "cell" else self.workload

    def blocks_needed(self, decode: bool) -> np.ndarray:
        """Engine blocks each request holds while running, int64 (n,)."""
        if not decode:
            return self.n_blocks
        size = self.engine_block_size
        return (self.prompt_tokens + self.output_tokens + size - 1) // size


def prepare_workload(trace: Trace, hp=None, engine_block_size: int = 128, rate_scale: float = 1.0) -> Workload:
    """Vectorised per-request arrays for replaying ``trace``.

    Parameters
    ----------
    trace : Trace
        The evaluation window; arrival times are made relative to ``trace.window[0]`` (or the
        first arrival when the window is open).
    hp : HpFile or None
        Supplies the class rule and class order; None puts every request in class 0.
    engine_block_size : int
        Tokens per engine block; must be a multiple of ``trace.block_size``.
    rate_scale : float
        Arrivals this many times as fast as in the trace (``replay --rate-scale``).

    Raises
    ------
    SimulationError
        Empty trace, block sizes that do not divide, an hp file fitted at another block size, or
        a class rule keyed on a field the trace lacks.
    """
    if trace.n_requests == 0:
        raise SimulationError("the evaluation window holds no requests")
    if engine_block_size < trace.block_size or engine_block_size % trace.block_size:
        raise SimulationError(
            f"engine block size {engine_block_size} must be a multiple of the trace's block size {trace.block_size}"
        )
    if hp is not None and hp.block_size is not None and hp.block_size != trace.block_size:
        raise SimulationError(
            f"the hp file was fitted on {hp.block_size}-token blocks but the trace has {trace.block_size}-token blocks"
        )
    group = engine_block_size // trace.block_size
    start = trace.window[0] if math.isfinite(trace.window[0]) else float(trace.timestamp[0])
    arrival = (trace.timestamp.astype(np.float64) - start) / rate_scale
    prompt = trace.input_length.astype(np.int64)
    # A full engine block needs its tokens and its trace hashes (guards short hash lists).
    n_full = np.minimum(prompt // engine_block_size, trace.n_blocks_per_request // group)
    offsets = np.zeros(trace.n_requests + 1, dtype=np.int64)
    np.cumsum(n_full, out=offsets[1:])
    owner = np.repeat(np.arange(trace.n_requests, dtype=np.int64), n_full)
    depth = np.arange(offsets[-1], dtype=np.int64) - offsets[owner]
    # The last trace block of the group carries the whole prefix's identity.
    hashes = trace.hash_ids[trace.hash_offsets[owner] + (depth + 1) * group - 1]
    _, block = np.unique(hashes, return_inverse=True)
    block = block.reshape(-1).astype(np.int64)
    nxt = next_access(block, owner)
    next_use = np.full(block.shape[0], np.inf)
    reused = nxt >= 0
    next_use[reused] = arrival[owner[nxt[reused]]]
    workload, names = _classes(trace, hp)
    cell = _cells(trace, hp)
    # The recorded times are the server's: only at its own block size and speed do they apply.
    timing = None
    if rate_scale == 1.0 and group == 1:
        timing = recorded_timing(trace, start, offsets, block, prompt, trace.output_length.astype(np.int64),
                                 engine_block_size)
    return Workload(
        arrival=arrival,
        prompt_tokens=prompt,
        output_tokens=trace.output_length.astype(np.int64),
        n_blocks=(prompt + engine_block_size - 1) // engine_block_size,
        n_lookup=np.minimum(np.maximum(prompt - 1, 0) // engine_block_size, n_full),
        offsets=offsets,
        block=block,
        next_use=next_use,
        workload=workload,
        cell=cell,
        class_names=names,
        engine_block_size=engine_block_size,
        duration=trace.duration / rate_scale,
        rate_scale=rate_scale,
        timing=timing,
    )


def _cells(trace: Trace, hp) -> np.ndarray:
    """Cell index of every request in the hp file's ``cell_names()`` order (all 0 without a file)."""
    if hp is None:
        return np.zeros(trace.n_requests, dtype=np.int32)
    codes, names = classify_trace(trace, hp.class_rule)
    if hp.cell_rule is None:
        to_cells = np.array([hp.cell_index(name) for name in names], dtype=np.int32)
        return to_cells[codes]
    try:
        cells = cells_of_trace(hp.cell_rule, trace, codes, names)
    except KeyError as exc:
        raise SimulationError(f"the hp file's cell rule reads field {exc} that the trace lacks") from None
    to_cells = np.array([hp.cell_index(name) for name in hp.cell_rule.names], dtype=np.int32)
    return to_cells[cells]


def _classes(trace: Trace, hp) -> tuple[np.ndarray, tuple[str, ...]]:
    """Class index of every request in the hp file's ``table()`` order, and those names."""
    if hp is None:
        return np.zeros(trace.n_requests, dtype=np.int32), ("all",)
    try:
        codes, names = classify_trace(trace, hp.class_rule)
    except ValueError as exc:
        raise SimulationError(f"the hp file's class rule does not fit the trace: {exc}") from None
    to_hp = np.array([hp.index_of(name) for name in names], dtype=np.int32)
    return to_hp[codes], tuple(hp.table()[0])
