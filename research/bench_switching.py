"""What wa's switching between candidates costs and gains, on the traces of the quality suite.

    python research/bench_switching.py [-j N] [--traces weka,mooncake,...] [--capacities 1000,6000] [-o switching.json]
    python research/bench_switching.py --sweep m=0.002,m=0.01,w=64,m=0.01/w=64,p=4 [--traces ...] [-o sweep.json]
    python research/bench_switching.py --sweep w=16,w=inf,w=inf/e=1 --windows [--traces weka,mooncake] [-o sweep.json]
    python research/bench_switching.py --starts [-j N] [--traces ...] [-o starts.json]
    python research/bench_switching.py --tested [--windows] [--traces ...] [-o tested.json]

For each trace and capacity of benchmarks/bench_quality.py, fit and tune on the fit window as the
suite does, then replay the evaluation window:

* **wa**: as the suite runs it (compiled), and once more in the reference (Python engine) with its
  switches logged: how many, the share of lookups each candidate led, and, summed over the periods
  between two comparisons of the shadows, the real cache's hits against the hits of the leader's
  shadow over the same periods. Their difference (**transition cost**) is what the real cache lost
  because its contents were chosen by earlier leaders; the leader's shadow against the best
  candidate's shadow (**choice cost**) is what following the windowed leader lost against the
  candidate that was best over the whole window.
* **fixed**: wa following each candidate throughout (shadows run, nobody switches), the real hit
  ratio of each (:func:`bench_shadows.led_by`).
* **alone**: each followed policy (s3fifo) and lru run as a policy of their own, against wa
  restricted to that candidate (no shadows): equal if the following costs nothing.

All figures are token hit ratios of the evaluation window (hits x block tokens / prompt tokens).

With ``--sweep``, instead: wa (compiled) tuned and replayed as the suite does under each setting of
the switching constants of :mod:`kvprof.policy.wa` (``m`` SWITCH_MARGIN, ``w`` WINDOW_CAPACITIES (``inf``: no forgetting),
``p`` FOLLOW_PERIOD_SHARE, ``e`` SWITCH_ERRORS; ``/`` joins several), each against the best baseline of the
``--baseline`` table (bench_quality.py's JSON). With ``--windows`` as well, on the real traces' two
other splits of benchmarks/bench_windows.py besides the suite's, each against the best baseline of
benchmarks/results/windows.json for its split. The constants are module state, so the sweep runs in
this process, one replay at a time.

With ``--starts``, instead: what the candidate wa starts on is worth. Per trace and capacity, the
tuned start (the shadows' best over the last third of the fit window, :mod:`kvprof.sim.tune`),
the shadows' best over the whole fit window (one more replay of it under wa at the tuned horizon),
and on the evaluation window wa (compiled) started on each candidate, and each candidate followed
throughout (wa restricted to it: what a rule that never switches would get from that start).

With ``--tested``, instead: the start chosen by the test the switches are held to. Per trace and capacity
(with ``--windows`` on the real traces' other splits too), the tuning replay (:mod:`kvprof.sim.tune`: the
last third of the fit window, on the file fitted before it, at the tuned horizon) once more through the
reference, each period's shadow hits recorded: each candidate's lead over the first (``model``, where an
untuned wa starts) and over LRU in standard errors of the per-period differences, no forgetting; the
*tested start*, the first candidate unless the shadows' best (never ``long-output``) leads it by the margin
and ``SWITCH_ERRORS`` errors; and wa (compiled, as the suite runs it) on the evaluation window from each
candidate, each against the best baseline of the ``--baseline`` table (the table: from the tuned and the
tested start).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from joblib import Parallel, delayed

from kvprof.atomic import atomic_write_text
from kvprof.policy import make_policy
from kvprof.policy import wa as wa_module
from kvprof.policy.wa import DEFAULT_ORDERS, FIRST_TURN_ORDERS, WorkloadAwarePolicy, candidate_orders
from kvprof.profiler.fit import fit_trace
from kvprof.sim import tune as tune_module
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.sweep import run_sweep
from kvprof.sim.tune import tune
from kvprof.sim.workload import prepare_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the suite: bench_quality
from bench_quality import REPO, chosen_traces  # the suite's traces, windows and sizes
from bench_windows import splits  # the real traces' other splits
from bench_shadows import led_by  # wa following one candidate throughout

ALONE = ("lru", "s3fifo")
#: ``--sweep`` keys: the switching constants of kvprof.policy.wa they set.
CONSTANTS = {"m": "SWITCH_MARGIN", "w": "WINDOW_CAPACITIES", "p": "FOLLOW_PERIOD_SHARE", "e": "SWITCH_ERRORS"}


class LoggedWA(WorkloadAwarePolicy):
    """``wa`` that counts, per period between comparisons, the real hits and the leader's shadow hits."""

    def _weigh(self, lookups: int, size: int) -> None:
        if not hasattr(self, "led"):
            self.led, self.switches, self.real_sum, self.leader_shadow_sum = [0] * len(self._shadows), 0, 0, 0
        self.led[self.leader] += lookups
        self.real_sum += self._real_hits - self._real_seen
        self.leader_shadow_sum += self._shadows[self.leader].hits - self._shadow_seen[self.leader]
        before = self.leader
        super()._weigh(lookups, size)
        self.switches += self.leader != before


