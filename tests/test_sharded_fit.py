"""A fit of a window's blocks in shards writes the same hp file as the fit of the window at once."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvprof.classes import ClassRule
from kvprof.profiler.fit import classes_of, fit_trace, fit_window
from kvprof.profiler.reader import read_trace
from kvprof.profiler.reuse import access_request_index, reuse_of_accesses
from kvprof.profiler.summary import ShardList, ShardReuse, merged_sorted
from kvprof.profiler.turns import next_turn_rates
from tests.helpers import synthetic


def _document(hp) -> str:
    data = hp.to_dict()
    data["provenance"].pop("created")
    return json.dumps(data, sort_keys=True)




@pytest.fixture(scope="module")
def bailian(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("sharded"), hours=0.3, seed=5)[1]


@pytest.mark.parametrize("n_shards", [2, 7])
def test_shards_of_the_blocks_fit_the_same_file_to_the_bit(bailian, n_shards):
    trace = bailian
    codes, names = classes_of(trace, ClassRule())
    request = access_request_index(trace)
    # Block ranges in order (the tree's sample is drawn in (block, request) order).
    bounds = np.quantile(trace.hash_ids, np.linspace(0, 1, n_shards + 1)[1:-1])
    shard_of = np.searchsorted(bounds, trace.hash_ids, side="right")
    shards = []
    for s in range(n_shards):
        mine = shard_of == s
        samples = reuse_of_accesses(trace.hash_ids[mine], request[mine], trace.timestamp, trace.censor_time, codes)
        shards.append(ShardReuse.of(samples, trace.n_requests, 60.0))
    sharded = fit_window(trace, codes, names, ShardList(shards), ClassRule(), n_accesses=trace.n_blocks,
                         horizon=60.0, min_gap=0.3, min_samples=200, max_cells=16, max_components=3,
                         next_turn=next_turn_rates(trace))
    assert _document(sharded) == _document(fit_trace(trace))


def test_sorted_runs_merge_in_bounded_chunks_into_their_sorted_union():
    rng = np.random.default_rng(0)
    runs = [np.sort(rng.exponential(10.0, size)) for size in (0, 5, 3000, 12000, 700)]
    runs.append(np.full(900, 2.5))  # a value repeated more often than a chunk holds
    chunks = list(merged_sorted(runs, chunk=512))
    assert len(chunks) > 10
    assert all(c.size <= 512 for c in chunks if 2.5 not in c)
    assert sum(1 for c in chunks if 2.5 in c) == 1 and max(c.size for c in chunks) <= 512 + 900
    assert np.array_equal(np.concatenate(chunks), np.sort(np.concatenate(runs)))


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("files"), hours=0.3, seed=6)[0]


@pytest.mark.parametrize("scan_blocks", [None, 5_000])
def test_a_file_fitted_in_shards_on_disk_writes_fit_traces_file_held_out_scores_included(trace_file, scan_blocks,
                                                                                          monkeypatch):
    """Also where the next-turn counts scan the spilled chains in many pieces (``scan_blocks``)."""
    from kvprof.profiler import shards

    if scan_blocks is not None:
        monkeypatch.setattr(shards, "SCAN_BLOCKS", scan_blocks)
    trace = read_trace(trace_file)[0]
    whole = fit_trace(trace.time_window(0, 500), holdout=trace.time_window(500, 1000))
    sharded = shards.fit_sharded([trace_file], window=(0, 500), shard_accesses=40_000)
    assert trace.time_window(0, 500).n_blocks > 4 * 5_000
    assert sharded.next_turn is not None and sharded.next_turn.to_dict() == whole.next_turn.to_dict()
    assert _document(sharded) == _document(whole)
    assert any("holdout" in (row.diagnostics or {}) for tiers in sharded.cells.values() for row in tiers)


def test_a_directory_of_servers_files_is_one_trace(trace_file, tmp_path):
    """Two files of whole conversations (as two servers write them), read one at a time."""
    from kvprof.profiler.shards import fit_sharded, trace_paths
    from kvprof.sim.sample import chain_roots

    trace = read_trace(trace_file)[0]
    lines = trace_file.read_text().splitlines(keepends=True)
    chat_ids = [json.loads(line)["chat_id"] for line in lines]
    root_of = dict(zip(trace.chat_id.tolist(), chain_roots(trace).tolist()))
    for name, parity in (("server-a.jsonl", 0), ("server-b.jsonl.zst", 1)):
        chosen = "".join(line for line, c in zip(lines, chat_ids) if root_of[c] % 2 == parity)
        write_text = (tmp_path / name).write_bytes
        if name.endswith(".zst"):
            import zstandard

            write_text(zstandard.ZstdCompressor().compress(chosen.encode()))
        else:
            write_text(chosen.encode())
    (tmp_path / "notes.txt").write_text("not a trace")
    assert [p.name for p in trace_paths(tmp_path)] == ["server-a.jsonl", "server-b.jsonl.zst"]
    sharded = fit_sharded(trace_paths(tmp_path), window=(None, None), shard_accesses=50_000)
    whole = fit_trace(trace)
    documents = [json.loads(_document(hp)) for hp in (sharded, whole)]
    for document in documents:  # the files' names and digests are not the one file's
        for key in ("trace", "sha256"):
            document["provenance"].pop(key)
    assert documents[0] == documents[1]


def test_fit_sharded_on_the_command_line(trace_file, tmp_path):
    from tests.helpers import invoke

    out = tmp_path / "hp.json"
    result = invoke("fit", trace_file, "--sharded", "--window", "0:500", "-o", out)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["provenance"]["n_requests"] > 0
    refused = invoke("fit", trace_file, "--sharded", "--capacity", "128", "-o", out)
    assert refused.exit_code == 2 and "fit --sharded, then tune" in refused.output
    (tmp_path / "empty").mkdir()
    nothing = invoke("fit", tmp_path / "empty", "--sharded", "-o", out)
    assert nothing.exit_code == 1 and "holds no trace files" in nothing.output
    spill = invoke("fit", trace_file, "--sharded", "--spill-dir", out, "-o", tmp_path / "other.json")
    assert spill.exit_code == 2 and "is not a directory" in spill.output
    fresh = invoke("fit", trace_file, "--sharded", "--window", "0:300", "--spill-dir", tmp_path / "new" / "spill",
                   "-o", tmp_path / "other.json")
    assert fresh.exit_code == 0 and not (tmp_path / "new").exists()  # made, used, removed with its parent


def test_a_window_starting_before_the_trace_is_cut_where_the_trace_starts(trace_file, tmp_path):
    from kvprof.profiler.shards import fit_sharded
    from tests.helpers import invoke, one_line

    records = [json.loads(line) for line in trace_file.read_text().splitlines()]
    kept = [r for r in records if r["timestamp"] >= 300]  # a trace whose clock starts at 300 s
    ids = {r["chat_id"] for r in kept}
    path = tmp_path / "later.jsonl"
    path.write_text("".join(json.dumps({**r, "parent_chat_id": r["parent_chat_id"] if r["parent_chat_id"] in ids
                                        else -1}) + "\n" for r in kept))
    shifted = read_trace(path)[0]
    assert shifted.window[0] == 300
    assert _document(fit_sharded([path], window=(0, 700), shard_accesses=30_000)) == _document(
        fit_trace(shifted.time_window(0, 700), holdout=shifted.time_window(700, 1400)))
    refused = invoke("fit", path, "--sharded", "--window", "-100:", "-o", tmp_path / "hp.json")
    assert refused.exit_code == 2 and "from the trace's start" in one_line(refused.output)


def test_a_trace_split_by_time_fits_in_shards_with_conversations_crossing_files(trace_file, tmp_path):
    from kvprof.errors import TraceError
    from kvprof.profiler.shards import fit_sharded, trace_paths

    trace = read_trace(trace_file)[0]
    lines = trace_file.read_text().splitlines(keepends=True)
    times = [json.loads(line)["timestamp"] for line in lines]
    cut = sorted(times)[len(times) // 2]
    parts = tmp_path / "split"
    parts.mkdir()
    (parts / "1-early.jsonl").write_text("".join(line for line, t in zip(lines, times) if t < cut))
    (parts / "2-late.jsonl").write_text("".join(line for line, t in zip(lines, times) if t >= cut))
    late = [json.loads(line) for line, t in zip(lines, times) if t >= cut]
    early_ids = {json.loads(line)["chat_id"] for line, t in zip(lines, times) if t < cut}
    assert any(r["parent_chat_id"] in early_ids for r in late)  # a conversation crosses the files
    sharded = fit_sharded(trace_paths(parts), window=(None, None), shard_accesses=50_000)
    documents = [json.loads(_document(hp)) for hp in (sharded, fit_trace(trace))]
    for document in documents:
        for key in ("trace", "sha256"):
            document["provenance"].pop(key)
    assert documents[0] == documents[1]
    # a file present twice, under another name, is refused, not counted twice
    (parts / "3-copy.jsonl").write_text((parts / "2-late.jsonl").read_text())
    with pytest.raises(TraceError, match=r"3-copy\.jsonl.*already the chat_id of a line of an earlier file"):
        fit_sharded(trace_paths(parts), window=(None, None), shard_accesses=50_000)
