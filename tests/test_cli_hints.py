"""Client hints end to end: trace fields read and checked, ``compare`` replaying them, stop hints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvprof.models.finish import END_OF_TURN
from kvprof.models.hints import Hint
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.hints import stop_hints
from tests.helpers import invoke, one_line

WINDOWS = ("--fit-window", "0:360", "--eval-window", "360:", "-j", "1")


def _records(seed: int = 5) -> list[dict]:
    return list(generate("bailian-a", 0.2, seed))


@pytest.fixture(scope="module")
def hinted_trace(tmp_path_factory):
    """A small trace whose requests carry hints: every third retains for 30 s (tag 1, priority 70),
    every fifth releases, the rest none."""
    records = _records()
    for i, record in enumerate(records):
        if i % 3 == 0:
            record.update(retain_s=30.0, retain_priority=70, hint_tag=1)
        elif i % 5 == 0:
            record["release"] = True
    path = tmp_path_factory.mktemp("hints") / "hinted.jsonl"
    write_jsonl(path, records)
    return path


def test_the_reader_keeps_each_requests_hint(hinted_trace):
    trace = read_trace(hinted_trace)[0]
    hints = trace.hints.hints()
    assert hints[0] == Hint(30.0, 70, False, 1)
    assert hints[5] == Hint(release=True)
    assert hints[1] is None
    assert trace.hints.n_hinted == sum(1 for i in range(trace.n_requests) if i % 3 == 0 or i % 5 == 0)
    assert read_trace(hinted_trace)[0].select(np.array([0, 1])).hints.hints() == hints[:2]


@pytest.mark.parametrize("field, value, message", [
    ("retain_s", -1, "retain_s': must be from 0"),
    ("retain_s", "10", "retain_s': must be a number of seconds, got str"),
    ("retain_priority", 100, "retain_priority': must be from 0 to 99, got 100"),
    ("retain_priority", 5.0, "retain_priority': must be an integer, got float"),
    ("release", 1, "release': must be true or false, got int"),
    ("hint_tag", -2, "hint_tag': must be from 0"),
    ("hint_session", "", "hint_session': must be 1 to 128 characters, got 0"),
    ("hint_session", 2.5, "hint_session': must be a string or an integer (a session id), got float"),
    ("hint_session", False, "hint_session': must be a string or an integer (a session id), got bool"),
    ("hint_session", -3, "hint_session': must be from 0"),
])
def test_a_bad_hint_field_is_an_error_naming_file_line_and_field(tmp_path, field, value, message):
    records = _records()[:8]
    records[4][field] = value
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, records)
    result = invoke("compare", path, "--policies", "lru", "--capacity", "64", "-o", tmp_path / "out", "-j", "1")
    assert result.exit_code != 0
    assert f"bad.jsonl, line 5, field '{message}" in one_line(result.output)
    assert not (tmp_path / "out").exists()


def test_release_and_retain_together_are_refused(tmp_path):
    records = _records()[:8]
    records[2].update(release=True, retain_s=5)
    path = tmp_path / "both.jsonl"
    write_jsonl(path, records)
    result = invoke("compare", path, "--policies", "lru", "--capacity", "64", "-o", tmp_path / "out", "-j", "1")
    assert result.exit_code != 0 and "line 3, field 'release'" in one_line(result.output)
    assert "contradict" in result.output


def test_compare_replays_trace_hints_beside_the_same_traffic_without_them(hinted_trace, tmp_path):
    out = tmp_path / "out"
    result = invoke("compare", hinted_trace, "--policies", "lru,belady", "--capacity", "64,256", "-o", out,
                    "--hint-max-fraction", "0.5", *WINDOWS)
    assert result.exit_code == 0, result.output
    document = json.loads((out / "results.json").read_text())
    assert document["config"]["policies"] == ["lru", "lru+hints", "belady"]
    assert document["inputs"]["hints"]["source"] == "trace"
    assert document["inputs"]["hints"]["max_fraction"] == 0.5
    ratios = {(run["policy"], run["capacity"]): run["token_hit_ratio"] for run in document["runs"]}
    assert any(ratios[("lru+hints", c)] != ratios[("lru", c)] for c in (64, 256))  # the hints changed something
    assert "lru+hints" in result.stdout

    ignored = invoke("compare", hinted_trace, "--policies", "lru,belady", "--capacity", "64,256", "-o",
                     tmp_path / "ignored", "--ignore-hints", *WINDOWS)
    assert ignored.exit_code == 0, ignored.output
    plain = json.loads((tmp_path / "ignored" / "results.json").read_text())
    assert plain["config"]["policies"] == ["lru", "belady"]
    assert {(r["policy"], r["capacity"]): r["token_hit_ratio"] for r in plain["runs"]}[("lru", 64)] == ratios[("lru", 64)]


def test_a_trace_without_hints_replays_as_before(tmp_path):
    path = tmp_path / "plain.jsonl"
    write_jsonl(path, _records())
    result = invoke("compare", path, "--policies", "lru", "--capacity", "64", "-o", tmp_path / "out", *WINDOWS)
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert document["config"]["policies"] == ["lru"] and "hints" not in document["inputs"]


def _stopped(tmp_path):
    """The small trace with a ``stop`` per request: a tool call where the session goes on, else an end of turn."""
    records = _records()
    parents = {r["parent_chat_id"] for r in records}
    for record in records:
        record["stop"] = "tool_use" if record["chat_id"] in parents else "end_turn"
    path = tmp_path / "stopped.jsonl"
    write_jsonl(path, records)
    return path


def test_stop_hints_from_the_fitted_retention(tmp_path):
    path = _stopped(tmp_path)
    out = tmp_path / "out"
    result = invoke("compare", path, "--policies", "lru,belady", "--capacity", "64,256", "-o", out, "--hints", "stop",
                    "--hint-end-turn", "retain", *WINDOWS)
    assert result.exit_code == 0, result.output
    document = json.loads((out / "results.json").read_text())
    assert document["inputs"]["hints"] == {"source": "stop", "hinted_requests": document["inputs"]["hints"]["hinted_requests"],
                                           "max_fraction": None, "share": 0.9, "end_turn": "retain",
                                           "tool_call": "retain"}
    assert document["inputs"]["hints"]["hinted_requests"] > 0
    assert "lru+hints" in document["config"]["policies"]


def test_stop_hints_that_only_release_retain_nothing(tmp_path):
    """``--hint-tool-call none``: a tool call sends no hint, so every hinted request is an end of turn's release."""
    path = _stopped(tmp_path)
    trace = read_trace(path)[0]
    hints = stop_hints(trace, fit_trace(trace.time_window(0, 360)), tool_call="none")
    assert not hints.retain_s.any()
    assert (hints.release == (trace.finish == END_OF_TURN)).all() and hints.release.any()
    out = tmp_path / "out"
    result = invoke("compare", path, "--policies", "lru", "--capacity", "64", "-o", out, "--hints", "stop",
                    "--hint-tool-call", "none", *WINDOWS)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "results.json").read_text())["inputs"]["hints"]["tool_call"] == "none"


