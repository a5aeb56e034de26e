"""The hyperparameter file: round trip, atomic save, strict loader, published format."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvprof.classes import MAX_TURN_CAP, ClassRule, workload_class
from kvprof.errors import HpFileError
from kvprof.models.hp import DEFAULT_CLASS, PUBLISHED_HORIZON_S, SCHEMA, ClassParams, HpFile, load_hp
from kvprof.models.sessions import session_stats
from tests.helpers import invoke, make_trace, one_line


@pytest.fixture
def hp():
    return HpFile(
        classes={
            "text_2": ClassParams(0.6, 0.05, "shrunk", naive={"p": 0.5, "lambda": 0.07}),
            "text_1": ClassParams(
                0.41,
                0.012,
                "fit",
                naive={"p": 0.38, "lambda": 0.02},
                diagnostics={"n_accesses": 10, "n_reuses": 4, "n_censored": 6, "ks": 0.03,
                             "mean_gap_s": 80.1, "median_gap_s": 47.0},
            ),
        },
        default=ClassParams(0.3, 0.01, "pooled"),
        horizon=60.0,
        class_rule=ClassRule("type_turn", turn_cap=5),
        min_gap=0.3,
        block_size=16,
        provenance={"trace": "a.jsonl", "window": [0, 3600], "n_requests": np.int64(21600)},
        sessions={"text": {"n_requests": 15, "n_sessions": 10, "survival": [1.0, 0.5], "p_next_turn": [0.5, 0.0],
                           "think_time_s": {"mean": 60.0, "median": 40.0, "p90": 150.0}}},
    )


def test_save_then_load_gives_the_same_file(hp, tmp_path):
    path = tmp_path / "hp.json"
    hp.save(path)
    loaded = load_hp(path)
    assert loaded == hp
    assert loaded.to_dict() == json.loads(path.read_text())


def test_json_layout_uses_the_documented_names(hp):
    data = hp.to_dict()
    assert data["schema"] == SCHEMA
    assert (data["horizon_s"], data["min_gap_s"], data["block_size"]) == (60.0, 0.3, 16)
    assert data["class_rule"] == {"key": "type_turn", "turn_cap": 5}
    assert data["classes"]["text_1"]["lambda"] == 0.012 and "lam" not in data["classes"]["text_1"]
    assert data["default"] == {"p": 0.3, "lambda": 0.01, "source": "pooled"}  # no naive/diagnostics when absent


def test_table_puts_sorted_classes_first_and_the_default_last(hp):
    names, p, lam = hp.table()
    assert names == ("text_1", "text_2", DEFAULT_CLASS)
    np.testing.assert_array_equal(p, [0.41, 0.6, 0.3])
    np.testing.assert_array_equal(lam, [0.012, 0.05, 0.01])
    assert [hp.index_of(name) for name in ("text_1", "text_2", "text_9", "")] == [0, 1, 2, 2]
    p[0] = 0.0  # the caller's copy; the file's table is unchanged
    assert hp.table()[1][0] == 0.41


def test_a_failed_save_leaves_the_previous_file_and_no_temporary(hp, tmp_path, monkeypatch):
    path = tmp_path / "hp.json"
    path.write_text("previous")

    def fail_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("kvprof.atomic.os.replace", fail_replace)
    with pytest.raises(OSError, match="disk full"):
        hp.save(path)
    assert path.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["hp.json"]


def test_an_unserialisable_value_fails_before_touching_the_disk(hp, tmp_path):
    bad = HpFile(hp.classes, hp.default, hp.horizon, hp.class_rule, provenance={"trace": object()})
    with pytest.raises(TypeError):
        bad.save(tmp_path / "hp.json")
    assert list(tmp_path.iterdir()) == []


def _set(data, dotted, value):
    *parents, last = dotted.split(".")
    for key in parents:
        data = data[key]
    data[last] = value


def _delete(data, dotted):
    *parents, last = dotted.split(".")
    for key in parents:
        data = data[key]
    del data[last]


HUGE = 10**400  # a JSON integer no float holds
TEXT_SESSION = "sessions.text"
NEXT_TURN = {"horizon_s": 30.0, "began": 100, "began_followed": 5, "continued": 40, "continued_followed": 12}
RETENTION_ROW = {"requests": 10, "returned": 8, "share_returned": 0.85, "retention_s": [3.0, 40.0]}
RETENTION = {"from": "arrival", "shares": [0.5, 0.9], "classes": {"text_1": {"tool_call": RETENTION_ROW}},
             "default": {"any": RETENTION_ROW}}

# (case, edit of the valid file's dict, JSON location the error must name, words the message must contain)
LOADER_ERRORS = [
    ("schema v7", lambda d: _set(d, "schema", "kvprof.hp/7"), "schema",
     "schema 'kvprof.hp/7' is not supported; this kvprof reads kvprof.hp/1, kvprof.hp/2, kvprof.hp/3, kvprof.hp/4, "
     "kvprof.hp/5 and kvprof.hp/6"),
    ("retention in a v5 file", lambda d: (_set(d, "schema", "kvprof.hp/5"), _set(d, "retention", RETENTION)),
     "retention", "unknown key 'retention'"),
    ("retention shares not rising", lambda d: _set(d, "retention", {**RETENTION, "shares": [0.9, 0.5]}),
     "retention.shares", "must rise strictly within (0, 1]"),
    ("retention share 0", lambda d: _set(d, "retention", {**RETENTION, "shares": [0.0, 0.5]}),
     "retention.shares", "must rise strictly within (0, 1]"),
    ("retention basis unknown", lambda d: _set(d, "retention", {**RETENTION, "from": "start"}),
     "retention.from", "must be one of arrival, end"),
    ("retention kind unknown", lambda d: _set(d, "retention", {**RETENTION, "default": {"release": RETENTION_ROW}}),
     "retention.default.release", "unknown key 'release'"),
    ("retention class name", lambda d: _set(d, "retention", {**RETENTION, "classes": {"<default>": {}}}),
     "retention.classes.<default>", "not a usable class name"),
    ("retention returned above requests",
     lambda d: _set(d, "retention", {**RETENTION, "default": {"any": {**RETENTION_ROW, "returned": 11}}}),
     "retention.default.any.returned", "from 0 to 10"),
    ("retention waits one short",
     lambda d: _set(d, "retention", {**RETENTION, "default": {"any": {**RETENTION_ROW, "retention_s": [3.0]}}}),
     "retention.default.any.retention_s", "one wait per share (2), got 1"),
    ("retention wait negative",
     lambda d: _set(d, "retention", {**RETENTION, "default": {"any": {**RETENTION_ROW, "retention_s": [-1.0, 3.0]}}}),
     "retention.default.any.retention_s[0]", "got float -1.0"),
    ("retention waits falling",
     lambda d: _set(d, "retention", {**RETENTION, "default": {"any": {**RETENTION_ROW, "retention_s": [9.0, 3.0]}}}),
     "retention.default.any", "non-decreasing"),
    ("retention share 0 beside returns",
     lambda d: _set(d, "retention", {**RETENTION, "default": {"any": {**RETENTION_ROW, "share_returned": 0}}}),
     "retention.default.any", "0 exactly when none returned"),
    ("retention wait null beside returns",
     lambda d: _set(d, "retention", {**RETENTION, "default": {"any": {**RETENTION_ROW, "retention_s": [None, 3.0]}}}),
     "retention.default.any", "all null (nothing returned)"),
    ("next_turn in a v4 file", lambda d: (_set(d, "schema", "kvprof.hp/4"), _set(d, "next_turn", NEXT_TURN)), "next_turn",
     "unknown key 'next_turn'"),
    ("next_turn followed above its requests", lambda d: _set(d, "next_turn", {**NEXT_TURN, "began_followed": 101}),
     "next_turn.began_followed", "at most began (100), got 101"),
    ("next_turn count negative", lambda d: _set(d, "next_turn", {**NEXT_TURN, "continued": -1}),
     "next_turn.continued", "an integer from 0"),
    ("next_turn key unknown", lambda d: _set(d, "next_turn", {**NEXT_TURN, "ratio": 3.0}), "next_turn.ratio",
     "unknown key 'ratio'"),
    ("schema missing", lambda d: _delete(d, "schema"), "schema", "missing"),
    ("schema a number", lambda d: _set(d, "schema", 1), "schema", "schema 1 is not supported"),
    ("p NaN", lambda d: _set(d, "classes.text_1.p", math.nan), "classes.text_1.p", "NaN is not a JSON number"),
    ("p above 1", lambda d: _set(d, "classes.text_1.p", 1.5), "classes.text_1.p", "from 0 to 1, got float 1.5"),
    ("lambda negative", lambda d: _set(d, "classes.text_2.lambda", -0.1), "classes.text_2.lambda", ">= 0"),
    ("lambda infinite", lambda d: _set(d, "default.lambda", math.inf), "default.lambda", "Infinity is not a JSON number"),
    ("p a string", lambda d: _set(d, "classes.text_1.p", "0.4"), "classes.text_1.p", "must be a finite number"),
    ("p a bool", lambda d: _set(d, "classes.text_1.p", True), "classes.text_1.p", "got bool True"),
    ("horizon zero", lambda d: _set(d, "horizon_s", 0), "horizon_s", "> 0"),
    # issue 14, item 16: "-1" was told ">= 0" where the rule is "> 0"
    ("horizon negative", lambda d: _set(d, "horizon_s", -1), "horizon_s", "must be a finite number > 0 and <= 1e+09"),
    ("horizon beyond the rule", lambda d: _set(d, "horizon_s", 1e10), "horizon_s", "> 0 and <= 1e+09"),
    # issue 14, item 4: names kvprof derives, which no class taken from a trace can have
    ("a class with an @", lambda d: _set(d, "classes.a@b", {"p": 0.1, "lambda": 0.1}), "classes.a@b",
     "not a usable class name"),
    ("a class with a comma", lambda d: _set(d, "classes.a,b", {"p": 0.1, "lambda": 0.1}), "classes.a,b",
     "not a usable class name"),
    ("a reused entry of a bad name", lambda d: _set(d, "classes.<x>@reused", {"p": 0.1, "lambda": 0.1}),
     "classes.<x>@reused", "not a usable class name"),
    ("horizon missing", lambda d: _delete(d, "horizon_s"), "horizon_s", "missing"),
    ("unknown top-level key", lambda d: _set(d, "horizon", 60.0), "horizon", "unknown key"),
    ("typo in a class", lambda d: _set(d, "classes.text_1.lamda", 0.1), "classes.text_1.lamda", "unknown key"),
    ("class lambda missing", lambda d: _delete(d, "classes.text_1.lambda"), "classes.text_1.lambda", "missing"),
    ("bad source", lambda d: _set(d, "classes.text_1.source", "guess"), "classes.text_1.source",
     "must be one of fit, shrunk, pooled, published, got str 'guess'"),
    ("naive p above 1", lambda d: _set(d, "classes.text_1.naive.p", 2.0), "classes.text_1.naive.p", "from 0 to 1"),
    ("negative count", lambda d: _set(d, "classes.text_1.diagnostics.n_reuses", -1),
     "classes.text_1.diagnostics.n_reuses", "integer from 0 to"),
    ("ks NaN", lambda d: _set(d, "classes.text_1.diagnostics.ks", math.nan), "classes.text_1.diagnostics.ks",
     "NaN is not a JSON number"),
    ("classes not an object", lambda d: _set(d, "classes", []), "classes", "must be an object, got list"),
    ("turn cap zero", lambda d: _set(d, "class_rule.turn_cap", 0), "class_rule.turn_cap", "from 1 to"),
    ("unknown class key", lambda d: _set(d, "class_rule.key", "model"), "class_rule.key", "must be one of type_turn"),
    ("block size zero", lambda d: _set(d, "block_size", 0), "block_size", "from 1 to"),
    ("reserved class name", lambda d: _set(d, "classes.<default>", {"p": 0.1, "lambda": 0.1}),
     "classes.<default>", "not a usable class name"),
    # issue 9, item 7: integers beyond floats (OverflowError before)
    ("horizon 10**400", lambda d: _set(d, "horizon_s", HUGE), "horizon_s", "finite number"),
    ("p 10**400", lambda d: _set(d, "classes.text_1.p", HUGE), "classes.text_1.p", "finite number from 0 to 1"),
    ("lambda 10**400", lambda d: _set(d, "classes.text_2.lambda", HUGE), "classes.text_2.lambda", "finite number"),
    ("default lambda -10**400", lambda d: _set(d, "default.lambda", -HUGE), "default.lambda", "finite number"),
    ("naive lambda 10**400", lambda d: _set(d, "classes.text_1.naive.lambda", HUGE), "classes.text_1.naive.lambda",
     "finite number"),
    ("min gap 10**400", lambda d: _set(d, "min_gap_s", HUGE), "min_gap_s", "finite number"),
    ("ks 10**400", lambda d: _set(d, "classes.text_1.diagnostics.ks", HUGE), "classes.text_1.diagnostics.ks",
     "finite number"),
    ("mean gap 10**400", lambda d: _set(d, "classes.text_1.diagnostics.mean_gap_s", HUGE),
     "classes.text_1.diagnostics.mean_gap_s", "finite number"),
    ("count beyond 64 bits", lambda d: _set(d, "classes.text_1.diagnostics.n_accesses", 2**64),
     "classes.text_1.diagnostics.n_accesses", "integer from 0 to"),
    ("block size 10**400", lambda d: _set(d, "block_size", HUGE), "block_size", "integer from 1 to"),
    # issue 9, item 7: the class rule's turn cap (show passed it, compare crashed)
    ("turn cap 2**31", lambda d: _set(d, "class_rule.turn_cap", 2**31), "class_rule.turn_cap",
     f"integer from 1 to {MAX_TURN_CAP}, got int {2**31}"),
    ("turn cap a float", lambda d: _set(d, "class_rule.turn_cap", 5.0), "class_rule.turn_cap", "got float 5.0"),
    ("field without key field", lambda d: _set(d, "class_rule.field", "tenant"), "class_rule",
     "a field name is given exactly when the class key is 'field'"),
    ("empty field name", lambda d: _set(d, "class_rule", {"key": "field", "field": ""}), "class_rule.field",
     "non-empty string"),
    # issue 9, item 7: the sessions block, field by field as session_stats writes it (show crashed)
    ("survival a number", lambda d: _set(d, f"{TEXT_SESSION}.survival", 5), f"{TEXT_SESSION}.survival",
     "must be a list, got int 5"),
    ("think time a list", lambda d: _set(d, f"{TEXT_SESSION}.think_time_s", [1, 2]), f"{TEXT_SESSION}.think_time_s",
     "must be an object, got list [1, 2]"),
    ("n_sessions a string", lambda d: _set(d, f"{TEXT_SESSION}.n_sessions", "many"), f"{TEXT_SESSION}.n_sessions",
     "must be an integer from 0 to 9223372036854775807, got str 'many'"),
    ("n_requests negative", lambda d: _set(d, f"{TEXT_SESSION}.n_requests", -1), f"{TEXT_SESSION}.n_requests",
     "integer from 0 to"),
    ("survival above 1", lambda d: _set(d, f"{TEXT_SESSION}.survival", [1.0, 1.5]), f"{TEXT_SESSION}.survival[1]",
     "from 0 to 1"),
    ("p_next_turn a string", lambda d: _set(d, f"{TEXT_SESSION}.p_next_turn", [0.5, "x"]),
     f"{TEXT_SESSION}.p_next_turn[1]", "got str 'x'"),
    ("p_next_turn shorter", lambda d: _set(d, f"{TEXT_SESSION}.p_next_turn", [0.5]), f"{TEXT_SESSION}.p_next_turn",
     "one entry per turn of survival (2), got 1"),
    ("more turns than reported", lambda d: _set(d, f"{TEXT_SESSION}.survival", [0.5] * 21),
     f"{TEXT_SESSION}.survival", "at most 20 entries"),
    ("think time missing p90", lambda d: _delete(d, f"{TEXT_SESSION}.think_time_s.p90"),
     f"{TEXT_SESSION}.think_time_s.p90", "missing"),
    ("think time 10**400", lambda d: _set(d, f"{TEXT_SESSION}.think_time_s.mean", HUGE),
     f"{TEXT_SESSION}.think_time_s.mean", "finite number"),
    ("session missing a key", lambda d: _delete(d, f"{TEXT_SESSION}.n_requests"), f"{TEXT_SESSION}.n_requests",
     "missing"),
    ("session typo", lambda d: _set(d, f"{TEXT_SESSION}.n_session", 3), f"{TEXT_SESSION}.n_session", "unknown key"),
    ("session not an object", lambda d: _set(d, TEXT_SESSION, [1]), TEXT_SESSION, "must be an object"),
    ("sessions not an object", lambda d: _set(d, "sessions", 5), "sessions", "must be an object"),
    ("provenance not an object", lambda d: _set(d, "provenance", "a.jsonl"), "provenance", "must be an object"),
]


@pytest.mark.parametrize("edit, where, words", [c[1:] for c in LOADER_ERRORS], ids=[c[0] for c in LOADER_ERRORS])
def test_loader_errors_name_the_file_and_the_json_location(hp, tmp_path, edit, where, words):
    data = copy.deepcopy(hp.to_dict())
    data["provenance"]["n_requests"] = 21600
    edit(data)
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))  # json writes NaN/Infinity tokens, as a careless tool would
    with pytest.raises(HpFileError) as caught:
        load_hp(path)
    error = caught.value
    assert (error.path, error.where) == (str(path), where)
    assert str(path) in str(error) and where in str(error) and words in str(error)


MINIMAL = {"schema": SCHEMA, "horizon_s": 60.0, "class_rule": {"key": "type_turn"},
           "classes": {"text_1": {"p": 0.4, "lambda": 0.01}}, "default": {"p": 0.3, "lambda": 0.01}}
SESSION = {"n_requests": 1, "n_sessions": 1, "survival": [1.0], "p_next_turn": [0.0], "think_time_s": None}

#: Issue 9, item 7: each crashed `show` or `compare` (or was silently taken). Case -> (text, location of the error).
CLI_CASES = {
    "horizon 10**400": (json.dumps({**MINIMAL, "horizon_s": HUGE}), "horizon_s"),
    "horizon 1e400": (json.dumps(MINIMAL).replace("60.0", "1e400"), "horizon_s"),
    "survival a number": (json.dumps({**MINIMAL, "sessions": {"text": {**SESSION, "survival": 5}}}),
                          "sessions.text.survival"),
    "think time a list": (json.dumps({**MINIMAL, "sessions": {"text": {**SESSION, "think_time_s": [1, 2]}}}),
                          "sessions.text.think_time_s"),
    "n_sessions a string": (json.dumps({**MINIMAL, "sessions": {"text": {**SESSION, "n_sessions": "many"}}}),
                            "sessions.text.n_sessions"),
    "turn cap 2**31": (json.dumps({**MINIMAL, "class_rule": {"key": "type_turn", "turn_cap": 2**31}}),
                       "class_rule.turn_cap"),
    "schema twice": (json.dumps(MINIMAL)[:-1] + ', "schema": "kvprof.hp/0"}', "schema"),
}


@pytest.mark.parametrize("case", CLI_CASES)
def test_show_and_compare_refuse_item_7_files_with_exit_1(tmp_path, case):
    text, where = CLI_CASES[case]
    path = tmp_path / "hp.json"
    path.write_text(text)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"chat_id": i, "parent_chat_id": -1, "timestamp": float(i), "input_length": 32,
                    "output_length": 4, "type": "text", "turn": 1, "hash_ids": [i, i + 100]}) + "\n" for i in range(4)))
    for result in (invoke("show", path),
                   invoke("compare", trace, "--config", path, "--policies", "lru,wa", "--capacity", "4",
                          "--eval-window", ":", "-j", "1", "-o", tmp_path / "out")):
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit)  # no traceback
        assert f"{path}, at {where}: " in " ".join(result.stderr.split())


def test_duplicate_keys_are_refused_where_they_are(tmp_path, hp):
    path = tmp_path / "hp.json"
    text = json.dumps(hp.to_dict(), default=int)
    for duplicated, where in (
        (text[:-1] + ', "schema": "kvprof.hp/1"}', "schema"),  # even with the same value
        (text.replace('"p": 0.41', '"p": 0.41, "p": 0.9'), "classes.text_1.p"),
        (text.replace('"n_sessions": 10', '"n_sessions": 10, "n_sessions": 11'), "sessions.text.n_sessions"),
    ):
        path.write_text(duplicated)
        with pytest.raises(HpFileError, match="appears twice") as caught:
            load_hp(path)
        assert caught.value.where == where


@pytest.mark.parametrize("depth", [100_000, 10_000])
def test_absurd_nesting_is_refused_not_a_recursion_error(tmp_path, depth):
    path = tmp_path / "hp.json"
    path.write_text('{"schema": "kvprof.hp/1", "provenance": {"x": ' + "[" * depth + "]" * depth + "}}")
    with pytest.raises(HpFileError, match="nested too deeply") as caught:
        load_hp(path)
    assert caught.value.path == str(path)


def test_what_session_stats_writes_loads(tmp_path, hp):
    """Untyped traces (type ""), no parent pairs (think time null) and 1 ms of timestamp jitter (negative think time)."""
    trace = make_trace([(0.0, "", 1, [1]), (1.0, "text", 1, [2], 1, -1), (0.9995, "text", 2, [2, 3], 2, 1),
                        (3.0, "text", 1, [4], 3, -1)])
    sessions = session_stats(trace)
    assert sessions[""]["think_time_s"] is None and sessions["text"]["think_time_s"]["mean"] < 0
    path = tmp_path / "hp.json"
    HpFile(hp.classes, hp.default, hp.horizon, hp.class_rule, sessions=sessions).save(path)
    assert load_hp(path).sessions == sessions


def test_loader_reports_where_the_json_breaks(tmp_path):
    path = tmp_path / "hp.json"
    path.write_text('{"schema": "kvprof.hp/1",\n "horizon_s": }')
    with pytest.raises(HpFileError, match="not valid JSON") as caught:
        load_hp(path)
    assert caught.value.where == "line 2, column 15" and str(path) in str(caught.value)
    with pytest.raises(HpFileError, match="cannot read"):
        load_hp(tmp_path / "missing.json")


def test_published_format_is_read_unchanged(tmp_path):
    path = tmp_path / "published.json"
    path.write_text(json.dumps({"a": {"text_1": 0.02, "text_7": 0.01}, "p": {"text_1": 0.4, "text_7": 0.3}}))
    hp = load_hp(path)
    assert hp.horizon == PUBLISHED_HORIZON_S and hp.block_size is None
    assert hp.classes["text_7"] == ClassParams(0.3, 0.01, "published")
    # The published classes are type x turn without a cap: turn 7 stays text_7, unlisted turns get the default.
    assert hp.index_of(workload_class(hp.class_rule, "text", 7)) == hp.table()[0].index("text_7")
    assert hp.index_of(workload_class(hp.class_rule, "text", 30)) == len(hp.classes)
    # The published rule for unknown classes: lambda 0, p 1.
    assert (hp.default.p, hp.default.lam, hp.default.source) == (1.0, 0.0, "published")
    # It can be re-saved in kvprof's own schema without loss.
    hp.save(path)
    assert load_hp(path) == hp


@pytest.mark.parametrize(
    "data, where",
    [
        ({"a": {"text_1": 0.02}, "p": {}}, "p.text_1"),
        ({"a": {"text_1": 0.02}, "p": {"text_1": 1.2}}, "p.text_1"),
        ({"a": {"text_1": -1}, "p": {"text_1": 0.5}}, "a.text_1"),
        ({"a": {"text_1": 0.02}}, "p"),
    ],
)
def test_published_format_is_validated_too(tmp_path, data, where):
    path = tmp_path / "published.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HpFileError) as caught:
        load_hp(path)
    assert caught.value.where == where and str(path) in str(caught.value)


def test_class_params_refuse_impossible_values():
    with pytest.raises(ValueError, match="p"):
        ClassParams(1.5, 0.1)
    with pytest.raises(ValueError, match="lambda"):
        ClassParams(0.5, math.nan)
    with pytest.raises(ValueError, match="source"):
        ClassParams(0.5, 0.1, source="magic")


# --- version 2: cells, mixtures, the cell rule, tuning ----------------------------------------


@pytest.fixture(scope="module")
def fitted_v2(tmp_path_factory):
    """A kvprof.hp/2 file as fit writes it: learned cells, tiers, held-out quality and a tuning entry."""
    from kvprof.profiler.fit import fit_trace
    from kvprof.profiler.reader import read_trace
    from kvprof.profiler.synth import generate, write_jsonl

    path = tmp_path_factory.mktemp("v2") / "trace.jsonl"
    write_jsonl(path, generate("bailian-a", 0.3, 1))
    trace, _ = read_trace(path)
    hp = fit_trace(trace.time_window(0, 540), max_cells=4, holdout=trace.time_window(540, 1080))
    tuning = ({"capacity": 512, "horizon_s": 15.0, "start": "frequency", "measured": {"shadow_hits": {"frequency": 1}}},
              {"capacity": 4096, "horizon_s": 60.0, "start": "model"})
    import dataclasses

    return dataclasses.replace(hp, tuning=tuning)


def test_a_fitted_version_2_file_round_trips(fitted_v2, tmp_path):
    path = tmp_path / "hp.json"
    fitted_v2.save(path)
    loaded = load_hp(path)
    assert loaded.to_dict() == fitted_v2.to_dict() and loaded.schema == SCHEMA
    assert loaded.cell_rule == fitted_v2.cell_rule and loaded.cell_names() == fitted_v2.cell_names()
    p, weights, rates = loaded.reuse_rows()
    assert p.shape == (len(loaded.cell_names()), 4) and weights.shape == rates.shape == p.shape + (weights.shape[2],)
    np.testing.assert_allclose(weights.sum(axis=2), 1.0)
    held = [row.diagnostics["holdout"] for tiers in loaded.cells.values() for row in tiers
            if row.diagnostics and "holdout" in row.diagnostics]
    assert held and all({"log_loss", "brier", "n", "single"} <= set(h) for h in held)


def test_tuning_is_taken_from_the_nearest_capacity_by_ratio(fitted_v2):
    assert fitted_v2.tuned(None) == {} and fitted_v2.tuned(100)["start"] == "frequency"
    assert fitted_v2.tuned(1440)["capacity"] == 512 and fitted_v2.tuned(1460)["capacity"] == 4096  # ratio midpoint 1448
    from kvprof.policy import make_policy

    policy = make_policy("wa", fitted_v2, 500)
    assert policy.order_name == "frequency" and policy.horizon == 15.0
    assert make_policy("wa", fitted_v2, 500, horizon=7.0).horizon == 7.0


def test_a_version_1_file_reads_its_classes_as_cells(hp):
    with_reused = HpFile({**hp.classes, "text_1@reused": ClassParams(0.9, 0.2)}, hp.default, hp.horizon,
                         hp.class_rule)
    assert with_reused.cell_names() == ("text_1", "text_2", DEFAULT_CLASS)
    p, weights, rates = with_reused.reuse_rows()
    np.testing.assert_array_equal(p[0], [0.41, 0.9, 0.9, 0.9])  # tier 0 the class, hit tiers its @reused entry
    np.testing.assert_array_equal(p[1], [0.6] * 4)
    np.testing.assert_array_equal(rates[:, :, 0][2], [0.01] * 4) and np.testing.assert_array_equal(weights, 1.0)
    assert with_reused.cell_index("text_2") == 1 and with_reused.cell_index("nope") == 2


V2_ERRORS = [
    ("weights not summing to 1", lambda d: _first_row(d)["components"][0].update(weight=0.5),
     "components", "weights must sum to 1"),
    ("a rate 1e400", lambda d: _first_row(d)["components"][0].update(rate=HUGE), "components[0].rate", "finite number"),
    ("no component", lambda d: _first_row(d).update(components=[]), "components", "must not be empty"),
    ("three tiers", lambda d: d["cells"][_first_cell(d)].pop(), None, "one reuse row per tier (4), got 3"),
    ("other tier edges", lambda d: d.update(tier_edges=[0, 1, 3]), "tier_edges", "reuse tiers [0, 1, 2, 4]"),
    ("a row typo", lambda d: _first_row(d).update(pp=1), "pp", "unknown key"),
    ("tuning start unknown", lambda d: d["tuning"][0].update(start="mru"), "tuning[0].start", "must be one of lru"),
    ("tuning capacity 0", lambda d: d["tuning"][0].update(capacity=0), "tuning[0].capacity", "integer from 1"),
    ("rule leaf names another cell", lambda d: _first_leaf(d).update(cell="elsewhere"), "cell_rule",
     "must name the same cells"),
    ("rule node test unknown feature", lambda d: _first_test(d).update(feature="nope"), "feature", "must be one of"),
    ("rule child before parent", lambda d: _first_test(d).update(left=0), "cell_rule", "children come after"),
    # issue 14, item 21: accepted although inconsistent
    ("a capacity tuned twice", lambda d: d["tuning"][1].update(capacity=512), "tuning[1].capacity",
     "capacity 512 is tuned twice (also tuning[0])"),
    ("a feature of no field of the rule", lambda d: d["cell_rule"]["features"].append("model=m1"),
     "cell_rule.features[" , "'model=m1' is no feature this rule can read"),
    ("a field that cannot make features", lambda d: d["cell_rule"]["fields"].append("a=b"), "cell_rule.fields[0]",
     "cannot name a cell field"),
    ("two leaves of one name", lambda d: _rename_second_leaf(d), "cell_rule", "each cell's name must be its own"),
]


def _rename_second_leaf(d):
    leaves = [n for n in d["cell_rule"]["nodes"] if "cell" in n]
    del d["cells"][leaves[1]["cell"]]
    leaves[1]["cell"] = leaves[0]["cell"]


def _first_cell(d):
    return next(iter(d["cells"]))


def _first_row(d):
    return d["cells"][_first_cell(d)][0]


def _first_leaf(d):
    return next(n for n in d["cell_rule"]["nodes"] if "cell" in n)


def _first_test(d):
    return next(n for n in d["cell_rule"]["nodes"] if "feature" in n)


@pytest.mark.parametrize("edit, where_ends, words", [c[1:] for c in V2_ERRORS], ids=[c[0] for c in V2_ERRORS])
def test_version_2_errors_are_located(fitted_v2, tmp_path, edit, where_ends, words):
    data = json.loads(json.dumps(fitted_v2.to_dict()))
    edit(data)
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HpFileError) as caught:
        load_hp(path)
    assert words in str(caught.value)
    if where_ends is not None:
        assert caught.value.where.endswith(where_ends) or where_ends in caught.value.where, caught.value.where


def test_version_2_keys_in_a_version_1_file_are_unknown(fitted_v2, tmp_path):
    data = {**fitted_v2.to_dict(), "schema": "kvprof.hp/1"}
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HpFileError, match="unknown key"):
        load_hp(path)


def test_a_cells_diagnostics_are_checked_like_a_class_s(tmp_path):
    """A hand-edited hold-out score in a cell's row is a located error, not a crash in ``show``."""
    data = json.loads((Path(__file__).resolve().parent.parent / "configs" / "bailian-a-hp.json").read_text())
    name = next(iter(data["cells"]))
    row = next(r for r in data["cells"][name] if (r.get("diagnostics") or {}).get("holdout"))
    row["diagnostics"]["holdout"] = 10**400
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HpFileError, match=r"diagnostics\.holdout.*must be an object"):
        load_hp(path)


