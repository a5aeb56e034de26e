"""The fit of traces larger than memory: the window's blocks in shards on disk, one at a time.

A reuse gap needs all accesses of one block together and nothing else, so the window's block
accesses are split by block into shards, and each shard's samples are computed on its own
(:mod:`kvprof.profiler.summary`); only the requests (a few columns each) are held whole. The
steps, each bounded by one shard (or one trace file) in memory:

1. read the trace files one at a time (:func:`~kvprof.profiler.reader.read_trace`), keep their
   requests in the windows and write their block accesses to disk, with a sample of block ids;
   then count the fit window's next turns from those chains, a file at a time;
2. split the accesses into shards by ranges of block id (from that sample, so the shards hold
   about as many accesses each; in order of id, so the cell tree's sample is the one
   :func:`~kvprof.profiler.fit.fit_trace` draws);
3. per shard, the reuse samples reduced (:class:`~kvprof.profiler.summary.ShardReuse`): counts
   added up in memory, the tree's accesses and the reuse gaps written to disk;
4. the cells learned from the tree's sample; per shard, the gaps sorted by key (and the
   held-out window's questions counted); the fit reads the sorted runs mapped from disk.

On one machine the shards run in turn; given a Ray cluster (``ray``), steps 3 and 4 run as its
tasks, the request columns put once into its object store (the spill directory must then be one
the cluster's nodes share). Either way the hp file is :func:`~kvprof.profiler.fit.fit_trace`'s
on the same window, to the bit (tested). The next-turn counts (``next_turn``) are taken in step 1,
from the spilled chains, one file at a time (:func:`_next_turns`).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvprof.classes import ClassRule
from kvprof.errors import KvprofError
from kvprof.models.hp import HpFile
from kvprof.models.next_turn import NEXT_TURN_HORIZON_S, NextTurnRates
from kvprof.profiler.fit import check_window, classes_of, fit_window, holdout_cells, row_question_counts
from kvprof.profiler.reader import read_trace
from kvprof.profiler.reuse import ReuseSamples, reuse_of_accesses
from kvprof.profiler.summary import N_TIERS, GapRuns, RowKeys, ShardReuse, SortedFile
from kvprof.profiler.trace import Trace, counts_back
from kvprof.profiler.turns import count_next_turns, full_blocks, infer_sessions
from kvprof.recording import FILE as RECORDING_FILE

#: Block accesses per shard by default: a shard's samples take ~60 bytes each while it is processed.
SHARD_ACCESSES = 4_000_000
#: Block ids the next-turn counts scan at a time (with their temporaries, ~40 bytes each).
SCAN_BLOCKS = 1 << 22
#: Every this-many-th block id read is kept to place the shards' boundaries.
_BOUNDARY_SAMPLE = 64


#: Names of trace files in a directory fitted in shards.
_TRACE_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")


def trace_paths(path: os.PathLike | str) -> list[Path]:
    """The trace files to fit: ``path`` itself, or a directory's ``*.jsonl[.gz|.zst]`` files by name.

    Raises
    ------
    KvprofError
        A directory without trace files, or a vLLM recording (read whole, :mod:`kvprof.recording`).
    """
    path = Path(path)
    if not path.is_dir():
        return [path]
    if (path / RECORDING_FILE).exists():  # one server's files: lines unsorted, a conversation across files
        raise KvprofError(f"{path}: a recording directory is read as one trace; fit it without --sharded")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(_TRACE_SUFFIXES))
    if not files:
        raise KvprofError(f"{path}: the directory holds no trace files (*.jsonl, *.jsonl.gz, *.jsonl.zst)")
    return files


@dataclass(frozen=True)
class _Requests:
    """The requests of both windows (fit, then held-out), in time order, without their hash ids."""

    trace: Trace  # hash ids empty; window = the fit window's
    n_fit: int  # requests [0, n_fit) are the fit window's, the rest the held-out window's
    holdout_end: float


def fit_sharded(paths: Sequence[os.PathLike | str], rule: ClassRule = ClassRule(), *, window=(None, None),
                holdout: bool = True, spill_dir: os.PathLike | str | None = None, shard_accesses: int = SHARD_ACCESSES,
                ray: str | None = None, read_options: dict | None = None, **fit_options) -> HpFile:
    """:func:`~kvprof.profiler.fit.fit_trace` of the window of several trace files, read one at a
    time and fitted in shards of their blocks (see the module docstring).

    Parameters
    ----------
    paths : sequence of path
        Trace files whose requests form one trace (their ``chat_id`` s distinct from file to
        file, as a recording's or one server's rotated files are).
    window : (start, end)
        The fit window, seconds from the traces' clock; either side may be None (no negative
        bounds: where the last arrival is, only the last file tells).
    holdout : bool
        Score the fit on the window after it, as long as it (when the window is closed).
    spill_dir : path or None
        Where the shards go (a temporary directory inside it, removed at the end).
    shard_accesses : int
        About this many block accesses per shard.
    ray : str or None
        Run the shards as tasks of this Ray cluster (:func:`~kvprof.parallel.connect_ray`).
    read_options : dict or None
        Passed to :func:`~kvprof.profiler.reader.read_trace` (format, block_size, skip_invalid).
    **fit_options
        :func:`~kvprof.profiler.fit.fit_trace`'s (horizon, min_gap, min_samples, max_cells,
        cell_fields, max_components).
    """
    if any(counts_back(bound) for bound in window):
        raise ValueError(f"a sharded fit's window counts from the traces' start, got {window}")
    options = {"horizon": 60.0, "min_gap": 0.3, "min_samples": 200, "max_cells": 16, "cell_fields": (),
               "max_components": 3, **fit_options}
    if spill_dir is not None:
        Path(spill_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvprof-shards-", dir=spill_dir) as scratch:
        spill = Path(scratch)
        requests, n_accesses, bounds, next_turn = _read(paths, window, holdout, spill, shard_accesses,
                                                        read_options or {})
        fitted, held = _windows(requests)
        check_window(fitted, options["horizon"])
        codes, names = classes_of(fitted, rule)
        _scatter(spill, requests, bounds)
        shards = DiskShards(spill, len(bounds) + 1, requests, rule, codes, held, options["horizon"], options["min_gap"],
                            ray)
        scored = None
        if held is not None:
            def scored(cell_rule, cell_names):
                return shards.holdout_counts(cell_rule, cell_names)
        return fit_window(fitted, codes, names, shards, rule, n_accesses=n_accesses, holdout_counts=scored,
                          next_turn=next_turn, **options)


def _read(paths, window, holdout, spill: Path, shard_accesses, read_options):
    """Step 1: every file's requests in the windows kept, its accesses written to ``spill``."""
    start, end = (-math.inf if window[0] is None else float(window[0])), (math.inf if window[1] is None else float(window[1]))
    holdout_end = end + (end - start) if holdout and math.isfinite(start) and math.isfinite(end) else end
    parts, sample, n_accesses = [], [], 0
    earlier = np.zeros(0, np.int64)  # chat ids of the files read: a conversation may cross files, a file not repeat
    for index, path in enumerate(paths):
        trace, _ = read_trace(path, earlier_chat_ids=earlier, **read_options)
        if trace.format == "bailian":  # Mooncake chat ids are row numbers, each file's own
            earlier = np.union1d(earlier, trace.chat_id)
        first, last, fit_last = np.searchsorted(trace.timestamp, [start, holdout_end, end])
        if first == last:
            continue
        # The windows are one run of rows: their accesses are a view, written out, never copied.
        lo, hi = trace.hash_offsets[first], trace.hash_offsets[last]
        n_accesses += int(trace.hash_offsets[fit_last] - lo)
        trace.hash_ids[lo:hi].tofile(spill / f"file{index}-blocks.bin")
        np.save(spill / f"file{index}-offsets.npy", trace.hash_offsets[first:last + 1] - lo)
        np.save(spill / f"file{index}-full.npy", full_blocks(trace)[first:last])
        sample.append(trace.hash_ids[lo:hi:_BOUNDARY_SAMPLE].copy())
        rows = np.arange(first, last)
        parts.append((index, replace(trace.select(rows[:0]), **{
            name: getattr(trace, name)[first:last] for name in
            ("timestamp", "input_length", "output_length", "chat_id", "parent_chat_id", "type_code", "turn")},
            extra={k: v[first:last] for k, v in trace.extra.items()}, hash_offsets=np.zeros(last - first + 1, np.int64),
            window=trace.window)))
        del trace
    if not parts:
        raise KvprofError(f"{paths[0] if len(paths) == 1 else 'the traces'}: the fit window holds no requests")
    requests, order = _concatenated([trace for _, trace in parts], window=(start, end))
    # Where each file's rows went in the time order of all requests.
    first = np.cumsum([0] + [trace.n_requests for _, trace in parts])
    rank = np.empty(order.size, np.int64)
    rank[order] = np.arange(order.size)
    for k, (index, _) in enumerate(parts):
        np.save(spill / f"file{index}-rank.npy", rank[first[k]:first[k + 1]])
    n_fit = int(np.searchsorted(requests.timestamp, end))
    n_shards = max(1, math.ceil(n_accesses / shard_accesses))
    ids = np.sort(np.concatenate(sample))
    bounds = np.unique(ids[np.linspace(0, ids.size, n_shards + 1, dtype=np.int64)[1:-1]]) if ids.size else ids
    next_turn = _next_turns(spill, [index for index, _ in parts], n_fit, requests.timestamp[:n_fit])
    return _Requests(requests, n_fit, holdout_end), n_accesses, bounds, next_turn


