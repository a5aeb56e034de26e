"""A regret-weighted mixture of eviction orders over one cache (LeCaR / CACHEUS style), on the quality suite.

    python research/bench_mixture.py [--traces mooncake,...] [--capacities 1000,2000] [--variants NAME,...]
                                       [--quality quality.json] [-o mixture.json]

Can one cache combine orders so as to cross more of the gap to Belady than ``wa``? Its shadows
switch the whole cache to the order whose shadow hit most, which pays a transition at each switch.
This prototype tries the other way to combine orders: LeCaR (Vietri et al., HotStorage '18) and
CACHEUS (Rodriguez et al., FAST '21) keep every expert's order over the *same* resident blocks and
pick each victim from one expert, drawn by weights that regret lowers: each expert remembers (a
ghost, FIFO, one cache's worth) the contents it evicted, and a miss on content in expert E's ghost
multiplies E's weight by ``exp(-learning_rate * discount ** age)`` (age in block accesses since the
eviction, ``discount = 0.005 ** (1 / capacity)``); weights are renormalised and floored at 1 %. A
victim every expert would have chosen goes in no ghost (LeCaR's rule: nobody is to blame).

The experts are ``wa``'s candidate orders (:mod:`kvprof.policy.orders`: ``lru``, ``model``,
``segmented``, ``frequency``, ``strict-frequency``, over wa's row lists, and ``s3fifo`` kept in step)
and ``arc`` (kept in step the same way), so the prototype is :class:`RegretMixture`, a ``wa``
without shadows whose leader is chosen again at every victim. Variants are named
``<experts>-<choice>-<rate>[-full]`` (:data:`EXPERT_SETS`, :class:`RegretMixture`'s ``choice``,
:data:`RATES`, full feedback).

Each trace is fitted as bench_quality fits it, with the tuning (horizon per capacity) read from a
bench_quality JSON (``--quality``), and the evaluation window is replayed on the Python engine. The
table gives each variant's token hit ratio (its gain over the best baseline, its share of the
best-baseline-to-Belady gap closed) beside lru, the best baseline, wa and Belady from that JSON;
the lru column also says whether this script's Python replay of lru equals the suite's (``=``),
which makes the comparison fair.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Hashable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the suite: bench_quality

from bench_quality import REPO, chosen_traces  # noqa: E402

from kvprof.atomic import atomic_write_text  # noqa: E402
from kvprof.models.hp import HpFile  # noqa: E402
from kvprof.policy.arc import ARCPolicy  # noqa: E402
from kvprof.policy.base import EvictionPolicy  # noqa: E402
from kvprof.policy.lru import LRUPolicy  # noqa: E402
from kvprof.policy.wa import WorkloadAwarePolicy  # noqa: E402
from kvprof.profiler.fit import fit_trace  # noqa: E402
from kvprof.sim.config import SimConfig  # noqa: E402
from kvprof.sim.engine import simulate  # noqa: E402
from kvprof.sim.workload import prepare_workload  # noqa: E402

#: Experts that are not wa candidates, kept in step with wa's lists by the mixture itself.
OUTSIDE_EXPERTS: dict[str, type[EvictionPolicy]] = {"arc": ARCPolicy}
#: LeCaR's constants: initial learning rate, the weight floor, the discount reaching this after one capacity of accesses.
LEARNING_RATE = 0.45
WEIGHT_FLOOR = 0.01
DISCOUNT_AFTER_CAPACITY = 0.005
#: CACHEUS' learning-rate search: bounds, and how many windows without progress before a random restart.
RATE_BOUNDS = (0.001, 1.0)
UNLEARN_WINDOWS = 10


class RegretMixture(WorkloadAwarePolicy):
    """``wa``'s row lists (and its followed S3-FIFO) with every victim chosen by one candidate order,
    picked by regret weights instead of by shadows; ARC (``arc``, not a wa candidate) can be an
    expert too, kept in step with the lists as wa keeps S3-FIFO.

    Invariants (on top of :class:`WorkloadAwarePolicy`'s, without shadows): every policy of
    ``_outside`` holds exactly the evictable blocks the lists hold; ``expert_weight`` is a
    probability vector with every entry >= ``WEIGHT_FLOOR`` / (1 + k * WEIGHT_FLOOR); ``_ghosts[i]``
    maps at most ``capacity`` contents, each evicted while order ``i`` would have chosen it, to the
    access count at that eviction, oldest first; ``_clock`` counts block accesses.

    ``choice`` says how the victim's expert is picked: ``random`` draws it by the weights (LeCaR;
    seeded), ``argmax`` takes the heaviest, ``vote`` evicts the block whose experts weigh most
    together. ``learning_rate`` None adapts it as CACHEUS does: once per capacity of accesses, the
    rate moves the way that raised the window's hit ratio, and restarts at random after
    ``UNLEARN_WINDOWS`` windows without a gain.

    ``feedback`` says what an expert is blamed for. ``bandit`` is LeCaR's: the victim goes in the
    ghost of the expert picked and of every expert whose first choice it was too, and a miss on it
    is regret. ``full`` uses that every row order's first choice can be looked at for free: at each
    eviction each expert's first choice goes in its ghost whether it is evicted or not (S3-FIFO's
    only when it is picked), and any later use of that content, hit or miss, is its regret (the
    cache would have missed it had that expert been followed for this one eviction).
    """

    name = "mixture"

    def __init__(self, p, weights, rates, horizon: float, *, orders, capacity: int, choice: str = "random",
                 learning_rate: float | None = LEARNING_RATE, feedback: str = "bandit", seed: int = 0, **kwargs) -> None:
        if choice not in ("random", "argmax", "vote"):
            raise ValueError(f"choice must be random, argmax or vote, got {choice!r}")
        if feedback not in ("bandit", "full"):
            raise ValueError(f"feedback must be bandit or full, got {feedback!r}")
        if not capacity or capacity <= 0:
            raise ValueError(f"the mixture needs the cache's capacity in blocks, got {capacity}")
        self.expert_names = tuple(orders)
        inside = tuple(name for name in orders if name not in OUTSIDE_EXPERTS)
        if not inside:
            raise ValueError(f"the mixture needs at least one of wa's candidates among its experts, got {orders}")
        super().__init__(p, weights, rates, horizon, orders=inside, safety_net=False, capacity=capacity, **kwargs)
        # expert -> its index among wa's candidates, or the outside policy it is
        self._expert: list[int | EvictionPolicy] = [OUTSIDE_EXPERTS[name]() if name in OUTSIDE_EXPERTS
                                                    else inside.index(name) for name in orders]
        self._outside = [expert for expert in self._expert if isinstance(expert, EvictionPolicy)]
        k = len(orders)
        self.choice = choice
        self.feedback = feedback
        self.expert_weight = np.full(k, 1.0 / k)
        self.adaptive = learning_rate is None
        self.learning_rate = LEARNING_RATE if learning_rate is None else float(learning_rate)
        self._discount = DISCOUNT_AFTER_CAPACITY ** (1.0 / capacity)
        self._ghosts: list[OrderedDict[Hashable, int]] = [OrderedDict() for _ in range(k)]
        self._clock = 0
        self._rng = np.random.default_rng(seed)
        self._victim_contents: list[Hashable | None] = []
        self.regrets = [0] * k  # ghost hits charged to each expert
        self.chosen = [0] * k  # victims each expert was picked for
        # CACHEUS' search state: the rate and hit ratio of the window before, the hits of this one.
        self._previous_rate = 0.0
        self._previous_ratio = 0.0
        self._window_hits = 0
        self._stalled = 0

    # -- regret ---------------------------------------------------------------------------
    def access(self, block, now, workload=0, depth=0, *, hit=False, next_use=math.inf, content=None) -> None:
        self._clock += 1
        if hit:
            self._window_hits += 1
        if content is not None and (self.feedback == "full" or not hit):
            self._regret(content)
        super().access(block, now, workload, depth, hit=hit, next_use=next_use, content=content)
        for policy in self._outside:
            policy.access(block, now, workload, depth, hit=hit, next_use=next_use, content=content)
        if self.adaptive and self._clock % self.capacity == 0:
            self._adapt_rate()

    def _regret(self, content: Hashable) -> None:
        """Lower the weight of every expert that evicted ``content``, or (full feedback) wanted to (it is wanted again)."""
        blamed = False
        for i, ghost in enumerate(self._ghosts):
            evicted_at = ghost.pop(content, None)
            if evicted_at is not None:
                self.expert_weight[i] *= math.exp(-self.learning_rate * self._discount ** (self._clock - evicted_at))
                self.regrets[i] += 1
                blamed = True
        if blamed:
            weight = self.expert_weight
            weight /= weight.sum()
            np.maximum(weight, WEIGHT_FLOOR, out=weight)
            weight /= weight.sum()

    def _adapt_rate(self) -> None:
        """CACHEUS' learning-rate search over one window of ``capacity`` accesses."""
        ratio = self._window_hits / self.capacity
        self._window_hits = 0
        rate_change = self.learning_rate - self._previous_rate
        ratio_change = ratio - self._previous_ratio
        self._previous_ratio = ratio
        low, high = RATE_BOUNDS
        if rate_change and ratio_change:
            direction = 1.0 if (rate_change > 0) == (ratio_change > 0) else -1.0
            self._previous_rate = self.learning_rate
            self.learning_rate = min(max(self.learning_rate * (1.0 + direction * abs(rate_change)), low), high)
            self._stalled = 0
        elif ratio_change <= 0:
            self._stalled += 1
            if self._stalled >= UNLEARN_WINDOWS:
                self._stalled = 0
                self._previous_rate = self.learning_rate
                self.learning_rate = float(self._rng.uniform(low, high))

    def free(self, blocks, now: float) -> None:
        blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
        super().free(blocks, now)
        for policy in self._outside:
            policy.free(blocks, now)

    def remove(self, block: int) -> None:
        super().remove(block)
        for policy in self._outside:
            policy.remove(block)

    def clear(self) -> None:
        super().clear()
        for policy in self._outside:
            policy.clear()

    # -- eviction -------------------------------------------------------------------------
    def _first_choice(self, expert: int, now: float) -> int | None:
        """The block ``expert`` would evict now, or None where no cheap look is possible (S3-FIFO)."""
        index = self._expert[expert]
        if isinstance(index, EvictionPolicy):
            return index.order(now, 1)[0]
        order = self._orders[index]
        if order is None:
            return None
        saved, self._order = self._order, order
        try:
            return self._fifos.merge(1, self._key, now, self.uniform_runs, take=False)[0]
        finally:
            self._order = saved

    def _pick(self, firsts: list[int | None]) -> int:
        """The expert whose victim goes now."""
        weight = self.expert_weight
        if self.choice == "random":
            return int(self._rng.choice(len(weight), p=weight))
        if self.choice == "argmax":
            return int(np.argmax(weight))
        votes: dict[object, float] = {}
        for i, block in enumerate(firsts):
            key = ("unseen", i) if block is None else block
            votes[key] = votes.get(key, 0.0) + weight[i]
        winner = max(votes, key=votes.get)
        return max((i for i, block in enumerate(firsts) if (("unseen", i) if block is None else block) == winner),
                   key=weight.__getitem__)

    def evict_n(self, n: int, now: float) -> list[int]:
        if n > len(self):
            raise IndexError(f"{n} victims asked for, {len(self)} evictable")
        return [self._evict_one(now) for _ in range(n)]

    def evict(self, now: float) -> int:
        if not len(self):
            raise IndexError("no evictable block")
        return self._evict_one(now)

    def _evict_one(self, now: float) -> int:
        firsts = [self._first_choice(i, now) for i in range(len(self._expert))]
        expert = self._pick(firsts)
        self.chosen[expert] += 1
        # Each expert's first choice, by content, before the eviction forgets the victim's.
        wanted = [None if block is None else self._content.get(block) for block in firsts]
        chosen = self._expert[expert]
        if isinstance(chosen, EvictionPolicy):  # as wa evicts for a followed policy
            victim = chosen.evict(now)
            self._fifos.remove(victim)
            for policy in self._followed.values():
                policy.remove(victim)
            self._remember([victim])
        else:
            self._lead(chosen)
            victim = super().evict_n(1, now)[0]
        for policy in self._outside:
            if policy is not chosen:
                policy.remove(victim)
        wanted[expert] = self._victim_contents[0]
        if self.feedback == "bandit":  # LeCaR: only the victim, in the ghost of each expert that chose it
            wanted = [content if i == expert or firsts[i] == victim else None for i, content in enumerate(wanted)]
        if len(set(wanted)) > 1:  # when every expert wanted the same, nobody is to blame
            for ghost, content in zip(self._ghosts, wanted):
                if content is not None:
                    ghost.pop(content, None)
                    ghost[content] = self._clock
                    if len(ghost) > self.capacity:
                        ghost.popitem(last=False)
        return victim

    def _remember(self, victims: list[int]) -> None:
        self._victim_contents = [self._content.get(block) for block in victims]
        super()._remember(victims)