@pytest.mark.parametrize("place, value, message", [
    (("hit_ratio_by_horizon_s",), 10**400, r"measured\.hit_ratio_by_horizon_s.*must be an object"),  # a CI fuzz find
    (("hit_ratio_by_horizon_s", "15"), 1.5, r"hit_ratio_by_horizon_s\.15.*from 0 to 1"),
    (("shadow_hits", "model"), "many", r"shadow_hits\.model.*must be an integer"),
    (("shadow_hits", "mru"), 3, r"shadow_hits\.mru.*must be one of"),
    (("extra",), 1, r"measured\.extra.*unknown key"),
])
def test_what_tuning_measured_is_checked(tmp_path, place, value, message):
    """``show`` prints a tuning entry's measurements, so a hand-edited one is a located error."""
    data = json.loads((Path(__file__).resolve().parent.parent / "configs" / "bailian-a-hp.json").read_text())
    target = data["tuning"][0]["measured"]
    for key in place[:-1]:
        target = target[key]
    target[place[-1]] = value
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HpFileError, match=message):
        load_hp(path)


def test_a_v1_file_saved_again_equals_what_was_read(tmp_path):
    """Saving writes kvprof.hp/2; the schema read from is not part of equality (a fuzz find)."""
    v1 = load_hp(Path(__file__).resolve().parent.parent / "configs" / "bailian-a-hp-v1.json")
    assert v1.schema == "kvprof.hp/1"
    v1.save(tmp_path / "again.json")
    again = load_hp(tmp_path / "again.json")
    assert again.schema == SCHEMA and again == v1


