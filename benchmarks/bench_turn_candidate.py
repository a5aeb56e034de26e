"""What a request's turn in its session is worth as a candidate under ``wa``'s safety net (a measurement, not a policy).

    python benchmarks/bench_turn_candidate.py [-j N] [--traces weka,mooncake] [--quality quality.json | --windows]
                                              [--only first-turn,lru]
    python benchmarks/bench_turn_candidate.py --profile [--traces weka,mooncake,bailian]

The oracle table (benchmarks/bench_oracles.py) puts a quarter to a half of Mooncake's
best-baseline-to-Belady gap in knowing whether a freed chain's session continues. A server can infer
one fact that predicts it from the block hashes alone: whether the request *continued* a session (an
earlier request's whole chain is a prefix of its own) or began one. On Mooncake a request that began
its session sends a next turn within 30 s 5 % of the time, one that continued 19-58 % (the later, the
likelier). bench_online_rules.py's ``turn1`` demotes the first turns' blocks, told each request's turn
from the whole trace. Here the same rule is a policy that infers turns online, from the chains it sees
freed, and a candidate ``wa`` must find by itself:

* ``first-turn``: :class:`FirstTurnLRU` alone on the evaluation window.
* the gate: ``first-turn`` and LRU on the tuning replay (the last third of the fit window, as
  :mod:`kvprof.sim.tune` replays ``long-output``); the candidate is offered to ``wa`` only where it hit
  more than LRU there.
* ``wa``: the suite's tuned ``wa`` on the Python engine (it must equal the suite's compiled ratio),
  and ``wa+first-turn``: the same with the candidate added where the gate lets it in (elsewhere it is
  ``wa`` by construction and not replayed).

With ``--windows`` the suite's JSON is not read: each real trace is fitted, tuned and swept as
bench_windows.py does on its two other splits (bench_quality.py's workflow), and the candidate is measured on
each. Prints one markdown table: token hit ratios, each over the best baseline and as a share of the gap.

``--only first-turn,lru`` adds ``wa`` over just those candidates (the first its start) at every point.
``--profile`` replays nothing: it prints, for each trace's fit window (and, for the real traces, the other
splits' fit windows), what a profiler could fit to tell where the rule belongs: how often a request that began
its session and one that continued it are followed by their session's next request within 30 s and 120 s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_quality  # noqa: E402
from bench_online_rules import suite_cases, suite_parser  # noqa: E402
from bench_windows import splits  # noqa: E402

import kvprof.policy.wa as wa_module  # noqa: E402
from kvprof.models.hp import HpFile  # noqa: E402
from kvprof.parallel import run_tasks  # noqa: E402
from kvprof.policy import make_policy  # noqa: E402
from kvprof.policy.long_output import LongOutputLRU  # noqa: E402
from kvprof.policy.wa import WorkloadAwarePolicy  # noqa: E402
from kvprof.profiler.fit import fit_trace  # noqa: E402
from kvprof.sim.config import SimConfig  # noqa: E402
from kvprof.sim.engine import simulate  # noqa: E402
from kvprof.sim.oracles import Future, infer_sessions  # noqa: E402
from kvprof.sim.tune import REPLAYED_SHARE  # noqa: E402
from kvprof.sim.workload import prepare_workload  # noqa: E402

#: Open tails remembered at most (contents; the oldest is forgotten first).
TAIL_MEMORY = 65536
#: Horizons (seconds) of ``--profile``'s continuation rates.
PROFILE_HORIZONS = (30.0, 120.0)


class FirstTurnLRU(LongOutputLRU):
    """``long-output``'s two LRU lists, but what sends a request's blocks to the front list is that the
    request began its session: those go first, oldest-freed first, then the others in free order.

    A freed request *continued* a session when one of its blocks holds an *open tail*: the content
    of the deepest block of an earlier freed request that no request has continued since (the
    deepest such, which it closes). Each free then opens the deepest freed block's content as a
    tail. Contents are compared, not blocks, so a session is followed across the eviction of its
    previous turn's tail. Only the past is read: on requests that run one at a time this is
    :func:`kvprof.sim.oracles.infer_sessions`' session start.

    Invariant: :class:`~kvprof.policy.long_output.LongOutputLRU`'s (each evictable block in one of
    its lists, ``_long`` here the first turns'); at most ``memory`` open tails are remembered, the
    oldest forgotten first.
    """

    name = "first-turn"

    def __init__(self, memory: int = TAIL_MEMORY) -> None:
        super().__init__(limit=0.0)  # the output limit is not read: finish decides nothing here
        self.memory = memory
        self._depth: dict[int, int] = {}
        self._content: dict[int, Hashable] = {}
        self._open: OrderedDict[Hashable, None] = OrderedDict()

    def access(self, block: int, now: float, workload: int = 0, depth: int = 0, *, hit: bool = False,
               next_use: float = math.inf, content: Hashable | None = None) -> None:
        self._depth[block] = depth
        if content is not None:
            self._content[block] = content

    def finish(self, request: Hashable, now: float, contents=None, *, n_blocks=None, n_output=None) -> None:
        """Nothing to decide: the free finds the request's turn from its blocks."""

    def free(self, blocks: Iterable[int], now: float) -> None:
        blocks = list(blocks)
        if not blocks:
            return
        deepest_first = sorted(blocks, key=lambda block: -self._depth.get(block, 0))
        contents = [self._content.get(block) for block in deepest_first]
        continued = next((content for content in contents if content is not None and content in self._open), None)
        if continued is not None:  # the session's previous turn: no other request continues it now
            del self._open[continued]
        if contents[0] is not None:
            self._open[contents[0]] = None
            if len(self._open) > self.memory:
                self._open.popitem(last=False)
        self._freeing_long = continued is None
        super().free(blocks, now)

    def clear(self) -> None:
        super().clear()
        for table in (self._depth, self._content, self._open):
            table.clear()


