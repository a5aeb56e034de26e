"""Where the headroom to Belady is: oracles told one fact about the future, on the quality suite.

    python research/bench_oracles.py [-j N] [--traces weka,mooncake,...] [--bases lru,best]
                                       [--quality quality.json] [-o oracles.json]

For each trace and capacity of benchmarks/bench_quality.py's suite, the evaluation window is
replayed (Python engine) under each oracle of :mod:`kvprof.sim.oracles` over each base order
(``lru``, and ``best``: the best baseline at that point), and the table gives each one's token hit
ratio and its share of the gap from the best baseline to Belady: (oracle - best) / (belady - best).
The baselines', wa's and Belady's ratios are the quality suite's (fit, tune, compiled sweep, as
bench_quality runs them), or read from its JSON with ``--quality`` (the same commit's, to save the
tuning). The JSON file holds the same table, the horizons and Belady's ratio on the Python engine
(it must equal the compiled one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the suite: bench_quality

from bench_quality import BASELINES, REPO, chosen_traces, run_case  # noqa: E402

from kvprof.atomic import atomic_write_text  # noqa: E402
from kvprof.parallel import run_tasks  # noqa: E402
from kvprof.profiler.fit import fit_trace  # noqa: E402
from kvprof.sim.config import SimConfig  # noqa: E402
from kvprof.sim.oracles import ORACLES, AccessIndexed, Future, oracle_task, reference_task, sessions_of  # noqa: E402
from kvprof.sim.workload import prepare_workload  # noqa: E402


def suite_rows(case, trace, quality: dict | None, jobs: int) -> tuple[list[dict], object]:
    """The quality suite's rows for ``case`` and the hp file to build base policies from: from
    ``quality`` (a bench_quality JSON) when it holds the case, else run as bench_quality runs it."""
    if quality is not None:
        for done in quality["cases"]:
            if done["trace"] == case.name:
                return done["rows"], fit_trace(trace.time_window(*case.fit))
    done = run_case(case, trace, jobs)
    return done["rows"], done["hp"]


def _base_of(row: dict, base: str) -> str:
    """The policy a base column names at ``row``'s point (``best``: its best baseline)."""
    return row["best_baseline"] if base == "best" else base


def _names(base: str, bases: list[str]) -> list[str]:
    """The oracles run over ``base``: belady-exact does not depend on its base, so under the first only."""
    return [name for name in ORACLES if name != "belady-exact" or base == bases[0]]


def run_oracles(case, trace, quality: dict | None, bases: list[str], jobs: int) -> dict:
    started = time.perf_counter()
    rows, hp = suite_rows(case, trace, quality, jobs)
    config = SimConfig(engine_block_size=case.engine_block)
    window = trace.time_window(*case.evaluate)
    workload = prepare_workload(window, hp, case.engine_block)
    future = Future.of(workload, sessions_of(window, workload))
    indexed = AccessIndexed.of(workload)
    shared = (indexed, future, hp, config)
    references = dict(zip(case.capacities, run_tasks(reference_task, shared, [(c,) for c in case.capacities],
                                                      n_jobs=jobs)))
    tasks = list(dict.fromkeys((name, _base_of(row, base), row["capacity"])
                               for row in rows for base in bases for name in _names(base, bases)))
    told = dict(zip(tasks, run_tasks(oracle_task, (*shared, references), tasks, n_jobs=jobs)))
    out = []
    for row in rows:
        capacity, ratio = row["capacity"], row["token_hit_ratio"]
        best = ratio[row["best_baseline"]]
        gap = ratio["belady"] - best
        ref = references[capacity]
        oracles = {}
        for base in bases:
            for name in _names(base, bases):
                value = told[(name, _base_of(row, base), capacity)]
                oracles[f"{name}+{base}"] = {"base": _base_of(row, base), "token_hit_ratio": value,
                                              "gap_closed": (value - best) / gap if gap > 0 else None}
        out.append({"capacity": capacity, "horizon_s": ref.horizon, "lru": ratio["lru"],
                    "best_baseline": row["best_baseline"], "best": best, "wa": ratio.get("wa"),
                    "belady": ratio["belady"], "belady_python": ref.belady, "lru_python": ref.lru,
                    "oracles": oracles})
    sessions = future.session
    return {"trace": case.name, "n_requests": int(workload.n_requests), "n_sessions": int(len(set(sessions.tolist()))),
            "sessions_inferred": not bool((window.parent_chat_id >= 0).any()),
            "shared_access_share": float(future.shared.mean()), "rows": out, "wall_s": time.perf_counter() - started}


def print_tables(cases: list[dict], bases: list[str]) -> None:
    for base in bases:
        columns = [f"{name}+{base}" for name in _names(base, bases)]
        print(f"\nBase order: {base} (each oracle: token hit ratio, share of the best-baseline-to-Belady gap closed)\n")
        print("| trace | capacity | H (s) | lru | best baseline | wa | belady | " + " | ".join(columns) + " |")
        print("|" + "---|" * (7 + len(columns)))
        for case in cases:
            for row in case["rows"]:
                cells = []
                for column in columns:
                    told = row["oracles"].get(column)
                    closed = told and told["gap_closed"]
                    cells.append("-" if told is None else f"{told['token_hit_ratio']:.4f} "
                                 f"({'-' if closed is None else f'{closed:+.0%}'})")
                wa = "-" if row["wa"] is None else f"{row['wa']:.4f}"
                print(f"| {case['trace']} | {row['capacity']:,} | {row['horizon_s']:.0f} | {row['lru']:.4f} | "
                      f"{row['best_baseline']} {row['best']:.4f} | {wa} | {row['belady']:.4f} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=1, help="joblib workers (-1: all cores)")
    parser.add_argument("--traces", help="comma-separated case names to run (default: all)")
    parser.add_argument("--bases", default="lru,best", help="base orders: policy names, or best (the best baseline)")
    parser.add_argument("--quality", type=Path, help="a bench_quality JSON to take the suite's ratios from")
    parser.add_argument("-o", "--output", type=Path, default=REPO / "research" / "oracles.json")
    args = parser.parse_args()
    bases = args.bases.split(",")
    quality = json.loads(args.quality.read_text()) if args.quality else None
    started = time.perf_counter()
    done = []
    for case, trace in chosen_traces(args.traces):
        done.append(run_oracles(case, trace, quality, bases, args.jobs))
        print(f"{case.name}: {done[-1]['wall_s']:.0f} s", file=sys.stderr)
        # written after every trace, so a long run that is stopped keeps the traces it finished
        document = {"oracles": list(ORACLES), "bases": bases, "baselines": list(BASELINES), "cases": done,
                    "wall_s": time.perf_counter() - started}
        atomic_write_text(args.output, json.dumps(document, indent=2) + "\n")
    print_tables(done, bases)
    print(f"\nwrote {args.output} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
