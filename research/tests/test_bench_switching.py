"""research/bench_switching.py --tested: the start held to wa's switch test, on recorded periods."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from tests.test_policies import wa_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # research/

from bench_switching import PeriodWA, start_by_test, z_scores  # noqa: E402

NAMES = ("model", "segmented", "long-output")


def test_a_steady_lead_is_the_start_and_a_lump_is_not():
    steady = np.array([(50.0, 55.0, 0.0)] * 8)  # 40 ahead, 2.8 errors of the periods' differences
    assert start_by_test(NAMES, steady) == "segmented"
    assert math.isclose(z_scores(steady, 0)[1], 40 / math.sqrt(8 * 25))
    lump = np.array([(50.0, 50.0, 0.0)] * 3 + [(50.0, 150.0, 0.0)] + [(50.0, 50.0, 0.0)] * 4)  # 100 ahead, 1 error
    assert start_by_test(NAMES, lump) == "model"


def test_long_output_is_never_the_start_however_far_it_leads():
    gains = np.array([(50.0, 40.0, 90.0)] * 20)
    assert start_by_test(NAMES, gains) == "model"
    assert z_scores(gains, 0)[2] > 2


def test_the_recorded_periods_are_the_shadows_hits_between_comparisons():
    model = wa_policy([0.5], [0.1])
    policy = PeriodWA(model.p, model.weights, model.rates, model.horizon, orders=("lru", "segmented"),
                      capacity=100)
    told = [(3, 5), (0, 7), (4, 4)]
    for period in told:
        for shadow, hits in zip(policy._shadows, period):
            shadow.hits += hits
        policy._weigh(100, 100)
    assert policy.periods == [list(map(float, period)) for period in told]
