"""benchmarks/bench_windows.py's splits: the first half of the suite's fit window, and the window shifted by half."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_quality import CASES  # noqa: E402
from bench_windows import splits  # noqa: E402


def test_each_split_fits_before_it_evaluates_and_evaluates_to_the_end():
    weka = next(case for case in CASES if case.name == "weka-agents-dev")
    assert splits(weka) == [((0, 1800), (1800, None)), ((1800, 5400), (5400, None))]
    for case in CASES:
        for (start, end), (evaluate, last) in splits(case):
            assert start < end == evaluate and last is None