#: The expert sets: LeCaR's pair (recency and a frequency order), the pair plus the fitted model, and wa's six.
EXPERT_SETS = {
    "lecar": ("lru", "strict-frequency"),
    "mix3": ("lru", "strict-frequency", "model"),
    "s3lru": ("s3fifo", "lru"),
    "mix6": ("model", "lru", "segmented", "frequency", "strict-frequency", "s3fifo"),
    "arc3": ("lru", "arc", "s3fifo"),
    "mix7": ("model", "lru", "segmented", "frequency", "strict-frequency", "s3fifo", "arc"),
}
#: Learning rates by name: LeCaR's, two smaller (a KV miss comes as a whole chain of block misses), CACHEUS' search.
RATES = {"lr0.45": LEARNING_RATE, "lr0.05": 0.05, "lr0.005": 0.005, "adaptive": None}
#: Every variant: ``<experts>-<choice>-<rate>[-full]`` -> (orders, choice, learning rate (None: adaptive), feedback).
VARIANTS = {f"{experts}-{choice}-{rate}{'-full' if feedback == 'full' else ''}": (orders, choice, value, feedback)
            for feedback in ("bandit", "full") for experts, orders in EXPERT_SETS.items()
            for choice in ("random", "argmax", "vote") for rate, value in RATES.items()}


