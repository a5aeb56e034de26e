"""What the output-length rule is worth as a candidate under ``wa``'s safety net (a measurement, not a policy).

    python benchmarks/bench_output_candidate.py [-j N] [--traces weka,mooncake] [--quality quality.json]

benchmarks/bench_online_rules.py found that demoting the blocks of requests whose output was
longer than the fit window's ``q``-th percentile closes 14-21 % of the best-baseline-to-Belady gap
at weka's three smaller sizes when the point's best order is known in advance. This asks what
``wa`` realises of it when it has to find the rule by itself: the candidate ``out<q>`` (LRU, with
the blocks freed by a request whose output was longer than the limit evicted first, oldest-freed
first) joins ``wa``'s candidates, with a shadow of its own, and ``wa`` follows it only while that
shadow hits most. Each point is replayed on the Python engine (the reference ``wa``) with the
suite's tuned hp file: ``wa`` as it is (its ratio must equal the suite's compiled one), ``wa`` with
``out50``, and ``wa`` with ``out25``, ``out50`` and ``out75``.

The rule needs each request's output length at its free, which neither the simulator's nor
vLLM's call protocol gives a policy yet; here the candidate reads it by request number from the
workload (the simulator numbers requests so). Prints one markdown table: each variant's token hit
ratio, its gain over the best baseline and its share of the gap closed, and the candidate the
real cache followed at the end.
"""

from __future__ import annotations

import json
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_online_rules import suite_cases, suite_parser  # noqa: E402

import kvprof.policy.wa as wa_module  # noqa: E402
from kvprof.models.hp import HpFile  # noqa: E402
from kvprof.parallel import run_tasks  # noqa: E402
from kvprof.policy.base import EvictionPolicy  # noqa: E402
from kvprof.policy.wa import DEFAULT_ORDERS, WorkloadAwarePolicy  # noqa: E402
from kvprof.profiler.fit import fit_trace  # noqa: E402
from kvprof.sim.config import SimConfig  # noqa: E402
from kvprof.sim.engine import simulate  # noqa: E402
from kvprof.sim.workload import prepare_workload  # noqa: E402

OUTPUT_PERCENTILES = (25, 50, 75)
VARIANTS = {"wa": (), "wa+out50": ("out50",), "wa+out25,50,75": ("out25", "out50", "out75")}


class DemotedLRU(EvictionPolicy):
    """LRU whose blocks freed while ``demote_next`` is set are evicted first, oldest-freed first.

    Invariant: every evictable block is in exactly one of ``_demoted`` and ``_kept``, each in
    the order it was freed; ``demote_next`` holds only for the next :meth:`free`.
    """

    name = "demoted-lru"

    def __init__(self) -> None:
        self._demoted: OrderedDict[int, None] = OrderedDict()
        self._kept: OrderedDict[int, None] = OrderedDict()
        self.demote_next = False

    def access(self, block, now, workload=0, depth=0, *, hit=False, next_use=float("inf"), content=None) -> None:
        pass

    def free(self, blocks: Iterable[int], now: float) -> None:
        into = self._demoted if self.demote_next else self._kept
        self.demote_next = False
        for block in blocks:
            into[block] = None

    def remove(self, block: int) -> None:
        if block in self._demoted:
            del self._demoted[block]
        else:
            del self._kept[block]

    def evict(self, now: float) -> int:
        pool = self._demoted or self._kept
        if not pool:
            raise IndexError("no evictable block")
        return pool.popitem(last=False)[0]

    def order(self, now: float, limit: int | None = None) -> list[int]:
        both = [*self._demoted, *self._kept]
        return both if limit is None else both[:limit]

    def clear(self) -> None:
        self._demoted.clear()
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._demoted) + len(self._kept)

    def __contains__(self, block: int) -> bool:
        return block in self._demoted or block in self._kept


class WithOutputRule(WorkloadAwarePolicy):
    """``wa`` whose ``out<q>`` candidates demote the blocks of requests with outputs over ``limits[name]``.

    The rule candidates join the orders given (``from_hp``'s tuned ones, else the default) after them.
    """

    def __init__(self, *args, output: list[int], limits: dict[str, float], **kwargs) -> None:
        _register(limits)  # here, not at import: a joblib worker gets this module's functions by value
        orders = tuple(kwargs.pop("orders", DEFAULT_ORDERS))
        orders += tuple(name for name in limits if name not in orders)
        super().__init__(*args, orders=orders, **kwargs)
        self.output = output
        self._rules = [(limits[name], i) for i, name in enumerate(orders) if name in limits]

    def finish(self, request, now, contents=None, *, n_blocks=None) -> None:
        output, shadows = self.output[request], self._shadows
        for limit, i in self._rules:  # the real cache's free comes next
            self._followed[i].demote_next = demote = output > limit
            if shadows:
                shadows[i].policy.demote_next = demote
        super().finish(request, now, contents, n_blocks=n_blocks)
        for _, i in self._rules if shadows else ():  # a request outside the shadows' sample frees nothing there
            shadows[i].policy.demote_next = False