def logged(workload, hp, capacity: int, config: SimConfig) -> dict:
    policy = LoggedWA.from_hp(hp, capacity=capacity)
    ratio = simulate(workload, policy, capacity, config, engine="python").token_hit_ratio
    per_hit = workload.engine_block_size / int(workload.prompt_tokens.sum())
    looked = sum(policy.led)
    return {"wa_reference": ratio, "switches": policy.switches, "start": policy.order_names[0],
            "led_share": {name: n / looked for name, n in zip(policy.order_names, policy.led)},
            "shadows": {name: hits * per_hit for name, hits in policy.shadow_hits().items()},
            "real_over_periods": policy.real_sum * per_hit, "leader_shadow_over_periods": policy.leader_shadow_sum * per_hit}


def alone(workload, hp, capacity: int, name: str, config: SimConfig) -> tuple[float, float]:
    """Token hit ratio of ``name`` as a policy of its own and of wa restricted to it."""
    own = simulate(workload, make_policy(name), capacity, config).token_hit_ratio
    restricted = simulate(workload, make_policy("wa", hp, capacity, orders=(name,)), capacity, config).token_hit_ratio
    return own, restricted


def run_case(case, trace, capacities, jobs: int) -> list[dict]:
    config = SimConfig(engine_block_size=case.engine_block)
    fitted = trace.time_window(*case.fit)
    hp = tune(fit_trace(fitted), fitted, capacities, config, n_jobs=jobs, refit=fit_trace)
    workload = prepare_workload(trace.time_window(*case.evaluate), hp, case.engine_block)
    tasks = ([("logged", c, None) for c in capacities] + [("fixed", c, name) for c in capacities for name in DEFAULT_ORDERS]
             + [("alone", c, name) for c in capacities for name in ALONE])

    def one(kind, capacity, name):
        if kind == "logged":
            return logged(workload, hp, capacity, config)
        if kind == "fixed":
            return led_by(workload, hp, capacity, name, config)[0]
        return alone(workload, hp, capacity, name, config)

    done = dict(zip(tasks, Parallel(n_jobs=jobs)(delayed(one)(*task) for task in tasks)))
    rows = []
    for capacity in capacities:
        wa = simulate(workload, make_policy("wa", hp, capacity), capacity, config).token_hit_ratio
        fixed = {name: done["fixed", capacity, name] for name in DEFAULT_ORDERS}
        row = {"trace": case.name, "capacity": capacity, "wa": wa, **done["logged", capacity, None], "fixed": fixed,
               "alone": {name: dict(zip(("policy", "wa_restricted"), done["alone", capacity, name])) for name in ALONE}}
        row["transition_cost"] = row["real_over_periods"] - row["leader_shadow_over_periods"]
        row["choice_cost"] = row["leader_shadow_over_periods"] - max(row["shadows"].values())
        rows.append(row)
    return rows


def sweep(specs: list[str], cases, baseline: dict) -> list[dict]:
    """wa's token hit ratio per case and capacity under each setting of the switching constants
    (``baseline``: ``(trace, fit window, capacity)`` -> the best baseline's ratio)."""
    rows = []
    for case, trace in cases:
        config = SimConfig(engine_block_size=case.engine_block)
        fitted = trace.time_window(*case.fit)
        fit = fit_trace(fitted)
        for spec in specs:
            setting = {CONSTANTS[key]: float(value) for key, value in (part.split("=") for part in spec.split("/"))}
            saved = {name: getattr(wa_module, name) for name in setting}
            for name, value in setting.items():
                setattr(wa_module, name, int(value) if name == "FOLLOW_PERIOD_SHARE" else value)
            try:
                hp = tune(fit, fitted, case.capacities, config, refit=fit_trace)
                results = run_sweep(trace.time_window(*case.evaluate), hp, ("wa",), case.capacities, config)
            finally:
                for name, value in saved.items():
                    setattr(wa_module, name, value)
            for capacity in case.capacities:
                wa = results.get("wa", capacity).token_hit_ratio
                best = baseline.get((case.name, tuple(case.fit), capacity))
                rows.append({"trace": case.name, "fit": list(case.fit), "capacity": capacity, "setting": spec, "wa": wa,
                             "gain_over_best": None if best is None else (wa - best) / best})
            print(f"{case.name} {spec}: " + " ".join(f"{row['wa']:.4f}" for row in rows[-len(case.capacities):]),
                  file=sys.stderr)
    return rows