# --- issue 14: what show says of a file -----------------------------------------------------------------


def test_a_file_with_a_p_key_and_other_keys_is_a_kvprof_file_without_schema_not_the_published_format(hp, tmp_path):
    data = hp.to_dict()
    del data["schema"], data["provenance"]
    data["p"] = {"text_1": 0.4}
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HpFileError) as caught:
        load_hp(path)
    assert caught.value.where == "schema" and "is missing" in str(caught.value)


def test_show_names_the_schema_it_read_and_says_when_there_is_no_provenance(hp, tmp_path):
    """An hp/1 or hp/2 file without provenance was shown as the published format."""
    data = hp.to_dict()
    del data["provenance"]
    path = tmp_path / "hp.json"
    for schema in ("kvprof.hp/1", "kvprof.hp/2"):
        path.write_text(json.dumps({**data, "schema": schema}))
        shown = invoke("show", path)
        assert shown.exit_code == 0 and f"schema {schema}" in shown.stdout and "no provenance" in shown.stdout
        assert "published" not in shown.stdout.split("\n")[0]
    path.write_text(json.dumps({"a": {"text_1": 0.02}, "p": {"text_1": 0.4}}))
    assert "published profiler format" in invoke("show", path).stdout


@pytest.mark.parametrize("schema, words", [
    ("kvprof.result/1", "show reads hp files (kvprof.hp/1, kvprof.hp/2, kvprof.hp/3, kvprof.hp/4, kvprof.hp/5, "
                        "kvprof.hp/6, or the "
                        "published format) "
                        "and results files (kvprof.results/1)"),
    ("kvprof.results/2", 'results schema "kvprof.results/2" is not supported; this kvprof reads kvprof.results/1'),
])
def test_show_of_a_file_of_another_schema_says_what_show_reads(tmp_path, schema, words):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"schema": schema, "runs": []}))
    result = invoke("show", path)
    assert result.exit_code == 1 and words in result.stderr