def _next_turns(spill: Path, indices: list[int], n_fit: int, timestamp: np.ndarray) -> NextTurnRates:
    """Step 1's last part: the fit window's :func:`~kvprof.profiler.turns.next_turn_rates`, as
    :func:`~kvprof.profiler.fit.fit_trace` counts them, from the spilled chains of files ``indices`` read
    one at a time: first each fit-window request's tail (its last full block), then of each chain only
    the full blocks that are some request's tail (no other block can end an earlier chain). A file's
    blocks are mapped, not loaded, and scanned :data:`SCAN_BLOCKS` at a time, so memory holds the
    requests' columns and what is kept, never a file's blocks with their per-block temporaries."""

    def files():  # each file's rows' places in the time order, chain offsets, full blocks, and blocks
        for index in indices:
            blocks = spill / f"file{index}-blocks.bin"
            yield (np.load(spill / f"file{index}-rank.npy"), np.load(spill / f"file{index}-offsets.npy"),
                   np.load(spill / f"file{index}-full.npy"),
                   np.memmap(blocks, np.int64, mode="r") if blocks.stat().st_size else np.zeros(0, np.int64))

    tails = np.full(n_fit, -1, np.int64)
    for rank, offsets, n_full, blocks in files():
        ends = (rank < n_fit) & (n_full > 0)
        tails[rank[ends]] = blocks[offsets[:-1][ends] + n_full[ends] - 1]
    known_tails = np.unique(tails[tails >= 0])
    rows, depths, found = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for rank, offsets, n_full, blocks in files() if known_tails.size else ():
        first = 0
        while first < rank.size:  # rows first .. stop - 1: about SCAN_BLOCKS blocks (at least one row)
            stop = max(int(np.searchsorted(offsets, offsets[first] + SCAN_BLOCKS, side="right")) - 1, first + 1)
            stop = min(stop, rank.size)
            start = offsets[first]
            row = np.repeat(np.arange(first, stop), np.diff(offsets[first:stop + 1]))
            depth = np.arange(start, offsets[stop]) - offsets[row]
            chunk = np.asarray(blocks[start:offsets[stop]])
            place = np.minimum(np.searchsorted(known_tails, chunk), known_tails.size - 1)
            kept = (rank[row] < n_fit) & (depth < n_full[row]) & (known_tails[place] == chunk)
            rows.append(rank[row[kept]])
            depths.append(depth[kept])
            found.append(chunk[kept])
            first = stop
    rows, depths, found = (np.concatenate(parts) for parts in (rows, depths, found))
    order = np.lexsort((depths, rows))  # by request in time order, each chain's blocks shallowest first
    offsets = np.searchsorted(rows[order], np.arange(n_fit + 1))
    return count_next_turns(infer_sessions(offsets, found[order], tails), timestamp, NEXT_TURN_HORIZON_S)


