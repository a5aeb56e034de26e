"""Reuse samples reduced to what the fits and their diagnostics read.

No fit needs its samples one by one. :class:`~kvprof.models.exponential.CureExponential` reads
the weighted count and sum of the reuse gaps and the censored exposures;
:class:`~kvprof.models.mixture.CureMixture` reads the gaps merged into geometric bins; the
diagnostics read the gaps in ascending order (KS statistic, median) once. :class:`ReuseData`
holds exactly that, so the same fits run on arrays (``ReuseData.of(time, censored)``) and on
statistics summed over shards of a trace too large for memory, whose gaps arrive as sorted
chunks merged from disk (:class:`SortedGaps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

#: Timestamps resolve to a microsecond at best, so shorter gaps are read as one (this bounds lam).
GAP_RESOLUTION_S = 1e-6
#: Gaps and exposures are merged into geometric bins from :data:`GAP_RESOLUTION_S` to this many
#: seconds (a year); each bin holds values within a factor :data:`BIN_RATIO` of each other.
LONGEST_S = 3.2e7
N_BINS = 240
BIN_RATIO = (LONGEST_S / GAP_RESOLUTION_S) ** (1.0 / N_BINS)


def validate_samples(time, censored, sample_weight=None):
    """Check and convert fit inputs; returns ``(time, censored, weight)`` as float64/bool/float64."""
    time = np.asarray(time, dtype=np.float64)
    censored = np.asarray(censored, dtype=bool)
    if time.ndim != 1 or censored.shape != time.shape:
        raise ValueError(f"time and censored must be 1-D of the same length, got shapes {time.shape} and {censored.shape}")
    if not np.all(np.isfinite(time)) or np.any(time < 0):
        raise ValueError("time must be finite and >= 0 (seconds)")
    if sample_weight is None:
        weight = np.ones_like(time)
    else:
        weight = np.asarray(sample_weight, dtype=np.float64)
        if weight.shape != time.shape:
            raise ValueError(f"sample_weight must have shape {time.shape}, got {weight.shape}")
        if not np.all(np.isfinite(weight)) or np.any(weight < 0):
            raise ValueError("sample_weight must be finite and >= 0")
    return time, censored, weight


def bin_of(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each value's geometric bin (int64) and the value clipped to [:data:`GAP_RESOLUTION_S`,
    :data:`LONGEST_S`], the range the bins cover."""
    clipped = np.clip(values, GAP_RESOLUTION_S, LONGEST_S)
    return np.minimum((np.log(clipped / GAP_RESOLUTION_S) / math.log(BIN_RATIO)).astype(np.int64), N_BINS - 1), clipped