@pytest.mark.parametrize("args, message", [
    (("--hints", "stop", "--hint-tool-call", "pin"), "'pin' is not one of retain, none"),
    (("--hint-tool-call", "none"), "applies to --hints stop only"),
    (("--hints", "stop"), "stop hints need the trace's 'stop' field"),
    (("--hints", "nope"), "'nope' is not one of trace, stop"),
    (("--hints", "stop", "--hint-end-turn", "keep"), "'keep' is not one of release, retain"),
    (("--hint-max-fraction", "1.5"), "--hint-max-fraction"),
    (("--hints", "stop", "--hint-share", "0.8"), "not 0.8"),
    # releases only: nothing retained, so the retention's share and the budget change nothing
    (("--hints", "stop", "--hint-tool-call", "none", "--hint-share", "0.9"), "--hint-share would change nothing"),
    (("--hints", "stop", "--hint-tool-call", "none", "--hint-max-fraction", "0.2"),
     "--hint-max-fraction would change nothing"),
    # only Belady, which is replayed without hints (and would fit an hp file for stop hints for nothing)
    (("--policies", "belady", "--hint-max-fraction", "0.2"), "--hint-max-fraction would change nothing"),
    (("--policies", "belady", "--hints", "stop"), "--hints stop would change nothing"),
])
def test_bad_hint_options_exit_2_naming_them(tmp_path, args, message):
    path = tmp_path / "plain.jsonl"
    records = _records()
    if "--hint-share" in args:
        path = _stopped(tmp_path)
    else:
        write_jsonl(path, records)
    policies = () if "--policies" in args else ("--policies", "lru")
    result = invoke("compare", path, *policies, "--capacity", "64", "-o", tmp_path / "out", *args, *WINDOWS)
    assert result.exit_code == 2, result.output
    assert message in one_line(result.output)



