"""The retention a client should ask for: Kaplan-Meier waits per class and hint kind, in the hp file and on screen."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.classes import ClassRule
from kvprof.models.hp import HpFile, load_hp
from kvprof.models.retention import FROM_ARRIVAL, FROM_END, RetentionRow, _row, fit_retention, start_problems
from kvprof.profiler.classes import classify_trace
from tests.helpers import invoke, make_trace, synthetic


def _km_reference(wait, returned):
    """Kaplan-Meier the textbook way: over distinct return times, survival *= 1 - d / n at risk."""
    survival, curve = 1.0, []
    for t in sorted(set(wait[returned].tolist())):
        at_risk = int((wait >= t).sum())
        d = int(((wait == t) & returned).sum())
        survival *= 1 - d / at_risk
        curve.append((t, 1 - survival))
    return curve


def test_without_censoring_the_waits_are_the_empirical_quantiles():
    row = _row(np.arange(1.0, 11.0), np.ones(10, bool), (0.5, 0.9, 0.99))
    assert row == RetentionRow(10, 10, 1.0, (5.0, 9.0, 10.0))


def test_a_censored_request_counts_as_not_returned_only_for_the_time_it_was_seen():
    # returns after 1 s and 3 s; one request seen 2 s (the window ended) and one seen 10 s without a return
    wait = np.array([1.0, 2.0, 3.0, 10.0])
    returned = np.array([True, False, True, False])
    row = _row(wait, returned, (0.5, 1.0))
    # S(1) = 3/4, S(3) = 3/4 * 1/2: 5/8 return; half of that (5/16) is reached only at 3 s
    # more than the naive 2 of 4: the request seen only 2 s might still have come back
    assert row.share_returned == 0.625 and row.seconds == (3.0, 3.0) and (row.requests, row.returned) == (4, 2)


def test_returns_come_before_censorings_at_one_time():
    row = _row(np.array([5.0, 5.0, 5.0]), np.array([False, True, False]), (1.0,))
    assert row.share_returned == pytest.approx(1 / 3) and row.seconds == (5.0,)


def test_nothing_returned_gives_no_waits():
    assert _row(np.array([4.0, 9.0]), np.zeros(2, bool), (0.5, 0.9)) == RetentionRow(2, 0, 0.0, (None, None))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans()), min_size=1, max_size=40),
       st.lists(st.floats(0.01, 1.0), min_size=1, max_size=4, unique=True))
def test_the_waits_match_the_textbook_estimator(pairs, shares):
    shares = tuple(sorted(shares))
    wait = np.array([float(w) for w, _ in pairs])
    returned = np.array([r for _, r in pairs])
    row = _row(wait, returned, shares)
    curve = _km_reference(wait, returned)
    assert row.returned == returned.sum() and row.requests == len(pairs)
    if not curve:
        assert row.seconds == (None,) * len(shares) and row.share_returned == 0.0
        return
    total = curve[-1][1]
    assert row.share_returned == pytest.approx(total, abs=1e-6)
    for share, seconds in zip(shares, row.seconds):
        expected = next(t for t, caught in curve if caught >= share * total - 1e-9)
        assert seconds == expected
    assert list(row.seconds) == sorted(row.seconds)


def _session_trace(finished=None):
    """Two sessions of type a, one of b: waits after each request, its stop, a child left past the window."""
    rows = [
        # (t, type, turn, hashes, chat_id, parent)
        (0.0, "a", 1, [1], 10, -1),   # tool call, back after 2 s
        (2.0, "a", 2, [1, 2], 11, 10),  # tool call, back after 3 s
        (5.0, "a", 3, [1, 2, 3], 12, 11),  # end of turn, back after 40 s
        (10.0, "b", 1, [7], 20, -1),  # end of turn, never back
        (45.0, "a", 4, [1, 2, 3, 4], 13, 12),  # not recorded; its child (at 200 s) is past the window
    ]
    trace = make_trace(rows, window=(0.0, 100.0))
    stop = np.array(["tool_use", "tool_use", "end_turn", "end_turn", ""], dtype=object)
    extra = {"stop": stop} if finished is None else {"stop": stop, "finished": np.asarray(finished, dtype=np.float64)}
    return dataclasses.replace(trace, extra=extra)


def test_fit_retention_takes_each_class_and_kind_over_its_requests():
    trace = _session_trace()
    codes, names = classify_trace(trace, ClassRule(key="type"))
    retention = fit_retention(trace, codes, names, shares=(0.5, 1.0))
    assert retention.basis == FROM_ARRIVAL and set(retention.classes) == {"a", "b"}
    a = retention.classes["a"]
    assert set(a) == {"tool_call", "end_turn", "any"}  # no "other" kind, and "any" holds the unrecorded request
    assert a["tool_call"] == RetentionRow(2, 2, 1.0, (2.0, 3.0))
    assert a["end_turn"] == RetentionRow(1, 1, 1.0, (40.0, 40.0))
    assert (a["any"].requests, a["any"].returned) == (4, 3)  # the last one is censored at the window's end
    assert retention.classes["b"]["end_turn"] == RetentionRow(1, 0, 0.0, (None, None))
    assert retention.default["end_turn"].requests == 2 and retention.default["end_turn"].share_returned == 0.5
    assert retention.row("c", "tool_call") == retention.default["tool_call"]  # an unseen class: the pooled rows
    assert retention.row("b", "tool_call") == retention.default["tool_call"]  # a kind the class did not have
    assert retention.row("b", "end_turn") == retention.classes["b"]["end_turn"]


def test_waits_count_from_the_recorded_end_where_every_request_has_one():
    trace = _session_trace(finished=[1.0, 2.5, 6.0, 11.0, 46.0])
    codes, names = classify_trace(trace, ClassRule(key="type"))
    retention = fit_retention(trace, codes, names, shares=(1.0,))
    assert retention.basis == FROM_END
    assert retention.classes["a"]["tool_call"].seconds == (2.5,)  # 2 - 1 and 5 - 2.5
    assert retention.classes["a"]["end_turn"].seconds == (39.0,)
    partial = _session_trace()
    partial = dataclasses.replace(partial, extra={**partial.extra,
                                                  "finished": np.array([1.0, None, 6.0, 11.0, 46.0], dtype=object)})
    assert fit_retention(partial, codes, names).basis == FROM_ARRIVAL


def test_ends_before_arrivals_or_after_the_next_turn_are_said_and_the_basis_follows():
    codes, names = classify_trace(_session_trace(), ClassRule(key="type"))
    good = _session_trace(finished=[1.0, 2.5, 6.0, 11.0, 46.0])
    assert start_problems(good) == [] and start_problems(_session_trace()) == []
    # request 11 finishes at 1.5 s, before it arrived (2 s): waits count from arrivals, and the user is told
    early = _session_trace(finished=[1.0, 1.5, 6.0, 11.0, 46.0])
    assert fit_retention(early, codes, names).basis == FROM_ARRIVAL
    (problem,) = start_problems(early)
    assert "1 requests finish before they arrive" in problem and "request 11" in problem
    # request 10 ends at 4 s, after its next turn arrived (2 s): that wait counts as 0 s, and the user is told
    late = _session_trace(finished=[4.0, 2.5, 6.0, 11.0, 46.0])
    assert fit_retention(late, codes, names).basis == FROM_END
    (problem,) = start_problems(late)
    assert "1 of 3 returns arrived before the request they follow ended" in problem


def test_a_trace_without_sessions_has_no_retention_figures():
    trace = make_trace([(0.0, "", 1, [1]), (1.0, "", 1, [1, 2])])
    codes, names = classify_trace(trace, ClassRule())
    assert fit_retention(trace, codes, names) is None


def test_fit_writes_the_figures_and_show_prints_them(tmp_path):
    path, _ = synthetic(tmp_path, hours=0.2)
    out = tmp_path / "hp.json"
    fitted = invoke("fit", path, "-o", out, "--window", "0:360")
    assert fitted.exit_code == 0, fitted.output
    hp = load_hp(out)
    assert hp.retention is not None and hp.retention.shares == (0.5, 0.9, 0.99)
    any_row = hp.retention.default["any"]
    assert set(hp.retention.default) == {"any"}  # a synthetic trace says nothing of how responses ended
    assert 0 < any_row.returned <= any_row.requests == hp.provenance["n_requests"]
    assert "retention catching 90% of a session's returns, from a request's arrival" in fitted.output
    shown = invoke("show", out)
    assert shown.exit_code == 0 and "retention to ask for" in shown.stdout and "(all classes)" in shown.stdout
    assert f"{any_row.requests:,}" in shown.stdout


def test_a_version_5_file_loads_without_figures_and_saves_as_version_6(tmp_path):
    trace = _session_trace()
    from kvprof.profiler.fit import fit_trace

    hp = fit_trace(trace, min_samples=1, max_cells=0)
    assert hp.retention is not None
    data = hp.to_dict()
    assert data["retention"] == json.loads(json.dumps(hp.retention.to_dict()))
    old = {key: value for key, value in data.items() if key != "retention"} | {"schema": "kvprof.hp/5"}
    path = tmp_path / "v5.json"
    path.write_text(json.dumps(old))
    loaded = load_hp(path)
    assert loaded.retention is None and loaded.schema == "kvprof.hp/5"
    loaded.save(path)
    assert json.loads(path.read_text())["schema"] == "kvprof.hp/6"
    hp.save(path)
    assert load_hp(path) == hp and isinstance(load_hp(path), HpFile)


def test_fit_gives_the_retention_for_the_shares_asked(tmp_path):
    path, _ = synthetic(tmp_path, hours=0.2)
    out = tmp_path / "hp.json"
    fitted = invoke("fit", path, "-o", out, "--window", "0:360", "--retention-shares", "0.95,0.8")
    assert fitted.exit_code == 0, fitted.output
    retention = load_hp(out).retention
    assert retention.shares == (0.8, 0.95) and all(len(row.seconds) == 2 for row in retention.default.values())
    assert "retention catching 95% of a session's returns" in fitted.output  # the share nearest 90 %


@pytest.mark.parametrize("text, words", [
    ("0,0.5", "each share must be a finite number > 0 and <= 1, got '0'"),
    ("0.5,1.5", "got '1.5'"),
    ("0.9,0.9", "a share is given twice"),
    ("0.5,,0.9", "has an empty item"),
])
def test_fit_refuses_a_share_outside_zero_to_one(tmp_path, text, words):
    path, _ = synthetic(tmp_path, hours=0.05)
    refused = invoke("fit", path, "-o", tmp_path / "hp.json", "--retention-shares", text)
    assert refused.exit_code == 2 and "--retention-shares" in refused.output and words in refused.output
    assert not (tmp_path / "hp.json").exists()
