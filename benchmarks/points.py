"""``wa`` against the best baseline at every point it is judged on, before and after a change.

    python benchmarks/points.py --before DIR [-o benchmarks/results/points.json]

A policy change is judged on 60 points, never on one suite: the quality suite (bench_quality.py, 24
points), the real traces' two other splits (bench_windows.py, 16) and the synthetic traces no rule was
chosen on (bench_quality.py --unseen, 20). ``DIR`` holds those three benchmarks' JSON from a run at the
earlier commit (``quality.json``, ``windows.json``, ``unseen.json``, each written with ``-o``); the later
run is the one in benchmarks/results/. Per point it prints the best baseline and ``wa``'s gain over it
before and after, then the issue's figures for each side: the worst point, how many points are more than
1 % below the best baseline, the mean, and the mean at the real traces' two smallest sizes. With ``-o`` it
writes the rows and both sides' provenance (benchmarks/render_results.py renders them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
#: The three sets of points, each a benchmark's JSON file.
SETS = (("suite", "quality.json"), ("other splits", "windows.json"), ("unseen", "unseen.json"))


def points(name: str, document: dict) -> dict[tuple, dict]:
    """``(set, trace, fit window, capacity) -> {best_baseline, best, wa}`` of one benchmark's JSON."""
    out = {}
    if name == "windows.json":
        for row in document["rows"]:
            out[(row["trace"], tuple(row["fit"]), row["capacity"])] = {
                "best_baseline": row["best_baseline"], "best": row["best"], "wa": row["wa"]}
        return out
    for case in document["cases"]:
        for row in case["rows"]:
            hits = row["token_hit_ratio"]
            out[(case["trace"], tuple(case["fit_window"]), row["capacity"])] = {
                "best_baseline": row["best_baseline"], "best": hits[row["best_baseline"]], "wa": hits["wa"]}
    return out


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path} not found (run the benchmark with -o {path})") from None
    except json.JSONDecodeError as error:
        raise SystemExit(f"error: {path}: not JSON ({error})") from None


def compare(before_dir: Path, after_dir: Path = RESULTS) -> dict:
    """The rows of both sides and each side's provenance per set."""
    rows, runs = [], {"before": {}, "after": {}}
    for label, name in SETS:
        sides = {}
        for side, folder in (("before", before_dir), ("after", after_dir)):
            document = read(folder / name)
            runs[side][label] = document.get("run")
            sides[side] = points(name, document)
        if sides["before"].keys() != sides["after"].keys():
            missing = sides["before"].keys() ^ sides["after"].keys()
            raise SystemExit(f"error: {name}: the two runs differ in their points ({len(missing)} in one only)")
        for key, after in sides["after"].items():
            before = sides["before"][key]
            trace, fit, capacity = key
            rows.append({"set": label, "trace": trace, "fit": list(fit), "capacity": capacity,
                         **{f"{side}_{field}": point[field] for side, point in (("before", before), ("after", after))
                            for field in ("best_baseline", "best", "wa")},
                         "gain_before": before["wa"] / before["best"] - 1, "gain_after": after["wa"] / after["best"] - 1})
    return {"runs": runs, "rows": rows, "summary": {side: summary(rows, side) for side in ("before", "after")}}


def summary(rows: list[dict], side: str) -> dict:
    """The figures of one side: worst gain, points more than 1 % below, mean, and the mean at the two
    smallest sizes of each split of the real traces (those with other splits)."""
    gains = [row[f"gain_{side}"] for row in rows]
    real = {row["trace"] for row in rows if row["set"] == "other splits"}  # only the real traces have other splits
    smallest = []
    for split in {(row["trace"], tuple(row["fit"])) for row in rows if row["trace"] in real}:
        sizes = sorted(row["capacity"] for row in rows if (row["trace"], tuple(row["fit"])) == split)[:2]
        smallest += [row[f"gain_{side}"] for row in rows
                     if (row["trace"], tuple(row["fit"])) == split and row["capacity"] in sizes]
    return {"points": len(gains), "worst": min(gains), "below_1_percent": sum(g < -0.01 for g in gains),
            "mean": sum(gains) / len(gains), "mean_real_smallest": sum(smallest) / len(smallest)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="folder of the earlier run's quality.json, "
                                                                   "windows.json and unseen.json")
    parser.add_argument("-o", "--output", type=Path, help="also write the comparison as JSON here")
    args = parser.parse_args()
    done = compare(args.before)
    print("| set | trace | fit window (s) | capacity | best baseline | wa vs best before | after |")
    print("|---|---|---|---|---|---|---|")
    for row in done["rows"]:
        print(f"| {row['set']} | {row['trace']} | {row['fit'][0]:g}-{row['fit'][1]:g} | {row['capacity']:,} | {row['after_best_baseline']} | "
              f"{row['gain_before']:+.1%} | {row['gain_after']:+.1%} |")
    for side, figures in done["summary"].items():
        print(f"{side}: worst {figures['worst']:+.1%}, {figures['below_1_percent']} of {figures['points']} points more "
              f"than 1 % below, mean {figures['mean']:+.2%}, real traces' two smallest sizes {figures['mean_real_smallest']:+.2%}")
    if args.output:
        from provenance import facts  # beside this script

        from kvprof.atomic import atomic_write_text
        atomic_write_text(args.output, json.dumps({"run": facts(), **done}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
