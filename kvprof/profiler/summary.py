"""A fit window's reuse samples, reduced to what the fit reads, in shards that add up.

Every reuse gap needs all accesses of one block together and nothing else, so a window's block
accesses can be split by block into shards and each shard's samples computed on its own
(:func:`~kvprof.profiler.reuse.reuse_of_accesses`). The fit then never reads a sample one by one:

1. before the cells are known, a shard gives (:class:`ShardReuse`) its censored accesses counted
   per request and reuse tier (an exposure is its request's, window end - arrival), its accesses
   whose outcome within the horizon is known (the cell tree's samples, in (block, request)
   order), and its reuse gaps with their request and tier;
2. once the cells are known, each shard's gaps are sorted by (cell, tier, class, gap)
   (:class:`GapRuns`), with the count, sums, smallest value and geometric bins of every key.

:class:`WindowReuse` adds the shards up and hands the fit a
:class:`~kvprof.models.data.ReuseData` for any set of cells, tiers and classes: counts and bins
summed over keys and shards, exposures weighted per request, and the gaps in ascending order,
merged from the shards' sorted runs a bounded chunk at a time (:func:`merged_sorted`). One shard
held in memory is :func:`~kvprof.profiler.fit.fit_trace`; many, on disk or on a Ray cluster, are
:mod:`kvprof.profiler.shards`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from kvprof.cells import TIER_EDGES
from kvprof.models.data import GAP_RESOLUTION_S, N_BINS, ReuseData, SortedGaps, bin_of
from kvprof.profiler.reuse import ReuseSamples

N_TIERS = len(TIER_EDGES)
#: Gaps merged per step when a statistic reads a row's gaps in order (8 bytes each).
MERGE_CHUNK = 1 << 22


def tier_codes(prior: np.ndarray) -> np.ndarray:
    """Reuse tier (:data:`~kvprof.cells.TIER_EDGES`) of each access, from its earlier uses."""
    return np.searchsorted(np.array(TIER_EDGES), prior, side="right") - 1


@dataclass(frozen=True, eq=False)
class ShardReuse:
    """One shard's reuse samples before the cells are known.

    Attributes
    ----------
    censored : int64 array, shape (n_requests, N_TIERS)
        Censored accesses per request and reuse tier.
    known_request : int64 array, shape (k,)
    known_reused : bool array, shape (k,)
        The accesses whose outcome within the horizon is known, in (block, request) order: each
        one's request and whether it was reused within the horizon (the cell tree's label).
    gap : float64 array, shape (g,)
    gap_request : int64 array, shape (g,)
    gap_tier : int8 array, shape (g,)
        The reuse gaps, with the request and tier of the access each follows.
    n_merged : int
        Accesses merged into a concurrent later one.
    """

    censored: np.ndarray
    known_request: np.ndarray
    known_reused: np.ndarray
    gap: np.ndarray
    gap_request: np.ndarray
    gap_tier: np.ndarray
    n_merged: int

    @classmethod
    def of(cls, samples: ReuseSamples, n_requests: int, horizon: float) -> ShardReuse:
        """The reduced form of a shard's samples (:func:`~kvprof.profiler.reuse.reuse_of_accesses`)."""
        tier = tier_codes(samples.prior).astype(np.int8)
        censored = samples.censored
        counts = np.bincount(samples.request[censored] * N_TIERS + tier[censored], minlength=n_requests * N_TIERS)
        known = (~censored) | (samples.time >= horizon)
        reused = ~censored
        return cls(
            censored=counts.reshape(n_requests, N_TIERS),
            known_request=samples.request[known],
            known_reused=reused[known] & (samples.time[known] < horizon),
            gap=samples.time[reused], gap_request=samples.request[reused], gap_tier=tier[reused],
            n_merged=samples.n_merged,
        )

    @property
    def n_samples(self) -> int:
        return int(self.censored.sum()) + self.gap.size


