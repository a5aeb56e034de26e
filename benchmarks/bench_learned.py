"""What the learned candidate's features carry, and what it does to ``wa`` on the quality suite.

    python benchmarks/bench_learned.py [--traces weka,mooncake] [--sizes 2] [-o FILE]
    python benchmarks/bench_learned.py --compare [-j N] [--traces ...] [-o FILE]

Without ``--compare``: per trace of the quality suite (``bench_quality.py``'s cases) and its
smallest ``--sizes`` capacities, the tuning's workload (the last third of the fit window, as
``tune`` labels it) is labelled by Belady's compiled replay
(:func:`kvprof.sim.learn.belady_labels`); the predictor is fitted on its first two thirds with
each feature set and scored on the last third: log-loss (beside the base rate's) and AUC of the
log-odds. A feature set leaves the other features' columns at bin 0.

With ``--compare``: per trace, the suite's workflow (``bench_quality.run_case``: fit, tune, replay
every policy on the evaluation window) without and with the learned candidate in the tuning
(``kvprof fit --learned``), side by side: lru, the best baseline, ``wa``, ``wa`` with the learned
candidate, each one's share of the best-to-Belady gap, the start order tuning chose with it, whether
the learned candidate's shadow led the tuning replay, and the predictor's held-out quality.

``-o FILE`` writes the printed rows as JSON with the run's provenance (benchmarks/provenance.py):
``{"run", "mode": "ablation" | "compare", "rows": [...]}``. benchmarks/render_results.py renders
the ``--compare`` one committed as benchmarks/results/learned.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bench_quality import chosen_traces, run_case
from kvprof.atomic import atomic_write_text

#: Feature columns (kvprof.models.learned.FEATURES order) of each set compared.
FEATURE_SETS = {"cell, tier, depth, tail": [0, 1, 2, 3], "+ turn, gap": [0, 1, 2, 3, 4, 5],
                "+ fan-out": [0, 1, 2, 3, 6], "all seven": list(range(7))}


def ablation(traces: str | None, sizes: int) -> list[dict]:
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
    out = []
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
            scores, base = {}, None
            for name, columns in FEATURE_SETS.items():
                kept = np.zeros(rows.shape[1], bool)
                kept[columns] = True
                masked = np.where(kept, rows, 0)
                model = fit_learned(masked[:split], labels[:split], n_cells, len(TIER_EDGES),
                                    holdout=(masked[split:], labels[split:]))
                if model is None:  # one label: nothing to predict
                    scores[name] = None
                    continue
                base = model.quality["holdout_base_log_loss"]
                scores[name] = {"log_loss": model.quality["holdout_log_loss"],
                                "auc": float(roc_auc_score(labels[split:], model.log_odds(masked[split:])))}
            out.append({"trace": case.name, "capacity": capacity, "labelled": int(len(labels)),
                        "friendly_share": float(labels.mean()), "feature_sets": scores, "base_log_loss": base})
            cells = ["one label" if s is None else f"{s['log_loss']:.3f} / {s['auc']:.3f}" for s in scores.values()]
            print(f"| {case.name} | {capacity:,} | {len(labels):,} | {labels.mean():.3f} | " + " | ".join(cells)
                  + f" | {'-' if base is None else f'{base:.3f}'} |", flush=True)
    return out


def compared_rows(plain: dict, learned: dict) -> list[dict]:
    """One row per capacity of a case run by ``run_case`` without and with ``learn``: the plain run's hit
    ratios, ``wa``'s with the learned candidate, and what the learned tuning chose and measured."""
    tuning = {entry["capacity"]: entry for entry in learned["tuning"]}
    rows = []
    for row, learned_row in zip(plain["rows"], learned["rows"], strict=True):
        entry = tuning.get(row["capacity"], {})
        shadow_hits = entry.get("measured", {}).get("shadow_hits", {})
        rows.append({"trace": plain["trace"], "capacity": row["capacity"], "token_hit_ratio": row["token_hit_ratio"],
                     "best_baseline": row["best_baseline"], "wa_learned": learned_row["token_hit_ratio"]["wa"],
                     "start": entry.get("start"),
                     # None where tuning trained no predictor (first-turn traces, or one label)
                     "learned_shadow_led": (shadow_hits["learned"] >= max(shadow_hits.values())
                                            if "learned" in shadow_hits else None),
                     "predictor": (entry.get("learned") or {}).get("quality")})
    return rows


def compare(traces: str | None, jobs: int) -> list[dict]:
    print("| trace | capacity | lru | best baseline | wa | wa with learned | vs without | tuned start | learned shadow "
          "led | predictor held-out log-loss (base rate's) | belady |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for case, trace in chosen_traces(traces):
        plain, learned = (run_case(case, trace, jobs, learn=learn) for learn in (False, True))
        for row in compared_rows(plain, learned):
            ratio, quality = row["token_hit_ratio"], row["predictor"] or {}
            held = (f"{quality['holdout_log_loss']:.3f} ({quality['holdout_base_log_loss']:.3f})"
                    if "holdout_log_loss" in quality else "-")
            print(f"| {row['trace']} | {row['capacity']:,} | {ratio['lru']:.4f} | {row['best_baseline']} "
                  f"{ratio[row['best_baseline']]:.4f} | {ratio['wa']:.4f} | {row['wa_learned']:.4f} | "
                  f"{row['wa_learned'] - ratio['wa']:+.4f} | {row['start']} | {row['learned_shadow_led']} | {held} | "
                  f"{ratio['belady']:.4f} |", flush=True)
            out.append(row)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", help="comma-separated case names (default: all)")
    parser.add_argument("--sizes", type=int, default=2, help="the smallest this many capacities of each case "
                                                             "(without --compare)")
    parser.add_argument("--compare", action="store_true", help="wa without and with the learned candidate on the suite")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="joblib workers of --compare (-1: all cores)")
    parser.add_argument("-o", "--output", type=Path, help="also write the rows as JSON with the run's provenance")
    args = parser.parse_args()
    from provenance import facts  # beside this script

    run = facts()
    rows = compare(args.traces, args.jobs) if args.compare else ablation(args.traces, args.sizes)
    if args.output:
        document = {"run": run, "mode": "compare" if args.compare else "ablation", "rows": rows}
        atomic_write_text(args.output, json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
