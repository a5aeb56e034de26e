"""How well wa's shadows predict each candidate's hit ratio, on the traces of the quality suite.

    python benchmarks/bench_shadows.py [-j N] [--traces weka,mooncake,...] [-o shadows.json]

For each trace and capacity of benchmarks/bench_quality.py, fit on the fit window, then replay the
evaluation window once per candidate order with wa following that candidate throughout
(``switch_margin=inf``: shadows run, nobody switches). Per candidate:

* **real**: the token hit ratio of the replay it led;
* **own shadow**: what its shadow predicted in that same replay (faithful shadows: the real cache's
  hits exactly);
* **others' runs**: what its shadow predicted in the replays the other candidates led, the
  counterfactual the safety net decides on; the table gives the one farthest from real.

Errors are absolute, in token hit ratio. The issue's target: within 0.5 %.

The JSON (``-o``; benchmarks/render_results.py renders it) holds the run's provenance
(benchmarks/provenance.py), one row per trace, capacity and candidate as above, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from joblib import Parallel, delayed

from kvprof.atomic import atomic_write_text
from kvprof.policy import make_policy
from kvprof.policy.wa import DEFAULT_ORDERS
from kvprof.profiler.fit import fit_trace
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import REPO, chosen_traces  # noqa: E402 - the suite's traces, windows and sizes


def led_by(workload, hp, capacity: int, candidate: str, config: SimConfig) -> tuple[float, dict[str, float]]:
    """Token hit ratio of wa following ``candidate`` throughout, and every shadow's prediction."""
    orders = (candidate, *(name for name in DEFAULT_ORDERS if name != candidate))
    policy = make_policy("wa", hp, capacity, orders=orders, switch_margin=math.inf)
    metrics = simulate(workload, policy, capacity, config)
    per_hit = workload.engine_block_size / int(workload.prompt_tokens.sum())
    return metrics.token_hit_ratio, {name: hits * per_hit for name, hits in policy.shadow_hits().items()}


def run_case(case, trace, jobs: int) -> list[dict]:
    config = SimConfig(engine_block_size=case.engine_block)
    hp = fit_trace(trace.time_window(*case.fit))
    workload = prepare_workload(trace.time_window(*case.evaluate), hp, case.engine_block)
    tasks = [(capacity, candidate) for capacity in case.capacities for candidate in DEFAULT_ORDERS]
    runs = Parallel(n_jobs=jobs)(delayed(led_by)(workload, hp, c, name, config) for c, name in tasks)
    by_task = dict(zip(tasks, runs))
    rows = []
    for capacity, candidate in tasks:
        real, predicted = by_task[capacity, candidate]
        others = {leader: by_task[capacity, leader][1][candidate] for leader in DEFAULT_ORDERS if leader != candidate}
        rows.append({"trace": case.name, "capacity": capacity, "candidate": candidate, "real": real,
                     "own_shadow": predicted[candidate], "in_others_runs": others})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=-1, help="joblib workers (-1: all cores)")
    parser.add_argument("--traces", help="comma-separated case names to run (default: all)")
    parser.add_argument("-o", "--output", type=Path, default=REPO / "benchmarks" / "shadows.json",
                        help="the rows as JSON with the run's provenance (benchmarks/results/shadows.json is the "
                             "one docs/results.md renders)")
    args = parser.parse_args()
    from provenance import facts  # beside this script

    run, rows = facts(), []
    started = time.perf_counter()
    for case, trace in chosen_traces(args.traces):
        rows += run_case(case, trace, args.jobs)
        print(f"{case.name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print("| trace | capacity | candidate | real | own shadow | error | others' runs, farthest | error |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        farthest = max(row["in_others_runs"].values(), key=lambda v: abs(v - row["real"]))
        print(f"| {row['trace']} | {row['capacity']:,} | {row['candidate']} | {row['real']:.4f} | "
              f"{row['own_shadow']:.4f} | {row['own_shadow'] - row['real']:+.4f} | {farthest:.4f} | "
              f"{farthest - row['real']:+.4f} |")
    own = max(abs(row["own_shadow"] - row["real"]) for row in rows)
    cross = [abs(v - row["real"]) for row in rows for v in row["in_others_runs"].values()]
    print(f"\nlargest error: own shadow {own:.4f}; in the others' runs {max(cross):.4f} "
          f"(mean {sum(cross) / len(cross):.4f}, {sum(e <= 0.005 for e in cross) / len(cross):.0%} within 0.005)")
    atomic_write_text(args.output, json.dumps({"run": run, "rows": rows, "wall_s": time.perf_counter() - started}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
