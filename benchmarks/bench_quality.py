"""The policy-quality suite: every policy on real and synthetic traces, four cache sizes each.

    python benchmarks/bench_quality.py [-j N | --ray ADDRESS] [--traces weka,mooncake,...] [--sample 0.1,0.01] [-o quality.json]
    python benchmarks/bench_quality.py --unseen [-j N] [-o unseen.json]

For each trace the published workflow runs as `kvprof compare` runs it without --config: fit
on the fit window (and tune wa for the suite's capacities on it), replay the evaluation window
under every policy at four capacities, from small (LRU's token hit ratio near 0.1) to large.
The table gives, per trace and capacity, each policy's token hit ratio, wa's gain over the best
baseline (the most of lru, lfu, s3fifo, arc, sieve and wa-paper) and wa's share of the gap from that
baseline to Belady; then the issue's targets, each met or missed. The JSON file holds the same.

Traces: ../shared/traces/weka-agents-dev (fit 0:3600, compare 3600:, 64-token blocks) and
mooncake-synthetic (fit 0:400, compare 400:, 512-token blocks) from the directory in
KVPROF_TRACES (default: ../shared/traces next to the repository), skipped with a message when
absent; `kvprof synth` bailian-a seeds 0, 1, 2 and bailian-b seed 0 (2 h; fit hour one,
compare hour two; 128-token blocks). With ``--unseen``, instead, five synthetic traces no rule of
``wa`` was chosen on (:data:`UNSEEN_CASES`), split and sized as the suite's synthetic ones.

With ``--sample``, each trace's evaluation window is also replayed on samples of its conversations
at caches scaled to them (``kvprof compare --sample``, :mod:`kvprof.sim.sample`), with the same
fitted and tuned hp file, and the table of sampled runs gives each one's error against the full
replay and the sweep's speed-up; the target is an error <= 0.01 in token hit ratio at 0.1 on every
trace whose sample holds >= 1,000 conversations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvprof.atomic import atomic_write_text
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.config import SimConfig, SimulationError
from kvprof.sim.sample import hit_ratio_error
from kvprof.sim.sweep import run_sweep
from kvprof.sim.tune import tune

BASELINES = ("lru", "lfu", "s3fifo", "arc", "sieve", "wa-paper")
POLICIES = (*BASELINES, "wa", "belady")
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    """One trace of the suite and how it is read, split and sized."""

    name: str
    source: str  # a file name in the traces directory, or "synth:<preset>:<seed>"
    fit: tuple[float, float]
    evaluate: tuple[float, float | None]
    trace_block: int | None
    engine_block: int
    capacities: tuple[int, ...]


CASES = (
    Case("weka-agents-dev", "weka-agents-dev.jsonl.zst", (0, 3600), (3600, None), 64, 64, (3000, 6000, 10000, 16000)),
    Case("mooncake-synthetic", "mooncake-synthetic.jsonl.zst", (0, 400), (400, None), None, 512, (1000, 2000, 4000, 8000)),
    *(Case(f"bailian-a seed {seed}", f"synth:bailian-a:{seed}", (0, 3600), (3600, None), None, 128,
           (256, 1024, 4096, 16384)) for seed in (0, 1, 2)),
    Case("bailian-b seed 0", "synth:bailian-b:0", (0, 3600), (3600, None), None, 128, (128, 512, 2048, 8192)),
)
#: Synthetic traces no rule of ``wa`` was chosen on (``--unseen``): the suite's presets at other seeds, split
#: and sized as the suite's. Seeds 6 and up stay unseen for checks that are not this benchmark's.
UNSEEN_CASES = (
    *(Case(f"bailian-a seed {seed}", f"synth:bailian-a:{seed}", (0, 3600), (3600, None), None, 128,
           (256, 1024, 4096, 16384)) for seed in (3, 4, 5)),
    *(Case(f"bailian-b seed {seed}", f"synth:bailian-b:{seed}", (0, 3600), (3600, None), None, 128,
           (128, 512, 2048, 8192)) for seed in (1, 2)),
)


def load(case: Case, traces_dir: Path, scratch: Path):
    if case.source.startswith("synth:"):
        _, preset, seed = case.source.split(":")
        path = scratch / f"{preset}-{seed}.jsonl"
        write_jsonl(path, generate(preset, 2.0, int(seed)))
    else:
        path = traces_dir / case.source
        if not path.exists():
            return None
    return read_trace(path, block_size=case.trace_block)[0]


def chosen_traces(names: str | None, cases: tuple[Case, ...] = CASES):
    """``(case, trace)`` for each of ``cases`` whose name starts with one of the comma-separated ``names``
    (all without), its trace read or generated; a real trace not found is skipped with a message."""
    traces_dir = Path(os.environ.get("KVPROF_TRACES", REPO.parent / "shared" / "traces"))
    with tempfile.TemporaryDirectory() as scratch:
        for case in cases:
            if names and not any(case.name.startswith(name) for name in names.split(",")):
                continue
            trace = load(case, traces_dir, Path(scratch))
            if trace is None:
                print(f"skipped {case.name}: {traces_dir / case.source} not found", file=sys.stderr)
                continue
            yield case, trace


def run_case(case: Case, trace, jobs: int, ray: str | None = None, learn: bool = False) -> dict:
    """Fit and tune on the fit window, sweep every policy on the evaluation window."""
    started = time.perf_counter()
    config = SimConfig(engine_block_size=case.engine_block)
    fitted = trace.time_window(*case.fit)
    hp = tune(fit_trace(fitted), fitted, case.capacities, config, n_jobs=jobs, ray=ray, learn=learn, refit=fit_trace)
    results = run_sweep(trace.time_window(*case.evaluate), hp, POLICIES, case.capacities, config, n_jobs=jobs, ray=ray)
    rows = []
    for capacity in case.capacities:
        ratio = {policy: results.get(policy, capacity).token_hit_ratio for policy in POLICIES}
        best = max(BASELINES, key=ratio.get)
        gap = ratio["belady"] - ratio[best]
        rows.append({
            "capacity": capacity,
            "token_hit_ratio": ratio,
            "best_baseline": best,
            "wa_gain_over_best": (ratio["wa"] - ratio[best]) / ratio[best] if ratio[best] else None,
            "wa_gain_over_lru": (ratio["wa"] - ratio["lru"]) / ratio["lru"] if ratio["lru"] else None,
            "wa_gap_closed": (ratio["wa"] - ratio[best]) / gap if gap > 0 else None,
        })
    return {"trace": case.name, "fit_window": list(case.fit), "eval_window": [case.evaluate[0], case.evaluate[1]],
            "engine_block": case.engine_block, "tuning": hp.to_dict().get("tuning", []), "rows": rows,
            "wall_s": time.perf_counter() - started, "sweep_s": results.wall_s, "hp": hp, "results": results}


def sampled(case: Case, trace, done: dict, rates: list[float], jobs: int, ray: str | None = None) -> list[dict]:
    """The case's evaluation sweep again on samples of ``rates``, with its hp file: errors and speed-ups."""
    out = []
    full = done["results"]
    for rate in rates:
        config = SimConfig(engine_block_size=case.engine_block, sample_rate=rate)
        try:
            results = run_sweep(trace.time_window(*case.evaluate), done["hp"], POLICIES, case.capacities, config,
                                n_jobs=jobs, ray=ray)
        except SimulationError as exc:  # a sample too small for the smallest cache's requests
            out.append({"trace": case.name, "rate": rate, "refused": str(exc)})
            continue
        errors = {f"{p} {c}": results.get(p, c).token_hit_ratio - full.get(p, c).token_hit_ratio
                  for p in POLICIES for c in case.capacities}
        facts = results.inputs["sample"]
        bounds = {f"{p} {c}": hit_ratio_error(results.get(p, c).token_hit_ratio, rate, facts["effective_chains"],
                                              facts["lost_token_share"][str(c)])
                  for p in POLICIES for c in case.capacities}
        out.append({"trace": case.name, "rate": rate, **results.inputs["sample"], "errors": errors,
                    "max_abs_error": max(map(abs, errors.values())), "bounds": bounds,
                    "within_bound": sum(abs(errors[k]) <= bounds[k] for k in errors),
                    "speed_up": full.wall_s / results.wall_s})
    return out


