"""Standing guard: arbitrary bytes and JSON values either load or raise kvprof's own located error.

Never another exception (a traceback is a bug). Example counts are bounded so CI stays fast; before
changing a loader, run the exhaustive sweeps at the end (``KVPROF_FUZZ_EXHAUSTIVE=1``, minutes):
CI's random draws found the hp loader's last three crashes one run at a time.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprof import results
from kvprof.classes import MAX_TURN_CAP
from kvprof.errors import HpFileError, ResultsFileError, TraceError
from kvprof.models.hp import load_hp
from kvprof.profiler.classes import classify_trace
from kvprof.profiler.reader import read_trace
from tests.helpers import invoke, make_trace

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: Text a hostile file may hold: any characters, lone surrogates (valid JSON: "\\ud800"), rich markup.
texts = st.text(max_size=10) | st.lists(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
    | st.sampled_from(["[bold]", "[/]", ":smile:", "\x1b[31m", "@reused", "<default>", "%"]) | st.characters(),
    max_size=4).map("".join)

#: Any JSON value: what a corrupted or hostile file may hold at any place.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=12,
)

VALID = {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 20, "output_length": 5,
         "type": "text", "turn": 1, "hash_ids": [1, 2]}


def _read(data: bytes):
    """Read ``data`` as a trace file; a TraceError is an answer, anything else propagates."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.jsonl"
        path.write_bytes(data)
        for skip_invalid in (False, True):
            try:
                read_trace(path, skip_invalid=skip_invalid)
            except TraceError as err:
                assert str(err).startswith(str(path)) and "np." not in str(err)


@FUZZ
@given(data=st.binary(max_size=300), codec=st.sampled_from([None, "gzip", "zstd", "magic"]))
def test_trace_reader_on_arbitrary_bytes(data, codec):
    if codec == "gzip":
        data = gzip.compress(data)[: len(data) + 10]  # sometimes whole, often truncated
    elif codec == "zstd":
        data = zstandard.ZstdCompressor().compress(data)[: len(data) + 5]
    elif codec == "magic":
        data = b"\x28\xb5\x2f\xfd" + data
    _read(data)


@FUZZ
@given(lines=st.lists(json_values, min_size=1, max_size=5))
def test_trace_reader_on_arbitrary_json_lines(lines):
    _read(b"".join(json.dumps(line).encode() + b"\n" for line in lines))


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([*VALID, "extra"]), json_values | st.integers()),
        min_size=1, max_size=4,
    )
)
def test_trace_reader_on_valid_records_with_fields_replaced(edits):
    """Valid lines with one field at a time set to any JSON value: reaches the checks past decoding."""
    lines = [dict(VALID, chat_id=i, timestamp=0.5 * i) for i in range(4)]
    for row, field, value in edits:
        lines[row][field] = value
    _read(b"".join(json.dumps(line).encode() + b"\n" for line in lines))


# --- the results loader -------------------------------------------------------------------------

RESULTS = {"schema": "kvprof.results/1", "complete": True, "config": {"policies": ["lru"]},
           "runs": [{"policy": "lru", "capacity": 16, "n_requests": 3, "token_hit_ratio": 0.5,
                     "qttft_mean_s": 1.0, "qttft_p99_s": 2.0}]}


def _load_results(data: bytes):
    """Load ``data`` as a results file; a ResultsFileError is an answer; a loaded one can be shown and plotted."""
    from kvprof.cli.plots import plot_results

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "results.json"
        path.write_bytes(data)
        try:
            document = results.load(path)
        except ResultsFileError as err:
            assert str(err).startswith(str(path))
            return
        plot_results(results.merge([document]), Path(tmp))


