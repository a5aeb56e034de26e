"""The statistics the presets are calibrated to, measured on records with the profiler's own definitions.

A hit, a reuse and its gap are what :mod:`kvprof.profiler.reuse` says they are (accesses sorted
once by block and request; an access is a hit when an earlier request holds the block, reused
when a later one does), so the calibration and the profiler can never disagree about them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from kvprof.profiler.reuse import BlockRuns, access_request_index, next_access
from kvprof.profiler.synth.presets import BLOCK_SIZE
from kvprof.profiler.trace import Trace


def measure(records: Iterable[dict]) -> dict:
    """The statistics the presets are calibrated to, computed from Bailian records in time order.

    Accesses are attributed to the type of the request that made them.

    Returns
    -------
    dict
        JSON-ready: ``n_requests``; ``duration_s`` (first to last arrival); ``qps``;
        ``requests_by_type``; ``mean_input_tokens``, ``mean_output_tokens``;
        ``multi_turn_fraction`` (requests with turn > 1); ``ideal_hit_ratio`` (accesses whose
        block an earlier request accessed / all accesses); ``hit_share_first_turn`` (share of
        those hits made by turn-1 requests); ``reuse_fraction_by_type`` (accesses whose block a
        later request accesses / accesses); ``median_gap_s_by_type``, ``mean_gap_s_by_type``
        (time to that later request); ``reuses_within_10s``, ``reuses_within_600s`` (fractions
        of gaps); ``lifespan_p90_s`` (90th percentile over distinct blocks of last minus first
        access time); ``top10_block_reuse_share`` (share of reuses made by the 10 % most reused
        blocks).
    """
    trace = _trace_of(list(records))
    n = trace.n_requests
    request = access_request_index(trace)
    runs = BlockRuns.of(trace.hash_ids, request)
    hit = np.empty(trace.n_blocks, dtype=bool)
    hit[runs.order] = ~runs.run_starts_block()[runs.run_of()]
    later = next_access(trace.hash_ids, request)
    reused = later >= 0
    access_time = trace.timestamp[request]
    gap = trace.timestamp[request[later[reused]]] - access_time[reused]
    gap_type = trace.type_code[request[reused]]
    access_type = trace.type_code[request]

    # Per distinct block, in (block, request) order: the span of its accesses and its reuses (runs - 1).
    first = np.flatnonzero(runs.new_block)
    last = np.append(first[1:], trace.n_blocks) - 1
    sorted_time = access_time[runs.order]
    lifespan = sorted_time[last] - sorted_time[first]
    reuses_per_block = np.sort(np.add.reduceat(runs.new_run.astype(np.int64), first) - 1)[::-1] if first.size else first
    top = max(1, math.ceil(0.1 * first.shape[0]))

    def by_type(values: np.ndarray, codes: np.ndarray, statistic) -> dict[str, float]:
        return {name: float(statistic(values[codes == c]))
                for c, name in enumerate(trace.type_names) if np.any(codes == c)}

    n_hits = int(hit.sum())
    duration = float(trace.timestamp[-1] - trace.timestamp[0])
    return {
        "n_requests": n,
        "duration_s": duration,
        "qps": n / duration if n > 1 else 0.0,
        "requests_by_type": {name: int(np.sum(trace.type_code == c)) for c, name in enumerate(trace.type_names)},
        "mean_input_tokens": float(np.mean(trace.input_length)),
        "mean_output_tokens": float(np.mean(trace.output_length)),
        "multi_turn_fraction": float(np.mean(trace.turn > 1)),
        "ideal_hit_ratio": n_hits / trace.n_blocks if trace.n_blocks else 0.0,
        "hit_share_first_turn": float(np.sum(hit & (trace.turn[request] == 1)) / n_hits) if n_hits else 0.0,
        "reuse_fraction_by_type": by_type(reused, access_type, np.mean),
        "median_gap_s_by_type": by_type(gap, gap_type, np.median),
        "mean_gap_s_by_type": by_type(gap, gap_type, np.mean),
        "reuses_within_10s": float(np.mean(gap <= 10.0)) if gap.shape[0] else 0.0,
        "reuses_within_600s": float(np.mean(gap <= 600.0)) if gap.shape[0] else 0.0,
        "lifespan_p90_s": float(np.percentile(lifespan, 90)) if lifespan.shape[0] else 0.0,
        "top10_block_reuse_share": float(reuses_per_block[:top].sum() / n_hits) if n_hits else 0.0,
    }


def _trace_of(records: list[dict]) -> Trace:
    """The records as a Trace (in their order, which must be time order), without the reader's checks."""
    if not records:
        raise ValueError("no records to measure")
    types: dict[str, int] = {}
    lengths = np.array([len(r["hash_ids"]) for r in records], dtype=np.int64)
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    def column(field, dtype):
        return np.array([r[field] for r in records], dtype=dtype)

    return Trace(
        timestamp=column("timestamp", np.float64),
        input_length=column("input_length", np.int64),
        output_length=column("output_length", np.int64),
        chat_id=column("chat_id", np.int64),
        parent_chat_id=column("parent_chat_id", np.int64),
        type_code=np.array([types.setdefault(r["type"], len(types)) for r in records], dtype=np.int32),
        type_names=tuple(types),
        turn=column("turn", np.int32),
        hash_offsets=offsets,
        hash_ids=np.fromiter((h for r in records for h in r["hash_ids"]), dtype=np.int64, count=int(offsets[-1])),
        block_size=BLOCK_SIZE,
        format="bailian",
    )
