"""A trace turned into what the replay loop reads: per request its classes, sizes and times, and
where its engine blocks lie in the trace.

The per-request arrays are computed once per (trace, hp file, engine block size), vectorised, and
shared by every run of a sweep. Per block access nothing is stored: the compiled replay streams the
accesses in chunks of requests (:meth:`Workload.engine_hashes`, :mod:`kvprof.core.stream`), so its
memory does not grow with the number of accesses; :attr:`Workload.block` and
:attr:`Workload.next_use` build the whole arrays for the readers that want them (the Python engine,
tests, small traces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kvprof.models.hints import HintColumns
from kvprof.profiler.classes import classify_trace
from kvprof.profiler.cells import cells_of_trace
from kvprof.profiler.reuse import next_access
from kvprof.profiler.trace import Trace
from kvprof.sim.config import SimulationError
from kvprof.sim.recorded import RecordedTiming, recorded_timing, timing_absent


@dataclass(frozen=True, eq=False)
class Workload:
    """Per-request replay inputs at engine-block granularity.

    Invariants: request ``i`` has ``offsets[i + 1] - offsets[i]`` cacheable (full) engine blocks,
    in chain order (depth = position), block ``k`` identified by the trace hash
    ``hash_ids[hash_start[i] + (k + 1) * group - 1]``; they are ``block[offsets[i]:offsets[i + 1]]``;
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
        CSR offsets of each request's engine blocks in the access sequence (``block``, ``next_use``).
    hash_ids : int64 array
        The trace's hash ids (its own column, not a copy).
    hash_start : int64 array, shape (n,)
        Where each request's hashes start in ``hash_ids``.
    group : int
        Trace blocks per engine block.
    workload : int32 array, shape (n,)
        Class index of each request into ``class_names`` (the hp file's ``table()`` order).
    cell : int32 array, shape (n,)
        Cell index of each request (the hp file's ``cell_names()`` order): what policies keyed
        by cells (``keyed_by == "cell"``) are told instead of the class.
    finish : int8 array, shape (n,)
        How each request's response ended (:attr:`Trace.finish`, the codes of
        :mod:`kvprof.models.finish`; 0 where not known): what ``policy.finish`` is told.
    class_names : tuple of str
    engine_block_size : int
        Tokens per engine block.
    duration : float
        Length of the evaluation window, seconds (divided by ``rate_scale``).
    rate_scale : float
        How many times as fast as in the trace requests arrive.
    timing : RecordedTiming or None
        When the server held each request's blocks, for a trace recorded by ``vllm serve
        --kv-record`` read at the server's block size and rate (:mod:`kvprof.sim.recorded`).
    timing_problem : str or None
        Where ``timing`` is None, why (no recorded times, another block size or rate, bad values).
    timing_error : bool
        Whether that is bad recorded values (an error wherever recorded timing would run).
    hints : HintColumns or None
        Each request's client hint (:attr:`Trace.hints`), None where the trace has none; a replay
        tells them to a policy that takes them (:class:`~kvprof.policy.hinted.HintedPolicy`).
    """

    arrival: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    n_blocks: np.ndarray
    n_lookup: np.ndarray
    offsets: np.ndarray
    hash_ids: np.ndarray
    hash_start: np.ndarray
    group: int
    workload: np.ndarray
    cell: np.ndarray
    finish: np.ndarray
    class_names: tuple[str, ...]
    engine_block_size: int
    duration: float
    rate_scale: float = 1.0
    timing: RecordedTiming | None = None
    timing_problem: str | None = None
    timing_error: bool = False
    hints: HintColumns | None = None

    @property
    def n_requests(self) -> int:
        return int(self.arrival.shape[0])

    @property
    def n_accesses(self) -> int:
        """Full engine-block accesses (the blocks a request looks up or caches)."""
        return int(self.offsets[-1])

    def engine_hashes(self, first: int, stop: int) -> np.ndarray:
        """The trace hash identifying each full engine block of requests ``first .. stop - 1``, in
        access order (int64, ``offsets[stop] - offsets[first]`` of them): the hash of its last
        trace block, which stands for the whole prefix as hashes are prefix-chained."""
        lengths = np.diff(self.offsets[first : stop + 1])
        owner = np.repeat(np.arange(first, stop), lengths)
        depth = np.arange(self.offsets[first], self.offsets[stop]) - self.offsets[owner]
        return self.hash_ids[self.hash_start[owner] + (depth + 1) * self.group - 1]

    @property
    def block(self) -> np.ndarray:
        """Dense engine block id (0..n_distinct-1, in hash order) of every access, int64 (m,);
        built whole on each call."""
        return np.unique(self.engine_hashes(0, self.n_requests), return_inverse=True)[1].reshape(-1).astype(np.int64)

    @property
    def next_use(self) -> np.ndarray:
        """Arrival (seconds since window start) of the next later request using the same engine
        block as each access, ``inf`` if none in the window (Belady reads it); float64 (m,), built
        whole on each call."""
        return _next_use(self.block, self.offsets, self.arrival)

    def codes_for(self, policy) -> np.ndarray:
        """What ``policy.access`` is told a request's workload is: its cell or its class."""
        return self.cell if policy.keyed_by == "cell" else self.workload

    def blocks_needed(self, decode: bool) -> np.ndarray:
        """Engine blocks each request holds while running, int64 (n,): with ``decode``, as many as
        its prompt and output fill but the last output token, whose KV vLLM never computes."""
        if not decode:
            return self.n_blocks
        size = self.engine_block_size
        return (self.prompt_tokens + np.maximum(self.output_tokens, 1) - 1 + size - 1) // size


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
    workload, names = _classes(trace, hp)
    prepared = Workload(
        arrival=arrival,
        prompt_tokens=prompt,
        output_tokens=trace.output_length.astype(np.int64),
        n_blocks=(prompt + engine_block_size - 1) // engine_block_size,
        n_lookup=np.minimum(np.maximum(prompt - 1, 0) // engine_block_size, n_full),
        offsets=offsets,
        hash_ids=trace.hash_ids,
        hash_start=trace.hash_offsets[:-1].astype(np.int64),
        group=group,
        workload=workload,
        cell=_cells(trace, hp),
        finish=trace.finish,
        class_names=names,
        engine_block_size=engine_block_size,
        duration=trace.duration / rate_scale,
        rate_scale=rate_scale,
        hints=trace.hints,
    )
    # The recorded times are the server's: only at its own block size and speed do they apply.
    problem = timing_absent(trace, engine_block_size, rate_scale)
    if problem is not None:
        return replace(prepared, timing_problem=problem)
    try:  # bad values matter only where recorded timing runs (not under --timing model)
        timing = recorded_timing(trace, start, offsets, prepared.block, prompt, prepared.output_tokens,
                                 engine_block_size)
    except SimulationError as exc:
        return replace(prepared, timing_problem=str(exc), timing_error=True)
    return replace(prepared, timing=timing)


def _next_use(block: np.ndarray, offsets: np.ndarray, arrival: np.ndarray) -> np.ndarray:
    """Arrival of the next later request using each access's block, ``inf`` if none."""
    owner = np.repeat(np.arange(offsets.size - 1, dtype=np.int64), np.diff(offsets))
    nxt = next_access(block, owner)
    next_use = np.full(block.shape[0], np.inf)
    reused = nxt >= 0
    next_use[reused] = arrival[owner[nxt[reused]]]
    return next_use


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
