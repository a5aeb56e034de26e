"""Profile-driven tuning: the profiler's own window, replayed, chooses the ``wa`` policy's knobs.

For each capacity the user will run at, :func:`tune` replays the last part of the fit window
(:data:`REPLAYED_SHARE`: the traffic closest to what the policy will meet, and a third of the
cost of the whole window) through the simulator under ``wa`` at a few horizons around the
fitted one and keeps the horizon with the highest token hit ratio, and, as the candidate order
to start on, the one whose shadow cache hit most in that replay (so the policy starts where the
safety net would have ended). Before those replays, with ``learn``, the same part of the window
is replayed under Belady at each capacity to train the ``learned`` candidate's predictor
(:mod:`kvprof.sim.learn`), which then takes part in the replays as a candidate. The
choices go into the hp file's ``tuning`` block; a policy built for a capacity takes the entry of
the nearest tuned one (:meth:`kvprof.models.hp.HpFile.tuned`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvprof.cells import TIER_EDGES
from kvprof.models.hp import HpFile
from kvprof.models.learned import LearnedModel
from kvprof.parallel import run_tasks
from kvprof.policy import make_policy
from kvprof.policy.wa import DEFAULT_ORDERS
from kvprof.profiler.trace import Trace
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.learn import belady_labels, fit_learned
from kvprof.sim.sample import Miniature, chain_sample, lost_shares
from kvprof.sim.workload import Workload, prepare_workload

#: Horizons tried, as multiples of the fitted one.
HORIZON_FACTORS = (0.25, 1.0, 4.0)
#: The share of the fit window, its end, that the tuning replays.
REPLAYED_SHARE = 1 / 3


def tune(hp: HpFile, trace: Trace, capacities: Sequence[int], config: SimConfig = SimConfig(), *,
         n_jobs: int = 1, ray: str | None = None, progress: Callable[[int, int], None] | None = None,
         learn: bool = False, holdout: Trace | None = None) -> HpFile:
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
        (:func:`~kvprof.parallel.sweep_workers`).
    ray : str or None
        Run the replays on the Ray cluster at this address instead (:mod:`kvprof.parallel`).
    progress : callable(done, total) or None
        Called as each replay finishes.
    learn : bool
        Train the ``learned`` candidate's predictor per capacity (on Belady's replays). Off by
        default: on the quality suite it gained nothing over the simple orders for 10x its time
        (README, "Policy quality").
    holdout : Trace or None
        The window after ``trace``: the start of it (as long as the replayed part) is labelled
        too, to measure the predictor on traffic it was not fitted on.

    Returns
    -------
    HpFile
        With ``tuning``: per capacity ``capacity``, ``horizon_s``, ``start`` and what was
        ``measured`` (hit ratio per horizon tried, shadow hits per candidate at the best one), and
        with ``learn`` the ``learned`` predictor where its labels held both classes.
    """
    end = trace.censor_time
    replayed = trace.time_window(end - (end - trace.first_arrival) * REPLAYED_SHARE, None)
    replayed = chain_sample(replayed if replayed.n_requests else trace, config.sample_rate)
    workload = prepare_workload(replayed, hp, config.engine_block_size, config.rate_scale)
    miniature = Miniature.of(replayed, workload, config.sample_rate)
    lost_shares(miniature, workload.blocks_needed(config.cost.decode), workload.prompt_tokens, capacities)
    horizons = [hp.horizon * factor for factor in HORIZON_FACTORS]
    n_cells = len(hp.cell_names())
    later = None
    if learn and holdout is not None and holdout.n_requests:
        start = holdout.first_arrival
        later = holdout.time_window(start, start + (end - trace.first_arrival) * REPLAYED_SHARE)
        later = prepare_workload(chain_sample(later, config.sample_rate), hp, config.engine_block_size,
                                 config.rate_scale) if later.n_requests else None
    learned = dict(zip(capacities, run_tasks(
        _learn, workload, [(miniature.capacity(capacity), miniature.config(config), n_cells, later)
                           for capacity in capacities], n_jobs=n_jobs, ray=ray))) if learn else {}
    tasks = [(capacity, horizon) for capacity in capacities for horizon in horizons]
    replays = run_tasks(_replay, workload, [(hp, miniature.capacity(capacity), horizon, miniature.config(config),
                                             learned.get(capacity)) for capacity, horizon in tasks],
                        n_jobs=n_jobs, ray=ray, progress=progress)
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
            **({"learned": learned[capacity]} if learned.get(capacity) is not None else {}),
        })
    return dataclasses.replace(hp, tuning=tuple(entries))


def _learn(workload: Workload, capacity: int, config: SimConfig, n_cells: int,
           holdout: Workload | None) -> LearnedModel | None:
    """The ``learned`` predictor trained on Belady's replay of ``workload`` at ``capacity``, measured on ``holdout``'s."""
    rows, labels, gaps = belady_labels(workload, capacity, config, n_cells, len(TIER_EDGES))
    held = belady_labels(holdout, capacity, config, n_cells, len(TIER_EDGES))[:2] if holdout is not None else None
    return fit_learned(rows, labels, n_cells, len(TIER_EDGES), gaps, held)


def _replay(workload: Workload, hp: HpFile, capacity: int, horizon: float, config: SimConfig,
            learned: LearnedModel | None = None) -> tuple[float, dict]:
    """Token hit ratio of ``wa`` at ``horizon`` (with the ``learned`` candidate if given) and its shadows' hits by candidate."""
    extra = {"learned": learned, "orders": DEFAULT_ORDERS + ("learned",)} if learned is not None else {}
    policy = make_policy("wa", hp, horizon=horizon, **extra)
    metrics = simulate(workload, policy, capacity, config)
    return metrics.token_hit_ratio, policy.shadow_hits()
