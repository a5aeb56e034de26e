"""Policies x capacities over one trace, in parallel, and the versioned results file.

The workload is prepared once in the calling process and shared with every run; each run builds
its own fresh policy instances, so runs are independent and their order does not matter.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvprof import results as results_file
from kvprof.parallel import Progress, run_tasks, sweep_workers
from kvprof.policy import make_policy
from kvprof.profiler.trace import Trace
from kvprof.sim.config import SimConfig, SimulationError, check_memory
from kvprof.sim.engine import simulate
from kvprof.sim.hints import base_name, make_hinted_policy
from kvprof.sim.metrics import RunMetrics
from kvprof.sim.sample import Miniature, chain_sample, lost_shares, sample_facts
from kvprof.sim.workload import Workload, prepare_workload

BASELINE = "lru"
ORACLE = "belady"


@dataclass(frozen=True)
class Results:
    """The outcome of a sweep: one :class:`RunMetrics` per (policy, capacity), plus what produced it.

    Invariant: ``runs`` holds exactly one entry per pair of ``policies`` x ``capacities``, in that
    order (policies outer), so a ``Results`` is always complete; partial sweeps are never built.
    """

    runs: tuple[RunMetrics, ...]
    policies: tuple[str, ...]
    capacities: tuple[int, ...]
    config: SimConfig
    inputs: dict = field(default_factory=dict)
    wall_s: float = math.nan

    def get(self, policy: str, capacity: int) -> RunMetrics:
        return self.runs[self.policies.index(policy) * len(self.capacities) + self.capacities.index(capacity)]

    def comparison(self, policy: str, capacity: int) -> dict:
        """Gains of ``policy`` over LRU at ``capacity`` and its share of the LRU-to-Belady gap.

        Returns
        -------
        dict
            ``hit_gain_over_lru`` (relative: (hit - lru) / lru), ``hit_gain_over_lru_abs``
            (hit - lru), ``qttft_gain_over_lru`` (relative reduction of mean QTTFT:
            (lru - q) / lru), ``belady_gap_closed`` ((hit - lru) / (belady - lru)); each None
            when its reference did not run or is 0.
        """
        run = self.get(policy, capacity)
        out = dict.fromkeys(
            ("hit_gain_over_lru", "hit_gain_over_lru_abs", "qttft_gain_over_lru", "belady_gap_closed")
        )
        if BASELINE in self.policies:
            lru = self.get(BASELINE, capacity)
            out["hit_gain_over_lru_abs"] = run.token_hit_ratio - lru.token_hit_ratio
            out["hit_gain_over_lru"] = _ratio(run.token_hit_ratio - lru.token_hit_ratio, lru.token_hit_ratio)
            out["qttft_gain_over_lru"] = _ratio(lru.qttft_mean_s - run.qttft_mean_s, lru.qttft_mean_s)
            if ORACLE in self.policies:
                gap = self.get(ORACLE, capacity).token_hit_ratio - lru.token_hit_ratio
                out["belady_gap_closed"] = _ratio(run.token_hit_ratio - lru.token_hit_ratio, gap)
        return out

    def to_dict(self) -> dict:
        """The ``kvprof.results/1`` document (docs/results-schema.md); JSON-ready, no NaN."""
        config = {**self.config.to_dict(), "policies": list(self.policies), "capacities": list(self.capacities)}
        runs = [{**run.to_dict(), **self.comparison(run.policy, run.capacity)} for run in self.runs]
        return results_file.build(inputs=self.inputs, config=config, runs=runs, wall_s=self.wall_s)

    def write(self, path: str | os.PathLike) -> Path:
        """Write the results document atomically (temporary file, then rename)."""
        return results_file.write(path, self.to_dict())


def run_sweep(
    trace: Trace,
    hp,
    policies: Sequence[str],
    capacities: Sequence[int],
    config: SimConfig = SimConfig(),
    *,
    n_jobs: int = 1,
    ray: str | None = None,
    progress: Progress | None = None,
    inputs: dict | None = None,
    hint_max_fraction: float | None = None,
) -> Results:
    """Replay ``trace`` under every policy at every capacity.

    Parameters
    ----------
    trace : Trace
        The evaluation window.
    hp : HpFile or None
        Classes for the workload and parameters for the policies that need them.
    policies : sequence of str
        ``make_policy`` names, e.g. ``["lru", "wa", "belady"]``; ``<name>+hints`` replays ``name``
        honouring the trace's hints (:mod:`kvprof.sim.hints`, on the Python engine).
    capacities : sequence of int
        GPU capacities in engine blocks; with ``config.capacity_schedule`` pass one (its start).
    config : SimConfig
    n_jobs : int
        joblib workers (-1: all cores, -2: all but one ...), capped by
        :func:`~kvprof.parallel.sweep_workers`.
    ray : str or None
        Run the replays as tasks of the Ray cluster at this address (``"auto"``: Ray's rule)
        instead (:mod:`kvprof.parallel`); the same results, number for number.
    progress : callable or None
        ``progress(done, total)`` after each run.
    inputs : dict or None
        Provenance to record (trace file, hp file ...); trace facts are added.
    hint_max_fraction : float or None
        The hinted policies' budget: retained blocks hold at most this share of the cache, each tag's
        and all together (None: no budget).

    Returns
    -------
    Results

    Raises
    ------
    SimulationError
        Unknown policy, capacity <= 0, tiers beyond the machine's memory, a sample whose
        scaled caches cannot hold requests the full ones hold (:func:`~kvprof.sim.sample.lost_shares`), or a
        workload that cannot be prepared.
    ParallelError
        ``n_jobs`` 0, or a Ray cluster that is not there (:mod:`kvprof.parallel`).
    """
    policies, capacities = tuple(policies), tuple(int(c) for c in capacities)
    if not policies or not capacities:
        raise SimulationError("a sweep needs at least one policy and one capacity")
    if len(set(policies)) != len(policies) or len(set(capacities)) != len(capacities):
        raise SimulationError("policies and capacities must not repeat")
    if any(c <= 0 for c in capacities):
        raise SimulationError(f"capacities must be > 0 blocks, got {', '.join(map(str, capacities))}")
    if config.capacity_schedule and capacities != (config.capacity_schedule[0][1],):
        raise SimulationError("with a capacity schedule, sweep the one capacity the schedule starts with")
    for name in {*map(base_name, policies), config.cpu_policy}:
        try:
            make_policy(name, hp)  # fail here, once, rather than in every worker
        except ValueError as exc:
            raise SimulationError(str(exc)) from None
    tasks = [(p, c) for p in policies for c in capacities]
    workers = sweep_workers(n_jobs, len(tasks))
    check_memory(max([*capacities, *(c for _, c in config.capacity_schedule)]), config.cpu_capacity, workers)
    started = time.perf_counter()
    replayed = chain_sample(trace, config.sample_rate)
    workload = prepare_workload(replayed, hp, config.engine_block_size, config.rate_scale)
    miniature = Miniature.of(replayed, workload, config.sample_rate)
    lost = lost_shares(miniature, workload.blocks_needed(config.cost.decode), workload.prompt_tokens,
                       [*capacities, *(c for _, c in config.capacity_schedule)])
    # Slow policies first, LRU (the cheapest) last, so no worker is left with a long run alone.
    schedule = sorted(range(len(tasks)), key=lambda i: tasks[i][0] == BASELINE)
    outputs = run_tasks(_run_one, workload, [(hp, *tasks[i], config, miniature, hint_max_fraction) for i in schedule],
                        n_jobs=n_jobs, ray=ray, progress=progress)
    runs = [None] * len(tasks)
    for i, metrics in zip(schedule, outputs):
        runs[i] = metrics
    facts = {
        "trace": {
            "source": trace.source,
            "sha256": trace.sha256,
            "format": trace.format,
            "block_size": trace.block_size,
            "window": [trace.window[0], trace.censor_time],
            "n_requests": trace.n_requests,
            "n_engine_block_accesses": workload.n_accesses,
        }
    }
    if config.sample_rate < 1:
        facts["sample"] = sample_facts(trace, replayed, miniature, lost)
    if hint_max_fraction is not None:  # retained blocks a hint tag may hold in each cache replayed (_run_one's)
        facts["hint_budget_blocks"] = {str(c): int(hint_max_fraction * miniature.capacity(c)) for c in capacities}
    return Results(
        runs=tuple(runs),
        policies=policies,
        capacities=capacities,
        config=config,
        inputs={**(inputs or {}), **facts},
        wall_s=time.perf_counter() - started,
    )


def _run_one(workload: Workload, hp, policy: str, capacity: int, config: SimConfig,
             miniature: Miniature = Miniature(), hint_max_fraction: float | None = None) -> RunMetrics:
    """One replay; of a sample, at caches scaled to it, labelled ``capacity`` and with policies
    built for the full sizes (their tuning's; a hint budget is a share of the cache replayed)."""
    host = make_policy(config.cpu_policy, hp, config.cpu_capacity) if config.cpu_capacity else None
    replayed = miniature.capacity(capacity)
    budget = None if hint_max_fraction is None else int(hint_max_fraction * replayed)
    replayed_policy = make_hinted_policy(policy, hp, capacity, budget)
    metrics = simulate(workload, replayed_policy, replayed, miniature.config(config), host_policy=host)
    counters = getattr(replayed_policy, "counters", None)  # a P+hints replay's: what its hints did
    return dataclasses.replace(metrics, capacity=capacity,
                               hints=None if counters is None else dataclasses.asdict(counters))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den and math.isfinite(num) and math.isfinite(den) else None
