"""What one replay measured (:class:`RunMetrics`) and how its raw counts become it
(:func:`metrics`): the one rule every engine and timing of :mod:`kvprof.sim` reports by."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from kvprof.sim.config import CostModel
from kvprof.sim.workload import Workload


@dataclass(frozen=True)
class RunMetrics:
    """What one replay measured.

    Hit counts are in engine blocks over the blocks a request may hit (``Workload.n_lookup``);
    ``hits_device + hits_host + misses == block_lookups``. Times are modelled seconds.

    Attributes
    ----------
    token_hit_ratio : float
        Cached prompt tokens / prompt tokens (the published metric; rejected requests count as
        uncached).
    block_hit_ratio : float
        (hits_device + hits_host) / block_lookups.
    evictions : int
        Cached GPU blocks whose content was overwritten for a new block.
    dropped : int
        Cached GPU blocks dropped by lowering the elastic capacity.
    host_evictions : int
        Evictions in the CPU tier.
    n_rejected : int
        Requests that could never get enough blocks (longer than the whole cache), not served.
    qttft_mean_s, qttft_p50_s, qttft_p90_s, qttft_p99_s : float
        Modelled queued time to first token (first token - arrival) over served requests.
    makespan_s : float
        Modelled time at which the last request finished its prefill.
    offered_load : float
        Prompt tokens the modelled server had to compute (uncached) per second of the trace,
        over its prefill throughput; NaN for a trace of no duration.
    qttft_overloaded : bool
        ``offered_load > 1``: uncached tokens arrive faster than the server prefills, the queue
        grows for as long as the trace lasts, and QTTFT measures the trace's length rather than
        the policy (the README says how to calibrate the cost model).
    hints : dict or None
        What the hint layer did in a ``P+hints`` replay of ``compare`` (the
        :class:`~kvprof.policy.hinted.HintCounters`, in blocks); None for any other run.
    """

    policy: str
    capacity: int
    n_requests: int
    n_rejected: int
    prompt_tokens: int
    cached_tokens: int
    token_hit_ratio: float
    block_lookups: int
    hits_device: int
    hits_host: int
    misses: int
    block_hit_ratio: float
    evictions: int
    dropped: int
    host_evictions: int
    qttft_mean_s: float
    qttft_p50_s: float
    qttft_p90_s: float
    qttft_p99_s: float
    makespan_s: float
    offered_load: float
    qttft_overloaded: bool
    hints: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def metrics(
    w: Workload, cost: CostModel, policy: str, capacity: int, *, qttft: np.ndarray, served: np.ndarray,
    hits_device: int, hits_host: int, computed: int, end: float, evictions: int, dropped: int, host_evictions: int,
) -> RunMetrics:
    """The metrics of a finished replay (either engine, any timing) from its raw counts.

    Parameters
    ----------
    w : Workload
        The workload replayed.
    cost : CostModel
        The cost model it was replayed under (its prefill throughput gives the offered load).
    policy : str
        The GPU tier's policy name.
    capacity : int
        GPU blocks (a schedule's first).
    qttft : float64 array
        Queued time to first token of each served request, seconds (empty: none modelled).
    served : bool array, shape (n,)
        Which requests were served.
    hits_device, hits_host : int
        Prefix hits in blocks, per tier.
    computed : int
        Prompt tokens computed (not cached), over the served requests.
    end : float
        When the last request finished its prefill (recorded timing: freed its blocks), seconds.
    evictions, dropped, host_evictions : int
        :class:`RunMetrics`' counts of the same names.
    """
    load = computed / (cost.prefill_tokens_per_s * w.duration) if w.duration > 0 else math.nan
    lookups = int(w.n_lookup.sum())
    prompt_tokens = int(w.prompt_tokens.sum())
    hits = hits_device + hits_host
    ebs = w.engine_block_size
    p50, p90, p99 = np.percentile(qttft, [50, 90, 99]) if qttft.size else (math.nan,) * 3
    return RunMetrics(
        policy=policy,
        capacity=capacity,
        n_requests=w.n_requests,
        n_rejected=int(w.n_requests - served.sum()),
        prompt_tokens=prompt_tokens,
        cached_tokens=hits * ebs,
        token_hit_ratio=hits * ebs / prompt_tokens if prompt_tokens else 0.0,
        block_lookups=lookups,
        hits_device=hits_device,
        hits_host=hits_host,
        misses=lookups - hits,
        block_hit_ratio=hits / lookups if lookups else 0.0,
        evictions=evictions,
        dropped=dropped,
        host_evictions=host_evictions,
        qttft_mean_s=float(qttft.mean()) if qttft.size else math.nan,
        qttft_p50_s=float(p50),
        qttft_p90_s=float(p90),
        qttft_p99_s=float(p99),
        makespan_s=end,
        offered_load=load,
        qttft_overloaded=bool(load > 1),
    )