def _concatenated(traces: list[Trace], window) -> tuple[Trace, np.ndarray]:
    """The files' requests as one trace in time order (stable: file order breaks ties), and that order.

    Its window starts where the files' traces start (the floor of their first arrival), or later
    at the window's start, as :meth:`~kvprof.profiler.trace.Trace.time_window` cuts one trace.
    """
    start = min(trace.window[0] for trace in traces)
    window = (max(window[0], start), window[1])
    if len(traces) == 1:
        return replace(traces[0], window=window), np.arange(traces[0].n_requests)
    names = tuple(dict.fromkeys(name for trace in traces for name in trace.type_names))
    columns = {name: np.concatenate([getattr(t, name) for t in traces])
               for name in ("timestamp", "input_length", "output_length", "chat_id", "parent_chat_id", "turn")}
    columns["type_code"] = np.concatenate([np.array([names.index(n) for n in t.type_names], np.int32)[t.type_code]
                                           for t in traces])
    extra = {key: np.concatenate([t.extra.get(key, np.full(t.n_requests, None, object)) for t in traces])
             for key in dict.fromkeys(k for t in traces for k in t.extra)}
    order = np.argsort(columns["timestamp"], kind="stable")
    n = order.size
    trace = replace(traces[0], **{k: v[order] for k, v in columns.items()}, type_names=names,
                    extra={k: v[order] for k, v in extra.items()}, hash_offsets=np.zeros(n + 1, np.int64),
                    window=window)
    return trace, order


