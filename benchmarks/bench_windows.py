"""The quality suite's real traces on other fit and evaluation windows: is a policy change more than one split's luck?

    python benchmarks/bench_windows.py [-j N] [--traces weka,mooncake] [-o windows.json]

bench_quality.py fits each real trace on one window and evaluates on the rest. A change tuned or
judged on that split alone may have fitted its noise, so this runs the same workflow (fit, tune
for the suite's capacities, sweep every policy) on two more splits of each real trace: its first
half-window (fit on the first half of the suite's fit window, evaluate on everything after) and a
later window (fit on the suite's fit window shifted by half its length, evaluate on everything
after). The table gives per split and capacity the best baseline, ``wa`` and Belady, ``wa``'s gain
over the best baseline and its share of the gap to Belady. Run it at two commits to compare them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quality import chosen_traces, run_case  # noqa: E402


def splits(case) -> list[tuple[tuple[float, float], tuple[float, None]]]:
    """The first half of ``case``'s fit window, and its fit window shifted by half its length, each
    evaluated on what follows."""
    start, end = case.fit
    half = (end - start) / 2
    return [((start, start + half), (start + half, None)), ((start + half, end + half), (end + half, None))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=1, help="joblib workers (-1: all cores)")
    parser.add_argument("--traces", default="weka,mooncake", help="comma-separated real traces of the suite")
    parser.add_argument("-o", "--output", type=Path, help="also write the rows as JSON here (with the run's "
                                                          "provenance; benchmarks/render_results.py renders them)")
    args = parser.parse_args()
    from provenance import facts  # beside this script

    run, rows = facts(), []
    print("| trace | fit window (s) | capacity | best baseline | wa | belady | wa vs best | gap closed |")
    print("|---|---|---|---|---|---|---|---|")
    for case, trace in chosen_traces(args.traces):
        if case.source.startswith("synth:"):
            continue
        for fit, evaluate in splits(case):
            done = run_case(dataclasses.replace(case, fit=fit, evaluate=evaluate), trace, args.jobs)
            for row in done["rows"]:
                ratio, name = row["token_hit_ratio"], row["best_baseline"]
                gap = row["wa_gap_closed"]
                rows.append({"trace": case.name, "fit": list(fit), "capacity": row["capacity"], "best_baseline": name,
                             "best": ratio[name], "wa": ratio["wa"], "belady": ratio["belady"],
                             "wa_gain_over_best": row["wa_gain_over_best"], "wa_gap_closed": gap})
                print(f"| {case.name} | {fit[0]:g}-{fit[1]:g} | {row['capacity']:,} | {name} {ratio[name]:.4f} | "
                      f"{ratio['wa']:.4f} | {ratio['belady']:.4f} | {row['wa_gain_over_best']:+.1%} | "
                      f"{'-' if gap is None else f'{gap:+.0%}'} |", flush=True)
    if args.output:
        args.output.write_text(json.dumps({"run": run, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
