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
from kvprof.profiler.synth import generate, write_jsonl


def _document(hp) -> str:
    data = hp.to_dict()
    data["provenance"].pop("created")
    return json.dumps(data, sort_keys=True)


@pytest.fixture(scope="module")
def bailian(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "a.jsonl"
    write_jsonl(path, generate("bailian-a", 0.3, 5))
    return read_trace(path)[0]


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
                         horizon=60.0, min_gap=0.3, min_samples=200, max_cells=16, max_components=3)
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