def test_a_big_cell_rule_is_shown_in_part(tmp_path):
    """A 3,000-node cell rule took 17 s to show: tables now stop at 256 rows and count the rest."""
    document = json.loads(Path("configs/bailian-a-hp.json").read_text())
    row = next(iter(document["cells"].values()))
    n = 1500
    nodes = []
    for i in range(n):
        nodes += [{"feature": "turn", "threshold": float(i), "left": len(nodes) + 1, "right": len(nodes) + 2},
                  {"cell": f"c{i}"}]
    nodes.append({"cell": f"c{n}"})
    document["cells"] = {f"c{i}": row for i in range(n + 1)}
    document["cell_rule"] = {"features": ["turn"], "fields": [], "nodes": nodes}
    path = tmp_path / "big.json"
    path.write_text(json.dumps(document))
    shown = invoke("show", path)
    assert shown.exit_code == 0 and "and 1,438 more cells (--json shows them all)" in one_line(shown.stdout)


def test_a_long_cell_name_is_shown_whole(tmp_path):
    """Cell names were cut (an ellipsis) in fit's and show's tables; the name column now folds."""
    document = json.loads(Path("configs/bailian-a-hp.json").read_text())
    long_name = "class=text_1,10.7<log2_prompt_tokens<=11.8,turn>4.5," + "".join(chr(97 + i % 26) for i in range(150))
    first = next(iter(document["cells"]))
    document["cells"] = {long_name: document["cells"][first]}
    document["cell_rule"] = {"features": [], "fields": [], "nodes": [{"cell": long_name}]}
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(document))
    shown = invoke("show", path)
    assert shown.exit_code == 0 and "…" not in shown.stdout
    rest = iter(shown.stdout)
    assert all(char in rest for char in long_name)  # every character, in order, across the folded lines