def make_variant(name: str, hp: HpFile, capacity: int, seed: int = 0) -> RegretMixture:
    orders, choice, rate, feedback = VARIANTS[name]
    return RegretMixture.from_hp(hp, capacity=capacity, orders=orders, choice=choice, learning_rate=rate,
                                 feedback=feedback, seed=seed)


def tuned_hp(case, trace, quality_case: dict) -> HpFile:
    """The hp file bench_quality sweeps with: fitted on the fit window, with the JSON's tuning."""
    fitted = fit_trace(trace.time_window(*case.fit))
    return HpFile.from_dict({**fitted.to_dict(), "tuning": quality_case["tuning"]})


def run_case(case, trace, quality_case: dict, capacities: list[int], variants: list[str], seed: int = 0) -> dict:
    started = time.perf_counter()
    hp = tuned_hp(case, trace, quality_case)
    config = SimConfig(engine_block_size=case.engine_block)
    workload = prepare_workload(trace.time_window(*case.evaluate), hp, case.engine_block)
    suite = {row["capacity"]: row for row in quality_case["rows"]}
    rows = []
    for capacity in capacities:
        row = suite[capacity]
        ratio = row["token_hit_ratio"]
        best_name = row["best_baseline"]
        best, belady = ratio[best_name], ratio["belady"]
        gap = belady - best
        tick = time.perf_counter()
        lru = simulate(workload, LRUPolicy(), capacity, config, engine="python").token_hit_ratio
        out = {"capacity": capacity, "lru": ratio["lru"], "lru_python": lru, "lru_s": time.perf_counter() - tick,
               "best_baseline": best_name, "best": best, "wa": ratio["wa"], "belady": belady, "variants": {}}
        for name in variants:
            tick = time.perf_counter()
            policy = make_variant(name, hp, capacity, seed)
            value = simulate(workload, policy, capacity, config, engine="python").token_hit_ratio
            out["variants"][name] = {
                "token_hit_ratio": value, "gain_over_best": (value - best) / best if best else None,
                "gap_closed": (value - best) / gap if gap > 0 else None,
                "weights": dict(zip(policy.expert_names, policy.expert_weight.round(3).tolist())),
                "chosen": dict(zip(policy.expert_names, policy.chosen)),
                "regrets": dict(zip(policy.expert_names, policy.regrets)),
                "learning_rate": policy.learning_rate, "wall_s": time.perf_counter() - tick}
            print(f"{case.name} {capacity} {name}: {value:.4f} (best {best_name} {best:.4f}, wa {ratio['wa']:.4f}, "
                  f"belady {belady:.4f}) {out['variants'][name]['wall_s']:.0f} s", file=sys.stderr, flush=True)
        rows.append(out)
    return {"trace": case.name, "rows": rows, "wall_s": time.perf_counter() - started}