def starts(case, trace, jobs: int) -> list[dict]:
    """wa on the evaluation window from each start and restricted to each candidate, and the fit window's choices."""
    config = SimConfig(engine_block_size=case.engine_block)
    fitted = trace.time_window(*case.fit)
    hp = tune(fit_trace(fitted), fitted, case.capacities, config, n_jobs=jobs, refit=fit_trace)
    whole = prepare_workload(fitted, hp, case.engine_block)
    evaluated = prepare_workload(trace.time_window(*case.evaluate), hp, case.engine_block)

    def one(kind, capacity, name):
        if kind == "whole":
            policy = make_policy("wa", hp, capacity)
            simulate(whole, policy, capacity, config)
            return policy.shadow_hits()
        orders = (name,) if kind == "only" else (name, *(other for other in DEFAULT_ORDERS if other != name))
        return simulate(evaluated, make_policy("wa", hp, capacity, orders=orders), capacity, config).token_hit_ratio

    tasks = ([("whole", c, None) for c in case.capacities]
             + [(kind, c, name) for kind in ("start", "only") for c in case.capacities for name in DEFAULT_ORDERS])
    done = dict(zip(tasks, Parallel(n_jobs=jobs)(delayed(one)(*task) for task in tasks)))
    rows = []
    for entry in hp.to_dict()["tuning"]:
        capacity = entry["capacity"]
        hits = done["whole", capacity, None]
        rows.append({"trace": case.name, "capacity": capacity, "tuned_start": entry["start"],
                     "whole_window_start": max(hits, key=hits.get), "whole_window_shadow_hits": hits,
                     "last_third_shadow_hits": entry["measured"]["shadow_hits"],
                     "wa_from": {name: done["start", capacity, name] for name in DEFAULT_ORDERS},
                     "only": {name: done["only", capacity, name] for name in DEFAULT_ORDERS}})
    return rows


class PeriodWA(WorkloadAwarePolicy):
    """``wa`` that records each period's shadow hits (in the whole traffic's) at every comparison."""

    def _weigh(self, lookups: int, size: int) -> None:
        if not hasattr(self, "periods"):
            self.periods = []
        self.periods.append([(shadow.hits - seen) / self._sample.rate
                             for shadow, seen in zip(self._shadows, self._shadow_seen)])
        super()._weigh(lookups, size)


def z_scores(gains: np.ndarray, base: int) -> np.ndarray:
    """Each candidate's summed lead over candidate ``base`` in standard errors of the per-period differences."""
    leads = gains - gains[:, [base]]
    errors = np.sqrt((leads * leads).sum(axis=0))
    return np.divide(leads.sum(axis=0), errors, out=np.zeros(gains.shape[1]), where=errors > 0)


def start_by_test(names: tuple, gains: np.ndarray) -> str:
    """The first candidate unless the one whose shadow hit most (never one of tune's NEVER_START) leads it by
    wa's margin and SWITCH_ERRORS standard errors over all ``gains`` (periods x candidates)."""
    totals = gains.sum(axis=0)
    best = max((i for i, name in enumerate(names) if name not in tune_module.NEVER_START), key=totals.item)
    lead, difference = totals[best] - totals[0], gains[:, best] - gains[:, 0]
    passed = (lead > totals[0] * wa_module.SWITCH_MARGIN
              and lead > wa_module.SWITCH_ERRORS * math.sqrt(float(difference @ difference)))
    return names[best] if passed else names[0]


