"""The profiling pipeline: trace window in, hyperparameter file out.

classify requests -> extract reuse gaps (censored at the window's end) -> session statistics ->

* per class and per tier (fresh blocks, blocks an earlier request already used), one
  cure-fraction exponential shrunk toward the pooled fit where data is thin, with the published
  profiler's naive estimates beside it (``classes``; what ``wa-paper`` and version 1 used);
* the ``wa`` policy's cells (learned from request features, :mod:`kvprof.profiler.cells`, or
  the classes) and, per cell and reuse tier, a cure fraction with a mixture of exponentials
  (``cells``), shrunk toward the cell's data where a tier's data is thin;

-> :class:`~kvprof.models.hp.HpFile` with provenance. Given a later window (``holdout``), each
cell's diagnostics also say how well its scores predict reuse there (:mod:`kvprof.profiler.quality`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import numpy as np

from kvprof import __version__
from kvprof.classes import ClassRule
from kvprof.errors import KvprofError
from kvprof.cells import TIER_EDGES
from kvprof.models.exponential import fit_classes
from kvprof.models.hp import REUSED_SUFFIX, HpFile, ReuseRow
from kvprof.models.mixture import CureMixture, diagnose_mixture
from kvprof.models.sessions import session_stats
from kvprof.profiler.cells import cells_of_trace, fit_cell_rule, known_outcomes, tree_sample
from kvprof.profiler.classes import classify_trace
from kvprof.profiler.quality import score_quality
from kvprof.profiler.reuse import ReuseSamples, extract_reuse
from kvprof.profiler.trace import Trace

#: Default horizon H in seconds: "reused within the next minute". It sits inside the range of
#: cache turnover times of the published capacities (tens of seconds to a few minutes at 6 QPS).
DEFAULT_HORIZON = 60.0
DEFAULT_MIN_GAP = 0.3
DEFAULT_MIN_SAMPLES = 200
DEFAULT_MAX_CELLS = 16
DEFAULT_MAX_COMPONENTS = 3


def fit_trace(
    trace: Trace,
    rule: ClassRule = ClassRule(),
    *,
    horizon: float = DEFAULT_HORIZON,
    min_gap: float = DEFAULT_MIN_GAP,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    max_cells: int = DEFAULT_MAX_CELLS,
    cell_fields=(),
    max_components: int = DEFAULT_MAX_COMPONENTS,
    holdout: Trace | None = None,
) -> HpFile:
    """Fit per-class and per-cell reuse models on a trace window.

    Parameters
    ----------
    trace : Trace
        Already restricted to the fit window; reuse is censored at its end.
    rule : ClassRule
        How requests map to classes; stored in the file so the live policy classifies alike.
    horizon : float
        H in seconds for the score P(reused within H | class, idle age).
    min_gap : float
        Concurrency floor in seconds (see :mod:`kvprof.profiler.reuse`).
    min_samples : int
        Classes and cell tiers with fewer block accesses are shrunk toward more data.
    max_cells : int
        Most cells a learned rule may draw; 0 makes each class a cell (no rule).
    cell_fields : sequence of str
        Trace fields clients tag that may split cells (:mod:`kvprof.profiler.cells`).
    max_components : int
        Most exponentials in a cell tier's mixture (chosen by BIC).
    holdout : Trace or None
        A later window: each cell tier's diagnostics then hold the held-out log-loss and Brier
        score of its score (:func:`kvprof.profiler.quality.score_quality`) beside those of a
        single cure exponential fitted to the same data (``holdout.single``).

    Returns
    -------
    HpFile
    """
    if trace.n_requests == 0:
        raise KvprofError(f"{trace.source or 'trace'}: the fit window {_window_text(trace)} holds no requests")
    if not horizon > 0:
        raise ValueError(f"horizon must be > 0 seconds, got {horizon}")
    try:
        codes, names = classify_trace(trace, rule)
    except ValueError as exc:
        raise KvprofError(f"{trace.source or 'trace'}: {exc}") from None
    samples = extract_reuse(trace, codes, min_gap=min_gap)
    if len(samples) == 0:
        raise KvprofError(f"{trace.source or 'trace'}: the fit window {_window_text(trace)} holds no block accesses")
    sessions = session_stats(trace)
    # Each class is fitted twice: on fresh blocks, and on blocks an earlier request already used
    # (``<class>@reused``), whose reuse is far likelier and sooner (shared prompts, documents).
    tiered = samples.workload + len(names) * samples.repeat.astype(np.int32)
    tiered_names = tuple(names) + tuple(name + REUSED_SUFFIX for name in names)
    per_class, pooled = fit_classes(
        samples.time, samples.censored, tiered, tiered_names, min_samples=min_samples, sessions=sessions
    )
    # A reused tier with no data at all says nothing beyond its class: leave it out.
    per_class = {
        name: params
        for name, params in per_class.items()
        if not (name.endswith(REUSED_SUFFIX) and params.source == "pooled")
    }
    if max_cells:
        try:
            request, reused = known_outcomes(samples, horizon)
            sample = tree_sample(request.size)
            cell_rule = fit_cell_rule(trace, request[sample], reused[sample], codes, names, fields=tuple(cell_fields),
                                      max_cells=max_cells, min_samples=min_samples)
        except ValueError as exc:
            raise KvprofError(f"{trace.source or 'trace'}: {exc}") from None
        cell_names = cell_rule.names
        cell_codes = cells_of_trace(cell_rule, trace, codes, names)
    else:
        cell_rule, cell_names, cell_codes = None, tuple(names), codes
    cells, default_cell, singles = fit_cell_rows(samples, cell_codes[samples.request], len(cell_names),
                                                 min_samples=min_samples, max_components=max_components)
    if holdout is not None and holdout.n_requests:
        cells = _with_holdout_quality(cells, singles, holdout, rule, cell_rule, cell_names, horizon, min_gap)
    provenance = {
        "trace": trace.source,
        "sha256": trace.sha256,
        "format": trace.format,
        "window": [trace.window[0], trace.censor_time],
        "block_size": trace.block_size,
        "n_requests": trace.n_requests,
        "n_block_accesses": trace.n_blocks,
        "n_samples": len(samples),
        "n_merged_concurrent": samples.n_merged,
        "kvprof_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
    }
    return HpFile(
        classes=per_class,
        default=pooled,
        horizon=float(horizon),
        class_rule=rule,
        min_gap=float(min_gap),
        block_size=trace.block_size,
        provenance=provenance,
        sessions=sessions,
        cells=dict(zip(cell_names, cells)),
        default_cell=default_cell,
        cell_rule=cell_rule,
    )


def tier_codes(prior: np.ndarray) -> np.ndarray:
    """Reuse tier (:data:`~kvprof.cells.TIER_EDGES`) of each access, from its earlier uses."""
    return np.searchsorted(np.array(TIER_EDGES), prior, side="right") - 1


def fit_cell_rows(samples: ReuseSamples, cell: np.ndarray, n_cells: int, *, min_samples: int,
                  max_components: int) -> tuple[list[tuple[ReuseRow, ...]], tuple[ReuseRow, ...], list]:
    """A :class:`~kvprof.models.mixture.CureMixture` per cell and reuse tier, and the pooled rows.

    A tier with at least ``min_samples`` accesses (and 5 reuses) keeps its own fit. A thinner one
    is fitted on its data together with its cell's (or, if the cell is thin too, the tier's
    pooled data), weighted to count as ``min_samples`` accesses: a prior worth that many samples
    that moves smoothly from the parent (no data) to the row's own fit (much data). A tier with
    no data takes the parent's fit as it is (``source="pooled"``). The default cell is the pooled
    fit of each tier.

    Parameters
    ----------
    samples : ReuseSamples
    cell : int array, shape (m,)
        Cell of each sample's request.
    n_cells : int

    Returns
    -------
    rows : list of tuple of ReuseRow
        Per cell, one row per tier.
    default : tuple of ReuseRow
    singles : list of tuple of ReuseRow
        The same rows fitted with one component (a cure exponential), to compare with.
    """
    tier = tier_codes(samples.prior)
    time, censored = samples.time, samples.censored

    def fit(rows, weight=None, source="fit", own=None, components=max_components) -> ReuseRow:
        """A row fitted on ``rows`` (weighted), diagnosed on its ``own`` samples (none when pooled)."""
        model = CureMixture(components).fit(time[rows], censored[rows], weight)
        own = rows if own is None else own
        return ReuseRow(model.p_, tuple(model.weights_.tolist()), tuple(model.rates_.tolist()), source,
                        diagnose_mixture(time[own], censored[own], model) if source != "pooled" else None)

    def big(rows) -> bool:
        return rows.size >= min_samples and np.count_nonzero(~censored[rows]) >= 5

    pooled_rows = [np.flatnonzero(tier == t) for t in range(len(TIER_EDGES))]
    everything = np.arange(len(samples))
    default = tuple(fit(rows if big(rows) else everything, source="pooled") for rows in pooled_rows)
    order = np.argsort(cell, kind="stable")
    bounds = np.searchsorted(cell[order], np.arange(n_cells + 1))
    out, singles = [], []
    for c in range(n_cells):
        in_cell = order[bounds[c]:bounds[c + 1]]
        tiers, single = [], []
        for t in range(len(TIER_EDGES)):
            rows = in_cell[tier[in_cell] == t]
            parent = in_cell if big(in_cell) else pooled_rows[t] if big(pooled_rows[t]) else everything
            if big(rows):
                data, weight, source, own = rows, None, "fit", None
            elif rows.size:
                data = np.concatenate([rows, parent])
                weight = np.concatenate([np.ones(rows.size), np.full(parent.size, min_samples / parent.size)])
                source, own = "shrunk", rows
            else:
                data, weight, source, own = parent, None, "pooled", None
            tiers.append(fit(data, weight, source, own))
            single.append(fit(data, weight, "pooled", components=1))
        out.append(tuple(tiers))
        singles.append(tuple(single))
    return out, default, singles


def _with_holdout_quality(cells, singles, holdout: Trace, rule: ClassRule, cell_rule, cell_names, horizon: float,
                          min_gap: float) -> list[tuple[ReuseRow, ...]]:
    """``cells`` with each row's held-out log-loss and Brier score, and a cure exponential's beside them."""
    codes, names = classify_trace(holdout, rule)
    if cell_rule is None:
        index = {name: i for i, name in enumerate(cell_names)}
        to_cell = np.array([index.get(name, -1) for name in names])
        cell = to_cell[codes]
    else:
        cell = cells_of_trace(cell_rule, holdout, codes, names)
    samples = extract_reuse(holdout, codes, min_gap=min_gap)
    n_tiers = len(TIER_EDGES)
    row = cell[samples.request] * n_tiers + tier_codes(samples.prior)
    known = cell[samples.request] >= 0  # classes unseen when fitting have no row of their own
    samples = ReuseSamples(*(getattr(samples, f)[known] for f in ("time", "censored", "workload", "request", "prior")),
                           n_merged=samples.n_merged)

    def arrays(rows):
        flat = [r for tiers in rows for r in tiers]
        k = max(len(r.weights) for r in flat)
        pad = lambda values: [list(v) + [0.0] * (k - len(v)) for v in values]  # noqa: E731
        return (np.array([r.p for r in flat]), np.array(pad([r.weights for r in flat])), np.array(pad([r.rates for r in flat])))

    quality = score_quality(samples, row[known], {"mixture": arrays(cells), "single": arrays(singles)}, horizon)["rows"]
    out = []
    for c, tiers in enumerate(cells):
        new = []
        for t, entry in enumerate(tiers):
            measured = quality.get(c * n_tiers + t)
            if measured is None or entry.diagnostics is None:
                new.append(entry)
                continue
            holdout_entry = {**measured["mixture"], "single": {k: measured["single"][k] for k in ("log_loss", "brier")}}
            new.append(dataclasses.replace(entry, diagnostics={**entry.diagnostics, "holdout": holdout_entry}))
        out.append(tuple(new))
    return out


def _window_text(trace: Trace) -> str:
    return f"[{trace.window[0]:g}, {trace.window[1]:g})"