def _register(names: Iterable[str]) -> None:
    """Make ``wa`` accept the rule candidates as followed policies, each a :class:`DemotedLRU` (its module
    checks names against these and builds followed policies from them)."""
    for name in names:
        wa_module.FOLLOWED_POLICIES.setdefault(name, DemotedLRU)
    wa_module.ORDER_NAMES = wa_module.ROW_ORDERS + tuple(wa_module.FOLLOWED_POLICIES)


def variant_task(shared: tuple, variant: str, capacity: int) -> tuple[float, str, float]:
    """``variant``'s token hit ratio at ``capacity``, the candidate followed at the end, and seconds."""
    workload, hp, config, limits = shared
    started = time.perf_counter()
    policy = WithOutputRule.from_hp(hp, capacity=capacity, output=workload.output_tokens.tolist(),
                                    limits={name: limits[name] for name in VARIANTS[variant]})
    ratio = simulate(workload, policy, capacity, config, engine="python").token_hit_ratio
    return ratio, policy.order_name, time.perf_counter() - started


def run_case(case, trace, quality: dict, jobs: int) -> dict:
    started = time.perf_counter()
    fitted = trace.time_window(*case.fit)
    hp_dict = fit_trace(fitted).to_dict()
    hp_dict["tuning"] = quality["tuning"]  # the suite's tuning, so that wa here is the suite's wa
    hp = HpFile.from_dict(hp_dict)
    config = SimConfig(engine_block_size=case.engine_block)
    workload = prepare_workload(trace.time_window(*case.evaluate), hp, case.engine_block)
    limits = {f"out{q}": float(np.percentile(fitted.output_length, q)) for q in OUTPUT_PERCENTILES}
    rows = quality["rows"]
    tasks = [(variant, row["capacity"]) for row in rows for variant in VARIANTS]
    done = dict(zip(tasks, run_tasks(variant_task, (workload, hp, config, limits), tasks, n_jobs=jobs)))
    out = []
    for row in rows:
        ratio, best_name = row["token_hit_ratio"], row["best_baseline"]
        best, gap = ratio[best_name], ratio["belady"] - ratio[best_name]
        variants = {}
        for variant in VARIANTS:
            value, followed, seconds = done[(variant, row["capacity"])]
            variants[variant] = {"token_hit_ratio": value, "over_best": value / best - 1 if best else None,
                                 "gap_closed": (value - best) / gap if gap > 0 else None,
                                 "followed_at_end": followed, "seconds": seconds}
        out.append({"capacity": row["capacity"], "best_baseline": best_name, "best": best,
                    "wa_suite": ratio["wa"], "belady": ratio["belady"], "variants": variants})
    return {"trace": case.name, "output_limits": limits, "rows": out, "wall_s": time.perf_counter() - started}


def print_table(cases: list[dict]) -> None:
    print("\n| trace | capacity | best baseline | belady | wa (suite) | " + " | ".join(VARIANTS) + " |")
    print("|" + "---|" * (5 + len(VARIANTS)))
    for case in cases:
        for row in case["rows"]:
            cells = []
            for variant in VARIANTS:
                v = row["variants"][variant]
                closed = "-" if v["gap_closed"] is None else f"{v['gap_closed']:+.0%}"
                cells.append(f"{v['token_hit_ratio']:.4f} ({v['over_best']:+.1%}, {closed}; {v['followed_at_end']})")
            print(f"| {case['trace']} | {row['capacity']:,} | {row['best_baseline']} {row['best']:.4f} | "
                  f"{row['belady']:.4f} | {row['wa_suite']:.4f} | " + " | ".join(cells) + " |")
    for case in cases:
        limits = ", ".join(f"{name} = {limit:.0f} tokens" for name, limit in case["output_limits"].items())
        print(f"\n{case['trace']}: {limits}; {case['wall_s']:.0f} s", file=sys.stderr)


def main() -> int:
    parser = suite_parser(__doc__)
    parser.add_argument("-o", "--output", type=Path, help="also write the table as JSON here")
    args = parser.parse_args()
    cases = [run_case(case, trace, quality, args.jobs) for case, trace, quality in suite_cases(parser, args)]
    print_table(cases)
    if args.output:
        args.output.write_text(json.dumps(cases, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