def gap_bins(values: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """Per geometric bin (:func:`bin_of`), the weight of ``values`` in it and their weighted sum
    (clipped); float64, shape (2, :data:`N_BINS`). Bins add up."""
    index, clipped = bin_of(values)
    if weight is None:
        weight = np.ones_like(clipped)
    return np.stack([np.bincount(index, weights=weight, minlength=N_BINS),
                     np.bincount(index, weights=weight * clipped, minlength=N_BINS)])


class SortedGaps:
    """Reuse gaps in ascending order, read in chunks, with their count, sum and smallest value.

    Each iteration yields the gaps afresh as sorted float64 arrays whose concatenation is sorted,
    so a statistic needs one chunk in memory at a time, never all of them.

    Parameters
    ----------
    chunks : callable
        ``chunks()`` -> iterator of the sorted chunks.
    n : int
    total : float
        Sum of the gaps.
    smallest : float
        The smallest gap (``inf`` when there is none).
    """

    def __init__(self, chunks: Callable[[], Iterator[np.ndarray]], n: int, total: float, smallest: float):
        self._chunks = chunks
        self.n = int(n)
        self.total = float(total)
        self.smallest = float(smallest)

    @classmethod
    def of(cls, gaps: np.ndarray) -> SortedGaps:
        """Gaps held in memory (in any order)."""
        ordered = np.sort(np.asarray(gaps, dtype=np.float64))
        return cls(lambda: iter((ordered,)), ordered.size, ordered.sum(), ordered[0] if ordered.size else math.inf)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self._chunks()

    @property
    def mean(self) -> float:
        return self.total / self.n

    def ks_and_median(self, cdf: Callable[[np.ndarray], np.ndarray] | None) -> tuple[float, float]:
        """The Kolmogorov-Smirnov statistic of the gaps against ``cdf`` (as ``scipy.stats.kstest``
        computes it; 1.0 for ``cdf=None``, a distribution with all its mass at infinity) and their
        median (as ``np.median``), in one pass. Needs at least one gap."""
        n, done, ks = self.n, 0, 0.0 if cdf is not None else 1.0
        middle = {(n - 1) // 2: math.nan, n // 2: math.nan}
        for chunk in self:
            if cdf is not None:
                fitted = cdf(chunk)
                ks = max(ks, float(np.max(np.arange(done + 1.0, done + chunk.size + 1.0) / n - fitted)),
                         float(np.max(fitted - np.arange(float(done), done + chunk.size) / n)))
            for rank in middle:
                if done <= rank < done + chunk.size:
                    middle[rank] = float(chunk[rank - done])
            done += chunk.size
        low, high = middle[(n - 1) // 2], middle[n // 2]
        return ks, (low + high) / 2 if n % 2 == 0 else low


@dataclass(frozen=True, eq=False)
class ReuseData:
    """One row's reuse samples as the fits read them.

    Invariants: ``reused_weight == gap_bins[0].sum()`` (to rounding); ``gaps``, when present, holds
    the ``n_reuses`` reuse gaps unweighted.

    Attributes
    ----------
    n_samples, n_reuses : int
        Accesses (reused and censored) and reused ones, unweighted.
    reused_weight : float
        Weight of the reused accesses.
    gap_sum : float
        Weighted sum of the reuse gaps, each at least :data:`GAP_RESOLUTION_S`.
    gap_bins : float64 array, shape (2, N_BINS)
        The reuse gaps' :func:`gap_bins`, weighted.
    exposure, exposure_weight : float64 arrays, shape (c,)
        Censored accesses' exposures (window end - access, s) and weights; equal exposures may
        come as one entry with their summed weight.
    gaps : SortedGaps or None
        The reuse gaps themselves, for diagnostics; None for a weighted mix of rows.
    """

    n_samples: int
    n_reuses: int
    reused_weight: float
    gap_sum: float
    gap_bins: np.ndarray
    exposure: np.ndarray
    exposure_weight: np.ndarray
    gaps: SortedGaps | None = None

    @classmethod
    def of(cls, time, censored, sample_weight=None) -> ReuseData:
        """The reduced form of samples held in arrays (checked as the fits check them).

        Parameters
        ----------
        time : array_like of float, shape (m,), s
            Reuse gap of reused accesses, exposure of censored ones.
        censored : array_like of bool, shape (m,)
        sample_weight : array_like of float, shape (m,), optional
        """
        time, censored, weight = validate_samples(time, censored, sample_weight)
        reused = ~censored
        gaps, gap_weight = time[reused], weight[reused]
        return cls(
            n_samples=int(time.size), n_reuses=int(gaps.size), reused_weight=float(gap_weight.sum()),
            gap_sum=float(np.einsum("i,i->", gap_weight, np.maximum(gaps, GAP_RESOLUTION_S))),
            gap_bins=gap_bins(gaps, gap_weight), exposure=time[censored], exposure_weight=weight[censored],
            gaps=SortedGaps.of(gaps),
        )

    @classmethod
    def combine(cls, parts: Iterable[tuple[ReuseData, float]]) -> ReuseData:
        """``sum(weight * data)``: the samples of every part, each part's weighted as given (no gaps)."""
        parts = list(parts)
        return cls(
            n_samples=sum(d.n_samples for d, _ in parts), n_reuses=sum(d.n_reuses for d, _ in parts),
            reused_weight=sum(w * d.reused_weight for d, w in parts), gap_sum=sum(w * d.gap_sum for d, w in parts),
            gap_bins=sum(w * d.gap_bins for d, w in parts),
            exposure=np.concatenate([d.exposure for d, _ in parts]),
            exposure_weight=np.concatenate([w * d.exposure_weight for d, w in parts]),
        )

    @property
    def n_censored(self) -> int:
        return self.n_samples - self.n_reuses

    @property
    def total_weight(self) -> float:
        return self.reused_weight + float(self.exposure_weight.sum())

    def diagnose(self, cdf: Callable[[np.ndarray], np.ndarray] | None) -> dict:
        """Counts, and the KS statistic of the reuse gaps against ``cdf`` (the model's gap
        distribution given reuse; None: all its mass at infinity, KS 1.0), their mean and median
        (None without reuse). JSON-ready."""
        summary = {"n_accesses": self.n_samples, "n_reuses": self.n_reuses, "n_censored": self.n_censored}
        if self.n_reuses == 0:
            return summary | {"ks": None, "mean_gap_s": None, "median_gap_s": None}
        ks, median = self.gaps.ks_and_median(cdf)
        return summary | {"ks": ks, "mean_gap_s": self.gaps.mean, "median_gap_s": median}