# --- version 3: the learned candidate's predictor in a tuning entry --------------------------------


def _with_learned(hp: HpFile) -> HpFile:
    """``hp`` tuned for one capacity with a predictor over its cells, started on it."""
    import dataclasses

    from kvprof.models.learned import N_LOG_BINS, LearnedModel

    model = LearnedModel(-0.5, cell=tuple(0.1 * i for i in range(len(hp.cell_names()))), tier=(-1.0, 0.0, 0.5, 2.0),
                         depth=(0.25,) * N_LOG_BINS, tail=(-0.25,) * N_LOG_BINS, edges=(0.25, 0.5),
                         quality={"n_frees": 10, "holdout_log_loss": 0.4})
    return dataclasses.replace(hp, tuning=({"capacity": 512, "horizon_s": 15.0, "start": "learned", "learned": model},))


def test_a_version_3_file_with_a_predictor_round_trips_and_adds_the_candidate(fitted_v2, tmp_path):
    from kvprof.policy import make_policy

    hp = _with_learned(fitted_v2)
    hp.save(tmp_path / "hp.json")
    loaded = load_hp(tmp_path / "hp.json")
    assert loaded.schema == SCHEMA and loaded.to_dict() == hp.to_dict()
    assert loaded.tuning[0]["learned"] == hp.tuning[0]["learned"]
    policy = make_policy("wa", loaded, capacity=500)
    assert policy.order_names[0] == "learned" and policy.learned == hp.tuning[0]["learned"]
    # Without a predictor for the capacity the candidate is absent, as in older files.
    assert "learned" not in make_policy("wa", fitted_v2, capacity=500).order_names


