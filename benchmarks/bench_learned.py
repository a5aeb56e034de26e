"""What the learned candidate's features carry, and what it does to ``wa`` on the quality suite.

    KVPROF_TRACES=../shared/traces python benchmarks/bench_learned.py [--traces weka,mooncake] [--sizes 2]
    python benchmarks/bench_learned.py --compare plain.json learned.json

Without ``--compare``: per trace of the quality suite (``bench_quality.py``'s cases) and its
smallest ``--sizes`` capacities, the tuning's workload (the last third of the fit window, as
``tune`` labels it) is labelled by Belady's compiled replay
(:func:`kvprof.sim.learn.belady_labels`); the predictor is fitted on its first two thirds with
each feature set and scored on the last third: log-loss (beside the base rate's) and AUC of the
log-odds. A feature set leaves the other features' columns at bin 0.

With ``--compare``: the quality table of two ``bench_quality.py -o`` runs of one commit, without
and with ``--learned``, side by side: lru, the best baseline, ``wa``, ``wa`` with the learned
candidate, each one's share of the best-to-Belady gap, the start order tuning chose and the
predictor's held-out quality at each size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bench_quality import chosen_traces

#: Feature columns (kvprof.models.learned.FEATURES order) of each set compared.
FEATURE_SETS = {"cell, tier, depth, tail": [0, 1, 2, 3], "+ turn, gap": [0, 1, 2, 3, 4, 5],
                "+ fan-out": [0, 1, 2, 3, 6], "all seven": list(range(7))}


def ablation(traces: str | None, sizes: int) -> None:
    from sklearn.metrics import roc_auc_score

    from kvprof.cells import TIER_EDGES
    from kvprof.profiler.fit import fit_trace
    from kvprof.sim.config import SimConfig
    from kvprof.sim.learn import belady_labels, fit_learned
    from kvprof.sim.tune import REPLAYED_SHARE
    from kvprof.sim.workload import prepare_workload

    print("| trace | capacity | labelled accesses | friendly share | "
          + " | ".join(f"{name}: log-loss / AUC" for name in FEATURE_SETS) + " | base rate's log-loss |")
    print("|---|---|---|---|" + "---|" * (len(FEATURE_SETS) + 1))
    for case, trace in chosen_traces(traces):
        config = SimConfig(engine_block_size=case.engine_block)
        fitted = trace.time_window(*case.fit)
        hp = fit_trace(fitted)
        end = fitted.censor_time
        replayed = fitted.time_window(end - (end - fitted.first_arrival) * REPLAYED_SHARE, None)
        workload = prepare_workload(replayed, hp, case.engine_block, 1.0)
        n_cells = len(hp.cell_names())
        for capacity in case.capacities[:sizes]:
            rows, labels, _ = belady_labels(workload, capacity, config, n_cells, len(TIER_EDGES))
            split = int(len(labels) * 2 / 3)
            cells, base = [], float("nan")
            for columns in FEATURE_SETS.values():
                kept = np.zeros(rows.shape[1], bool)
                kept[columns] = True
                masked = np.where(kept, rows, 0)
                model = fit_learned(masked[:split], labels[:split], n_cells, len(TIER_EDGES),
                                    holdout=(masked[split:], labels[split:]))
                if model is None:
                    cells.append("one label")
                    continue
                quality = model.quality
                base = quality["holdout_base_log_loss"]
                auc = roc_auc_score(labels[split:], model.log_odds(masked[split:]))
                cells.append(f"{quality['holdout_log_loss']:.3f} / {auc:.3f}")
            print(f"| {case.name} | {capacity:,} | {len(labels):,} | {labels.mean():.3f} | " + " | ".join(cells)
                  + f" | {base:.3f} |", flush=True)


def compare(plain_path: Path, learned_path: Path) -> None:
    plain, learned = (json.loads(path.read_text()) for path in (plain_path, learned_path))
    print("| trace | capacity | lru | best baseline | wa | wa vs best | wa with learned | vs best | gap closed: wa / "
          "with learned | tuned start | predictor held-out log-loss (base rate's) / accuracy (majority's) | belady |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case, learned_case in zip(plain["cases"], learned["cases"]):
        if case["trace"] != learned_case["trace"]:
            raise SystemExit(f"the runs differ in their traces: {case['trace']} vs {learned_case['trace']}")
        tuning = {entry["capacity"]: entry for entry in learned_case["tuning"]}
        for row, learned_row in zip(case["rows"], learned_case["rows"]):
            ratio, with_learned = row["token_hit_ratio"], learned_row["token_hit_ratio"]["wa"]
            best = row["best_baseline"]
            gap = ratio["belady"] - ratio[best]
            entry = tuning.get(row["capacity"], {})
            quality = (entry.get("learned") or {}).get("quality", {})
            held = "-"
            if "holdout_log_loss" in quality:
                majority = max(quality["holdout_base_rate"], 1 - quality["holdout_base_rate"])
                held = (f"{quality['holdout_log_loss']:.3f} ({quality['holdout_base_log_loss']:.3f}) / "
                        f"{quality['holdout_accuracy']:.1%} ({majority:.1%})")

            def closed(value: float) -> str:
                return f"{(value - ratio[best]) / gap:+.0%}" if gap > 1e-9 else "-"

            print(f"| {case['trace']} | {row['capacity']:,} | {ratio['lru']:.4f} | {best} {ratio[best]:.4f} | "
                  f"{ratio['wa']:.4f} | {(ratio['wa'] - ratio[best]) / ratio[best]:+.1%} | {with_learned:.4f} | "
                  f"{(with_learned - ratio[best]) / ratio[best]:+.1%} | {closed(ratio['wa'])} / {closed(with_learned)} | "
                  f"{entry.get('start', '-')} | {held} | {ratio['belady']:.4f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", help="comma-separated case names (default: all)")
    parser.add_argument("--sizes", type=int, default=2, help="the smallest this many capacities of each case")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("PLAIN", "LEARNED"),
                        help="bench_quality.py outputs without and with --learned")
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        ablation(args.traces, args.sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
