"""The hyperparameter file: round trip, atomic save, strict loader, published format."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

from kvprof.errors import HpFileError
from kvprof.models.hp import DEFAULT_CLASS, PUBLISHED_HORIZON_S, SCHEMA, ClassParams, HpFile, load_hp
from kvprof.classes import ClassRule, workload_class


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
        sessions={"text": {"n_sessions": 10, "survival": [1.0, 0.5], "p_next_turn": [0.5, 0.0],
                           "think_time_s": None}},
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


# (case, edit of the valid file's dict, JSON location the error must name, words the message must contain)
LOADER_ERRORS = [
    ("schema v2", lambda d: _set(d, "schema", "kvprof.hp/2"), "schema",
     "schema 'kvprof.hp/2' is not supported; this kvprof reads kvprof.hp/1"),
    ("schema missing", lambda d: _delete(d, "schema"), "schema", "missing"),
    ("p NaN", lambda d: _set(d, "classes.text_1.p", math.nan), "classes.text_1.p", "finite"),
    ("p above 1", lambda d: _set(d, "classes.text_1.p", 1.5), "classes.text_1.p", "in [0, 1]"),
    ("lambda negative", lambda d: _set(d, "classes.text_2.lambda", -0.1), "classes.text_2.lambda", ">= 0"),
    ("lambda infinite", lambda d: _set(d, "default.lambda", math.inf), "default.lambda", "finite"),
    ("p a string", lambda d: _set(d, "classes.text_1.p", "0.4"), "classes.text_1.p", "expected a number"),
    ("p a bool", lambda d: _set(d, "classes.text_1.p", True), "classes.text_1.p", "expected a number"),
    ("horizon zero", lambda d: _set(d, "horizon_s", 0), "horizon_s", "> 0"),
    ("horizon missing", lambda d: _delete(d, "horizon_s"), "horizon_s", "missing"),
    ("unknown top-level key", lambda d: _set(d, "horizon", 60.0), "horizon", "unknown key"),
    ("typo in a class", lambda d: _set(d, "classes.text_1.lamda", 0.1), "classes.text_1.lamda", "unknown key"),
    ("class lambda missing", lambda d: _delete(d, "classes.text_1.lambda"), "classes.text_1.lambda", "missing"),
    ("bad source", lambda d: _set(d, "classes.text_1.source", "guess"), "classes.text_1.source", "not one of"),
    ("naive p above 1", lambda d: _set(d, "classes.text_1.naive.p", 2.0), "classes.text_1.naive.p", "in [0, 1]"),
    ("negative count", lambda d: _set(d, "classes.text_1.diagnostics.n_reuses", -1),
     "classes.text_1.diagnostics.n_reuses", ">= 0"),
    ("ks NaN", lambda d: _set(d, "classes.text_1.diagnostics.ks", math.nan), "classes.text_1.diagnostics.ks", "finite"),
    ("classes not an object", lambda d: _set(d, "classes", []), "classes", "expected an object"),
    ("turn cap zero", lambda d: _set(d, "class_rule.turn_cap", 0), "class_rule.turn_cap", ">= 1"),
    ("unknown class key", lambda d: _set(d, "class_rule.key", "model"), "class_rule", "not one of"),
    ("block size zero", lambda d: _set(d, "block_size", 0), "block_size", ">= 1"),
    ("reserved class name", lambda d: _set(d, "classes.<default>", {"p": 0.1, "lambda": 0.1}),
     "classes.<default>", "not a usable class name"),
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
