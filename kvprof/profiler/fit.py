"""The profiling pipeline: trace window in, hyperparameter file out.

classify requests -> extract reuse gaps (censored at the window's end) -> fit one cure-fraction
exponential per class and per tier (fresh blocks, and blocks an earlier request already used),
shrunk toward the pooled fit where data is thin -> session statistics ->
:class:`~kvprof.models.hp.HpFile` with provenance.
"""

from __future__ import annotations

import datetime as dt

import numpy as np

from kvprof import __version__
from kvprof.classes import ClassRule
from kvprof.errors import KvprofError
from kvprof.models.exponential import fit_classes
from kvprof.models.hp import REUSED_SUFFIX, HpFile
from kvprof.models.sessions import session_stats
from kvprof.profiler.classes import classify_trace
from kvprof.profiler.reuse import extract_reuse
from kvprof.profiler.trace import Trace

#: Default horizon H in seconds: "reused within the next minute". It sits inside the range of
#: cache turnover times of the published capacities (tens of seconds to a few minutes at 6 QPS).
DEFAULT_HORIZON = 60.0
DEFAULT_MIN_GAP = 0.3
DEFAULT_MIN_SAMPLES = 200


def fit_trace(
    trace: Trace,
    rule: ClassRule = ClassRule(),
    *,
    horizon: float = DEFAULT_HORIZON,
    min_gap: float = DEFAULT_MIN_GAP,
    min_samples: int = DEFAULT_MIN_SAMPLES,
) -> HpFile:
    """Fit per-class reuse models on a trace window.

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
        Classes with fewer block accesses are shrunk toward the pooled fit.

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
    )


def _window_text(trace: Trace) -> str:
    return f"[{trace.window[0]:g}, {trace.window[1]:g})"
