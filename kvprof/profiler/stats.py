"""Descriptive statistics of a trace, for ``kvprof inspect``."""

from __future__ import annotations

import numpy as np

from kvprof.classes import ClassRule
from kvprof.models.finish import FINISH_FIELD, FINISH_NAMES
from kvprof.profiler.classes import classify_trace
from kvprof.profiler.reuse import extract_reuse, ideal_hit_ratio
from kvprof.profiler.trace import Trace

GAP_QUANTILES = (0.1, 0.5, 0.9, 0.99)


def trace_summary(trace: Trace, rule: ClassRule = ClassRule(), *, min_gap: float = 0.3) -> dict:
    """Requests, sessions, types, turns, lengths, how responses ended and client hints (None where the trace
    has no ``stop`` or no hint field), block reuse and reuse-gap quantiles per class.

    Returns
    -------
    dict
        JSON-ready; times in seconds, lengths in tokens.
    """
    codes, names = classify_trace(trace, rule)
    samples = extract_reuse(trace, codes, min_gap=min_gap)
    types, type_counts = np.unique(trace.type_code, return_counts=True)
    turns, turn_counts = np.unique(trace.turn, return_counts=True)
    span = float(trace.timestamp[-1] - trace.timestamp[0]) if trace.n_requests > 1 else 0.0
    per_class = {}
    for code, name in enumerate(names):
        mine = samples.workload == code
        gaps = samples.time[mine & ~samples.censored]
        per_class[name] = {
            "requests": int(np.count_nonzero(codes == code)),
            "accesses": int(np.count_nonzero(mine)),
            "reuses": int(gaps.shape[0]),
            "reuse_share": float(gaps.shape[0] / max(np.count_nonzero(mine), 1)),
            "gap_quantiles_s": (
                {f"p{round(q * 100)}": float(v) for q, v in zip(GAP_QUANTILES, np.quantile(gaps, GAP_QUANTILES))}
                if gaps.shape[0]
                else None
            ),
        }
    return {
        "trace": trace.source,
        "format": trace.format,
        "block_size": trace.block_size,
        "window": [trace.window[0], trace.censor_time],
        "requests": trace.n_requests,
        "duration_s": span,
        "qps": trace.n_requests / span if span > 0 else None,
        "sessions": int(np.count_nonzero(trace.parent_chat_id < 0)),
        "types": {trace.type_names[t] or "(none)": int(c) for t, c in zip(types, type_counts)},
        "turns": {int(t): int(c) for t, c in zip(turns, turn_counts)},
        "stops": _stops(trace),
        "hints": _hints(trace),
        "mean_input_tokens": float(trace.input_length.mean()),
        "mean_output_tokens": float(trace.output_length.mean()),
        "block_accesses": trace.n_blocks,
        "distinct_blocks": int(np.unique(trace.hash_ids).shape[0]),
        "ideal_hit_ratio": ideal_hit_ratio(trace),
        "min_gap_s": min_gap,
        "merged_concurrent_accesses": samples.n_merged,
        "classes": per_class,
    }


def _stops(trace: Trace) -> dict[str, int] | None:
    """Requests by how their response ended (the ``stop`` codes' names), None where the trace has no ``stop``."""
    if FINISH_FIELD not in trace.extra:
        return None
    return {FINISH_NAMES[code]: int(n) for code, n in enumerate(np.bincount(trace.finish, minlength=len(FINISH_NAMES)))}


def _hints(trace: Trace) -> dict[str, int] | None:
    """Requests that ask to retain and to release, and the hint tags they name; None where the trace has no hint."""
    hints = trace.hints
    if hints is None:
        return None
    retains = hints.retain_s > 0
    return {"retain": int(retains.sum()), "release": int(hints.release.sum()),
            "tags": int(np.unique(hints.tag[retains | hints.release]).shape[0])}