def _windows(requests: _Requests) -> tuple[Trace, Trace | None]:
    """The fit window's requests, and the held-out window's (None without one), as traces."""
    trace, n_fit = requests.trace, requests.n_fit
    fitted = trace.select(np.arange(n_fit), window=trace.window)
    if n_fit == trace.n_requests:
        return fitted, None
    return fitted, trace.select(np.arange(n_fit, trace.n_requests), window=(trace.window[1], requests.holdout_end))


def _scatter(spill: Path, requests: _Requests, bounds: np.ndarray, chunk: int = 1 << 24) -> None:
    """Step 2: every file's accesses, their rows now the requests' time order, appended to the
    shard their block's id falls in, ``chunk`` accesses at a time."""
    n_shards = bounds.size + 1
    outputs = [open(spill / f"shard{s}.bin", "wb") for s in range(n_shards)]  # noqa: SIM115 - closed below
    try:
        for blocks_file in sorted(spill.glob("file*-blocks.bin"), key=lambda p: int(p.name[4:].split("-")[0])):
            stem = blocks_file.name.removesuffix("-blocks.bin")
            offsets, rank = np.load(spill / f"{stem}-offsets.npy"), np.load(spill / f"{stem}-rank.npy")
            for at in range(0, int(offsets[-1]), chunk):
                part = np.fromfile(blocks_file, dtype=np.int64, count=chunk, offset=8 * at)
                rows = rank[np.searchsorted(offsets, np.arange(at, at + part.size), side="right") - 1]
                shard = np.searchsorted(bounds, part, side="right")
                order = np.argsort(shard, kind="stable")
                cuts = np.searchsorted(shard[order], np.arange(n_shards + 1))
                pairs = np.stack([part[order], rows[order]], axis=1)
                for s in range(n_shards):
                    pairs[cuts[s]:cuts[s + 1]].tofile(outputs[s])
            for name in (blocks_file.name, f"{stem}-offsets.npy", f"{stem}-rank.npy", f"{stem}-full.npy"):
                (spill / name).unlink()
    finally:
        for out in outputs:
            out.close()