def _learned_data(fitted_v2) -> dict:
    return _with_learned(fitted_v2).to_dict()


@pytest.mark.parametrize("edit, where, words", [
    (lambda d: (d.pop("next_turn", None), d.pop("retention", None), d.update(schema="kvprof.hp/2")), "tuning[0].learned", "unknown key"),
    (lambda d: d["tuning"][0]["learned"]["cell"].append(0.0), "tuning[0].learned.cell", "the file has"),
    (lambda d: d["tuning"][0]["learned"]["depth"].pop(), "tuning[0].learned.depth", "must hold 12 weights"),
    (lambda d: d["tuning"][0]["learned"]["tier"].__setitem__(1, "x"), "tuning[0].learned.tier[1]", "finite number"),
    (lambda d: d["tuning"][0]["learned"].update(bias=10**400), "tuning[0].learned.bias", "finite number"),
    (lambda d: d["tuning"][0]["learned"].update(edges=[0.5, 0.25]), "tuning[0].learned.edges", "increasing"),
    (lambda d: d["tuning"][0]["learned"].update(edges=[1.0]), "tuning[0].learned.edges[0]", "> 0"),
    (lambda d: d["tuning"][0]["learned"].update(edges=[]), "tuning[0].learned.edges", "must not be empty"),
    (lambda d: d["tuning"][0]["learned"]["quality"].update(n_frees="ten"), "tuning[0].learned.quality.n_frees",
     "finite number"),
    (lambda d: d["tuning"][0].pop("learned"), "tuning[0].start", "no learned predictor"),
])
def test_a_bad_predictor_is_a_located_error(fitted_v2, tmp_path, edit, where, words):
    data = _learned_data(fitted_v2)
    edit(data)
    _assert_located_error(data, tmp_path, where, words)


