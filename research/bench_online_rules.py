"""Where the continuation oracle's headroom is reachable online: demotion rules on one known fact.

    python research/bench_online_rules.py [-j N] [--traces weka,mooncake] [--quality quality.json]

The oracle table (research/bench_oracles.py) says that knowing whether a freed chain's session
continues within the horizon closes 25-47 % of the best-baseline-to-Belady gap on Mooncake and up
to 26 % on weka. This replays, on the quality suite's points, demotion rules that use only what a
server knows when a request frees its blocks, each over ``lru`` and over the point's best baseline,
beside that oracle:

* ``root<k>``: demote the blocks of a request whose chain's first block fewer than ``k`` earlier
  requests began with (counted from the trace's start, the fit window included): a popular root
  (a shared system prompt or document) is a chain that others extend.
* ``out<q>``: demote the blocks of a request whose output was longer than the fit window's
  ``q``-th percentile of output lengths: a short answer (an agent's tool call) is followed by the
  session's next turn soon, a long one less often.

Demoted blocks are evicted first, oldest-freed first, as the oracles' are
(:class:`kvprof.sim.oracles.ToldPolicy`). The baselines', wa's and Belady's ratios are the suite's,
read from ``--quality`` (bench_quality.py's JSON, by default the committed benchmarks/results/quality.json;
a run of the suite at the commit measured compares like with like). Prints one markdown table: each
rule's token hit ratio and its share of the gap closed, (rule - best) / (belady - best).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the suite: bench_quality

from bench_quality import REPO, chosen_traces  # noqa: E402

from kvprof.parallel import run_tasks  # noqa: E402
from kvprof.policy import make_policy  # noqa: E402
from kvprof.profiler.fit import fit_trace  # noqa: E402
from kvprof.sim.config import SimConfig  # noqa: E402
from kvprof.sim.oracles import (  # noqa: E402
    AccessIndexed, Future, ToldPolicy, infer_sessions, make_oracle, reference_task, replay, sessions_of,
)
from kvprof.sim.workload import prepare_workload  # noqa: E402

ROOT_SEEN = (1, 2)
OUTPUT_PERCENTILES = (25, 50, 75)


class RootSeen(ToldPolicy):
    """Demotes the blocks of a request whose chain's first block fewer than ``k`` earlier requests began with."""

    def __init__(self, base, seen: list[int], k: int):
        super().__init__(base, f"root{k}+{base.name}")
        self.seen, self.k = seen, k

    def verdict(self, access, request, now):
        return None if self.seen[request] >= self.k else self._freed


class ShortOutput(ToldPolicy):
    """Demotes the blocks of a request whose output was longer than ``limit`` tokens."""

    def __init__(self, base, output: list[int], limit: float, name: str):
        super().__init__(base, f"{name}+{base.name}")
        self.output, self.limit = output, limit

    def verdict(self, access, request, now):
        return None if self.output[request] <= self.limit else self._freed


class FirstTurn(ToldPolicy):
    """Demotes the blocks of a request that began its session."""

    def __init__(self, base, began: list[bool]):
        super().__init__(base, f"turn1+{base.name}")
        self.began = began

    def verdict(self, access, request, now):
        return self._freed if self.began[request] else None


def began_session(workload) -> np.ndarray:
    """Per request, whether it began its session (bool): no earlier request's whole chain is a prefix of its own."""
    return infer_sessions(workload) == np.arange(workload.n_requests)


def roots_seen_before(workload) -> np.ndarray:
    """Per request, how many earlier requests' chains began with its chain's first block (0 without blocks)."""
    counts: dict[int, int] = {}
    seen = np.zeros(workload.n_requests, dtype=np.int64)
    lengths = np.diff(workload.offsets)
    firsts = workload.block[np.minimum(workload.offsets[:-1], max(len(workload.block) - 1, 0))].tolist()
    for r, (first, length) in enumerate(zip(firsts, lengths.tolist())):
        if length:
            seen[r] = counts.get(first, 0)
            counts[first] = seen[r] + 1
    return seen


def rule_task(shared: tuple, rule: str, base: str, capacity: int) -> float:
    """The token hit ratio of ``rule`` (``continues``, ``root<k>``, ``turn1``, ``out<q>``) over ``base`` at ``capacity``."""
    indexed, future, hp, config, seen, began, output, limits, references = shared
    policy = make_policy(base, hp, capacity)
    if rule == "continues":
        told = make_oracle("continues", policy, future, references[capacity])
    elif rule.startswith("root"):
        told = RootSeen(policy, seen, int(rule[4:]))
    elif rule == "turn1":
        told = FirstTurn(policy, began)
    else:
        told = ShortOutput(policy, output, limits[rule], rule)
    return replay(indexed, told, capacity, config).token_hit_ratio