class DiskShards:
    """:class:`~kvprof.profiler.summary.Shards` of block-id ranges, on disk.

    Each shard's accesses are read, its samples reduced (:func:`_shard_reuse`) and written
    back; the per-request counts are summed here as the shards finish.
    """

    def __init__(self, spill: Path, n_shards: int, requests: _Requests, rule: ClassRule, codes: np.ndarray, held,
                 horizon: float, min_gap: float, ray: str | None):
        from kvprof.parallel import run_tasks

        self.spill, self.n_shards, self.ray, self.rule = spill, n_shards, ray, rule
        trace = requests.trace
        self._context = _Context(trace.timestamp, codes, requests.n_fit, trace.censor_time, requests.holdout_end,
                                 horizon, min_gap)
        facts = run_tasks(_shard_reuse, self._context, [(str(spill), s) for s in range(n_shards)], ray=ray)
        self.censored = np.zeros((requests.n_fit, N_TIERS), np.int64)
        for s in range(n_shards):  # each shard's requests that have any, as (request, counts per tier)
            rows = np.load(spill / f"shard{s}-censored-rows.npy")
            self.censored[rows] += np.load(spill / f"shard{s}-censored.npy")
        self.n_samples = sum(f["n_samples"] for f in facts)
        self.n_merged = sum(f["n_merged"] for f in facts)
        self._known_starts = np.cumsum([0] + [f["n_known"] for f in facts])
        self.n_known = int(self._known_starts[-1])
        self.held = held

    def known(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        parts = np.searchsorted(positions, self._known_starts)
        requests, labels = [], []
        for s in range(self.n_shards):  # one shard's accesses in memory at a time
            picks = positions[parts[s]:parts[s + 1]] - self._known_starts[s]
            requests.append(np.load(self.spill / f"shard{s}-known-request.npy")[picks])
            labels.append(np.load(self.spill / f"shard{s}-known-reused.npy")[picks])
        return np.concatenate(requests), np.concatenate(labels)

    def gap_runs(self, keys: RowKeys) -> list[GapRuns]:
        from kvprof.parallel import run_tasks

        run_tasks(_sort_gaps, keys, [(str(self.spill), s) for s in range(self.n_shards)], ray=self.ray)
        return [GapRuns(SortedFile(self.spill / f"shard{s}-sorted.bin"), np.load(self.spill / f"shard{s}-starts.npy"))
                for s in range(self.n_shards)]

    def holdout_counts(self, cell_rule, cell_names) -> np.ndarray:
        """The held-out window's question counts per cell and tier, summed over the shards."""
        cell = holdout_cells(self.held, self.rule, cell_rule, cell_names)
        total = 0
        for s in range(self.n_shards):
            held = {name: np.load(self.spill / f"shard{s}-held-{name}.npy")
                    for name in ("time", "censored", "request", "prior")}
            samples = ReuseSamples(held["time"], held["censored"], np.zeros(held["time"].size, np.int32),
                                   held["request"], held["prior"], 0)
            total = total + row_question_counts(samples, cell, len(cell_names), self._context.horizon)
        return total


@dataclass(frozen=True, eq=False)
class _Context:
    """What every shard reads besides its own accesses: the requests' times and classes."""

    timestamp: np.ndarray
    codes: np.ndarray
    n_fit: int
    censor_time: float
    holdout_end: float
    horizon: float
    min_gap: float


def _shard_reuse(context: _Context, spill: str, shard: int) -> dict:
    """Step 3 for one shard: its samples reduced; counts and the tree's accesses and gaps written."""
    spill = Path(spill)
    pairs = np.fromfile(spill / f"shard{shard}.bin", dtype=np.int64).reshape(-1, 2)
    fit = pairs[:, 1] < context.n_fit
    n = context.n_fit
    samples = reuse_of_accesses(pairs[fit, 0], pairs[fit, 1], context.timestamp[:n], context.censor_time,
                                context.codes, min_gap=context.min_gap)
    reduced = ShardReuse.of(samples, n, context.horizon)
    rows = np.flatnonzero(reduced.censored.any(axis=1))
    np.save(spill / f"shard{shard}-censored-rows.npy", rows)
    np.save(spill / f"shard{shard}-censored.npy", reduced.censored[rows])
    np.save(spill / f"shard{shard}-known-request.npy", reduced.known_request)
    np.save(spill / f"shard{shard}-known-reused.npy", reduced.known_reused)
    for name in ("gap", "gap_request", "gap_tier"):
        np.save(spill / f"shard{shard}-{name}.npy", getattr(reduced, name))
    held = pairs[~fit]
    if held.size:  # the held-out window's own samples, censored at its end
        samples = reuse_of_accesses(held[:, 0], held[:, 1] - n, context.timestamp[n:], context.holdout_end,
                                    np.zeros(context.timestamp.size - n, np.int32), min_gap=context.min_gap)
    else:
        samples = reuse_of_accesses(np.zeros(0, np.int64), np.zeros(0, np.int64), context.timestamp[n:],
                                    context.holdout_end, np.zeros(0, np.int32), min_gap=context.min_gap)
    for name in ("time", "censored", "request", "prior"):
        np.save(spill / f"shard{shard}-held-{name}.npy", getattr(samples, name))
    (spill / f"shard{shard}.bin").unlink()
    return {"n_samples": reduced.n_samples, "n_merged": reduced.n_merged, "n_known": reduced.known_request.size}


def _sort_gaps(keys: RowKeys, spill: str, shard: int) -> None:
    """Step 4 for one shard: its gaps sorted by key, written for the fit to map."""
    spill = Path(spill)
    gap = np.load(spill / f"shard{shard}-gap.npy")
    runs = GapRuns.of(gap, keys.of(np.load(spill / f"shard{shard}-gap_request.npy"),
                                   np.load(spill / f"shard{shard}-gap_tier.npy")), keys.n_keys)
    runs.values.tofile(spill / f"shard{shard}-sorted.bin")
    np.save(spill / f"shard{shard}-starts.npy", runs.starts)