def print_table(cases: list[dict], variants: list[str]) -> None:
    print("| trace | capacity | lru (suite / python) | best baseline | wa | belady | "
          + " | ".join(variants) + " |")
    print("|" + "---|" * (6 + len(variants)))
    for case in cases:
        for row in case["rows"]:
            cells = []
            for name in variants:
                told = row["variants"].get(name)
                if told is None:
                    cells.append("-")
                    continue
                gain, closed = told["gain_over_best"], told["gap_closed"]
                cells.append(f"{told['token_hit_ratio']:.4f} ({gain:+.1%}, {'-' if closed is None else f'{closed:+.0%}'})")
            same = "=" if abs(row["lru"] - row["lru_python"]) < 5e-5 else f"/ {row['lru_python']:.4f} (DIFFERS)"
            print(f"| {case['trace']} | {row['capacity']:,} | {row['lru']:.4f} {same} | {row['best_baseline']} "
                  f"{row['best']:.4f} | {row['wa']:.4f} | {row['belady']:.4f} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", help="comma-separated case names to run (default: all)")
    parser.add_argument("--capacities", help="comma-separated capacities to run (default: the case's four)")
    parser.add_argument("--variants", default="*", help="comma-separated names or shell patterns of VARIANTS "
                                                        "(<experts>-<choice>-<rate>; default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random variants' draws")
    parser.add_argument("--quality", type=Path, default=REPO / "benchmarks" / "results" / "quality.json",
                        help="bench_quality.py's JSON giving the tuning and the suite's ratios (default: the committed "
                             "one docs/results.md renders, measured at its run.commit)")
    parser.add_argument("-o", "--output", type=Path, default=REPO / "research" / "mixture.json")
    args = parser.parse_args()
    patterns = args.variants.split(",")
    unknown = [pattern for pattern in patterns if not fnmatch.filter(VARIANTS, pattern)]
    if unknown:
        parser.error(f"no variant matches {unknown}; known: {', '.join(VARIANTS)}")
    variants = [name for name in VARIANTS if any(fnmatch.fnmatch(name, pattern) for pattern in patterns)]
    if not args.quality.is_file():
        parser.error(f"--quality {args.quality}: no such file (bench_quality.py writes it)")
    quality = {case["trace"]: case for case in json.loads(args.quality.read_text())["cases"]}
    started = time.perf_counter()
    done = []
    for case, trace in chosen_traces(args.traces):
        if case.name not in quality:
            print(f"skipped {case.name}: not in {args.quality}", file=sys.stderr)
            continue
        capacities = [int(c) for c in args.capacities.split(",")] if args.capacities else list(case.capacities)
        done.append(run_case(case, trace, quality[case.name], [c for c in capacities if c in case.capacities],
                             variants, args.seed))
        # written after every trace, so a long run that is stopped keeps the traces it finished
        document = {"seed": args.seed, "variants": {name: list(map(str, VARIANTS[name])) for name in variants},
                    "cases": done, "wall_s": time.perf_counter() - started}
        atomic_write_text(args.output, json.dumps(document, indent=2) + "\n")
    print_table(done, variants)
    print(f"\nwrote {args.output} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
