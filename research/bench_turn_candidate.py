"""What a request's turn in its session is worth as a candidate under ``wa``'s safety net (a measurement, not a policy).

    python research/bench_turn_candidate.py [-j N] [--traces weka,mooncake] [--quality quality.json | --windows]
                                              [--only first-turn,lru]
    python research/bench_turn_candidate.py --profile [--traces weka,mooncake,bailian]

The oracle table (research/bench_oracles.py) puts a quarter to a half of Mooncake's
best-baseline-to-Belady gap in knowing whether a freed chain's session continues. A server can infer
one fact that predicts it from the block hashes alone: whether the request *continued* a session (an
earlier request's whole chain is a prefix of its own) or began one. On Mooncake's fit windows a request that
continued its session is followed by the session's next request within 30 s 5-17 times as often as one that
began it. bench_online_rules.py's ``turn1`` demotes the first turns' blocks, told each request's turn
from the whole trace. Here the same rule is a policy that infers turns online, from the chains it sees
freed, and a candidate ``wa`` must find by itself:

* ``first-turn``: :class:`FirstTurnLRU` alone on the evaluation window.
* the gate: ``first-turn`` and LRU on the tuning replay (the last third of the fit window, as
  :mod:`kvprof.sim.tune` replays ``long-output``); the candidate is offered to ``wa`` only where it hit
  more than LRU there.
* ``wa``: the suite's tuned ``wa`` with its default candidates on the Python engine (it equals the suite's
  compiled ratio where the fit window's next-turn counts keep those), and ``wa+first-turn``: the same with the
  candidate added where the gate lets it in (elsewhere it is ``wa`` by construction and not replayed).

With ``--windows`` the suite's JSON is not read: each real trace is fitted, tuned and swept as
bench_windows.py does on its two other splits (bench_quality.py's workflow), and the candidate is measured on
each. Prints one markdown table: token hit ratios, each over the best baseline and as a share of the gap.

``--only first-turn,lru`` adds ``wa`` over just those candidates (the first its start) at every point.
``--profile`` replays nothing: it prints, for each trace's fit window (and, for the real traces, the other
splits' fit windows), the counts ``kvprof fit`` writes as ``next_turn``
(:func:`kvprof.profiler.turns.next_turn_rates`): how often a request that began its session and one that
continued it are followed by their session's next request within 30 s and 120 s, and whether ``wa`` then runs
over ``first-turn`` and LRU (the suite's ``wa`` does so where it does; ``wa`` here, built with explicit
candidates or over the suite's tuning, is the candidate set without that switch).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the suite: bench_quality

import bench_quality  # noqa: E402
from bench_online_rules import suite_cases, suite_parser  # noqa: E402
from bench_windows import splits  # noqa: E402

from kvprof.models.hp import HpFile  # noqa: E402
from kvprof.parallel import run_tasks  # noqa: E402
from kvprof.policy import make_policy  # noqa: E402
from kvprof.policy.first_turn import FirstTurnLRU  # noqa: E402
from kvprof.policy.wa import WorkloadAwarePolicy  # noqa: E402
from kvprof.profiler.fit import fit_trace  # noqa: E402
from kvprof.profiler.turns import next_turn_rates  # noqa: E402
from kvprof.sim.config import SimConfig  # noqa: E402
from kvprof.sim.engine import simulate  # noqa: E402
from kvprof.sim.tune import REPLAYED_SHARE  # noqa: E402
from kvprof.sim.workload import prepare_workload  # noqa: E402

#: Horizons (seconds) of ``--profile``'s continuation rates.
PROFILE_HORIZONS = (30.0, 120.0)


class WithFirstTurn(WorkloadAwarePolicy):
    """``wa`` with ``first-turn`` among its candidates, after the tuned ones (never its start)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, orders=(*kwargs.pop("orders"), FirstTurnLRU.name), **kwargs)


