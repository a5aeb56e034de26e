"""benchmarks/points.py: wa against the best baseline at every judged point, before and after a change."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from points import compare  # noqa: E402

RUN = {"commit": "abc1234", "date": "2026-12-05"}


def suite(trace: str, fit: list, rows: list[tuple[int, float, float]]) -> dict:
    """A bench_quality.py document of one case: (capacity, best baseline's ratio, wa's ratio) per row."""
    return {"run": RUN, "cases": [{"trace": trace, "fit_window": fit, "rows": [
        {"capacity": c, "best_baseline": "lru", "token_hit_ratio": {"lru": best, "wa": wa}} for c, best, wa in rows]}]}


def write(folder: Path, quality: dict, windows: list[tuple], unseen: dict) -> Path:
    folder.mkdir()
    (folder / "quality.json").write_text(json.dumps(quality))
    (folder / "unseen.json").write_text(json.dumps(unseen))
    (folder / "windows.json").write_text(json.dumps({"run": RUN, "rows": [
        {"trace": t, "fit": f, "capacity": c, "best_baseline": "arc", "best": best, "wa": wa} for t, f, c, best, wa in windows]}))
    return folder


def test_gains_and_the_issue_figures_of_each_side(tmp_path):
    before = write(tmp_path / "before", suite("weka", [0, 3600], [(100, 0.5, 0.49), (200, 0.5, 0.55), (400, 0.5, 0.5)]),
                   [("weka", [0, 1800], 100, 0.4, 0.38)], suite("bailian-a seed 3", [0, 3600], [(256, 0.2, 0.2)]))
    after = write(tmp_path / "after", suite("weka", [0, 3600], [(100, 0.5, 0.5), (200, 0.5, 0.55), (400, 0.5, 0.52)]),
                  [("weka", [0, 1800], 100, 0.4, 0.41)], suite("bailian-a seed 3", [0, 3600], [(256, 0.2, 0.19)]))
    done = compare(before, after)
    assert [(r["set"], r["capacity"]) for r in done["rows"]] == [
        ("suite", 100), ("suite", 200), ("suite", 400), ("other splits", 100), ("unseen", 256)]
    assert done["rows"][0]["gain_before"] == pytest.approx(-0.02) and done["rows"][0]["gain_after"] == pytest.approx(0.0)
    before_figures, after_figures = done["summary"]["before"], done["summary"]["after"]
    assert before_figures["worst"] == pytest.approx(-0.05) and before_figures["below_1_percent"] == 2
    assert after_figures["worst"] == pytest.approx(-0.05) and after_figures["below_1_percent"] == 1
    # the two smallest sizes of each real split: weka 0-3600 at 100 and 200, weka 0-1800 at 100 (unseen left out)
    assert before_figures["mean_real_smallest"] == pytest.approx((-0.02 + 0.1 - 0.05) / 3)
    assert after_figures["mean"] == pytest.approx((0 + 0.1 + 0.04 + 0.025 - 0.05) / 5)


def test_runs_that_differ_in_their_points_are_refused(tmp_path):
    before = write(tmp_path / "before", suite("weka", [0, 3600], [(100, 0.5, 0.5)]), [], suite("x", [0, 1], [(1, 0.1, 0.1)]))
    after = write(tmp_path / "after", suite("weka", [0, 3600], [(200, 0.5, 0.5)]), [], suite("x", [0, 1], [(1, 0.1, 0.1)]))
    with pytest.raises(SystemExit, match="quality.json: the two runs differ in their points"):
        compare(before, after)


def test_a_missing_file_names_it(tmp_path):
    after = write(tmp_path / "after", suite("weka", [0, 3600], [(100, 0.5, 0.5)]), [], suite("x", [0, 1], [(1, 0.1, 0.1)]))
    with pytest.raises(SystemExit, match="quality.json not found"):
        compare(tmp_path / "nowhere", after)
