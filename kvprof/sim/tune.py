"""Profile-driven tuning: the profiler's own window, replayed, chooses the ``wa`` policy's knobs.

For each capacity the user will run at, :func:`tune` replays the last part of the fit window
(:data:`REPLAYED_SHARE`: the traffic closest to what the policy will meet, and a third of the
cost of the whole window) through the simulator under ``wa`` at a few horizons around the
fitted one and keeps the horizon with the highest token hit ratio, and, as the candidate order
to start on, the one whose shadow cache hit most in that replay (so the policy starts where the
safety net would have ended; never one of :data:`NEVER_START`).

Before those replays, the same part is replayed under the ``long-output`` candidate alone
(:class:`~kvprof.policy.long_output.LongOutputLRU`) at each of :data:`OUTPUT_PERCENTILES` of the
window's output lengths, and under LRU: the median's limit, or a quartile's that hit clearly more
(:data:`LIMIT_LEAD_ERRORS`), becomes the candidate's where it hit more than LRU, and the candidate
takes part in ``wa``'s replays (its shadow decides, there and in serving, whether ``wa`` follows
it). Where the window's requests carry finish codes (the trace's ``stop``, :mod:`kvprof.models.finish`)
and some ended the turn, the part is replayed under the ``finish-reason`` candidate alone too (LRU that
evicts first the blocks of requests whose response ended the turn), and ``wa`` carries it
(``finish_reason``) where it hit more than LRU. With ``learn``, the same part is replayed under Belady at each capacity to train the
``learned`` candidate's predictor (:mod:`kvprof.sim.learn`), which then takes part as a candidate
too. The choices go into the hp file's ``tuning`` block; a policy built for a capacity takes the
entry of the nearest tuned one (:meth:`kvprof.models.hp.HpFile.tuned`).

With ``refit`` (the fit the hp file came from, as a function of a window), the replays that choose the
horizon and the start judge the fitted orders out of sample: ``wa`` runs on a file fitted on the fit
window before the replayed part, so the ``model`` order is not scored on the traffic it was fitted on
while the parameter-free orders (LRU, segmented, S3-FIFO, ...) never are. Judged in sample, the model
won starts it then lost on the traffic after the window (weka, fit 1800-5400 s, 16,000 blocks: tuned
start ``model``, whose shadow then hit 7 % less than LRU's; docs/results.md, "`wa`'s switching").

Where the fit window's next-turn counts put ``wa`` over the first-turn order and LRU
(:func:`~kvprof.policy.wa.candidate_orders`), neither the horizon, the output limit, the predictor nor the
start changes what it does: the part is replayed once under those candidates, at the fitted horizon, and
the entry records what their shadows hit, with the first-turn order as the start.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from kvprof.cells import TIER_EDGES
from kvprof.models.finish import END_OF_TURN
from kvprof.models.hp import HpFile
from kvprof.models.learned import LearnedModel
from kvprof.parallel import run_tasks
from kvprof.policy import make_policy
from kvprof.policy.base import EvictionPolicy
from kvprof.policy.finish_reason import FinishReasonLRU
from kvprof.policy.long_output import LongOutputLRU
from kvprof.policy.lru import LRUPolicy
from kvprof.policy.wa import FIRST_TURN_ORDERS, candidate_orders
from kvprof.profiler.trace import Trace
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.learn import belady_labels, fit_learned
from kvprof.sim.sample import Miniature, chain_sample, lost_shares
from kvprof.sim.workload import Workload, prepare_workload

#: The tuning replays' key of the finish-reason candidate run alone (beside LRU's, None, and each output limit).
FINISH_REASON = "finish-reason"
#: Horizons tried, as multiples of the fitted one.
HORIZON_FACTORS = (0.25, 1.0, 4.0)
#: The share of the fit window, its end, that the tuning replays.
REPLAYED_SHARE = 1 / 3
#: The long-output candidate's limits tried: these percentiles of the fit window's output lengths
#: (the rule benchmark's best differed by trace: the lower quartile on weka, the median on Mooncake).
OUTPUT_PERCENTILES = (25, 50, 75)
#: Candidates ``wa`` never starts on, however well their shadow did in the tuning replay. Started on
#: ``long-output``, ``wa`` lost to starting on the best other shadow at 5 of 7 such points of weka and
#: Mooncake over two fit windows (each replayed with both starts from one hp file; by 1.7 % of hit ratio on
#: average): followed, it leads where its shadow says so, and starting on it skips the comparison that keeps
#: it honest.
NEVER_START = ("long-output",)
#: A quartile's limit is chosen over the median's only if it hit more by this many standard errors
#: of the median's hit count (``1 / sqrt(hits)``, relative): the replayed third of a short window
#: holds few hits, and a lead within their noise did not carry over to the traffic after it.
LIMIT_LEAD_ERRORS = 2.0


def tune(hp: HpFile, trace: Trace, capacities: Sequence[int], config: SimConfig = SimConfig(), *,
         n_jobs: int = 1, ray: str | None = None, progress: Callable[[int, int], None] | None = None,
         learn: bool = False, holdout: Trace | None = None,
         refit: Callable[[Trace], HpFile] | None = None) -> HpFile:
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
        (README, "Policy quality"). Not trained where ``wa`` runs over the first-turn order and LRU.
    holdout : Trace or None
        The window after ``trace``: the start of it (as long as the replayed part) is labelled
        too, to measure the predictor on traffic it was not fitted on.
    refit : callable(Trace) -> HpFile, optional
        The fit ``hp`` came from (same options): with it, ``wa``'s replays run on a file fitted on
        ``trace`` before the replayed part, so no fitted order is judged on its own fit data. Not
        with ``learn`` (the predictor is trained for ``hp``'s cells).

    Returns
    -------
    HpFile
        With ``tuning``: per capacity ``capacity``, ``horizon_s``, ``start`` and what was
        ``measured`` (hit ratio per horizon tried, shadow hits per candidate at the best one, the
        long-output candidate's hit ratio alone per limit and LRU's), ``long_output_tokens`` where a
        limit beat LRU, and with ``learn`` the ``learned`` predictor where its labels held both classes.
    """
    end = trace.censor_time
    replayed = trace.time_window(end - (end - trace.first_arrival) * REPLAYED_SHARE, None)
    replayed = chain_sample(replayed if replayed.n_requests else trace, config.sample_rate)
    first_turn = candidate_orders(hp) == FIRST_TURN_ORDERS  # the file's counts decide, as in serving
    # first-turn and LRU fit nothing to the window: only the default candidates' model needs judging apart
    judged = hp if learn or first_turn else _judged(hp, trace, replayed, refit)
    workload = prepare_workload(replayed, judged, config.engine_block_size, config.rate_scale)
    miniature = Miniature.of(replayed, workload, config.sample_rate)
    lost_shares(miniature, workload.blocks_needed(config.cost.decode), workload.prompt_tokens, capacities)
    horizons = [hp.horizon] if first_turn else [hp.horizon * factor for factor in HORIZON_FACTORS]
    learn = learn and not first_turn
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
    limits = ([float(np.percentile(trace.output_length, q)) for q in OUTPUT_PERCENTILES]
              if trace.n_requests and not first_turn else [])
    ends = not first_turn and bool(np.any(trace.finish == END_OF_TURN))  # what finish-reason demotes
    variants = [*limits, *([FINISH_REASON] if ends else [])]
    simple = [(capacity, variant) for capacity in capacities for variant in [None, *variants]] if variants else []
    alone = dict(zip(simple, run_tasks(_replay_alone, workload, [(miniature.capacity(capacity), _alone(variant),
                                                                  miniature.config(config)) for capacity, variant in simple],
                                       n_jobs=n_jobs, ray=ray)))
    output_limit = {capacity: _best_limit(alone, capacity, limits) for capacity in capacities}
    finish_reason = {capacity: ends and alone[(capacity, FINISH_REASON)][0] > alone[(capacity, None)][0]
                     for capacity in capacities}
    tasks = [(capacity, horizon) for capacity in capacities for horizon in horizons]
    replays = run_tasks(_replay, workload, [(judged, miniature.capacity(capacity), horizon, miniature.config(config),
                                             candidate_orders(hp, learned.get(capacity), output_limit[capacity],
                                                              finish_reason[capacity]),
                                             learned.get(capacity), output_limit[capacity])
                                            for capacity, horizon in tasks],
                        n_jobs=n_jobs, ray=ray, progress=progress)
    entries = []
    for capacity in capacities:
        tried = {horizon: replay for (c, horizon), replay in zip(tasks, replays) if c == capacity}
        best = max(tried, key=lambda horizon: tried[horizon][0])
        shadow_hits = tried[best][1]
        entries.append({
            "capacity": int(capacity),
            "horizon_s": float(best),
            "start": FIRST_TURN_ORDERS[0] if first_turn else max((name for name in shadow_hits if name not in NEVER_START),
                                                                  key=shadow_hits.get),
            "measured": {"hit_ratio_by_horizon_s": {f"{h:g}": ratio for h, (ratio, _) in tried.items()},
                         "shadow_hits": shadow_hits,
                         **({"hit_ratio_by_output_limit": {f"{limit:g}": alone[(capacity, limit)][0] for limit in limits}}
                            if limits else {}),
                         **({"lru_hit_ratio": alone[(capacity, None)][0]} if variants else {}),
                         **({"finish_reason_hit_ratio": alone[(capacity, FINISH_REASON)][0]} if ends else {})},
            **({"long_output_tokens": output_limit[capacity]} if output_limit[capacity] is not None else {}),
            **({"finish_reason": True} if finish_reason[capacity] else {}),
            **({"learned": learned[capacity]} if learned.get(capacity) is not None else {}),
        })
    return dataclasses.replace(hp, tuning=tuple(entries))


