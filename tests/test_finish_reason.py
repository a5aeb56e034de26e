"""How a response ended (a trace's ``stop`` field): read, checked and coded per request as ``Trace.finish``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.models.finish import END_OF_TURN, FINISH_NAMES, OTHER, TOOL_CALL, UNKNOWN, finish_code, finish_codes
from kvprof.profiler.reader import read_trace
from tests.test_reader import bailian_records, mooncake_records, read_error, write_jsonl

#: (value of ``stop``, or the key left out: ``...``; its code)
VALUES = [
    ("tool_use", TOOL_CALL),
    ("tool_calls", TOOL_CALL),
    ("function_call", TOOL_CALL),
    ("end_turn", END_OF_TURN),
    ("stop", END_OF_TURN),
    ("length", OTHER),
    ("max_tokens", OTHER),
    ("stop_sequence", OTHER),
    ("Tool_Use", OTHER),  # API constants are lower case: no guessing at other spellings
    ("", UNKNOWN),
    (None, UNKNOWN),
    (..., UNKNOWN),
]


def _with_stops(records, values):
    return [r if v is ... else dict(r, stop=v) for r, v in zip(records, values)]


def test_each_value_gets_its_code(tmp_path):
    values = [v for v, _ in VALUES]
    records = _with_stops(bailian_records(len(values)), values)
    trace, report = read_trace(write_jsonl(tmp_path / "t.jsonl", records))
    assert trace.finish.dtype == np.int8
    assert trace.finish.tolist() == [code for _, code in VALUES]
    assert list(trace.extra["stop"]) == [None if v is ... else v for v in values]  # the text stays beside the codes
    assert report.ignored_fields == ()


def test_a_trace_without_the_field_has_unknown_finishes(tmp_path):
    for records in (bailian_records(5), mooncake_records(5)):
        trace, _ = read_trace(write_jsonl(tmp_path / "t.jsonl", records))
        assert trace.finish.tolist() == [UNKNOWN] * 5


def test_the_codes_follow_their_requests_through_sorting_and_windows(tmp_path):
    records = _with_stops(bailian_records(12), ["tool_use", "end_turn", "", "length"] * 3)
    records[4]["timestamp"] = records[3]["timestamp"] - 0.0005  # out of order within the tolerance: rows sorted
    trace, _ = read_trace(write_jsonl(tmp_path / "t.jsonl", records))
    by_chat = {r["chat_id"]: finish_code(r["stop"]) for r in records}
    assert trace.finish.tolist() == [by_chat[c] for c in trace.chat_id.tolist()]
    cut = trace.time_window(records[5]["timestamp"], None)
    assert cut.finish.tolist() == [by_chat[c] for c in cut.chat_id.tolist()]


@pytest.mark.parametrize("value, words", [
    (5, "got int 5"),
    (True, "got bool True"),
    (["tool_use"], "got list"),
    ({"reason": "tool_use"}, "got dict"),
])
def test_a_value_that_is_not_a_string_names_the_file_line_and_field(tmp_path, value, words):
    records = bailian_records(6)
    records[3]["stop"] = value
    path = write_jsonl(tmp_path / "t.jsonl", records)
    err = read_error(path)
    assert (err.line, err.field) == (4, "stop") and "t.jsonl" in str(err)
    assert "must be a string" in err.reason and words in err.reason
    trace, report = read_trace(path, skip_invalid=True)
    assert report.skipped == {"wrong_type": 1} and trace.n_requests == 5


def test_a_missing_required_field_is_named_before_a_bad_stop(tmp_path):
    records = bailian_records(4)
    records[2]["stop"] = 7
    del records[2]["timestamp"]
    err = read_error(write_jsonl(tmp_path / "t.jsonl", records))
    assert (err.line, err.field) == (3, "timestamp")


def test_names_cover_the_codes():
    assert FINISH_NAMES[UNKNOWN] == "unknown" and FINISH_NAMES[TOOL_CALL] == "tool_call"
    assert FINISH_NAMES[END_OF_TURN] == "end_turn" and FINISH_NAMES[OTHER] == "other"


def test_finish_codes_refuses_a_value_that_is_not_text():
    with pytest.raises(ValueError, match="'stop' field must hold strings, got int 3"):
        finish_codes(np.array(["tool_use", 3], dtype=object), 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.sampled_from([v for v, _ in VALUES if isinstance(v, str)]), st.text(max_size=6))))
def test_codes_of_a_column_are_the_codes_of_its_values(values):
    column = np.array(values, dtype=object) if values else np.zeros(0, dtype=object)
    codes = finish_codes(column, len(values))
    assert codes.dtype == np.int8 and codes.tolist() == [finish_code(v) for v in values]
    assert set(codes.tolist()) <= {UNKNOWN, TOOL_CALL, END_OF_TURN, OTHER}