def wa_over(orders: str, hp, capacity: int) -> WorkloadAwarePolicy:
    """``--only``'s variant: ``wa`` over just ``orders`` (comma-separated), the first its start."""
    return WorkloadAwarePolicy.from_hp(hp, capacity=capacity, orders=tuple(orders.split(",")))


def replay_task(shared: tuple, variant: str, window: str, capacity: int) -> tuple[float, str]:
    """``variant``'s token hit ratio on ``window`` (``tuning`` or ``evaluation``) and the order it ends on."""
    workloads, hp, config = shared
    default = dataclasses.replace(hp, next_turn=None)  # wa with its default candidates, whatever next_turn says
    if variant.startswith("wa over "):
        policy = wa_over(variant.removeprefix("wa over "), hp, capacity)
    else:
        policy = {"lru": lambda: make_policy("lru", hp, capacity),
                  "first-turn": FirstTurnLRU,
                  "wa": lambda: WorkloadAwarePolicy.from_hp(default, capacity=capacity),
                  "wa+first-turn": lambda: WithFirstTurn.from_hp(default, capacity=capacity)}[variant]()
    ratio = simulate(workloads[window], policy, capacity, config, engine="python").token_hit_ratio
    return ratio, getattr(policy, "order_name", variant)


def run_case(case, trace, quality: dict, jobs: int, orders: str | None = None) -> dict:
    """The table's rows for one trace; with ``orders``, also ``wa`` over just those at every point."""
    started = time.perf_counter()
    hp = quality.get("hp")  # bench_quality.run_case's tuned file (--windows); from the suite's JSON, refitted
    if hp is None:
        hp_dict = fit_trace(trace.time_window(*case.fit)).to_dict()
        hp_dict["tuning"] = quality["tuning"]  # the suite's tuning, so that wa here is the suite's wa
        hp = HpFile.from_dict(hp_dict)
    config = SimConfig(engine_block_size=case.engine_block)
    first, last = case.fit
    workloads = {"tuning": prepare_workload(trace.time_window(last - (last - first) * REPLAYED_SHARE, last), hp,
                                            case.engine_block),
                 "evaluation": prepare_workload(trace.time_window(*case.evaluate), hp, case.engine_block)}
    shared = (workloads, hp, config)
    capacities = [row["capacity"] for row in quality["rows"]]
    tasks = [(variant, window, capacity) for capacity in capacities
             for variant, window in (("lru", "tuning"), ("first-turn", "tuning"), ("first-turn", "evaluation"),
                                     ("wa", "evaluation"))]
    done = dict(zip(tasks, run_tasks(replay_task, shared, tasks, n_jobs=jobs)))
    gated = [c for c in capacities if done[("first-turn", "tuning", c)][0] > done[("lru", "tuning", c)][0]]
    added = [("wa+first-turn", "evaluation", c) for c in gated]
    added += [(f"wa over {orders}", "evaluation", c) for c in capacities] if orders else []
    done.update(zip(added, run_tasks(replay_task, shared, added, n_jobs=jobs)))
    out = []
    for row in quality["rows"]:
        c, ratio, best_name = row["capacity"], row["token_hit_ratio"], row["best_baseline"]
        out.append({"capacity": c, "best_baseline": best_name, "best": ratio[best_name], "belady": ratio["belady"],
                    "wa_suite": ratio["wa"], "tuning_lru": done[("lru", "tuning", c)][0],
                    "tuning_first_turn": done[("first-turn", "tuning", c)][0],
                    "first_turn": done[("first-turn", "evaluation", c)][0], "wa": done[("wa", "evaluation", c)],
                    "wa_first_turn": done.get(("wa+first-turn", "evaluation", c)),
                    "wa_only": done.get((f"wa over {orders}", "evaluation", c))})
    return {"trace": case.name, "only": orders, "rows": out, "wall_s": time.perf_counter() - started}


def split_cases(traces: str, jobs: int):
    """``(case, trace, bench_quality's case dict)`` for each real trace's two other splits (bench_windows.py's)."""
    for case, trace in bench_quality.chosen_traces(traces):
        if case.source.startswith("synth:"):
            continue
        for fit, evaluate in splits(case):
            split = dataclasses.replace(case, name=f"{case.name} {fit[0]:g}-{fit[1]:g}", fit=fit, evaluate=evaluate)
            yield split, trace, bench_quality.run_case(split, trace, jobs)


