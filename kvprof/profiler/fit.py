"""The profiling pipeline: trace window in, hyperparameter file out.

classify requests -> extract reuse gaps (censored at the window's end), reduced per shard of the
window's blocks (:mod:`kvprof.profiler.summary`) -> session statistics ->

* per class and per tier (fresh blocks, blocks an earlier request already used), one
  cure-fraction exponential shrunk toward the pooled fit where data is thin, with the published
  profiler's naive estimates beside it (``classes``; what ``wa-paper`` and version 1 used);
* the ``wa`` policy's cells (learned from request features, :mod:`kvprof.profiler.cells`, or
  the classes) and, per cell and reuse tier, a cure fraction with a mixture of exponentials
  (``cells``), shrunk toward the cell's data where a tier's data is thin;
* per class and hint kind, the retention a client should ask for (``retention``,
  :mod:`kvprof.models.retention`), from the requests alone;

-> :class:`~kvprof.models.hp.HpFile` with provenance. Given a later window (``holdout``), each
cell's diagnostics also say how well its scores predict reuse there (:mod:`kvprof.profiler.quality`).

:func:`fit_trace` fits a window held in memory as one shard; :func:`fit_window` fits any shards
that add up to a window (:mod:`kvprof.profiler.shards`: traces larger than memory), with the
same code and so the same file.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import numpy as np

from kvprof import __version__
from kvprof.classes import ClassRule
from kvprof.errors import KvprofError
from kvprof.models.data import ReuseData
from kvprof.models.exponential import fit_classes_of
from kvprof.models.hp import REUSED_SUFFIX, HpFile, ReuseRow
from kvprof.models.mixture import CureMixture, diagnose_mixture_of
from kvprof.models.next_turn import NextTurnRates
from kvprof.models.retention import RETENTION_SHARES, fit_retention
from kvprof.models.sessions import session_stats
from kvprof.profiler.cells import cells_of_trace, fit_cell_rule, tree_sample
from kvprof.profiler.classes import classify_trace
from kvprof.profiler.quality import question_counts, score_counts
from kvprof.profiler.reuse import extract_reuse
from kvprof.profiler.summary import N_TIERS, RowKeys, ShardList, ShardReuse, Shards, WindowReuse, tier_codes
from kvprof.profiler.trace import Trace
from kvprof.profiler.turns import next_turn_rates

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
    retention_shares=RETENTION_SHARES,
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
    retention_shares : sequence of float
        Shares of a session's returns to give the retention for (:mod:`kvprof.models.retention`),
        rising within (0, 1].

    Returns
    -------
    HpFile
    """
    check_window(trace, horizon)
    codes, names = classes_of(trace, rule)
    samples = extract_reuse(trace, codes, min_gap=min_gap)
    shards = ShardList([ShardReuse.of(samples, trace.n_requests, horizon)])
    scored = None
    if holdout is not None and holdout.n_requests:
        def scored(cell_rule, cell_names):
            return holdout_counts(holdout, rule, cell_rule, cell_names, horizon, min_gap)
    return fit_window(trace, codes, names, shards, rule, n_accesses=trace.n_blocks, horizon=horizon, min_gap=min_gap,
                      min_samples=min_samples, max_cells=max_cells, cell_fields=cell_fields,
                      max_components=max_components, holdout_counts=scored, next_turn=next_turn_rates(trace),
                      retention_shares=retention_shares)


def check_window(trace: Trace, horizon: float) -> None:
    """The checks every fit starts with: a window with requests, a positive horizon."""
    if trace.n_requests == 0:
        raise KvprofError(f"{trace.source or 'trace'}: the fit window {_window_text(trace)} holds no requests")
    if not horizon > 0:
        raise ValueError(f"horizon must be > 0 seconds, got {horizon}")


def classes_of(trace: Trace, rule: ClassRule) -> tuple[np.ndarray, tuple[str, ...]]:
    """:func:`~kvprof.profiler.classes.classify_trace`, a rule the trace cannot follow being bad data."""
    try:
        return classify_trace(trace, rule)
    except ValueError as exc:
        raise KvprofError(f"{trace.source or 'trace'}: {exc}") from None


