"""The fit window's next-turn counts (:func:`kvprof.profiler.turns.next_turn_rates`), how the hp file keeps
them, and the one decision they make: ``wa`` over ``first-turn`` and LRU where a continued session comes
back soon far more often than a new one."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from rich.console import Console

from kvprof.cli.hp_tables import NOT_TRAINED, tuning_table
from kvprof.models.hp import load_hp
from kvprof.models.next_turn import FIRST_TURN_RATIO, MIN_FOLLOWED, MIN_REQUESTS, NextTurnRates
from kvprof.policy import make_policy
from kvprof.policy.wa import DEFAULT_ORDERS, FIRST_TURN_ORDERS
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.turns import infer_sessions, next_turn_rates
from kvprof.sim.tune import tune
from tests.helpers import make_trace, synthetic
from tests.test_first_turn import chain_trees


def test_next_turns_are_counted_within_the_horizon_by_how_the_request_stood():
    # sessions: 0 -> 1 -> 3 (10 s, then 50 s later); 2 begins and is never continued; 4 is too close to the end
    trace = make_trace([(t, "text", 1, chain) for t, chain in
                        zip([0.0, 10.0, 20.0, 60.0, 100.0], [[1], [1, 2], [7], [1, 2, 3], [9]])])
    # known (arrival <= 70): began 0 (next in 10 s) and 2 (never); continued 1 (next in 50 s) and 3 (none)
    assert next_turn_rates(trace, horizon_s=30.0) == NextTurnRates(30.0, 2, 1, 2, 0)
    assert next_turn_rates(trace, horizon_s=60.0) == NextTurnRates(60.0, 2, 1, 1, 1)


def test_only_full_blocks_make_a_chain_as_a_server_caches_them():
    # request 0's second block is partial: the next turn's block 2 differs from it, yet it continues request 0
    rows = [(0.0, "text", 1, [1, 2]), (5.0, "text", 1, [1, 3, 4]), (100.0, "text", 1, [8])]
    trace = make_trace(rows, block_size=16)
    assert next_turn_rates(trace).continued == 0  # all blocks full: [1, 2] is no prefix of [1, 3, 4]
    partial = dataclasses.replace(trace, input_length=np.array([24, 48, 16]))
    assert next_turn_rates(partial) == NextTurnRates(30.0, 1, 1, 1, 0)


@pytest.mark.parametrize("rates, ratio, favours", [
    (NextTurnRates(30.0, 100, 5, 40, 12), 6.0, True),
    (NextTurnRates(30.0, 100, 10, 40, 12), 3.0, True),  # at the ratio
    (NextTurnRates(30.0, 100, 11, 40, 12), 0.3 / 0.11, False),
    (NextTurnRates(30.0, 100, 5, MIN_REQUESTS - 1, 12), 0.05 ** -1 * 12 / (MIN_REQUESTS - 1), False),  # too few
    (NextTurnRates(30.0, 100, 0, 40, 12), math.inf, False),  # no began request followed: too few events for a ratio
    (NextTurnRates(30.0, 100, MIN_FOLLOWED, 40, 12), 0.3 / 0.03, True),
    (NextTurnRates(30.0, 100, 0, 40, 0), math.nan, False),
    (NextTurnRates(30.0, 0, 0, 40, 12), math.nan, False),
])
def test_the_ratio_decides_above_the_threshold_on_enough_requests(rates, ratio, favours):
    assert FIRST_TURN_RATIO == 3.0
    assert rates.ratio == pytest.approx(ratio, nan_ok=True) and rates.favours_first_turn() is favours


def test_counts_above_their_requests_are_refused():
    with pytest.raises(ValueError, match="followed"):
        NextTurnRates(30.0, 10, 11, 0, 0)


@pytest.fixture(scope="module")
def window(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("next-turn"), hours=0.2, seed=3)[1]


@pytest.fixture(scope="module")
def fitted(window):
    return fit_trace(window)


def test_fit_writes_the_counts_and_they_load_back(fitted, tmp_path):
    assert fitted.next_turn is not None and fitted.next_turn.began + fitted.next_turn.continued > 0
    fitted.save(tmp_path / "hp.json")
    assert load_hp(tmp_path / "hp.json").next_turn == fitted.next_turn


def test_wa_runs_over_first_turn_and_lru_where_the_counts_favour_it(fitted):
    favouring = dataclasses.replace(fitted, next_turn=NextTurnRates(30.0, 1000, 10, 100, 30))
    assert make_policy("wa", favouring, capacity=500).order_names == FIRST_TURN_ORDERS
    assert make_policy("wa", favouring, capacity=500, orders=("lru",)).order_names == ("lru",)  # asked for wins
    against = dataclasses.replace(fitted, next_turn=NextTurnRates(30.0, 1000, 100, 100, 12))
    for hp in (against, dataclasses.replace(fitted, next_turn=None)):
        assert make_policy("wa", hp, capacity=500).order_names == DEFAULT_ORDERS


def test_the_tuning_replays_the_candidates_wa_will_run(fitted, window):
    # where the counts favour first-turn, neither the horizon, an output limit nor a predictor changes what wa
    # does: one replay per capacity under its own two candidates, started on first-turn, nothing else tuned
    favouring = dataclasses.replace(fitted, next_turn=NextTurnRates(30.0, 1000, 10, 100, 30))
    tuned = tune(favouring, window, [64, 256], learn=True)
    for entry in tuned.tuning:
        assert set(entry["measured"]["shadow_hits"]) == set(FIRST_TURN_ORDERS) and entry["start"] == "first-turn"
        assert list(entry["measured"]["hit_ratio_by_horizon_s"]) == [f"{fitted.horizon:g}"]
        assert not {"long_output_tokens", "learned"} & set(entry) and "hit_ratio_by_output_limit" not in entry["measured"]
    assert make_policy("wa", tuned, capacity=256).order_names == FIRST_TURN_ORDERS
    console = Console(record=True, width=400)
    console.print(tuning_table(tuned, learn_asked=True))  # what `fit --learned` says instead of a predictor
    assert console.export_text().count(NOT_TRAINED) == 2
    plain = tune(fitted, window, [256])  # elsewhere the default candidates, at three horizons
    assert set(plain.tuning[0]["measured"]["shadow_hits"]) >= set(DEFAULT_ORDERS)
    assert len(plain.tuning[0]["measured"]["hit_ratio_by_horizon_s"]) == 3


def test_fit_and_show_say_what_the_counts_decide(tmp_path):
    from tests.helpers import invoke

    path = synthetic(tmp_path, hours=0.2, seed=4)[0]
    fitted = invoke("fit", path, "-o", tmp_path / "hp.json")
    assert fitted.exit_code == 0, fitted.output
    line = next(line for line in fitted.output.splitlines() if line.startswith("next request of the session"))
    assert "that began a session" in line and "wa keeps its default candidates" in line  # bailian-like: about 1
    assert line in invoke("show", tmp_path / "hp.json").output


@settings(max_examples=200, deadline=None)
@given(chain_trees())
def test_chains_cut_to_the_blocks_that_end_some_chain_give_the_same_sessions(chains):
    # what a sharded fit reads of each chain: only those blocks can end an earlier chain
    offsets = np.cumsum([0] + [len(c) for c in chains])
    whole = infer_sessions(offsets, np.array(sum(chains, []), dtype=np.int64))
    tails = np.array([c[-1] if c else -1 for c in chains], dtype=np.int64)
    cut = [[b for b in c if b in set(tails)] for c in chains]
    assert (infer_sessions(np.cumsum([0] + [len(c) for c in cut]), np.array(sum(cut, []), dtype=np.int64), tails)
            == whole).all()