@FUZZ
@given(data=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_results_loader_on_arbitrary_bytes_and_json(data):
    _load_results(data)


@settings(max_examples=25, deadline=None)
@given(
    place=st.sampled_from(["top", "config", "run"]),
    key=st.sampled_from(["schema", "complete", "config", "runs", "policies", "engine_block_size", "rate_scale",
                         "policy", "capacity", "n_requests", "token_hit_ratio", "qttft_mean_s", "qttft_p99_s",
                         "measured", "qttft_overloaded", "inputs"]),
    value=json_values,
)
def test_results_loader_on_a_valid_document_with_one_value_replaced(place, key, value):
    """Each field set to any JSON value: reaches every check, and what loads still plots (few: each plots)."""
    document = json.loads(json.dumps(RESULTS))
    target = {"top": document, "config": document["config"], "run": document["runs"][0]}[place]
    target[key] = value
    _load_results(json.dumps(document).encode())


# --- the hp loader --------------------------------------------------------------------------------

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _trimmed(document: dict, classes: tuple[str, ...], sessions: tuple[str, ...] = ()) -> dict:
    """``document`` with only some of its classes and sessions, and of a v2 file's cells only the
    first under a one-leaf rule: fewer places to mutate, faster shows."""
    if "schema" not in document:
        return {key: {name: document[key][name] for name in classes} for key in ("a", "p")}
    trimmed = {**document, "classes": {name: document["classes"][name] for name in classes},
               "sessions": {name: document["sessions"][name] for name in sessions}}
    if "cells" in document:
        first = next(iter(document["cells"]))
        trimmed["cells"] = {first: document["cells"][first]}
        trimmed["cell_rule"] = {"features": [], "fields": [], "nodes": [{"cell": first}]}
    return trimmed


def _with_learned(document: dict) -> dict:
    """A version 3 ``document``: its first tuning entry holds a predictor over its cells (the default's included)."""
    model = {"bias": -0.5, "cell": [0.25] * (len(document["cells"]) + 1), "tier": [-1.0, 0.0, 0.5, 2.0],
             "depth": [0.1] * 12, "tail": [-0.1] * 12, "edges": [0.25, 0.5], "quality": {"n_frees": 10}}
    tuning = [{**document["tuning"][0], "learned": model}, *document["tuning"][1:]]
    return {**document, "schema": "kvprof.hp/3", "tuning": tuning}


def _with_long_output(document: dict) -> dict:
    """A version 4 ``document``: its first tuning entry starts on the long-output candidate, with its limit
    and the tuning's measurements of it."""
    entry = {**document["tuning"][0], "start": "long-output", "long_output_tokens": 225.0}
    entry["measured"] = {**entry.get("measured", {}), "hit_ratio_by_output_limit": {"145": 0.25, "225": 0.27},
                         "lru_hit_ratio": 0.18}
    return {**document, "schema": "kvprof.hp/4", "tuning": [entry, *document["tuning"][1:]]}


#: Valid documents to mutate: fitted files of every schema version and a published-format one (configs/README.md).
HP_DOCUMENTS = (
    _trimmed(json.loads((CONFIGS / "bailian-a-hp.json").read_text()), ("text_1", "text_1@reused", "text_5+"),
             ("text", "image")),
    _with_learned(_trimmed(json.loads((CONFIGS / "bailian-a-hp.json").read_text()), ("text_1",), ())),
    _with_long_output(_trimmed(json.loads((CONFIGS / "bailian-a-hp.json").read_text()), ("text_1",), ())),
    _trimmed(json.loads((CONFIGS / "bailian-a-hp-v1.json").read_text()), ("text_1", "text_1@reused", "text_5+"),
             ("text", "image")),
    _trimmed(json.loads((CONFIGS / "bailian-a-published-format.json").read_text()), ("text_1", "text_2", "file_5+")),
)

#: Values a hand-edited or hostile file may hold where a number, count or turn cap goes.
EDGE_VALUES = st.sampled_from([10**400, -(10**400), 2**31 - 1, 2**31, 2**63, 2**64, -1, 0, 1, 0.5, 1.5, -0.0, 1e308,
                               True, None, "", "many", [], [1, 2], {}])


def _places(value, path: tuple = ()) -> list[tuple]:
    """The path (keys and indexes) of ``value`` and of every value inside it."""
    if type(value) is dict:
        return [path, *(p for key, child in value.items() for p in _places(child, (*path, key)))]
    if type(value) is list:
        return [path, *(p for index, child in enumerate(value) for p in _places(child, (*path, index)))]
    return [path]


HP_PLACES = tuple(_places(document) for document in HP_DOCUMENTS)
#: A key no document holds; renamed in the text to repeat an existing key.
REPEAT = "\x00repeat"


def _mutated(document: dict, place: tuple, action: str, value) -> bytes:
    """The text of ``document`` with the value at ``place`` replaced, deleted, given a new member, or its key repeated."""
    document = copy.deepcopy(document)
    if not place:
        return json.dumps(value if action == "replace" else document).encode()
    parent = document
    for step in place[:-1]:
        parent = parent[step]
    last = place[-1]
    if action == "replace":
        parent[last] = value
    elif action == "delete":
        del parent[last]
    elif action == "add" and type(parent[last]) is dict:
        parent[last]["extra"] = value
    elif action == "add" and type(parent[last]) is list:
        parent[last].append(value)
    elif action == "repeat" and type(parent) is dict:
        parent[REPEAT] = value
        return json.dumps(document).replace(json.dumps(REPEAT), json.dumps(last), 1).encode()
    return json.dumps(document).encode()


def _load_hp(data: bytes):
    """Load ``data`` as an hp file; an HpFileError is an answer. What loads shows, saves and reads back the same, and classifies."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hp.json"
        path.write_bytes(data)
        try:
            hp = load_hp(path)
        except HpFileError as err:
            assert str(err).startswith(str(path))
            return
        shown = invoke("show", path)
        assert shown.exit_code == 0, shown.output
        assert len(hp.table()[0]) == len(hp.reused_rows()) == len(hp.classes) + 1
        saved = Path(tmp) / "saved.json"
        hp.save(saved)
        assert load_hp(saved) == hp
        trace = make_trace([(0.0, "text", 1, [1]), (1.0, "text", 9, [2]), (2.0, "image", MAX_TURN_CAP, [3])])
        if hp.class_rule.field is not None:
            trace.extra[hp.class_rule.field] = np.array(["x", "y", "x"], dtype=object)
        classify_trace(trace, hp.class_rule)


@FUZZ
@given(data=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_hp_loader_on_arbitrary_bytes_and_json(data):
    _load_hp(data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hp_loader_on_valid_documents_mutated(data):
    """One place of a valid file replaced by any JSON value or an edge value, deleted, extended or its key repeated."""
    which = data.draw(st.sampled_from(range(len(HP_DOCUMENTS))), label="document")
    place = data.draw(st.sampled_from(HP_PLACES[which]), label="place")
    action = data.draw(st.sampled_from(["replace", "delete", "add", "repeat"]), label="action")
    value = data.draw(EDGE_VALUES | json_values, label="value")
    _load_hp(_mutated(HP_DOCUMENTS[which], place, action, value))


# --- exhaustive sweeps (opt-in) -------------------------------------------------------------------

EXHAUSTIVE = os.environ.get("KVPROF_FUZZ_EXHAUSTIVE") == "1"
#: Every kind of value a hand-edited or hostile file may hold; NaN is written as JSON's ``NaN``.
SWEEP_VALUES = (10**400, -(10**400), 2**31, 2**63, 2**64, -1, 0, 1, 0.5, 1.5, -0.0, 1e308, float("nan"), True,
                None, "", "many", [], [1, 2], {}, {"a": 1}, ["x"])
SWEEP_ACTIONS = (("replace", SWEEP_VALUES), ("delete", (None,)), ("add", (1, {})), ("repeat", (1, {})))


def _sweep(document: dict, load) -> None:
    """``load`` every mutation of ``document``: each place, action and value."""
    for place in _places(document):
        for action, values in SWEEP_ACTIONS:
            for value in values:
                try:
                    load(_mutated(document, place, action, value))
                except Exception as err:
                    raise AssertionError(f"{action} at {place} with {value!r}") from err


@pytest.mark.skipif(not EXHAUSTIVE, reason="exhaustive sweep (minutes): set KVPROF_FUZZ_EXHAUSTIVE=1")
@pytest.mark.parametrize("which", range(len(HP_DOCUMENTS)))
def test_hp_loader_on_every_mutation(which):
    _sweep(HP_DOCUMENTS[which], _load_hp)


@pytest.mark.skipif(not EXHAUSTIVE, reason="exhaustive sweep (minutes): set KVPROF_FUZZ_EXHAUSTIVE=1")
def test_results_loader_on_every_mutation():
    _sweep(RESULTS, _load_results)
