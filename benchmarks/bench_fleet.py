"""A fleet at a fixed total number of GPU blocks: routers x policies x replica counts.

    nice -n 5 python benchmarks/bench_fleet.py [-j 2] [--traces bailian-a,weka] [--replicas 1,2,4,8]
        [--routers ...] [--policies lru,s3fifo,wa] [--max-accesses 100000] [-o fleet.json] [--plot fleet.png]
    python benchmarks/bench_fleet.py --from A.json B.json [--only TRACE,...] --plot fleet.png
        (one table per trace: the runs of a trace, e.g. other routers run later, are merged)

For each trace of the quality suite (benchmarks/bench_quality.py: weka-agents-dev, mooncake-synthetic,
bailian-a and -b; its fit and evaluation windows and engine blocks), a fleet of N replicas shares
TOTAL blocks (the suite's third capacity: TOTAL / N per replica): every router of
:mod:`kvprof.sim.fleet` in front of every policy, on the first requests of the evaluation window
(``--max-accesses`` engine blocks), as ``kvprof fleet`` runs each configuration (:func:`kvprof.cli.fleet_cmd.run_configuration`;
one replica is the single server, run once). ``wa`` runs one hp file fitted on the end of the fit
window (``--fit-seconds``) and tuned for every per-replica capacity, as ``kvprof fleet`` without ``--config``; with
``--per-replica``, behind the routers that read only the trace also one hp file per replica
(``--hp-per-replica``) at the replica counts given.

Prints per trace the fleet token hit ratio table, wa's gain over lru (and over the best other
baseline) per router and replica count beside the single server's, and per-replica against
fleet fits; writes the rows as JSON and a plot of fleet hit ratio against replicas per router.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench_quality import REPO, chosen_traces
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvprof.atomic import atomic_open, atomic_write_text
from kvprof.cli.common import needs_hp
from kvprof.cli.fleet_cmd import run_configuration
from kvprof.parallel import run_tasks
from kvprof.profiler.fit import fit_trace
from kvprof.sim.config import SimConfig
from kvprof.sim.fleet import ROUTERS, RouterSpec
from kvprof.sim.tune import tune
from kvprof.sim.workload import prepare_workload

#: The routers that read only the trace (``--per-replica`` fits need no replica to run while routing).
TRACE_ONLY = ("round-robin", "session")


def run_case(case, trace, args) -> dict:
    """Every configuration of one trace: fit and tune once, then one task per configuration."""
    started = time.perf_counter()
    config = SimConfig(engine_block_size=case.engine_block, timing="model")
    total = case.capacities[2]
    capacities = {n: total // n for n in args.replicas}
    fit_start, fit_end = case.fit
    fitted = trace.time_window(max(fit_start, fit_end - args.fit_seconds), fit_end)
    hp = tune(fit_trace(fitted), fitted, sorted(set(capacities.values())), config,
              n_jobs=args.jobs, refit=fit_trace) if needs_hp(args.policies) else None
    evaluated = trace.time_window(*case.evaluate)
    # the first requests of the window up to --max-accesses engine blocks (a trace's requests differ 100x in size)
    blocks = np.cumsum(-(-evaluated.input_length // case.engine_block))
    evaluated = evaluated.head(max(1, int(np.searchsorted(blocks, args.max_accesses))))
    workload = prepare_workload(evaluated, hp, config.engine_block_size)
    tasks = []
    for n in args.replicas:
        for router in (args.routers[:1] if n == 1 else args.routers):
            for policy in args.policies:
                tasks.append((RouterSpec(router), n, policy, capacities[n], False, config))
                if policy == "wa" and n in args.per_replica and router in TRACE_ONLY:
                    tasks.append((RouterSpec(router), n, policy, capacities[n], True, config))
    outcomes = run_tasks(run_configuration, (evaluated, workload, hp, fitted), tasks, n_jobs=args.jobs)
    rows = [{**run.to_dict(), "router": "single" if run.replicas == 1 else run.router} for run, _ in outcomes]
    return {"trace": case.name, "total_blocks": total, "engine_block": case.engine_block,
            "fit_window": [fitted.window[0], fit_end], "eval_window": list(case.evaluate), "max_accesses": args.max_accesses,
            "n_requests": evaluated.n_requests, "rows": rows, "wall_s": time.perf_counter() - started}


def ratio(rows, router, n, policy, hp="fleet"):
    for row in rows:
        if (row["router"], row["replicas"], row["policy"], row["hp"]) == (router, n, policy, hp):
            return row["fleet_token_hit_ratio"]
    return None


def gain(a, b):
    return None if a is None or not b else (a - b) / b


def percent(value):
    return "-" if value is None else f"{value:+.1%}"


def print_case(case: dict, args) -> None:
    rows = args_rows = case["rows"]
    print(f"\n### {case['trace']}: {case['total_blocks']:,} blocks in all ({case['engine_block']}-token), "
          f"{case['n_requests']:,} requests of the evaluation window\n")
    others = [p for p in args.policies if p not in ("lru", "wa")]
    print("| router | replicas | blocks each | " + " | ".join(args.policies) + " | belady | wa vs lru | "
          + (f"wa vs best of {', '.join(others)} | " if others else "") + "imbalance (lru) |")
    print("|" + "---|" * (6 + len(args.policies) + bool(others)))
    for n in args.replicas:
        for router in ("single",) if n == 1 else args.routers:
            cells = [ratio(rows, router, n, p) for p in args.policies]
            first = next(row for row in args_rows if row["router"] == router and row["replicas"] == n)
            lru, wa = ratio(rows, router, n, "lru"), ratio(rows, router, n, "wa")
            best = max((ratio(rows, router, n, p) or 0.0 for p in others), default=None)
            print(f"| {router} | {n} | {first['capacity']:,} | "
                  + " | ".join("-" if c is None else f"{c:.4f}" for c in cells)
                  + f" | {first['belady_token_hit_ratio']:.4f} | {percent(gain(wa, lru))} | "
                  + (f"{percent(gain(wa, best))} | " if others else "")
                  + f"{first['load_imbalance']:.2f} |")
    fits = [(row["router"], row["replicas"]) for row in rows if row["hp"] == "per-replica"]
    if fits:
        print("\n| router | replicas | wa, fleet hp | wa, hp per replica | per replica vs fleet |\n|---|---|---|---|---|")
        for router, n in fits:
            fleet, own = ratio(rows, router, n, "wa"), ratio(rows, router, n, "wa", "per-replica")
            print(f"| {router} | {n} | {fleet:.4f} | {own:.4f} | {percent(gain(own, fleet))} |")


def plot(cases: list[dict], args, path: Path) -> None:
    """Fleet hit ratio against replicas: a panel per trace, a colour per router, a line style per policy."""
    figure = Figure(figsize=(5 * len(cases), 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    styles = ("-", "--", ":", "-.")
    for k, case in enumerate(cases):
        axes = figure.add_subplot(1, len(cases), k + 1)
        for i, router in enumerate(args.routers):
            for j, policy in enumerate(args.policies):
                points = [(n, ratio(case["rows"], "single" if n == 1 else router, n, policy)) for n in args.replicas]
                points = [(n, r) for n, r in points if r is not None]
                axes.plot([n for n, _ in points], [r for _, r in points], styles[j % len(styles)], marker="o",
                          color=f"C{i}", label=f"{router}, {policy}")
        axes.set_xscale("log", base=2)
        axes.set_xticks(args.replicas, [str(n) for n in args.replicas])
        axes.set_xlabel(f"replicas ({case['total_blocks']:,} blocks in all)")
        axes.set_ylabel("fleet token hit ratio")
        axes.set_title(case["trace"])
    figure.axes[0].legend(fontsize="x-small", ncol=2)
    with atomic_open(path, "wb") as out:
        figure.savefig(out, format="png", dpi=110)


def merged(cases: list[dict]) -> list[dict]:
    """The cases of one trace from several runs (e.g. other routers, run later) as one, in first-seen order:
    their rows together. A configuration two runs both hold (the single server, which every run measures)
    is kept once; its figures must agree, since both runs replayed the same window with the same fit."""
    by_trace: dict[str, dict] = {}
    for case in cases:
        into = by_trace.setdefault(case["trace"], {**case, "rows": []})
        for field in ("total_blocks", "engine_block", "n_requests", "max_accesses", "fit_window"):
            if case[field] != into[field]:
                raise SystemExit(f"{case['trace']}: runs with another {field} ({case[field]} vs {into[field]}) "
                                 f"are no one table")
        held = {_key(row): row for row in into["rows"]}
        for row in case["rows"]:
            other = held.get(_key(row))
            if other is None:
                into["rows"].append(row)
            elif other["fleet_token_hit_ratio"] != row["fleet_token_hit_ratio"]:
                raise SystemExit(f"{case['trace']}: {_key(row)} differs between runs "
                                 f"({other['fleet_token_hit_ratio']} vs {row['fleet_token_hit_ratio']})")
    return list(by_trace.values())


def _key(row: dict) -> tuple:
    return row["router"], row["replicas"], row["policy"], row["hp"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=2, help="joblib workers")
    parser.add_argument("--traces", default="bailian-a seed 0,mooncake,weka,bailian-b",
                        help="comma-separated case names of bench_quality's, run in this order")
    parser.add_argument("--replicas", default="1,2,4,8", help="replica counts (1: the single server)")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--policies", default="lru,s3fifo,wa")
    parser.add_argument("--per-replica", default="4", help="replica counts that also run wa with one hp file per "
                                                           "replica behind round-robin and session ('' for none)")
    parser.add_argument("--max-accesses", type=int, default=100_000,
                        help="replay the first requests of each evaluation window up to this many engine blocks")
    parser.add_argument("--fit-seconds", type=float, default=1200.0,
                        help="fit and tune on the last this many seconds of the suite's fit window")
    parser.add_argument("-o", "--output", type=Path, default=REPO / "benchmarks" / "fleet.json")
    parser.add_argument("--plot", type=Path, default=REPO / "benchmarks" / "fleet.png")
    parser.add_argument("--from", dest="sources", nargs="+", type=Path, metavar="JSON",
                        help="print and plot the cases of earlier runs' -o files (together) instead of running")
    parser.add_argument("--only", help="with --from: only these comma-separated traces (exact names)")
    args = parser.parse_args()
    args.replicas = [int(n) for n in args.replicas.split(",")]
    args.routers = args.routers.split(",")
    args.policies = args.policies.split(",")
    args.per_replica = [int(n) for n in args.per_replica.split(",") if n]
    if args.sources:  # earlier runs' cases, printed and plotted together
        cases = merged([case for source in args.sources for case in json.loads(source.read_text())["cases"]
                        if not args.only or case["trace"] in args.only.split(",")])
        for case in cases:
            print_case(case, args)
        plot(cases, args, args.plot)
        print(f"\nwrote {args.plot}", file=sys.stderr)
        return 0
    from provenance import facts  # beside this script

    run, cases = facts(), []
    started = time.perf_counter()
    for case, trace in (one for name in args.traces.split(",") for one in chosen_traces(name)):
        cases.append(run_case(case, trace, args))
        print_case(cases[-1], args)
        sys.stdout.flush()
        # written after every trace, so a long run stopped early keeps what it measured
        atomic_write_text(args.output, json.dumps({"run": run, "cases": cases,
                                                   "wall_s": time.perf_counter() - started}, indent=1) + "\n")
        plot(cases, args, args.plot)
    print(f"\nwrote {args.output} and {args.plot} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