def starts_tested(case, trace, baseline: dict) -> list[dict]:
    """The tuned and the tested start of each capacity, the tuning replay's z-scores, wa from each candidate."""
    config = SimConfig(engine_block_size=case.engine_block)
    fitted = trace.time_window(*case.fit)
    hp = tune(fit_trace(fitted), fitted, case.capacities, config, refit=fit_trace)
    end = fitted.censor_time
    replayed = fitted.time_window(end - (end - fitted.first_arrival) * tune_module.REPLAYED_SHARE, None)
    first_turn = candidate_orders(hp) == FIRST_TURN_ORDERS  # tune replays hp itself there, and keeps the start
    judged = hp if first_turn else tune_module._judged(hp, fitted, replayed, fit_trace)
    workload = prepare_workload(replayed, judged, case.engine_block)
    evaluated = trace.time_window(*case.evaluate)
    rows = []
    for index, entry in enumerate(hp.tuning):
        capacity = entry["capacity"]
        orders = candidate_orders(hp, None, entry.get("long_output_tokens"), bool(entry.get("finish_reason")))
        policy = PeriodWA.from_hp(judged, horizon=entry["horizon_s"], orders=orders,
                                  output_limit=entry.get("long_output_tokens"))
        simulate(workload, policy, capacity, config, engine="python")
        gains = np.array(policy.periods)
        start = entry["start"] if first_turn else start_by_test(orders, gains)
        wa = {}
        for name in orders:
            tuning = list(hp.tuning)
            tuning[index] = {**entry, "start": name}
            forced = dataclasses.replace(hp, tuning=tuple(tuning))
            wa[name] = run_sweep(evaluated, forced, ("wa",), [capacity], config).get("wa", capacity).token_hit_ratio
        best = baseline.get((case.name, tuple(case.fit), capacity))
        rows.append({"trace": case.name, "fit": list(case.fit), "capacity": capacity, "periods": len(gains),
                     "tuned_start": entry["start"], "tested_start": start,
                     "z_over_first": dict(zip(orders, z_scores(gains, 0).round(2).tolist())),
                     "z_over_lru": dict(zip(orders, z_scores(gains, orders.index("lru")).round(2).tolist())),
                     "wa_from": wa,
                     "gain_over_best": None if best is None else {name: (r - best) / best for name, r in wa.items()}})
        print(f"{case.name} {case.fit} {capacity}: {entry['start']} -> {start}", file=sys.stderr)
    return rows


