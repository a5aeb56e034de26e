"""``kvprof replay`` pieces that need no server: prompts, trace reading and error counting."""
# Traces here are valid Bailian lines: replay reads them with the same strict reader as fit.

from __future__ import annotations

import json
import socket

from kvprof.cli.replay_cmd import block_tokens, prompt_of, run_replay


def test_equal_hash_prefixes_are_equal_token_prefixes():
    a = prompt_of({"hash_ids": [1, 2, 3], "input_length": 40}, 16, 500)
    b = prompt_of({"hash_ids": [1, 2, 9], "input_length": 48}, 16, 500)
    assert a[:32] == b[:32] and a[32:40] != b[32:40] and len(a) == 40
    assert block_tokens(5, 16, 500) == block_tokens(5, 16, 500)
    assert all(4 <= t < 500 for t in a)


def test_errors_are_counted_not_retried(tmp_path):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"chat_id": i, "parent_chat_id": -1, "timestamp": i * 0.01, "input_length": 20, "output_length": 2,
                                          "type": "text", "turn": 1, "hash_ids": [i, i + 1]}) + "\n" for i in range(3)))
    res = run_replay(trace, f"http://127.0.0.1:{port}", "m", tmp_path / "out", capacity=4, timeout=5)
    run = res["runs"][0]
    assert run["n_requests"] == 3 and run["n_errors"] == 3 and run["cached_tokens"] == 0
    assert run["capacity"] == 4 and res["inputs"]["server"]["num_gpu_blocks"] is None  # no /metrics: --capacity alone
    assert (tmp_path / "out" / "results.json").exists() and (tmp_path / "out" / "hit_ratio.png").exists()
    assert len((tmp_path / "out" / "requests.jsonl").read_text().splitlines()) == 3


def test_replay_rejects_a_bad_trace_with_line_and_field(tmp_path):
    import pytest

    from kvprof.errors import TraceError

    trace = tmp_path / "bad.jsonl"
    trace.write_text(json.dumps({"timestamp": 0.0, "input_length": 20, "output_length": 2, "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl, line 1, field 'hash_ids'"):
        run_replay(trace, "http://127.0.0.1:9", "m", tmp_path / "out", timeout=1)
    assert not (tmp_path / "out" / "results.json").exists()
