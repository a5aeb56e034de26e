"""Trace lines decoded by orjson read as json reads them: the same trace, or the same error."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvprof.profiler.reader as reader
import kvprof.profiler.records as records
from kvprof.errors import TraceError

GOOD = {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 32, "output_length": 4, "type": "text",
        "turn": 1, "hash_ids": [7, 8]}
BIG = "123456789012345678901234567890"  # beyond 64 bits: json keeps an int, orjson would make it a float


@pytest.mark.parametrize("second", [
    json.dumps({**GOOD, "chat_id": 2, "model": "m"}),
    json.dumps({**GOOD, "chat_id": 2}).replace('"turn": 1', f'"turn": 1, "tenant": {BIG}'),
    json.dumps({**GOOD, "chat_id": 2}).replace('"timestamp": 0.5', f'"timestamp": {BIG}'),
    json.dumps({**GOOD, "chat_id": 2}).replace('"hash_ids": [7, 8]', f'"hash_ids": [7, {BIG}]'),
    json.dumps({**GOOD, "chat_id": 2}).replace('"chat_id": 2', f'"chat_id": {BIG}'),
    json.dumps({**GOOD, "chat_id": 2}).replace('"timestamp": 0.5', '"timestamp": NaN'),
    json.dumps({**GOOD, "chat_id": 2, "note": "\ud800"}, ensure_ascii=True),
    json.dumps({**GOOD, "chat_id": 2}).replace('"turn": 1', '"turn": 1.0'),
    '{"chat_id": 2, "unfinished"',
])
@pytest.mark.parametrize("skip_invalid", [False, True])
def test_orjson_reads_every_line_as_json_does(tmp_path, monkeypatch, second, skip_invalid):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + second + "\n")

    def outcome():
        try:
            trace, report = reader.read_trace(path, skip_invalid=skip_invalid)
        except TraceError as exc:
            return str(exc)
        columns = {k: v.tolist() for k, v in vars(trace).items() if isinstance(v, np.ndarray)}
        return columns, {k: v.tolist() for k, v in trace.extra.items()}, report.skipped

    fast = outcome()
    monkeypatch.setattr(records, "_fast_decode", lambda line: None)  # every line through json
    assert fast == outcome()