def print_sampled(rows: list[dict]) -> None:
    print("\n| trace | sample | conversations | max abs error (token hit ratio) | worst point | within the 2-SE bound "
          "| sweep speed-up |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "refused" in row:
            print(f"| {row['trace']} | {row['rate']:g} | refused: {row['refused']} | | | | |")
            continue
        worst = max(row["errors"], key=lambda k: abs(row["errors"][k]))
        print(f"| {row['trace']} | {row['rate']:g} | {row['chains']:,} of {row['of_chains']:,} | "
              f"{row['max_abs_error']:.4f} | {worst} ({row['errors'][worst]:+.4f}) | "
              f"{row['within_bound']} of {len(row['errors'])} | {row['speed_up']:.1f}x |")
    eligible = [row for row in rows if row["rate"] == 0.1 and row.get("chains", 0) >= 1000]
    met = all(row["max_abs_error"] <= 0.01 for row in eligible)
    print(f"- {'met' if met else 'MISSED'}: error <= 0.01 at sample 0.1 where it holds >= 1,000 conversations: "
          + (", ".join(f"{row['trace']} {row['max_abs_error']:.4f}" for row in eligible) or "no such trace"))


def targets(cases: list[dict]) -> list[dict]:
    """The quality targets (benchmarks/README.md) over the cases run."""
    every = [row["wa_gain_over_best"] for case in cases for row in case["rows"] if row["wa_gain_over_best"] is not None]
    # the two smallest sizes of the real traces (weka, Mooncake): where the headroom to Belady is largest
    small = [row for case in cases if not case["trace"].startswith("bailian") for row in case["rows"][:2]]
    gains = [row["wa_gain_over_best"] for row in small if row["wa_gain_over_best"] is not None]
    closed = [row["wa_gap_closed"] for row in small if row["wa_gap_closed"] is not None]
    bailian_a = [case for case in cases if case["trace"].startswith("bailian-a")]
    bailian = [case["rows"][0]["wa_gain_over_lru"] for case in bailian_a]
    out = [{"target": "wa >= best baseline - 1 % on every trace and capacity",
            "measured": f"worst {min(every):+.1%}" if every else "-", "met": bool(every) and min(every) >= -0.01}]
    if gains:
        mean = sum(gains) / len(gains)
        out.append({"target": "weka and Mooncake, two smallest capacities: wa >= best baseline + 3 % on average",
                    "measured": f"{mean:+.1%}", "met": mean >= 0.03})
    if closed:
        mean = sum(closed) / len(closed)
        out.append({"target": "weka and Mooncake, two smallest capacities: wa closes >= 10 % of the "
                              "best-baseline-to-Belady gap on average", "measured": f"{mean:+.1%}", "met": mean >= 0.10})
    if bailian:
        seeds = ", ".join(case["trace"].removeprefix("bailian-a seed ") for case in bailian_a)
        out.append({"target": f"bailian-a seeds {seeds}, smallest capacity: wa >= +10 % over lru",
                    "measured": ", ".join(f"{g:+.1%}" for g in bailian), "met": min(bailian) >= 0.10})
    return out


def print_table(cases: list[dict], checks: list[dict]) -> None:
    header = ["trace", "capacity", *POLICIES, "wa vs best", "gap closed"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for case in cases:
        for row in case["rows"]:
            ratio = row["token_hit_ratio"]
            cells = [f"**{ratio[p]:.4f}**" if p == row["best_baseline"] else f"{ratio[p]:.4f}" for p in POLICIES]
            gain, closed = row["wa_gain_over_best"], row["wa_gap_closed"]
            print(f"| {case['trace']} | {row['capacity']:,} | " + " | ".join(cells)
                  + f" | {'-' if gain is None else f'{gain:+.1%}'} | {'-' if closed is None else f'{closed:+.1%}'} |")
    print()
    for check in checks:
        print(f"- {'met' if check['met'] else 'MISSED'}: {check['target']}: {check['measured']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=-1, help="joblib workers (-1: all cores)")
    parser.add_argument("--learned", action="store_true", help="train wa's learned candidate in the tuning (fit --learned)")
    parser.add_argument("--traces", help="comma-separated case names to run (default: all)")
    parser.add_argument("--unseen", action="store_true", help="run the synthetic traces no rule was chosen on "
                                                               "(UNSEEN_CASES: bailian-a seeds 3-5, bailian-b seeds 1-2) "
                                                               "instead of the suite")
    parser.add_argument("--sample", help="comma-separated sample rates to replay each evaluation window at too")
    parser.add_argument("--ray", metavar="ADDRESS", help="run the replays on this Ray cluster (auto: RAY_ADDRESS or the "
                                                         "local one) instead of -j workers")
    parser.add_argument("-o", "--output", type=Path, default=REPO / "benchmarks" / "quality.json")
    args = parser.parse_args()
    rates = [float(r) for r in args.sample.split(",")] if args.sample else []
    done, samples = [], []
    from provenance import facts  # beside this script; imported here so that importers of CASES need not find it

    run = facts()
    started = time.perf_counter()
    for case, trace in chosen_traces(args.traces, UNSEEN_CASES if args.unseen else CASES):
        done.append(run_case(case, trace, args.jobs, args.ray, args.learned))
        print(f"{case.name}: {done[-1]['wall_s']:.0f} s", file=sys.stderr)
        samples += sampled(case, trace, done[-1], rates, args.jobs, args.ray)
        del done[-1]["hp"], done[-1]["results"]  # kept for the samples, not for the JSON
    checks = targets(done)
    document = {"run": run, "policies": list(POLICIES), "baselines": list(BASELINES), "cases": done, "targets": checks,
                "samples": samples, "wall_s": time.perf_counter() - started}
    atomic_write_text(args.output, json.dumps(document, indent=2) + "\n")
    print_table(done, checks)
    if samples:
        print_sampled(samples)
    print(f"\nwrote {args.output} in {document['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