@pytest.mark.parametrize("command", ["compare", "fleet"])
def test_stop_hints_from_an_hp_file_keyed_on_a_field_the_trace_lacks_are_refused_cleanly(tmp_path, command):
    records = _records()
    write_jsonl(tmp_path / "a.jsonl", [dict(r, tenant=f"t{i % 3}") for i, r in enumerate(records)])
    write_jsonl(tmp_path / "b.jsonl", [dict(r, stop=("tool_use" if i % 2 else "end_turn"))
                                       for i, r in enumerate(records)])
    fitted = invoke("fit", tmp_path / "a.jsonl", "--window", "0:", "--class-field", "tenant", "-o", tmp_path / "hp.json",
                    "-j", "1")
    assert fitted.exit_code == 0, fitted.output
    extra = ("--replicas", "2") if command == "fleet" else ()
    result = invoke(command, tmp_path / "b.jsonl", "--config", tmp_path / "hp.json", "--hints", "stop", "--policies",
                    "lru", "--capacity", "8", "--eval-window", "0:", "-o", tmp_path / "out", "-j", "1", *extra)
    assert result.exit_code == 2 and "class field 'tenant' is not in the trace" in one_line(result.stderr)
    assert "Traceback" not in result.output and not (tmp_path / "out" / "results.json").exists()


def test_a_budget_the_samples_scaled_cache_rounds_to_no_block_is_warned_of(hinted_trace, tmp_path):
    # 0.001 of 2,048 blocks is 2 blocks; a fifth of the cache holds none
    result = invoke("compare", hinted_trace, "--policies", "lru", "--capacity", "2048", "--sample", "0.2",
                    "--hint-max-fraction", "0.001", "-o", tmp_path / "out", *WINDOWS)
    assert result.exit_code == 0, result.output
    assert "holds no whole block of the cache --sample scales capacity 2,048" in one_line(result.stderr)
    budgets = json.loads((tmp_path / "out" / "results.json").read_text())["inputs"]["hint_budget_blocks"]
    assert budgets == {"2048": 0}
    unsampled = invoke("compare", hinted_trace, "--policies", "lru", "--capacity", "2048", "--hint-max-fraction",
                       "0.001", "-o", tmp_path / "full", *WINDOWS)
    assert unsampled.exit_code == 0 and "no whole block" not in unsampled.stderr
    assert json.loads((tmp_path / "full" / "results.json").read_text())["inputs"]["hint_budget_blocks"] == {"2048": 2}


