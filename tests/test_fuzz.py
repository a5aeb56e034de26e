"""Standing guard: arbitrary bytes and JSON values either load or raise kvprof's own located error.

Never another exception (a traceback is a bug). Example counts are bounded so CI stays fast; raise
them locally with ``--hypothesis-seed`` and a profile if a loader changes.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprof import results
from kvprof.errors import ResultsFileError, TraceError
from kvprof.profiler.reader import read_trace

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: Any JSON value: what a corrupted or hostile file may hold at any place.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
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
                assert str(err).startswith(str(path))


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