def fit_window(requests: Trace, codes: np.ndarray, names, shards: Shards, rule: ClassRule, *, n_accesses: int,
               horizon: float, min_gap: float, min_samples: int, max_cells: int, cell_fields=(),
               max_components: int, holdout_counts=None, next_turn: NextTurnRates | None = None,
               retention_shares=RETENTION_SHARES) -> HpFile:
    """:func:`fit_trace` of a window given as its requests and the shards of its blocks' reuse.

    Parameters
    ----------
    requests : Trace
        The window's requests (their hash ids are not read).
    codes, names
        Their classes (:func:`classes_of`).
    shards : Shards
        The reuse of the window's block accesses (censored at ``requests.censor_time``).
    n_accesses : int
        Block accesses of the window (provenance).
    holdout_counts : callable or None
        ``holdout_counts(cell_rule, cell_names)``: the held-out window's
        :func:`~kvprof.profiler.quality.question_counts` per cell and tier.
    next_turn : NextTurnRates or None
        The window's :func:`~kvprof.profiler.turns.next_turn_rates` (a sharded fit counts them from its
        spilled chains).

    Other parameters are :func:`fit_trace`'s.
    """
    if shards.n_samples == 0:
        raise KvprofError(f"{requests.source or 'trace'}: the fit window {_window_text(requests)} holds no block accesses")
    sessions = session_stats(requests)
    if max_cells:
        request, reused = shards.known(tree_sample(shards.n_known))
        try:
            cell_rule = fit_cell_rule(requests, request, reused, codes, names, fields=tuple(cell_fields),
                                      max_cells=max_cells, min_samples=min_samples)
        except ValueError as exc:
            raise KvprofError(f"{requests.source or 'trace'}: {exc}") from None
        cell_names = cell_rule.names
        cell_codes = cells_of_trace(cell_rule, requests, codes, names)
    else:
        cell_rule, cell_names, cell_codes = None, tuple(names), codes
    keys = RowKeys(cell_codes, codes, len(cell_names), len(names))
    window = WindowReuse(shards.censored, np.maximum(requests.censor_time - requests.timestamp, 0.0), keys,
                         shards.gap_runs(keys))
    per_class, pooled = _fit_classes(window, names, min_samples, sessions)
    cells, default_cell, singles = fit_cell_rows(window, min_samples=min_samples, max_components=max_components)
    if holdout_counts is not None:
        cells = _with_holdout_quality(cells, singles, holdout_counts(cell_rule, cell_names), horizon)
    provenance = {
        "trace": requests.source,
        "sha256": requests.sha256,
        "format": requests.format,
        "window": [requests.window[0], requests.censor_time],
        "block_size": requests.block_size,
        "n_requests": requests.n_requests,
        "n_block_accesses": int(n_accesses),
        "n_samples": shards.n_samples,
        "n_merged_concurrent": shards.n_merged,
        "kvprof_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
    }
    return HpFile(
        classes=per_class,
        default=pooled,
        horizon=float(horizon),
        class_rule=rule,
        min_gap=float(min_gap),
        block_size=requests.block_size,
        provenance=provenance,
        sessions=sessions,
        cells=dict(zip(cell_names, cells)),
        default_cell=default_cell,
        cell_rule=cell_rule,
        next_turn=next_turn,
        retention=fit_retention(requests, codes, names, retention_shares),
    )


def _fit_classes(window: WindowReuse, names, min_samples: int, sessions: dict):
    """Each class fitted twice: on fresh blocks, and on blocks an earlier request already used
    (``<class>@reused``), whose reuse is far likelier and sooner (shared prompts, documents)."""
    reused_tiers = range(1, N_TIERS)
    per_class = {name: window.data(classes=(code,), tiers=(0,)) for code, name in enumerate(names)}
    per_class |= {name + REUSED_SUFFIX: window.data(classes=(code,), tiers=reused_tiers) for code, name in enumerate(names)}
    per_class, pooled = fit_classes_of(per_class, window.data(), min_samples=min_samples, sessions=sessions)
    # A reused tier with no data at all says nothing beyond its class: leave it out.
    return {name: params for name, params in per_class.items()
            if not (name.endswith(REUSED_SUFFIX) and params.source == "pooled")}, pooled