def _assert_located_error(data: dict, tmp_path, where: str, words: str) -> None:
    """Loading ``data`` fails at JSON location ``where`` with a message holding ``words``."""
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HpFileError) as caught:
        load_hp(path)
    assert caught.value.where == where and words in str(caught.value)


# --- version 4: the long-output candidate's limit in a tuning entry --------------------------------


def _long_output_data(hp: HpFile) -> dict:
    """``hp`` tuned for one capacity with a long-output limit, started on that candidate, as JSON."""
    import dataclasses

    tuned = {"capacity": 512, "horizon_s": 15.0, "start": "long-output", "long_output_tokens": 225.0,
             "measured": {"hit_ratio_by_output_limit": {"145": 0.30, "225": 0.31}, "lru_hit_ratio": 0.29}}
    return dataclasses.replace(hp, tuning=(tuned,)).to_dict()


def test_a_version_4_file_with_an_output_limit_round_trips_and_adds_the_candidate(fitted_v2, tmp_path):
    from kvprof.policy import make_policy

    data = _long_output_data(fitted_v2)
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))
    loaded = load_hp(path)
    assert loaded.schema == SCHEMA == "kvprof.hp/6" and loaded.to_dict() == data
    policy = make_policy("wa", loaded, capacity=500)
    assert policy.order_names[0] == "long-output" and policy.output_limit == 225.0
    assert policy._followed[0].limit == 225.0
    # Without a limit for the capacity the candidate is absent, as in older files.
    assert "long-output" not in make_policy("wa", fitted_v2, capacity=500).order_names


