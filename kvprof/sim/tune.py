"""Profile-driven tuning: the profiler's own window, replayed, chooses the ``wa`` policy's knobs.

For each capacity the user will run at, :func:`tune` replays the last part of the fit window
(:data:`REPLAYED_SHARE`: the traffic closest to what the policy will meet, and a third of the
cost of the whole window) through the simulator under ``wa`` at a few horizons around the
fitted one and keeps the horizon with the highest token hit ratio, and, as the candidate order
to start on, the one whose shadow cache hit most in that replay (so the policy starts where the
safety net would have ended). The
choices go into the hp file's ``tuning`` block; a policy built for a capacity takes the entry of
the nearest tuned one (:meth:`kvprof.models.hp.HpFile.tuned`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvprof.models.hp import HpFile
from kvprof.policy import make_policy
from kvprof.profiler.trace import Trace
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.sample import Miniature, chain_sample
from kvprof.sim.runner import run_tasks
from kvprof.sim.workload import Workload, prepare_workload

#: Horizons tried, as multiples of the fitted one.
HORIZON_FACTORS = (0.25, 1.0, 4.0)
#: The share of the fit window, its end, that the tuning replays.
REPLAYED_SHARE = 1 / 3


def tune(hp: HpFile, trace: Trace, capacities: Sequence[int], config: SimConfig = SimConfig(), *,
         n_jobs: int = 1, ray: str | None = None, progress: Callable[[int, int], None] | None = None) -> HpFile:
    """``hp`` with a tuning entry per capacity, chosen by replaying the end of ``trace`` (the fit window).

    Parameters
    ----------
    hp : HpFile
        Fitted on ``trace``.
    trace : Trace
        The fit window; its last :data:`REPLAYED_SHARE` is replayed (all of it if that part is empty).
    capacities : sequence of int
        GPU capacities in engine blocks.
    config : SimConfig
        Engine block size and cost model of the replays (those the policy will meet); with a
        ``sample_rate``, a sample of the chains is replayed at scaled capacities
        (:mod:`kvprof.sim.sample`), the entries still named by the full capacities.
    n_jobs : int
        joblib workers for the replays (capacities x horizons), capped as a sweep's
        (:func:`~kvprof.sim.runner.sweep_workers`).
    ray : str or None
        Run the replays on the Ray cluster at this address instead (:mod:`kvprof.sim.runner`).
    progress : callable(done, total) or None
        Called as each replay finishes.

    Returns
    -------
    HpFile
        With ``tuning``: per capacity ``capacity``, ``horizon_s``, ``start`` and what was
        ``measured`` (hit ratio per horizon tried, shadow hits per candidate at the best one).
    """
    end = trace.censor_time
    replayed = trace.time_window(end - (end - trace.first_arrival) * REPLAYED_SHARE, None)
    replayed = chain_sample(replayed if replayed.n_requests else trace, config.sample_rate)
    workload = prepare_workload(replayed, hp, config.engine_block_size, config.rate_scale)
    miniature = Miniature.of(replayed, workload, config.sample_rate)
    horizons = [hp.horizon * factor for factor in HORIZON_FACTORS]
    tasks = [(capacity, horizon) for capacity in capacities for horizon in horizons]
    replays = run_tasks(_replay, workload, [(hp, miniature.capacity(capacity), horizon, miniature.config(config))
                                            for capacity, horizon in tasks], n_jobs=n_jobs, ray=ray, progress=progress)
    entries = []
    for capacity in capacities:
        tried = {horizon: replay for (c, horizon), replay in zip(tasks, replays) if c == capacity}
        best = max(tried, key=lambda horizon: tried[horizon][0])
        shadow_hits = tried[best][1]
        entries.append({
            "capacity": int(capacity),
            "horizon_s": float(best),
            "start": max(shadow_hits, key=shadow_hits.get),
            "measured": {"hit_ratio_by_horizon_s": {f"{h:g}": ratio for h, (ratio, _) in tried.items()},
                         "shadow_hits": shadow_hits},
        })
    return dataclasses.replace(hp, tuning=tuple(entries))


def _replay(workload: Workload, hp: HpFile, capacity: int, horizon: float, config: SimConfig) -> tuple[float, dict]:
    """Token hit ratio of ``wa`` at ``horizon`` and its shadows' hits by candidate."""
    policy = make_policy("wa", hp, horizon=horizon)
    metrics = simulate(workload, policy, capacity, config)
    return metrics.token_hit_ratio, policy.shadow_hits()