def print_profiles(traces: str) -> None:
    """``--profile``'s table, for each chosen trace's fit window and (real traces) the other splits':
    :func:`kvprof.profiler.turns.next_turn_rates` at each horizon, as ``kvprof fit`` counts it at the first."""
    horizons = " | ".join(f"next turn within {h:g} s: began / continued" for h in PROFILE_HORIZONS)
    print(f"| trace | fit window (s) | requests known | began a session | {horizons} | ratio at {PROFILE_HORIZONS[0]:g} s "
          "| wa over first-turn, lru |")
    print("|" + "---|" * (6 + len(PROFILE_HORIZONS)))
    for case, trace in bench_quality.chosen_traces(traces):
        windows = [case.fit] + ([] if case.source.startswith("synth:") else [fit for fit, _ in splits(case)])
        for fit in windows:
            window = trace.time_window(*fit)
            rates = [next_turn_rates(window, horizon) for horizon in PROFILE_HORIZONS]
            known = rates[0].began + rates[0].continued
            print(f"| {case.name} | {fit[0]:g}-{fit[1]:g} | {known:,} | {rates[0].began / max(known, 1):.0%} | "
                  + " | ".join(f"{r.began_followed / max(r.began, 1):.3f} / {r.continued_followed / max(r.continued, 1):.3f}"
                               for r in rates)
                  + f" | {rates[0].ratio:.1f} | {'yes' if rates[0].favours_first_turn() else 'no'} |", flush=True)


def print_table(cases: list[dict]) -> None:
    orders = cases[0]["only"] if cases else None
    print("\n| trace | capacity | best baseline | belady | first-turn alone | tuning: lru / first-turn | wa "
          "| wa+first-turn |" + (f" wa over {orders} |" if orders else ""))
    print("|" + "---|" * (9 if orders else 8))
    for case in cases:
        for row in case["rows"]:
            best, gap = row["best"], row["belady"] - row["best"]

            def cell(value: float, followed: str | None = None) -> str:
                closed = f"{(value - best) / gap:+.0%}" if gap > 0 else "-"
                return f"{value:.4f} ({value / best - 1:+.1%}, {closed}{f'; {followed}' if followed else ''})"

            added = row["wa_first_turn"]
            print(f"| {case['trace']} | {row['capacity']:,} | {row['best_baseline']} {best:.4f} | {row['belady']:.4f} | "
                  f"{cell(row['first_turn'])} | {row['tuning_lru']:.4f} / {row['tuning_first_turn']:.4f} | "
                  f"{cell(*row['wa'])} | {cell(*added) if added else 'off (gate)'} |"
                  + (f" {cell(*row['wa_only'])} |" if orders else ""))
    for case in cases:
        print(f"{case['trace']}: {case['wall_s']:.0f} s", file=sys.stderr)


def main() -> int:
    parser = suite_parser(__doc__)
    parser.add_argument("--windows", action="store_true", help="the real traces' other two splits (bench_windows.py's), "
                        "fitted and tuned here, instead of the suite's JSON")
    parser.add_argument("--only", metavar="ORDERS", help="also replay wa over just these candidates (comma-separated, "
                        "the first its start; e.g. first-turn,lru) at every point")
    parser.add_argument("--profile", action="store_true", help="only the fit windows' continuation rates by turn")
    parser.add_argument("-o", "--output", type=Path, help="also write the table as JSON here")
    args = parser.parse_args()
    if args.profile:
        print_profiles(args.traces)
        return 0
    chosen = split_cases(args.traces, args.jobs) if args.windows else suite_cases(parser, args)
    cases = [run_case(case, trace, quality, args.jobs, args.only) for case, trace, quality in chosen]
    print_table(cases)
    if args.output:
        args.output.write_text(json.dumps(cases, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