@pytest.mark.parametrize("edit, where, words", [
    (lambda d: (d.pop("next_turn", None), d.pop("retention", None), d.update(schema="kvprof.hp/3")), "tuning[0].long_output_tokens",
     "unknown key"),
    (lambda d: d["tuning"][0].update(long_output_tokens=-1), "tuning[0].long_output_tokens", "from 0 to"),
    (lambda d: d["tuning"][0].update(long_output_tokens="many"), "tuning[0].long_output_tokens", "finite number"),
    (lambda d: d["tuning"][0].update(long_output_tokens=1e300), "tuning[0].long_output_tokens", "from 0 to"),
    (lambda d: d["tuning"][0].pop("long_output_tokens"), "tuning[0].start", "no long_output_tokens"),
    (lambda d: d["tuning"][0]["measured"]["hit_ratio_by_output_limit"].update({"300": 1.5}),
     "tuning[0].measured.hit_ratio_by_output_limit.300", "from 0 to 1"),
    (lambda d: d["tuning"][0]["measured"].update(lru_hit_ratio=None), "tuning[0].measured.lru_hit_ratio", "finite number"),
])
def test_a_bad_output_limit_is_a_located_error(fitted_v2, tmp_path, edit, where, words):
    data = _long_output_data(fitted_v2)
    edit(data)
    _assert_located_error(data, tmp_path, where, words)


def _finish_reason_data(hp: HpFile) -> dict:
    """``hp`` tuned for one capacity where ``wa`` carries the finish-reason candidate and starts on it, as JSON."""
    import dataclasses

    tuned = {"capacity": 512, "horizon_s": 15.0, "start": "finish-reason", "finish_reason": True,
             "measured": {"lru_hit_ratio": 0.29, "finish_reason_hit_ratio": 0.31}}
    return dataclasses.replace(hp, tuning=(tuned,)).to_dict()


def test_a_version_6_file_that_carries_the_finish_reason_candidate_round_trips_and_adds_it(fitted_v2, tmp_path):
    from kvprof.policy import make_policy

    data = _finish_reason_data(fitted_v2)
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))
    loaded = load_hp(path)
    assert loaded.to_dict() == data
    policy = make_policy("wa", loaded, capacity=500)
    assert policy.order_names[0] == "finish-reason" and policy.order_name == "finish-reason"
    assert "finish-reason" not in make_policy("wa", fitted_v2, capacity=500).order_names


@pytest.mark.parametrize("edit, where, words", [
    (lambda d: (d.pop("retention", None), d.update(schema="kvprof.hp/5")), "tuning[0].finish_reason", "unknown key"),
    (lambda d: d["tuning"][0].update(finish_reason=False), "tuning[0].finish_reason", "leave it out"),
    (lambda d: d["tuning"][0].update(finish_reason=1), "tuning[0].finish_reason", "true or false"),
    (lambda d: d["tuning"][0].pop("finish_reason"), "tuning[0].start", "no finish_reason"),
    (lambda d: d["tuning"][0]["measured"].update(finish_reason_hit_ratio=2.0),
     "tuning[0].measured.finish_reason_hit_ratio", "from 0 to 1"),
])
def test_a_bad_finish_reason_entry_is_a_located_error(fitted_v2, tmp_path, edit, where, words):
    data = _finish_reason_data(fitted_v2)
    edit(data)
    _assert_located_error(data, tmp_path, where, words)
