"""The simulator's server from a live one: prefill rate and step overhead fitted to measured TTFTs.

The cost model (:class:`kvprof.sim.config.CostModel`) takes a step ``step_overhead_s + tokens /
prefill_tokens_per_s``; a request that finds the server idle gets its first token after one such
step over its uncached prompt tokens. Requests that queued behind others took longer, so the fit
follows the lower edge of the cloud: requests are cut into up to ten bins by uncached tokens,
each bin gives the request at its 10th percentile of TTFT (a request that found the server
idle, queued ones being above it), and a least-squares line through those requests gives the
overhead (intercept) and the rate (1 / slope).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvprof.replay.runner import RequestRecord
from kvprof.sim.config import COST_BOUNDS

#: Fewest answered requests, and distinct bins, a fit is made from.
MIN_REQUESTS = 8
MIN_BINS = 3
#: TTFT quantile (a fraction) whose request stands for a bin's unqueued time.
LOWER_QUANTILE = 0.1


@dataclass(frozen=True)
class Calibration:
    """A fitted server: prefill tokens per second and seconds per step, from ``n_requests`` answered requests."""

    prefill_tokens_per_s: float
    step_overhead_s: float
    n_requests: int


def calibrate(records: Sequence[RequestRecord]) -> Calibration | str:
    """The fitted server, or why none can be fitted (a sentence)."""
    ok = [r for r in records if r.answered]
    if len(ok) < MIN_REQUESTS:
        return f"{len(ok)} answered requests are too few to fit the server's prefill rate (at least {MIN_REQUESTS})"
    uncached = np.array([max(r.prompt_tokens - r.cached_tokens, 1) for r in ok], dtype=float)
    ttft = np.array([r.ttft_s for r in ok])
    order = np.argsort(uncached, kind="stable")
    chosen = [part[np.argsort(ttft[part], kind="stable")[int(LOWER_QUANTILE * part.size)]]
              for part in np.array_split(order, min(10, len(ok) // 4))]
    x, y = uncached[chosen], ttft[chosen]
    if np.unique(x).size < MIN_BINS:
        return "the requests' uncached prompt lengths are too alike to tell prefill time from overhead"
    slope, intercept = np.polyfit(x, y, 1)
    if not slope > 0:
        return "first-token times do not grow with uncached prompt tokens, so no prefill rate can be read from them"
    rate, overhead = float(1.0 / slope), float(max(intercept, 0.0))
    for name, value in (("prefill_tokens_per_s", rate), ("step_overhead_s", overhead)):
        if not COST_BOUNDS[name].accepts(value):
            return f"the fitted {name} {value:g} is not {COST_BOUNDS[name].describe()}, so it models no server"
    return Calibration(prefill_tokens_per_s=rate, step_overhead_s=overhead, n_requests=len(ok))