def _learn(workload: Workload, capacity: int, config: SimConfig, n_cells: int,
           holdout: Workload | None) -> LearnedModel | None:
    """The ``learned`` predictor trained on Belady's replay of ``workload`` at ``capacity``, measured on ``holdout``'s."""
    rows, labels, gaps = belady_labels(workload, capacity, config, n_cells, len(TIER_EDGES))
    held = belady_labels(holdout, capacity, config, n_cells, len(TIER_EDGES))[:2] if holdout is not None else None
    return fit_learned(rows, labels, n_cells, len(TIER_EDGES), gaps, held)


def _best_limit(alone: dict, capacity: int, limits: list[float]) -> float | None:
    """The limit of ``limits`` (ascending, the median's in the middle) the long-output candidate takes at
    ``capacity``, from ``alone[(capacity, limit)]`` = (token hit ratio, hit blocks) of its replays (limit
    None: LRU's): the median's, or the limit that hit most if it led the median's by more than
    :data:`LIMIT_LEAD_ERRORS` standard errors; None unless that hit more than LRU."""
    if not limits:
        return None
    median = limits[len(limits) // 2]
    best = max(limits, key=lambda limit: alone[(capacity, limit)][0])
    median_ratio, median_hits = alone[(capacity, median)]
    if alone[(capacity, best)][0] <= median_ratio * (1 + LIMIT_LEAD_ERRORS / math.sqrt(max(median_hits, 1))):
        best = median
    return best if alone[(capacity, best)][0] > alone[(capacity, None)][0] else None


def _alone(variant: float | str | None) -> EvictionPolicy:
    """The policy a tuning replay runs alone: LRU (None), the finish-reason candidate (:data:`FINISH_REASON`)
    or the long-output candidate at the limit ``variant``."""
    if variant is None:
        return LRUPolicy()
    return FinishReasonLRU() if variant == FINISH_REASON else LongOutputLRU(variant)


def _replay_alone(workload: Workload, capacity: int, policy: EvictionPolicy, config: SimConfig) -> tuple[float, int]:
    """Token hit ratio and hit blocks of ``policy`` (a fresh instance) alone."""
    metrics = simulate(workload, policy, capacity, config)
    return metrics.token_hit_ratio, metrics.hits_device


def _judged(hp: HpFile, trace: Trace, replayed: Trace, refit: Callable[[Trace], HpFile] | None) -> HpFile:
    """The file ``wa``'s tuning replays run on: ``refit`` of ``trace`` before ``replayed`` (``hp`` without
    ``refit`` or where nothing comes before)."""
    if refit is None:
        return hp
    earlier = trace.time_window(None, replayed.window[0])
    return refit(earlier) if earlier.n_requests else hp


def _replay(workload: Workload, hp: HpFile, capacity: int, horizon: float, config: SimConfig, orders: tuple,
            learned: LearnedModel | None = None, output_limit: float | None = None) -> tuple[float, dict]:
    """Token hit ratio of ``wa`` over ``orders`` at ``horizon`` (with the ``learned`` and ``long-output``
    candidates where given) and its shadows' hits by candidate."""
    policy = make_policy("wa", hp, horizon=horizon, orders=orders, learned=learned, output_limit=output_limit)
    metrics = simulate(workload, policy, capacity, config)
    return metrics.token_hit_ratio, policy.shadow_hits()