def run_case(case, trace, quality: dict, jobs: int) -> dict:
    started = time.perf_counter()
    fitted = trace.time_window(*case.fit)
    hp = fit_trace(fitted)
    config = SimConfig(engine_block_size=case.engine_block)
    whole = prepare_workload(trace.time_window(0, float("inf")), hp, case.engine_block)
    window = trace.time_window(*case.evaluate)
    workload = prepare_workload(window, hp, case.engine_block)
    first = whole.n_requests - workload.n_requests  # the window is the trace's suffix from its start
    if first < 0 or not np.array_equal(np.diff(whole.offsets)[first:], np.diff(workload.offsets)):
        raise SystemExit(f"{case.name}: the evaluation window is not the trace's suffix")
    seen = roots_seen_before(whole)[first:].tolist()
    began = began_session(whole)[first:].tolist()
    limits = {f"out{q}": float(np.percentile(fitted.output_length, q)) for q in OUTPUT_PERCENTILES}
    rules = ["continues", *(f"root{k}" for k in ROOT_SEEN), "turn1", *limits]
    indexed = AccessIndexed.of(workload)
    future = Future.of(workload, sessions_of(window, workload))
    rows = quality["rows"]
    capacities = [row["capacity"] for row in rows]  # the continuation oracle's horizon, once per capacity
    references = dict(zip(capacities, run_tasks(reference_task, (indexed, future, hp, config),
                                                 [(c,) for c in capacities], n_jobs=jobs)))
    shared = (indexed, future, hp, config, seen, began, workload.output_tokens.tolist(), limits, references)
    tasks = list(dict.fromkeys((rule, base, row["capacity"]) for row in rows for rule in rules
                               for base in ("lru", row["best_baseline"])))
    ratios = dict(zip(tasks, run_tasks(rule_task, shared, tasks, n_jobs=jobs)))
    out = []
    for row in rows:
        ratio, best_name = row["token_hit_ratio"], row["best_baseline"]
        best, gap = ratio[best_name], ratio["belady"] - ratio[best_name]
        told = {f"{rule}+{base}": {"token_hit_ratio": ratios[(rule, name, row["capacity"])],
                                   "gap_closed": (ratios[(rule, name, row["capacity"])] - best) / gap if gap > 0 else None}
                for rule in rules for base, name in (("lru", "lru"), ("best", best_name))}
        out.append({"capacity": row["capacity"], "best_baseline": best_name, "best": best, "wa": ratio["wa"],
                    "belady": ratio["belady"], "rules": told})
    return {"trace": case.name, "output_limits": limits, "rules": rules, "rows": out,
            "wall_s": time.perf_counter() - started}


def print_table(cases: list[dict]) -> None:
    for base in ("lru", "best"):
        print(f"\nOver {base} (token hit ratio, share of the best-baseline-to-Belady gap closed)\n")
        columns = cases[0]["rules"] if cases else []
        print("| trace | capacity | best baseline | wa | belady | " + " | ".join(f"{c}+{base}" for c in columns) + " |")
        print("|" + "---|" * (5 + len(columns)))
        for case in cases:
            for row in case["rows"]:
                cells = []
                for rule in columns:
                    told = row["rules"][f"{rule}+{base}"]
                    closed = told["gap_closed"]
                    cells.append(f"{told['token_hit_ratio']:.4f} ({'-' if closed is None else f'{closed:+.0%}'})")
                print(f"| {case['trace']} | {row['capacity']:,} | {row['best_baseline']} {row['best']:.4f} | "
                      f"{row['wa']:.4f} | {row['belady']:.4f} | " + " | ".join(cells) + " |")
    for case in cases:
        limits = ", ".join(f"{name} = {limit:.0f} tokens" for name, limit in case["output_limits"].items())
        print(f"\n{case['trace']}: {limits} (the fit window's percentiles); {case['wall_s']:.0f} s", file=sys.stderr)


def suite_parser(doc: str) -> argparse.ArgumentParser:
    """The options of the benchmarks that read the quality suite's JSON: jobs, traces and that JSON."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=1, help="joblib workers (-1: all cores)")
    parser.add_argument("--traces", default="weka,mooncake", help="comma-separated case names (default: the real traces)")
    parser.add_argument("--quality", type=Path, default=REPO / "benchmarks" / "results" / "quality.json",
                        help="bench_quality.py's JSON: the suite's ratios and tuning (default: the committed one "
                             "docs/results.md renders, measured at its run.commit)")
    return parser


def suite_cases(parser: argparse.ArgumentParser, args):
    """``(case, trace, the suite's JSON for it)`` for each chosen case that ``--quality`` holds."""
    if not args.quality.is_file():
        parser.error(f"--quality {args.quality}: no such file (bench_quality.py writes it)")
    quality = {case["trace"]: case for case in json.loads(args.quality.read_text())["cases"]}
    for case, trace in chosen_traces(args.traces):
        if case.name not in quality:
            print(f"skipped {case.name}: not in {args.quality}", file=sys.stderr)
            continue
        yield case, trace, quality[case.name]


def main() -> int:
    parser = suite_parser(__doc__)
    args = parser.parse_args()
    print_table([run_case(case, trace, quality, args.jobs) for case, trace, quality in suite_cases(parser, args)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
