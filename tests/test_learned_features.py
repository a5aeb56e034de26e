"""The learned candidate's chain features: online (never read the future), the same at fit time as in the pool."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.kinds.classed import tier_table
from kvprof.models.learned import FEATURES, N_LOG_BINS, gap_bin, log_bin
from kvprof.policy.learned import FreeFeatures
from kvprof.sim.free_features import _features

N_CELLS, N_TIERS = 3, 4


@st.composite
def streams(draw):
    """Requests whose chains grow from earlier ones (turns, shared prefixes that branch), each
    access a hit or a miss, arrivals non-decreasing: (contents, offsets, arrival, cell, hit)."""
    n_requests = draw(st.integers(1, 25))
    chains: list[list[int]] = []
    contents, offsets, arrival, cells = [], [0], [], []
    now, fresh = 0.0, 0
    for _ in range(n_requests):
        base = draw(st.sampled_from(chains)) if chains and draw(st.booleans()) else []
        keep = draw(st.integers(0, len(base)))
        grow = draw(st.integers(1 if keep == len(base) == 0 else 0, 4))
        chain = base[:keep] + list(range(fresh, fresh + grow))
        fresh += grow
        if not chain:
            chain = [fresh]
            fresh += 1
        chains.append(chain)
        contents += chain
        offsets.append(len(contents))
        now += draw(st.sampled_from([0.0, 0.1, 0.3, 1.0, 7.5, 100.0]))
        arrival.append(now)
        cells.append(draw(st.integers(-1, N_CELLS)))
    hit = draw(st.lists(st.booleans(), min_size=len(contents), max_size=len(contents)))
    return (np.array(contents, np.int64), np.array(offsets, np.int64), np.array(arrival), np.array(cells, np.int64),
            np.array(hit, np.bool_))


def offline(contents, offsets, arrival, cells, hit):
    n_contents = int(contents.max()) + 1
    return _features(contents, offsets, arrival, cells, hit, tier_table(), N_CELLS, N_TIERS, n_contents)


def online(contents, offsets, arrival, cells, hit) -> np.ndarray:
    """The pool's features: each request's blocks accessed in depth order, then freed tail first at its arrival
    (blocks numbered by content: nothing is evicted)."""
    features = FreeFeatures(N_CELLS, N_TIERS)
    rows = np.zeros((len(contents), len(FEATURES)), np.int64)
    for r in range(len(offsets) - 1):
        start, stop = offsets[r], offsets[r + 1]
        for k in range(start, stop):
            features.access(int(contents[k]), int(cells[r]), k - start, bool(hit[k]))
        blocks = [int(b) for b in contents[start:stop][::-1]]
        rows[start:stop] = features.of_free(blocks, float(arrival[r]))[::-1]
    return rows


@settings(max_examples=120, deadline=None)
@given(stream=streams(), cut=st.integers(0, 25))
def test_features_of_a_prefix_of_the_stream_are_those_of_the_whole_stream(stream, cut):
    """Never reading the future: the features up to any request are the same whether the stream ends there or not."""
    contents, offsets, arrival, cells, hit = stream
    cut = min(cut, len(offsets) - 1)
    if cut == 0:
        return
    end = offsets[cut]
    whole = offline(*stream)
    prefix = offline(contents[:end], offsets[:cut + 1], arrival[:cut], cells[:cut], hit[:end])
    assert np.array_equal(prefix, whole[:end])
    assert np.array_equal(online(contents[:end], offsets[:cut + 1], arrival[:cut], cells[:cut], hit[:end]),
                          online(*stream)[:end])


@settings(max_examples=120, deadline=None)
@given(stream=streams())
def test_the_training_features_are_what_the_pool_computes(stream):
    """The compiled pass the fit labels (per content) gives each access the bins the pool's
    FreeFeatures gives the block at its free, when nothing is evicted and a request frees at its arrival."""
    assert np.array_equal(offline(*stream), online(*stream))


def test_a_chain_counts_its_turns_its_gap_and_the_branches_past_its_blocks():
    features = FreeFeatures(N_CELLS, N_TIERS)

    def request(chain, now, hit_until=0):
        for depth, block in enumerate(chain):
            features.access(block, 0, depth, depth < hit_until)
        return features.of_free(chain[::-1], now)[::-1]

    first = request([0, 1, 2], 10.0)
    assert [row[4:] for row in first] == [(log_bin(1), 0, 1), (log_bin(1), 0, 1), (log_bin(1), 0, 0)]
    second = request([0, 1, 2, 3], 15.0, hit_until=3)  # extends the chain's tail (block 2) 5 s later
    assert [row[4] for row in second] == [log_bin(2)] * 4 and second[0][5] == gap_bin(5.0) == 1 + log_bin(20)
    assert second[2][6] == log_bin(1)  # block 2 now continues into block 3: its first child
    branch = request([0, 1, 4], 16.0, hit_until=2)  # another chain continues past block 1: fan-out 2
    assert branch[1][6] == log_bin(2) and branch[0][6] == log_bin(1)
    # Block 1 was the first chain's tail's parent (a partial last block is another content next
    # turn): the branch is that chain's second turn, 6 s after its first.
    assert [row[4:6] for row in branch] == [(log_bin(2), gap_bin(6.0))] * 3
    assert [row[4] for row in request([5, 6], 17.0)] == [log_bin(1)] * 2  # a chain first seen
    for block in (0, 1, 4):
        features.access(block, 0, 0, False)  # allocated anew: the chain's turns are forgotten
    assert [row[4] for row in request([0, 1, 4], 20.0)] == [log_bin(1)] * 3


def test_gap_bins_are_quarter_seconds_doubling_and_capped():
    assert [gap_bin(s) for s in (-1.0, 0.0, 0.2, 0.25, 0.5, 1.0, 1e12)] == [0, 1, 1, 2, 3, 4, N_LOG_BINS - 1]