def test_compare_says_what_the_hints_did_in_each_hinted_run(hinted_trace, tmp_path):
    result = invoke("compare", hinted_trace, "--policies", "lru", "--capacity", "64", "-o", tmp_path / "out", *WINDOWS)
    assert result.exit_code == 0, result.output
    runs = {run["policy"]: run for run in json.loads((tmp_path / "out" / "results.json").read_text())["runs"]}
    assert runs["lru"]["hints"] is None
    counts = runs["lru+hints"]["hints"]
    assert set(counts) >= {"retained_hits", "lapsed", "released_evicted", "hinted_hits", "beyond_horizon"}
    assert counts["released_evicted"] > 0 and counts["hinted_hits"] >= counts["retained_hits"]
    assert "what the hints did" in result.stdout and f"{counts['released_evicted']:,}" in result.stdout


def test_retention_shares_on_a_trace_without_sessions_are_refused(tmp_path):
    path = tmp_path / "m.jsonl"
    write_jsonl(path, [dict(r, parent_chat_id=-1, turn=1) for r in _records()])
    result = invoke("fit", path, "--window", "0:", "--retention-shares", "0.5,0.9", "-o", tmp_path / "hp.json")
    assert result.exit_code == 2 and "no retention is fitted" in one_line(result.stderr), result.output
    assert not (tmp_path / "hp.json").exists()


@pytest.mark.parametrize("command", ["compare", "fleet"])
@pytest.mark.parametrize("case", ["no stop field", "a share the fit does not give"])
def test_stop_hints_that_cannot_be_sent_are_refused_before_the_fit(tmp_path, monkeypatch, command, case):
    import kvprof.cli.compare_cmd
    import kvprof.cli.fleet_cmd

    def no_fit(*args, **kwargs):
        raise AssertionError("fitted before refusing")

    monkeypatch.setattr(kvprof.cli.compare_cmd, "fit_and_tune", no_fit)
    monkeypatch.setattr(kvprof.cli.fleet_cmd, "fit_and_tune", no_fit)
    if case == "no stop field":
        path, extra, words = tmp_path / "plain.jsonl", (), "stop hints need the trace's 'stop' field"
        write_jsonl(path, _records())
    else:
        path, extra, words = _stopped(tmp_path), ("--hint-share", "0.8"), "retention for shares 0.5, 0.9, 0.99, not 0.8"
    replicas = ("--replicas", "2") if command == "fleet" else ()
    result = invoke(command, path, "--policies", "lru", "--capacity", "64", "-o", tmp_path / "out", "--hints", "stop",
                    *extra, *replicas, *WINDOWS)
    assert result.exit_code == 2 and words in one_line(result.stderr), result.output


def test_a_fleet_sweep_too_large_with_its_hinted_twins_is_refused_before_reading(tmp_path, monkeypatch):
    import kvprof.cli.fleet_cmd

    def no_read(*args, **kwargs):
        raise AssertionError("read the trace before refusing")

    monkeypatch.setattr(kvprof.cli.fleet_cmd, "open_trace", no_read)
    path = tmp_path / "plain.jsonl"
    write_jsonl(path, _records())
    replicas = ",".join(str(n) for n in range(1, 601))  # 600 configurations, 1,200 with lru+hints
    result = invoke("fleet", path, "--policies", "lru", "--router", "round-robin", "--replicas", replicas,
                    "--capacity", "64", "-o", tmp_path / "out", *WINDOWS)
    assert result.exit_code == 2 and "1,200 configurations" in one_line(result.stderr), result.output
    assert "--ignore-hints leaves them out" in one_line(result.stderr)


def test_fleet_says_what_the_hints_did_summed_over_the_replicas(hinted_trace, tmp_path):
    result = invoke("fleet", hinted_trace, "--policies", "lru", "--capacity", "64", "--replicas", "2", "--router",
                    "round-robin", "-o", tmp_path / "out", *WINDOWS)
    assert result.exit_code == 0, result.output
    rows = {row["policy"]: row for row in json.loads((tmp_path / "out" / "results.json").read_text())["runs"]}
    assert rows["lru, round-robin x2"]["hints"] is None
    counts = rows["lru+hints, round-robin x2"]["hints"]
    assert counts["released_evicted"] > 0 and "what the hints did" in result.stdout