class Shards(Protocol):
    """A fit window's reuse in shards of its blocks, read through what the fit asks of them.

    Shards are in block order (the first holds the lowest block ids), so their accesses of known
    outcome, one shard's after the other's, are in the window's (block, request) order.
    """

    censored: np.ndarray  # (n_requests, N_TIERS), summed over the shards
    n_samples: int
    n_merged: int
    n_known: int

    def known(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Request and label of the accesses of known outcome at sorted ``positions``."""

    def gap_runs(self, keys: RowKeys) -> list[GapRuns]:
        """Every shard's gaps sorted by ``keys``."""


class ShardList:
    """:class:`Shards` held in memory (one for :func:`~kvprof.profiler.fit.fit_trace`)."""

    def __init__(self, shards: Sequence[ShardReuse]):
        self.shards = list(shards)
        self.censored = sum(shard.censored for shard in self.shards)
        self.n_samples = sum(shard.n_samples for shard in self.shards)
        self.n_merged = sum(shard.n_merged for shard in self.shards)
        self._known_starts = np.cumsum([0] + [shard.known_request.size for shard in self.shards])
        self.n_known = int(self._known_starts[-1])

    def known(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        parts = np.searchsorted(positions, self._known_starts)
        picks = [positions[parts[i]:parts[i + 1]] - self._known_starts[i] for i in range(len(self.shards))]
        return (np.concatenate([s.known_request[p] for s, p in zip(self.shards, picks)]),
                np.concatenate([s.known_reused[p] for s, p in zip(self.shards, picks)]))

    def gap_runs(self, keys: RowKeys) -> list[GapRuns]:
        return [GapRuns.of(s.gap, keys.of(s.gap_request, s.gap_tier), keys.n_keys) for s in self.shards]


class RowKeys:
    """The keys gaps are sorted by: (cell, tier, class) of the access, numbered row-major.

    Parameters
    ----------
    cell, klass : int arrays, shape (n_requests,)
        Each request's cell and class.
    n_cells, n_classes : int
    """

    def __init__(self, cell: np.ndarray, klass: np.ndarray, n_cells: int, n_classes: int):
        self.cell, self.klass = np.asarray(cell, dtype=np.int64), np.asarray(klass, dtype=np.int64)
        self.shape = (n_cells, N_TIERS, n_classes)
        self.n_keys = n_cells * N_TIERS * n_classes

    def of(self, request: np.ndarray, tier: np.ndarray) -> np.ndarray:
        """The key of each access, from its request and tier."""
        return (self.cell[request] * N_TIERS + tier) * self.shape[2] + self.klass[request]

    def select(self, cells=None, tiers=None, classes=None) -> np.ndarray:
        """Mask over keys, shape (n_keys,): those of the given cells, tiers and classes (None: all)."""
        axes = [np.ones(size, dtype=bool) if chosen is None else np.isin(np.arange(size), list(chosen))
                for size, chosen in zip(self.shape, (cells, tiers, classes))]
        return (axes[0][:, None, None] & axes[1][None, :, None] & axes[2][None, None, :]).reshape(-1)


@dataclass(frozen=True, eq=False)
class GapRuns:
    """One shard's reuse gaps sorted by (key, gap).

    Invariant: the gaps of key ``k`` are ``values[starts[k]:starts[k + 1]]``, ascending.

    Attributes
    ----------
    values : float64 array, shape (g,), or SortedFile
        In memory, or on disk.
    starts : int64 array, shape (n_keys + 1,)
    """

    values: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, gap: np.ndarray, key: np.ndarray, n_keys: int) -> GapRuns:
        # By gap, then stably by key: numpy sorts small integers stably in linear time (radix).
        order = np.argsort(gap)
        order = order[np.argsort(key[order].astype(np.min_scalar_type(n_keys)), kind="stable")]
        return cls(gap[order], np.searchsorted(key[order], np.arange(n_keys + 1)))

    def runs(self, keys) -> list[np.ndarray]:
        """The sorted runs of the given keys (indices), the empty ones left out."""
        return [self.values[self.starts[k]:self.starts[k + 1]] for k in keys if self.starts[k + 1] > self.starts[k]]


@dataclass(frozen=True, eq=False)
class KeyStats:
    """Per key, the count, sums, least value and bins of its reuse gaps over every shard.

    Computed from each key's gaps merged in ascending order and cut into pieces of
    :data:`MERGE_CHUNK` (:func:`canonical_pieces`), so the sums are added in one order however the
    window was sharded: a sharded fit and a fit in memory read the same numbers, to the bit.

    Attributes
    ----------
    count : int64 array, shape (n_keys,)
    gap_sum : float64 array, shape (n_keys,)
        Sum of the gaps, each at least ``GAP_RESOLUTION_S`` (what the cure exponential reads).
    total : float64 array, shape (n_keys,)
    smallest : float64 array, shape (n_keys,)
        Least gap (inf without any).
    bins : float64 array, shape (n_keys, 2, N_BINS)
        :func:`~kvprof.models.data.gap_bins` of the key's gaps.
    """

    count: np.ndarray
    gap_sum: np.ndarray
    total: np.ndarray
    smallest: np.ndarray
    bins: np.ndarray

    @classmethod
    def of(cls, shards: Sequence[GapRuns], n_keys: int) -> KeyStats:
        stats = cls(np.zeros(n_keys, np.int64), np.zeros(n_keys), np.zeros(n_keys), np.full(n_keys, np.inf),
                    np.zeros((n_keys, 2, N_BINS)))
        for k in range(n_keys):
            for piece in canonical_pieces(merged_sorted([run for shard in shards for run in shard.runs((k,))])):
                index, clipped = bin_of(piece)
                stats.count[k] += piece.size
                stats.gap_sum[k] += float(np.maximum(piece, GAP_RESOLUTION_S).sum())
                stats.total[k] += float(piece.sum())
                stats.smallest[k] = min(stats.smallest[k], float(piece[0]))
                stats.bins[k] += (np.bincount(index, minlength=N_BINS), np.bincount(index, weights=clipped, minlength=N_BINS))
        return stats


def canonical_pieces(chunks: Iterator[np.ndarray], size: int = MERGE_CHUNK) -> Iterator[np.ndarray]:
    """The values of ``chunks``, in order, cut into pieces of exactly ``size`` (the last shorter):
    where the cuts fall depends on the values alone, not on how they arrived."""
    held, n_held = [], 0
    for chunk in chunks:
        held.append(chunk)
        n_held += chunk.size
        if n_held >= size:
            joined = np.concatenate(held)
            cut = joined.size - joined.size % size
            yield from (joined[i:i + size] for i in range(0, cut, size))
            held, n_held = [joined[cut:]], joined.size - cut
    if n_held:
        yield np.concatenate(held)


class SortedFile:
    """A sorted float64 run in a raw file, read only where asked: a slice is another run, a
    sample or ``np.asarray`` reads, :meth:`searchsorted` reads the few values it probes. Never
    mapped, so reading every run once leaves none of them in memory.
    """

    def __init__(self, path: str | Path, offset: int = 0, size: int | None = None):
        self.path, self.offset = str(path), offset
        self.size = (os.path.getsize(path) - offset) // 8 if size is None else size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice):
        start, stop, step = key.indices(self.size)
        if step == 1:
            return SortedFile(self.path, self.offset + 8 * start, max(stop - start, 0))
        picks = [self._read(at, min(at + MERGE_CHUNK, stop))[(start - at) % step::step]
                 for at in range(start, stop, MERGE_CHUNK - MERGE_CHUNK % step)]
        return np.concatenate(picks) if picks else np.zeros(0)

    def __array__(self, dtype=None, copy=None):
        values = self._read(0, self.size)
        return values if dtype is None else values.astype(dtype)

    def _read(self, start: int, stop: int) -> np.ndarray:
        return np.fromfile(self.path, dtype=np.float64, count=max(stop - start, 0), offset=self.offset + 8 * start)

    def searchsorted(self, value: float, side: str = "right") -> int:
        """``np.searchsorted`` of the run, by binary search over pages of it."""
        low, high = 0, self.size
        while high - low > 512:
            middle = (low + high) // 2
            if self._read(middle, middle + 1)[0] <= value if side == "right" else self._read(middle, middle + 1)[0] < value:
                low = middle + 1
            else:
                high = middle
        return low + int(np.searchsorted(self._read(low, high), value, side=side))


def _searchsorted(run, value: float) -> int:
    return run.searchsorted(value, side="right") if isinstance(run, SortedFile) else int(
        np.searchsorted(run, value, side="right"))


def merged_sorted(runs: Sequence[np.ndarray], chunk: int = MERGE_CHUNK) -> Iterator[np.ndarray]:
    """The values of sorted ``runs`` in ascending order, about ``chunk`` at a time.

    Each chunk holds the values in a range ``(low, high]`` from every run (found by binary
    search, so runs on disk are read only where needed), sorted; the ranges' bounds come from a
    sample of every run, so a chunk holds about ``chunk`` values (more only where one value
    repeats more often than that).
    """
    runs = [run for run in runs if run.size]
    total = sum(run.size for run in runs)
    if total <= chunk:
        if runs:
            yield np.sort(np.concatenate([np.asarray(run) for run in runs]), kind="stable")
        return
    step = max(1, chunk // (16 * len(runs)))
    sample = np.sort(np.concatenate([np.asarray(run[step - 1::step]) for run in runs]))
    bounds = np.unique(sample[chunk // (2 * step)::chunk // (2 * step)])
    low = [0] * len(runs)
    for high in [*bounds.tolist(), np.inf]:
        parts = []
        for i, run in enumerate(runs):
            end = run.size if high == np.inf else _searchsorted(run, high)
            if end > low[i]:
                parts.append(np.asarray(run[low[i]:end]))
                low[i] = end
        if parts:
            yield np.sort(np.concatenate(parts), kind="stable")


class WindowReuse:
    """The fit window's reuse, summed over its shards: what :func:`~kvprof.profiler.fit.fit_window` reads.

    Parameters
    ----------
    censored : int64 array, shape (n_requests, N_TIERS)
        Censored accesses per request and tier, summed over the shards.
    exposure : float64 array, shape (n_requests,)
        Each request's exposure: window end - arrival (at least 0).
    keys : RowKeys
    runs : sequence of GapRuns
        One per shard, sorted by ``keys``.
    """

    def __init__(self, censored: np.ndarray, exposure: np.ndarray, keys: RowKeys, runs: Sequence[GapRuns]):
        self.censored = censored
        self.exposure = exposure
        self.keys = keys
        self.runs = list(runs)
        self.stats = KeyStats.of(self.runs, keys.n_keys)

    def data(self, cells=None, tiers=None, classes=None) -> ReuseData:
        """The samples of the accesses of requests in ``cells`` and ``classes`` at ``tiers`` (None: all)."""
        keys = self.keys
        selected = np.flatnonzero(keys.select(cells, tiers, classes))
        weight = self.censored[:, list(range(N_TIERS)) if tiers is None else list(tiers)].sum(axis=1)
        if cells is not None:
            weight = weight * np.isin(keys.cell, list(cells))
        if classes is not None:
            weight = weight * np.isin(keys.klass, list(classes))
        censored = np.flatnonzero(weight)
        stats, shards = self.stats, self.runs
        count = int(stats.count[selected].sum())

        def chunks():
            return merged_sorted([run for shard in shards for run in shard.runs(selected)])

        smallest = float(stats.smallest[selected].min()) if selected.size else np.inf
        return ReuseData(
            n_samples=count + int(weight[censored].sum()), n_reuses=count, reused_weight=float(count),
            gap_sum=float(stats.gap_sum[selected].sum()), gap_bins=stats.bins[selected].sum(axis=0),
            exposure=self.exposure[censored], exposure_weight=weight[censored].astype(np.float64),
            gaps=SortedGaps(chunks, count, float(stats.total[selected].sum()), smallest),
        )
