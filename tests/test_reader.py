"""read_trace: formats, compression, windows, extra fields, every invalid input, and a round-trip property."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.errors import TraceError
from kvprof.profiler import stored
from kvprof.profiler.reader import SKIP_KINDS, ReadReport, detect_format, read_trace

# --- helpers: synthetic traces ----------------------------------------------------------------


def bailian_records(n=40, *, seed=0, block_size=16, types=("text", "search", "image", "file")):
    """Bailian-like records: rising timestamps, some follow-up turns, prefix-shared hash ids."""
    rng = np.random.default_rng(seed)
    records, next_id = [], 0
    t = 0.0
    for i in range(n):
        t += float(rng.exponential(0.5))
        parent = records[int(rng.integers(i))] if i and rng.random() < 0.3 else None
        length = int(rng.integers(0, 20 * block_size))
        n_ids = -(-length // block_size)
        shared = parent["hash_ids"][: n_ids // 2] if parent else []
        fresh = list(range(next_id, next_id + n_ids - len(shared)))
        next_id += len(fresh)
        records.append(
            {
                "chat_id": 1000 + i,
                "parent_chat_id": parent["chat_id"] if parent else -1,
                "timestamp": round(t, 3),
                "input_length": length,
                "output_length": int(rng.integers(1, 500)),
                "type": parent["type"] if parent else str(rng.choice(types)),
                "turn": parent["turn"] + 1 if parent else 1,
                "hash_ids": shared + fresh,
            }
        )
    return records


def mooncake_records(n=40, *, seed=0, block_size=512):
    """Mooncake-like records: millisecond integer timestamps, no session fields."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.integers(0, 3000, n))
    lengths = rng.integers(0, 8 * block_size, n)
    return [
        {
            "timestamp": int(times[i]),
            "input_length": int(lengths[i]),
            "output_length": int(rng.integers(1, 500)),
            "hash_ids": [int(h) for h in rng.integers(0, 50, -(-int(lengths[i]) // block_size))],
        }
        for i in range(n)
    ]


def write_jsonl(path, records, compress=None) -> Path:
    """Write records one a line (dicts as JSON, str or bytes as they are); compress: None, "gz", "zst"."""
    as_bytes = {str: str.encode, bytes: bytes}
    text = b"".join(as_bytes.get(type(r), lambda r: json.dumps(r).encode())(r) + b"\n" for r in records)
    if compress == "gz":
        text = gzip.compress(text)
    elif compress == "zst":
        text = zstandard.ZstdCompressor().compress(text)
    path = Path(path)
    path.write_bytes(text)
    return path


def assert_trace_equals(trace, records, fmt):
    """Every column of ``trace`` equals the records (already in time order)."""
    units = 1000 if fmt == "mooncake" else 1
    np.testing.assert_array_equal(trace.timestamp, [r["timestamp"] / units for r in records])
    np.testing.assert_array_equal(trace.input_length, [r["input_length"] for r in records])
    np.testing.assert_array_equal(trace.output_length, [r["output_length"] for r in records])
    np.testing.assert_array_equal(trace.hash_ids, [h for r in records for h in r["hash_ids"]])
    np.testing.assert_array_equal(trace.n_blocks_per_request, [len(r["hash_ids"]) for r in records])
    if fmt == "bailian":
        np.testing.assert_array_equal(trace.chat_id, [r["chat_id"] for r in records])
        np.testing.assert_array_equal(trace.parent_chat_id, [r["parent_chat_id"] for r in records])
        np.testing.assert_array_equal(trace.turn, [r["turn"] for r in records])
        assert list(trace.types) == [r["type"] for r in records]
    else:
        np.testing.assert_array_equal(trace.chat_id, np.arange(len(records)))
        assert (trace.parent_chat_id == -1).all() and (trace.turn == 1).all()
        assert trace.type_names == ("",)
    assert trace.hash_ids.dtype == trace.hash_offsets.dtype == np.int64
    assert trace.timestamp.dtype == np.float64


def read_error(path, **kwargs) -> TraceError:
    with pytest.raises(TraceError) as info:
        read_trace(path, **kwargs)
    return info.value


# --- formats ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, make", [("bailian", bailian_records), ("mooncake", mooncake_records)])
def test_round_trip(tmp_path, fmt, make):
    records = make()
    path = write_jsonl(tmp_path / "t.jsonl", records)
    trace, report = read_trace(path)
    assert_trace_equals(trace, records, fmt)
    assert trace.format == fmt
    assert trace.block_size == {"bailian": 16, "mooncake": 512}[fmt]
    assert trace.source == "t.jsonl"
    assert trace.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert report == ReadReport(lines=len(records), requests=len(records))


def test_detect_format():
    assert detect_format({"chat_id": 1, "timestamp": 0}) == "bailian"
    assert detect_format({"turn": 1}) == "bailian"
    assert detect_format({"timestamp": 0, "hash_ids": []}) == "mooncake"


def test_forcing_bailian_on_mooncake_names_the_missing_field(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", mooncake_records(3))
    err = read_error(path, format="bailian", block_size=512)
    assert (err.line, err.field) == (1, "chat_id")
    assert "missing" in str(err) and str(path) in str(err)


def test_forcing_mooncake_keeps_session_fields_as_extra(tmp_path):
    records = bailian_records(10, block_size=512)
    path = write_jsonl(tmp_path / "b.jsonl", [dict(r, timestamp=r["timestamp"] * 1000) for r in records])
    trace, _ = read_trace(path, format="mooncake")
    assert trace.format == "mooncake" and trace.block_size == 512
    np.testing.assert_allclose(trace.timestamp, [r["timestamp"] for r in records])
    np.testing.assert_array_equal(trace.extra["chat_id"], [r["chat_id"] for r in records])
    assert list(trace.extra["type"]) == [r["type"] for r in records]


def test_a_bailian_line_in_a_detected_mooncake_file_is_an_error_of_its_line(tmp_path):
    records = mooncake_records(5)
    lines = records[:3] + [dict(bailian_records(1, block_size=512)[0], timestamp=records[2]["timestamp"])] + records[3:]
    err = read_error(write_jsonl(tmp_path / "m.jsonl", lines))
    assert (err.line, err.field) == (4, None) and "a bailian record in a file whose line 1 is mooncake" in err.reason
    trace, report = read_trace(tmp_path / "m.jsonl", skip_invalid=True)
    assert report.skipped == {"mixed_format": 1} and trace.n_requests == 5


def test_a_fifo_is_read_as_a_stream_and_an_empty_one_says_nothing_arrived(tmp_path):
    import threading

    records = bailian_records(5)
    fifo = tmp_path / "pipe"
    for payload, expected in ((b"".join(json.dumps(r).encode() + b"\n" for r in records), None),
                              (b"", "nothing arrived")):
        if fifo.exists():
            fifo.unlink()
        os.mkfifo(fifo)
        writer = threading.Thread(target=fifo.write_bytes, args=(payload,))
        writer.start()
        if expected is None:
            trace, _ = read_trace(fifo)
            assert_trace_equals(trace, records, "bailian")
        else:
            assert expected in read_error(fifo).reason
        writer.join(timeout=10)


def test_block_size_override_drives_the_length_check(tmp_path):
    records = bailian_records(5, block_size=32)
    records[0]["input_length"] = 100  # 4 blocks of 32, 7 of 16
    records[0]["hash_ids"] = [1, 2, 3, 4]
    path = write_jsonl(tmp_path / "b32.jsonl", records)
    err = read_error(path)
    assert (err.line, err.field) == (1, "hash_ids")
    assert "4 hash ids" in err.reason and "needs 7" in err.reason
    trace, _ = read_trace(path, block_size=32)
    assert trace.block_size == 32
    assert_trace_equals(trace, records, "bailian")


@pytest.mark.parametrize("compress", ["gz", "zst"])
def test_compressed_files_detected_by_magic_bytes(tmp_path, compress):
    records = bailian_records(30)
    path = write_jsonl(tmp_path / "no_suffix.jsonl", records, compress=compress)
    progress = []
    trace, _ = read_trace(path, progress=lambda done, total: progress.append((done, total)))
    assert_trace_equals(trace, records, "bailian")
    assert trace.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()  # of the stored bytes
    assert progress[-1] == (path.stat().st_size, path.stat().st_size)


def test_multi_frame_zstd_and_multi_member_gzip(tmp_path):
    records = mooncake_records(20)
    parts = (records[:8], records[8:])
    halves = [write_jsonl(tmp_path / f"h{i}", part).read_bytes() for i, part in enumerate(parts)]
    zst = tmp_path / "t.zst"
    zst.write_bytes(b"".join(zstandard.ZstdCompressor().compress(h) for h in halves))
    gz = tmp_path / "t.gz"
    gz.write_bytes(b"".join(gzip.compress(h) for h in halves))
    for path in (zst, gz):
        assert_trace_equals(read_trace(path)[0], records, "mooncake")


@pytest.mark.parametrize("compress", ["gz", "zst"])
def test_truncated_compressed_file_is_an_error(tmp_path, compress):
    whole = write_jsonl(tmp_path / "whole", mooncake_records(300), compress=compress).read_bytes()
    path = tmp_path / "cut"
    path.write_bytes(whole[: len(whole) // 2])
    err = read_error(path)
    codec = {"gz": "gzip", "zst": "zstd"}[compress]
    assert f"cannot decompress the {codec} stream" in str(err) and str(path) in str(err)


def test_compressed_magic_with_garbage_after_it(tmp_path):
    path = tmp_path / "bad.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"not zstd at all" * 10)
    assert "cannot decompress the zstd stream" in str(read_error(path))


def test_progress_reports_every_few_megabytes(tmp_path, monkeypatch):
    monkeypatch.setattr(stored, "_PROGRESS_BYTES", 4096)  # every 4 kB instead of 4 MB, to keep the file small
    monkeypatch.setattr(stored, "_CHUNK_BYTES", 1000)
    path = write_jsonl(tmp_path / "t.jsonl", bailian_records(200))
    calls = []
    read_trace(path, progress=lambda done, total: calls.append((done, total)))
    size = path.stat().st_size
    assert len(calls) >= size // 4096 and calls[-1] == (size, size)
    assert all(later[0] > earlier[0] for earlier, later in zip(calls, calls[1:]))


# --- windows ----------------------------------------------------------------------------------


def test_default_window_starts_at_the_floor_of_the_first_arrival(tmp_path):
    records = bailian_records(10)
    for i, r in enumerate(records):
        r["timestamp"] = 3600.7 + i
    trace, _ = read_trace(write_jsonl(tmp_path / "t.jsonl", records))
    assert trace.window == (3600.0, math.inf)
    assert trace.censor_time == trace.timestamp[-1]


def test_window_cuts_and_sets_censor_bound(tmp_path):
    records = bailian_records(60)
    path = write_jsonl(tmp_path / "t.jsonl", records)
    trace, report = read_trace(path, window=(5.0, 15.0))
    inside = [r for r in records if 5.0 <= r["timestamp"] < 15.0]
    assert_trace_equals(trace, inside, "bailian")
    assert trace.window == (5.0, 15.0) and trace.censor_time == 15.0
    assert (report.requests, report.outside_window) == (len(inside), len(records) - len(inside))


def test_open_sided_windows(tmp_path):
    records = bailian_records(60)
    path = write_jsonl(tmp_path / "t.jsonl", records)
    head, _ = read_trace(path, window=(None, 10.0))
    tail, _ = read_trace(path, window=(10.0, None))
    assert head.window == (0.0, 10.0) and tail.window == (10.0, math.inf)
    assert head.n_requests + tail.n_requests == len(records)
    assert head.timestamp[-1] < 10.0 <= tail.timestamp[0]


def test_empty_window_raises(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", bailian_records(10))
    err = read_error(path, window=(1e6, 2e6))
    assert f"window [1e+06, 2e+06) of {path} holds no requests" in str(err)


def test_window_with_end_before_start_is_a_usage_error(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", bailian_records(3))
    with pytest.raises(ValueError, match="END must be greater than START"):
        read_trace(path, window=(10.0, 5.0))


# --- extra fields -----------------------------------------------------------------------------


def test_extra_scalar_fields_become_columns(tmp_path):
    records = bailian_records(4)
    extras = [
        {"region": "eu", "priority": 2, "score": 0.5, "stream": True, "tags": ["a"]},
        {"region": "us", "priority": 3, "score": 1, "stream": False, "note": "x"},
        {"region": "eu", "priority": 1, "score": 2.5, "stream": True, "note": None},
        {"region": "ap", "priority": 7, "score": 3.0, "stream": False},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", [dict(r, **e) for r, e in zip(records, extras)])
    trace, report = read_trace(path)
    extra = trace.extra
    assert list(extra["region"]) == ["eu", "us", "eu", "ap"] and extra["region"].dtype == object
    assert extra["priority"].dtype == np.int64 and list(extra["priority"]) == [2, 3, 1, 7]
    assert extra["score"].dtype == np.float64 and list(extra["score"]) == [0.5, 1.0, 2.5, 3.0]
    assert extra["stream"].dtype == np.bool_ and list(extra["stream"]) == [True, False, True, False]
    # Present on some lines only (null counts as missing): an object column with None.
    assert list(extra["note"]) == [None, "x", None, None]
    assert "tags" not in extra and report.ignored_fields == ("tags",)


def test_a_recordings_list_fields_are_kept_as_arrays(tmp_path):
    records = bailian_records(3)
    records[0].update(output_hash_ids=[5, 6], grown=[1, 2.5])
    records[2].update(output_hash_ids=[7], grown=[])
    trace, report = read_trace(write_jsonl(tmp_path / "t.jsonl", records))
    ids, grown = trace.extra["output_hash_ids"], trace.extra["grown"]
    assert ids[1] is None and grown[1] is None and report.ignored_fields == ()
    assert ids[0].dtype == np.int64 and ids[0].tolist() == [5, 6] and ids[2].tolist() == [7]
    assert grown[0].dtype == np.float64 and grown[0].tolist() == [1.0, 2.5] and grown[2].tolist() == []
    # equal lengths stay one array per row, not a 2-D block
    records[1].update(output_hash_ids=[8, 9], grown=[3.0, 4.0])
    ids = read_trace(write_jsonl(tmp_path / "u.jsonl", records))[0].extra["output_hash_ids"]
    assert ids.shape == (3,) and ids[1].tolist() == [8, 9]


def test_extra_fields_follow_rows_through_sorting_and_windows(tmp_path):
    records = [dict(r, seq=i) for i, r in enumerate(bailian_records(30))]
    trace, _ = read_trace(write_jsonl(tmp_path / "t.jsonl", records), window=(3.0, 9.0))
    expected = [r["seq"] for r in records if 3.0 <= r["timestamp"] < 9.0]
    np.testing.assert_array_equal(trace.extra["seq"], expected)


# --- time order -------------------------------------------------------------------------------


def test_small_backward_jitter_is_sorted_stably(tmp_path):
    records = bailian_records(6)
    records[3]["timestamp"] = records[2]["timestamp"] - 0.0005
    records[4]["timestamp"] = records[3]["timestamp"]  # tie with the jittered row: stays after it
    trace, _ = read_trace(write_jsonl(tmp_path / "t.jsonl", records))
    expected = [records[i] for i in (0, 1, 3, 4, 2, 5)]
    assert_trace_equals(trace, expected, "bailian")


def test_tolerance_is_configurable(tmp_path):
    records = bailian_records(6)
    records[3]["timestamp"] = records[2]["timestamp"] - 0.5
    path = write_jsonl(tmp_path / "t.jsonl", records)
    err = read_error(path)
    assert (err.line, err.field) == (4, "timestamp") and "goes back 0.5 s from line 3" in err.reason
    trace, _ = read_trace(path, time_tolerance=1.0)
    assert np.all(np.diff(trace.timestamp) >= 0)


def test_mooncake_tolerance_is_in_seconds(tmp_path):
    records = mooncake_records(5)
    records[2]["timestamp"] = records[1]["timestamp"] - 2  # 2 ms back
    path = write_jsonl(tmp_path / "m.jsonl", records)
    assert read_error(path).line == 3
    assert read_trace(path, time_tolerance=0.005)[0].n_requests == 5


# --- invalid input: one case per problem --------------------------------------------------------


def _set(field, value):
    return lambda r: dict(r, **{field: value})


def _set_ids(value):
    """Every hash id of the record replaced by ``value`` (the count stays right)."""
    return lambda r: dict(r, hash_ids=[value] * len(r["hash_ids"]))


def _drop(*fields):
    return lambda r: {k: v for k, v in r.items() if k not in fields}


#: (name, edit of line 3's record or its raw text, kind, field, words the message must hold)
BAD_LINES = [
    ("truncated json", lambda r: json.dumps(r)[:-5], "malformed_json", None, "not valid JSON"),
    ("a mooncake line", _drop("chat_id", "parent_chat_id", "type", "turn"), "mixed_format", None,
     "a mooncake record in a file whose line 1 is bailian"),
    ("not an object", lambda r: "[1, 2, 3]", "malformed_json", None, "JSON object"),
    ("bad utf-8", lambda r: b'{"chat_id": "\xff"}', "malformed_json", None, "not valid JSON"),
    ("missing timestamp", _drop("timestamp"), "missing_field", "timestamp", "missing"),
    ("missing hash_ids", _drop("hash_ids"), "missing_field", "hash_ids", "missing"),
    ("string timestamp", _set("timestamp", "12.5"), "wrong_type", "timestamp", "must be a number"),
    ("bool turn", _set("turn", True), "wrong_type", "turn", "must be an integer, got bool"),
    ("float length", _set("input_length", 3.0), "wrong_type", "input_length", "must be an integer"),
    ("type not a string", _set("type", 3), "wrong_type", "type", "must be a string"),
    ("hash_ids not a list", _set("hash_ids", "1,2"), "wrong_type", "hash_ids", "list of integers"),
    ("hash id a float", _set_ids(1.5), "wrong_type", "hash_ids", "float"),
    ("hash id a bool", _set_ids(True), "wrong_type", "hash_ids", "boolean"),
    ("hash id too big", _set_ids(2**64), "bad_value", "hash_ids", "64 bits"),
    ("chat id too big", _set("chat_id", 2**70), "bad_value", "chat_id", "64 bits"),
    ("negative length", _set("output_length", -1), "bad_value", "output_length", ">= 0"),
    ("NaN timestamp", _set("timestamp", float("nan")), "bad_value", "timestamp", "finite"),
    ("infinite timestamp", _set("timestamp", float("inf")), "bad_value", "timestamp", "finite"),
    ("timestamp 2**64", _set("timestamp", 2**64), "bad_value", "timestamp", "below 2**43 s"),
    ("timestamp 1e300", _set("timestamp", 1e300), "bad_value", "timestamp", "below 2**43 s"),
    ("negative timestamp", _set("timestamp", -1.0), "bad_value", "timestamp", ">= 0"),
    ("turn zero", _set("turn", 0), "bad_value", "turn", "between 1"),
    ("parent below -1", _set("parent_chat_id", -2), "bad_value", "parent_chat_id", ">= -1"),
    ("negative hash id", _set_ids(-5), "bad_value", "hash_ids", "-5"),
    ("too many ids", lambda r: dict(r, hash_ids=r["hash_ids"] + [7]), "hash_length", "hash_ids", "needs"),
    ("time backwards", _set("timestamp", 0.0), "timestamp_backwards", "timestamp", "goes back"),
    ("duplicate chat id", _set("chat_id", 1000), "duplicate_chat_id", "chat_id", "chat_id of line 1"),
    ("unknown parent", _set("parent_chat_id", 99), "unknown_parent", "parent_chat_id", "99"),
    # a repeated key: the decoder kept the last value silently, and a repeated chat_id was blamed on a later line
    ("repeated key", lambda r: json.dumps(r)[:-1] + ', "type": "other"}', "malformed_json", "type", "appears twice"),
    ("repeated key, spaced", lambda r: json.dumps(r)[:-1] + ', "chat_id" :1000}', "malformed_json", "chat_id",
     "appears twice"),
    ("repeated key beside a colon in a value", lambda r: json.dumps(dict(r, model="qwen:7b"))[:-1] + ', "turn": 1}',
     "malformed_json", "turn", "appears twice"),
    ("repeated key in an ignored object", lambda r: json.dumps(r)[:-1] + ', "meta": {"a": 1, "a": 2}}',
     "malformed_json", "a", "appears twice"),
    ("timestamp beyond milliseconds", _set("timestamp", 2.0**43), "bad_value", "timestamp",
     "where a float still holds a millisecond, got 8796093022208.0"),
    ("parent later", _set("parent_chat_id", 1004), "unknown_parent", "parent_chat_id", "earlier"),
    # the list fields of a recording (output_hash_ids, grown): the field and the bad value named
    ("output ids not a list", _set("output_hash_ids", 3), "wrong_type", "output_hash_ids", "list of integers"),
    ("output id a float", _set("output_hash_ids", [1, 2.0]), "wrong_type", "output_hash_ids", "float 2.0"),
    ("output id a bool", _set("output_hash_ids", [True]), "wrong_type", "output_hash_ids", "bool"),
    ("output id too big", _set("output_hash_ids", [2**64]), "bad_value", "output_hash_ids", "64 bits"),
    ("grown not a list", _set("grown", "1.5"), "wrong_type", "grown", "list of numbers"),
    ("grown holds a string", _set("grown", [1.0, "2"]), "wrong_type", "grown", "str '2'"),
    ("grown negative", _set("grown", [-1.0]), "bad_value", "grown", "-1.0"),
    ("grown NaN", _set("grown", [float("nan")]), "bad_value", "grown", "nan"),
]


def _trace_with_bad_line_3(edit, n=6):
    """Six valid first-turn records with line 3 edited; returns (lines, valid records)."""
    records = bailian_records(n)
    for i, r in enumerate(records):
        r.update(chat_id=1000 + i, parent_chat_id=-1, turn=1, timestamp=float(i + 1))
        r.update(input_length=32, hash_ids=[i, i + 1])
    lines = list(records)
    lines[2] = edit(records[2])
    return lines, records[:2] + records[3:]


@pytest.mark.parametrize("name, edit, kind, field, words", BAD_LINES, ids=[case[0] for case in BAD_LINES])
def test_invalid_line_raises_with_file_line_and_field(tmp_path, name, edit, kind, field, words):
    lines, _ = _trace_with_bad_line_3(edit)
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    err = read_error(path)
    assert (err.path, err.line, err.field) == (str(path), 3, field)
    assert str(err).startswith(f"{path}, line 3")
    assert words in err.reason and "np." not in err.reason  # values as JSON writes them, never numpy's reprs


@pytest.mark.parametrize("name, edit, kind, field, words", BAD_LINES, ids=[case[0] for case in BAD_LINES])
def test_skip_invalid_counts_the_kind(tmp_path, name, edit, kind, field, words):
    lines, valid = _trace_with_bad_line_3(edit)
    trace, report = read_trace(write_jsonl(tmp_path / "bad.jsonl", lines), skip_invalid=True)
    assert report.skipped == {kind: 1}
    assert (report.lines, report.requests, report.n_skipped) == (6, 5, 1)
    assert_trace_equals(trace, valid, "bailian")


def test_skip_kinds_cover_every_case():
    assert {case[2] for case in BAD_LINES} == set(SKIP_KINDS)


def test_error_is_the_earliest_bad_line(tmp_path):
    records = bailian_records(8)
    records[2]["input_length"] = -3  # found by the vectorised pass
    lines = records[:5] + ["{oops"] + records[5:]  # stops the parse at line 6
    err = read_error(write_jsonl(tmp_path / "t.jsonl", lines))
    assert (err.line, err.field) == (3, "input_length")


def test_line_numbers_count_blank_lines(tmp_path):
    records = bailian_records(4)
    records[3]["output_length"] = -1
    lines = [records[0], "", records[1], "   ", records[2], records[3]]
    err = read_error(write_jsonl(tmp_path / "t.jsonl", lines))
    assert (err.line, err.field) == (6, "output_length")


def test_children_of_skipped_turns_are_unknown_parents(tmp_path):
    records = bailian_records(6)
    for i, r in enumerate(records):
        r.update(chat_id=i, parent_chat_id=i - 1 if i in (2, 3, 4) else -1, turn=1)
    records[1]["hash_ids"] = [1.5] * len(records[1]["hash_ids"])  # turn 1 of the chain 1 <- 2 <- 3 <- 4
    trace, report = read_trace(write_jsonl(tmp_path / "t.jsonl", records), skip_invalid=True)
    assert report.skipped == {"wrong_type": 1, "unknown_parent": 3}
    np.testing.assert_array_equal(trace.chat_id, [0, 5])


def test_unused_types_of_skipped_lines_are_dropped(tmp_path):
    records = bailian_records(5, types=("text",))
    records[2]["type"] = "image"
    records[2]["output_length"] = -1
    trace, _ = read_trace(write_jsonl(tmp_path / "t.jsonl", records), skip_invalid=True)
    assert trace.type_names == ("text",)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_raises(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    err = read_error(path, skip_invalid=True)
    assert "holds no requests" in str(err) and str(path) in str(err)


def test_file_of_only_invalid_lines_raises_even_when_skipping(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ["{", "[]", '{"timestamp": "x"}'])
    err = read_error(path, skip_invalid=True)
    assert "all 3 lines were skipped" in str(err) and "malformed_json: 2" in str(err)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"format": "csv"}, "format"),
        ({"block_size": 0}, "block size"),
        ({"block_size": 16.0}, "block size"),
        ({"time_tolerance": -1.0}, "tolerance"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, words):
    with pytest.raises(ValueError, match=words):
        read_trace(write_jsonl(tmp_path / "t.jsonl", bailian_records(2)), **kwargs)


# --- property: every valid record comes back exactly ----------------------------------------------

_ints = st.integers(0, 2**62)
_bailian_record = st.fixed_dictionaries(
    {
        "chat_id": _ints,
        "parent": st.one_of(st.none(), st.integers(0, 100)),  # index of an earlier record, mod its count
        "gap": st.floats(0, 1e4, allow_nan=False),
        "input_length": st.integers(0, 200),
        "output_length": _ints,
        "type": st.text(max_size=8),
        "turn": st.integers(1, 2**31 - 1),
        "ids": st.lists(_ints, min_size=13),  # enough for ceil(200 / 16)
        "x": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.text(), st.booleans()),
    }
)


def _as_bailian(drawn):
    """Records with rising timestamps, parents among earlier records, exactly ceil(input_length / 16)
    hash ids, and an extra field ``x`` on some of them."""
    records, t = [], 0.0
    for i, d in enumerate(drawn):
        t += d["gap"]
        record = {
            "chat_id": d["chat_id"],
            "parent_chat_id": records[d["parent"] % i]["chat_id"] if i and d["parent"] is not None else -1,
            "timestamp": t,
            "input_length": d["input_length"],
            "output_length": d["output_length"],
            "type": d["type"],
            "turn": d["turn"],
            "hash_ids": d["ids"][: -(-d["input_length"] // 16)],
        }
        if d["x"] is not None:
            record["x"] = d["x"]
        records.append(record)
    return records


@settings(max_examples=60, deadline=None)
@given(
    drawn=st.lists(_bailian_record, min_size=1, max_size=15, unique_by=lambda d: d["chat_id"]),
    compress=st.sampled_from([None, "gz", "zst"]),
)
def test_property_bailian_round_trip(drawn, compress):
    records = _as_bailian(drawn)
    with tempfile.TemporaryDirectory() as tmp:
        trace, report = read_trace(write_jsonl(Path(tmp) / "t", records, compress=compress))
    assert_trace_equals(trace, records, "bailian")
    assert report.requests == len(records) and not report.skipped
    if any("x" in r for r in records):
        column, expected = trace.extra["x"], [r.get("x") for r in records]
        if column.dtype == object:
            assert list(column) == expected
        else:  # one kind on every line: a typed column (ints mixed with floats become floats)
            np.testing.assert_array_equal(column, np.array(expected, dtype=column.dtype))
    else:
        assert trace.extra == {}


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 10**9), st.integers(0, 3000), _ints, st.lists(_ints, max_size=6)),
        min_size=1,
        max_size=15,
    )
)
def test_property_mooncake_round_trip(rows):
    records, t = [], 0
    for gap, length, out, ids in rows:
        t += gap
        n_ids = -(-length // 512)
        ids = (ids + [0] * 6)[:n_ids]
        records.append({"timestamp": t, "input_length": length, "output_length": out, "hash_ids": ids})
    with tempfile.TemporaryDirectory() as tmp:
        trace, _ = read_trace(write_jsonl(Path(tmp) / "t", records))
    assert_trace_equals(trace, records, "mooncake")


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    # Line 1 stays valid: it decides the format, and a Mooncake first line would make every other line the odd one.
    edits=st.lists(st.tuples(st.integers(1, 29), st.sampled_from(BAD_LINES)), max_size=10),
)
def test_property_skip_invalid_accounts_for_every_line(seed, edits):
    records = bailian_records(30, seed=seed)
    lines = list(records)
    for row, (_, edit, *_) in edits:
        lines[row] = edit(records[row])
    with tempfile.TemporaryDirectory() as tmp:
        trace, report = read_trace(write_jsonl(Path(tmp) / "t", lines), skip_invalid=True)
    assert report.lines == len(lines) == report.requests + report.n_skipped
    assert set(report.skipped) <= set(SKIP_KINDS)
    kept = {}  # the first line of a chat_id: a repeat is skipped as a duplicate
    for r in lines:
        if isinstance(r, dict) and "chat_id" in r:
            kept.setdefault(r["chat_id"], r)
    for i in range(trace.n_requests):
        assert trace.blocks_of(i).tolist() == kept[trace.chat_id[i]]["hash_ids"]


# --- repeated keys, skippable zstd frames, millisecond timestamps (issue 14) -----------------------------


@settings(max_examples=60, deadline=None)
@given(line=st.integers(0, 5), key=st.sampled_from(["chat_id", "parent_chat_id", "timestamp", "input_length",
                                                     "output_length", "type", "turn", "hash_ids", "model"]),
       value=st.sampled_from(['1000', '"text"', '[1, 2]', '2.5', 'null', '{"a": 1}']),
       spaces=st.sampled_from(["", " ", "\t"]), colon=st.booleans())
def test_a_repeated_key_is_an_error_of_its_own_line(line, key, value, spaces, colon):
    """Whatever key a line repeats, and whatever the repeated value would do (collide with another line's
    chat_id, make time go back), the error is that line's, field the key."""
    records = [dict(r, chat_id=1000 + i, parent_chat_id=-1, turn=1, timestamp=float(i + 1), input_length=32,
                    hash_ids=[i, i + 1], model="a:b" if colon else "m") for i, r in enumerate(bailian_records(6))]
    lines = [json.dumps(r) for r in records]
    lines[line] = lines[line][:-1] + f', "{key}"{spaces}:{spaces}{value}}}'
    with tempfile.TemporaryDirectory() as tmp:
        path = write_jsonl(Path(tmp) / "t.jsonl", lines)
        err = read_error(path)
        assert (err.line, err.field, err.reason.startswith("the key appears twice")) == (line + 1, key, True)
        trace, report = read_trace(path, skip_invalid=True)
        assert report.skipped == {"malformed_json": 1} and trace.n_requests == 5


def _skippable(payload: bytes, magic: int = 0x184D2A50) -> bytes:
    import struct

    return struct.pack("<II", magic, len(payload)) + payload


def test_a_zstd_file_that_starts_with_a_skippable_frame_is_read(tmp_path):
    """pzstd writes one before its data frames; zstd -t accepts such a file, kvprof read it as text."""
    records = bailian_records(30)
    text = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    compress = zstandard.ZstdCompressor().compress
    data = (_skippable(b"pzstd") + compress(text[:500]) + _skippable(b"", 0x184D2A5F) + compress(text[500:])
            + _skippable(b"tail" * 100, 0x184D2A57))
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(data)
    assert_trace_equals(read_trace(path)[0], records, "bailian")
    path.write_bytes(_skippable(b"only this"))
    assert "holds no requests" in str(read_error(path))


def test_timestamps_keep_their_milliseconds_up_to_2_43_seconds(tmp_path):
    """A timestamp near 1e15 s lost its milliseconds (gaps of 0.125 s); below 2**43 s a float holds them."""
    base = 2.0**43 - 10
    records = [dict(r, timestamp=base + 0.001 * i) for i, r in enumerate(bailian_records(5))]
    for i, r in enumerate(records):
        r.update(chat_id=i, parent_chat_id=-1, turn=1)
    trace, _ = read_trace(write_jsonl(tmp_path / "t.jsonl", records))
    np.testing.assert_allclose(np.diff(trace.timestamp), 0.001, rtol=0.05)
    ms = [dict(r) for r in mooncake_records(3)]
    ms[2]["timestamp"] = int(2**43 * 1000)
    err = read_error(write_jsonl(tmp_path / "m.jsonl", ms))
    assert err.line == 3 and "below 2**43 s" in err.reason and "(8.79609e+12 s)" in err.reason