def register() -> None:
    """Make ``wa`` accept ``first-turn`` as a followed candidate (its module checks names against these).
    Called where a policy is built, not at import: a joblib worker gets this module's functions by value."""
    wa_module.FOLLOWED_POLICIES.setdefault(FirstTurnLRU.name, FirstTurnLRU)
    wa_module.ORDER_NAMES = wa_module.ROW_ORDERS + tuple(wa_module.FOLLOWED_POLICIES)


class WithFirstTurn(WorkloadAwarePolicy):
    """``wa`` with ``first-turn`` among its candidates, after the tuned ones (never its start)."""

    def __init__(self, *args, **kwargs) -> None:
        register()
        super().__init__(*args, orders=(*kwargs.pop("orders"), FirstTurnLRU.name), **kwargs)


def wa_over(orders: str, hp, capacity: int) -> WorkloadAwarePolicy:
    """``--only``'s variant: ``wa`` over just ``orders`` (comma-separated), the first its start."""
    register()
    return WorkloadAwarePolicy.from_hp(hp, capacity=capacity, orders=tuple(orders.split(",")))


def replay_task(shared: tuple, variant: str, window: str, capacity: int) -> tuple[float, str]:
    """``variant``'s token hit ratio on ``window`` (``tuning`` or ``evaluation``) and the order it ends on."""
    workloads, hp, config = shared
    if variant.startswith("wa over "):
        policy = wa_over(variant.removeprefix("wa over "), hp, capacity)
    else:
        policy = {"lru": lambda: make_policy("lru", hp, capacity),
                  "first-turn": FirstTurnLRU,
                  "wa": lambda: WorkloadAwarePolicy.from_hp(hp, capacity=capacity),
                  "wa+first-turn": lambda: WithFirstTurn.from_hp(hp, capacity=capacity)}[variant]()
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


def continuation_by_turn(workload, horizons=PROFILE_HORIZONS) -> dict:
    """On one window: the share of requests that began their session (sessions inferred from the chains), and per
    horizon the share of those, and of the requests that continued one, whose session sends its next request
    within it. Requests closer than the horizon to the window's last arrival are left out (not known yet)."""
    session = infer_sessions(workload)
    began = session == np.arange(workload.n_requests)
    wait = Future.of(workload, session).next_arrival - workload.arrival
    rates = {}
    for horizon in horizons:
        known = workload.arrival <= workload.arrival.max() - horizon
        rates[horizon] = [float(np.mean(wait[known & first] <= horizon)) for first in (began, ~began)]
    return {"requests": workload.n_requests, "began": float(began.mean()), "rates": rates}


def print_profiles(traces: str) -> None:
    """``--profile``'s table, for each chosen trace's fit window and (real traces) the other splits'."""
    horizons = " | ".join(f"next turn within {h:g} s: began / continued" for h in PROFILE_HORIZONS)
    print(f"| trace | fit window (s) | requests | began a session | {horizons} | ratio at {PROFILE_HORIZONS[0]:g} s |")
    print("|" + "---|" * (5 + len(PROFILE_HORIZONS)))
    for case, trace in bench_quality.chosen_traces(traces):
        windows = [case.fit] + ([] if case.source.startswith("synth:") else [fit for fit, _ in splits(case)])
        for fit in windows:
            window = trace.time_window(*fit)
            got = continuation_by_turn(prepare_workload(window, fit_trace(window), case.engine_block))
            rates = [got["rates"][h] for h in PROFILE_HORIZONS]
            first, later = rates[0]
            print(f"| {case.name} | {fit[0]:g}-{fit[1]:g} | {got['requests']:,} | {got['began']:.0%} | "
                  + " | ".join(f"{a:.3f} / {b:.3f}" for a, b in rates)
                  + f" | {later / first if first else math.inf:.1f} |", flush=True)


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