def fit_cell_rows(window: WindowReuse, *, min_samples: int,
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
    window : WindowReuse
        The window's reuse, its keys' cells the cells fitted.

    Returns
    -------
    rows : list of tuple of ReuseRow
        Per cell, one row per tier.
    default : tuple of ReuseRow
    singles : list of tuple of ReuseRow
        The same rows fitted with one component (a cure exponential), to compare with.
    """

    def fit(data: ReuseData, source="fit", own: ReuseData | None = None, components=max_components) -> ReuseRow:
        """A row fitted on ``data``, diagnosed on its ``own`` samples (none when pooled)."""
        model = CureMixture(components).fit_data(data)
        return ReuseRow(model.p_, tuple(model.weights_.tolist()), tuple(model.rates_.tolist()), source,
                        diagnose_mixture_of(data if own is None else own, model) if source != "pooled" else None)

    def big(data: ReuseData) -> bool:
        return data.n_samples >= min_samples and data.n_reuses >= 5

    pooled = [window.data(tiers=(t,)) for t in range(N_TIERS)]
    everything = window.data()
    default = tuple(fit(rows if big(rows) else everything, source="pooled") for rows in pooled)
    out, singles = [], []
    for c in range(window.keys.shape[0]):
        in_cell = window.data(cells=(c,))
        tiers, single = [], []
        for t in range(N_TIERS):
            rows = window.data(cells=(c,), tiers=(t,))
            parent = in_cell if big(in_cell) else pooled[t] if big(pooled[t]) else everything
            if big(rows):
                data, source, own = rows, "fit", None
            elif rows.n_samples:
                data = ReuseData.combine([(rows, 1.0), (parent, min_samples / parent.n_samples)])
                source, own = "shrunk", rows
            else:
                data, source, own = parent, "pooled", None
            tiers.append(fit(data, source, own))
            single.append(fit(data, "pooled", components=1))
        out.append(tuple(tiers))
        singles.append(tuple(single))
    return out, default, singles


def holdout_counts(holdout: Trace, rule: ClassRule, cell_rule, cell_names, horizon: float,
                   min_gap: float) -> np.ndarray:
    """The held-out window's :func:`~kvprof.profiler.quality.question_counts` per cell and tier
    (rows ``cell * N_TIERS + tier``)."""
    cell = holdout_cells(holdout, rule, cell_rule, cell_names)
    codes, _ = classify_trace(holdout, rule)
    return row_question_counts(extract_reuse(holdout, codes, min_gap=min_gap), cell, len(cell_names), horizon)


def holdout_cells(holdout: Trace, rule: ClassRule, cell_rule, cell_names) -> np.ndarray:
    """Each held-out request's cell; -1 for a class unseen when fitting, which has no cell of its own."""
    codes, names = classify_trace(holdout, rule)
    if cell_rule is None:
        index = {name: i for i, name in enumerate(cell_names)}
        return np.array([index.get(name, -1) for name in names], dtype=np.int64)[codes]
    return cells_of_trace(cell_rule, holdout, codes, names)


def row_question_counts(samples, cell: np.ndarray, n_cells: int, horizon: float) -> np.ndarray:
    """:func:`~kvprof.profiler.quality.question_counts` of held-out samples by their request's
    cell and their tier (samples of requests without a cell left out)."""
    cell = cell[samples.request]
    row = np.where(cell >= 0, cell * N_TIERS + tier_codes(samples.prior), -1)
    return question_counts(samples, row, n_cells * N_TIERS, horizon)


def _with_holdout_quality(cells, singles, counts: np.ndarray, horizon: float) -> list[tuple[ReuseRow, ...]]:
    """``cells`` with each row's held-out log-loss and Brier score, and a cure exponential's beside them."""

    def arrays(rows):
        flat = [r for tiers in rows for r in tiers]
        k = max(len(r.weights) for r in flat)
        pad = lambda values: [list(v) + [0.0] * (k - len(v)) for v in values]  # noqa: E731
        return (np.array([r.p for r in flat]), np.array(pad([r.weights for r in flat])), np.array(pad([r.rates for r in flat])))

    quality = score_counts(counts, {"mixture": arrays(cells), "single": arrays(singles)}, horizon)["rows"]
    out = []
    for c, tiers in enumerate(cells):
        new = []
        for t, entry in enumerate(tiers):
            measured = quality.get(c * N_TIERS + t)
            if measured is None or entry.diagnostics is None:
                new.append(entry)
                continue
            holdout_entry = {**measured["mixture"], "single": {k: measured["single"][k] for k in ("log_loss", "brier")}}
            new.append(dataclasses.replace(entry, diagnostics={**entry.diagnostics, "holdout": holdout_entry}))
        out.append(tuple(new))
    return out


def _window_text(trace: Trace) -> str:
    return f"[{trace.window[0]:g}, {trace.window[1]:g})"