def print_tested(rows: list[dict]) -> None:
    print("| trace | fit window (s) | capacity | tuned start | tested start | its lead over the first candidate (errors) "
          "| wa from tuned / tested vs best |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        gains = row["gain_over_best"] or {}
        cells = " / ".join(f"{gains[name]:+.1%}" if name in gains else f"{row['wa_from'][name]:.4f}"
                           for name in dict.fromkeys((row["tuned_start"], row["tested_start"])))
        print(f"| {row['trace']} | {row['fit'][0]:g}-{row['fit'][1]:g} | {row['capacity']:,} | {row['tuned_start']} | "
              f"{row['tested_start']} | {row['z_over_first'].get(row['tuned_start'], 0):+.2f} | {cells} |")


def print_starts(rows: list[dict]) -> None:
    print("| trace | capacity | tuned start | whole-window start | wa from " + " / ".join(DEFAULT_ORDERS)
          + " | followed throughout: " + " / ".join(DEFAULT_ORDERS) + " |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['trace']} | {row['capacity']:,} | {row['tuned_start']} | {row['whole_window_start']} | "
              + " / ".join(f"{row['wa_from'][name]:.4f}" for name in DEFAULT_ORDERS) + " | "
              + " / ".join(f"{row['only'][name]:.4f}" for name in DEFAULT_ORDERS) + " |")


def best_baselines(path: Path) -> dict:
    """``(trace, fit window, capacity) -> the best baseline's token hit ratio`` of a bench_quality.py JSON
    file, and of bench_windows.py's beside it in benchmarks/results/ where that exists."""
    document = json.loads(path.read_text())
    best = {(case["trace"], tuple(case["fit_window"]), row["capacity"]): row["token_hit_ratio"][row["best_baseline"]]
            for case in document["cases"] for row in case["rows"]}
    windows = REPO / "benchmarks" / "results" / "windows.json"
    if windows.exists():
        best.update({(row["trace"], tuple(row["fit"]), row["capacity"]): row["best"]
                     for row in json.loads(windows.read_text())["rows"]})
    return best


def with_windows(cases):
    """Each real trace's case and its two other splits (bench_windows.py); synthetic cases as they are."""
    for case, trace in cases:
        yield case, trace
        if not case.source.startswith("synth:"):
            for fit, evaluate in splits(case):
                yield dataclasses.replace(case, fit=fit, evaluate=evaluate), trace


def print_sweep(rows: list[dict]) -> None:
    settings = list(dict.fromkeys(row["setting"] for row in rows))
    points = list(dict.fromkeys((row["trace"], tuple(row["fit"]), row["capacity"]) for row in rows))
    by = {(row["trace"], tuple(row["fit"]), row["capacity"], row["setting"]): row for row in rows}
    print("| trace | fit window (s) | capacity | " + " | ".join(settings) + " |")
    print("|---|---|---|" + "---|" * len(settings))
    for trace, fit, capacity in points:
        cells = []
        for setting in settings:
            row = by.get((trace, fit, capacity, setting))
            gain = row and row["gain_over_best"]
            cells.append("-" if row is None else f"{row['wa']:.4f}" + ("" if gain is None else f" ({gain:+.1%})"))
        print(f"| {trace} | {fit[0]:g}-{fit[1]:g} | {capacity:,} | " + " | ".join(cells) + " |")
    for setting in settings:
        gains = [row["gain_over_best"] for row in rows if row["setting"] == setting and row["gain_over_best"] is not None]
        if gains:
            print(f"- {setting}: worst {min(gains):+.1%}, {sum(g < -0.01 for g in gains)} of {len(gains)} points "
                  f"more than 1 % below the best baseline, mean {sum(gains) / len(gains):+.2%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=1, help="joblib workers (-1: all cores)")
    parser.add_argument("--traces", help="comma-separated case names to run (default: all)")
    parser.add_argument("--capacities", help="comma-separated capacities to run (default: each case's four)")
    parser.add_argument("--sweep", help="comma-separated settings of the switching constants (see the docstring)")
    parser.add_argument("--starts", action="store_true", help="wa from each start candidate (see the docstring)")
    parser.add_argument("--tested", action="store_true", help="the start chosen by the switch test (see the docstring)")
    parser.add_argument("--windows", action="store_true", help="with --sweep or --tested: the real traces' other two "
                                                               "splits too")
    parser.add_argument("--baseline", type=Path, default=REPO / "benchmarks" / "results" / "quality.json",
                        help="bench_quality.py's JSON: the best baselines the sweep is compared with (default: the "
                             "committed one docs/results.md renders)")
    parser.add_argument("-o", "--output", type=Path, default=REPO / "research" / "switching.json")
    args = parser.parse_args()
    if args.sweep:
        started = time.perf_counter()
        cases = chosen_traces(args.traces)
        rows = sweep(args.sweep.split(","), with_windows(cases) if args.windows else cases,
                     best_baselines(args.baseline) if args.baseline.exists() else {})
        print_sweep(rows)
        atomic_write_text(args.output, json.dumps({"sweep": rows, "wall_s": time.perf_counter() - started}, indent=1)
                          + "\n")
        return 0
    if args.tested:
        started = time.perf_counter()
        cases = chosen_traces(args.traces)
        baseline = best_baselines(args.baseline) if args.baseline.exists() else {}
        rows = [row for case, trace in (with_windows(cases) if args.windows else cases)
                for row in starts_tested(case, trace, baseline)]
        print_tested(rows)
        atomic_write_text(args.output, json.dumps({"tested": rows, "wall_s": time.perf_counter() - started}, indent=1)
                          + "\n")
        return 0
    if args.starts:
        started = time.perf_counter()
        rows = [row for case, trace in chosen_traces(args.traces) for row in starts(case, trace, args.jobs)]
        print_starts(rows)
        atomic_write_text(args.output, json.dumps({"starts": rows, "wall_s": time.perf_counter() - started}, indent=1)
                          + "\n")
        return 0
    wanted = {int(c) for c in args.capacities.split(",")} if args.capacities else None
    rows = []
    started = time.perf_counter()
    for case, trace in chosen_traces(args.traces):
        capacities = [c for c in case.capacities if wanted is None or c in wanted]
        if capacities:
            rows += run_case(case, trace, capacities, args.jobs)
            print(f"{case.name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print("| trace | capacity | wa | switches | led most | best fixed | transition cost | choice cost "
          "| s3fifo alone / wa only s3fifo |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        most = max(row["led_share"], key=row["led_share"].get)
        best = max(row["fixed"], key=row["fixed"].get)
        s3 = row["alone"]["s3fifo"]
        print(f"| {row['trace']} | {row['capacity']:,} | {row['wa']:.4f} | {row['switches']} | "
              f"{most} {row['led_share'][most]:.0%} | {best} {row['fixed'][best]:.4f} | "
              f"{row['transition_cost']:+.4f} | {row['choice_cost']:+.4f} | "
              f"{s3['policy']:.4f} / {s3['wa_restricted']:.4f} |")
    atomic_write_text(args.output, json.dumps({"rows": rows, "wall_s": time.perf_counter() - started}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
