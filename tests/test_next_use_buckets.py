"""Belady's next uses computed bucket by bucket (:func:`kvprof.core.stream.next_uses`) are the
whole trace's (:attr:`Workload.next_use`), whatever the number of buckets and the chunk size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core import stream
from kvprof.sim.workload import prepare_workload
from tests.helpers import make_trace

#: Hashes from a small alphabet (repeats within a request, across requests, far apart) and the extremes.
HASHES = st.one_of(st.integers(0, 6), st.sampled_from([-(2**63), 2**63 - 1, -1, 2**62 + 3]))


@st.composite
def workloads(draw):
    """Traces of arbitrary (not prefix-chained) hashes, empty requests and ties in arrival included."""
    rows, t = [], 0.0
    for _ in range(draw(st.integers(1, 30))):
        t += draw(st.sampled_from([0.0, 0.25, 1.0]))
        rows.append((t, "a", 1, draw(st.lists(HASHES, max_size=8))))
    trace = make_trace(rows)
    return prepare_workload(trace, engine_block_size=draw(st.sampled_from([16, 32])))


@settings(max_examples=200, deadline=None)
@given(workload=workloads(), chunk=st.integers(1, 5), bucket_accesses=st.sampled_from([1, 2, 3, 7, 1 << 19]))
def test_next_uses_by_bucket_are_the_whole_traces(workload, chunk, bucket_accesses):
    with stream.next_uses(workload, chunk, bucket_accesses) as later:
        assert np.array_equal(later.read(0, workload.n_accesses), workload.next_use)


@pytest.mark.parametrize(("n_accesses", "bucket_accesses", "n_buckets"),
                         [(0, 4, 1), (1, 4, 1), (4, 4, 1), (5, 4, 2), (17, 4, 8), (28_700_000, 1 << 19, 64)])
def test_buckets_are_the_fewest_power_of_two_holding_the_accesses(n_accesses, bucket_accesses, n_buckets):
    assert stream.n_buckets_for(n_accesses, bucket_accesses) == n_buckets


@given(hashes=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=50), bits=st.integers(0, 10))
def test_a_hash_falls_in_one_of_the_buckets(hashes, bits):
    buckets = stream.bucket_of(np.array(hashes, np.int64), 1 << bits)
    assert ((0 <= buckets) & (buckets < 1 << bits)).all()
    assert np.array_equal(buckets, stream.bucket_of(np.array(hashes[::-1], np.int64), 1 << bits)[::-1])
