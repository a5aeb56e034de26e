"""benchmarks/bench_learned.py --compare: the rows pair a suite run without and with the learned candidate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_learned import compared_rows  # noqa: E402


def _run(wa: float, tuning: list[dict]) -> dict:
    """A ``bench_quality.run_case`` result of one trace at two sizes (only the keys the comparison reads)."""
    rows = [{"capacity": capacity, "token_hit_ratio": {"lru": 0.1, "s3fifo": 0.12, "wa": wa, "belady": 0.2},
             "best_baseline": "s3fifo"} for capacity in (1000, 2000)]
    return {"trace": "weka", "rows": rows, "tuning": tuning}


def test_each_size_gets_wa_with_learned_and_what_its_tuning_chose():
    quality = {"holdout_log_loss": 0.53, "holdout_base_log_loss": 0.51}
    learned = _run(0.135, [
        {"capacity": 1000, "start": "segmented", "measured": {"shadow_hits": {"lru": 10, "segmented": 14, "learned": 12}},
         "learned": {"bias": 0.0, "quality": quality}},
        {"capacity": 2000, "start": "learned", "measured": {"shadow_hits": {"lru": 10, "learned": 15}},
         "learned": {"bias": 0.0}}])
    rows = compared_rows(_run(0.13, []), learned)
    assert [(r["capacity"], r["token_hit_ratio"]["wa"], r["wa_learned"]) for r in rows] == [(1000, 0.13, 0.135),
                                                                                          (2000, 0.13, 0.135)]
    assert [r["start"] for r in rows] == ["segmented", "learned"]
    assert [r["learned_shadow_led"] for r in rows] == [False, True]
    assert rows[0]["predictor"] == quality and rows[1]["predictor"] is None  # no held-out quality recorded


def test_a_size_where_tuning_trained_no_predictor_says_so():
    learned = _run(0.13, [{"capacity": c, "start": "first-turn", "measured": {"shadow_hits": {"first-turn": 9}}}
                          for c in (1000, 2000)])
    rows = compared_rows(_run(0.13, []), learned)
    assert all(r["learned_shadow_led"] is None and r["predictor"] is None for r in rows)


def test_runs_of_different_sizes_are_refused():
    learned = _run(0.13, [])
    learned["rows"] = learned["rows"][:1]
    with pytest.raises(ValueError):
        compared_rows(_run(0.13, []), learned)
