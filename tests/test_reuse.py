import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.classes import ClassRule
from kvprof.profiler.classes import classify_trace
from kvprof.profiler.reuse import extract_reuse, ideal_hit_ratio, next_access
from tests.helpers import make_trace


def test_gaps_and_censoring_by_hand():
    trace = make_trace(
        [
            (0.0, "text", 1, [1, 2]),
            (10.0, "text", 2, [1, 2, 3]),
            (10.1, "file", 1, [1]),  # 0.1 s after request 1: concurrent with it
            (30.0, "file", 1, [9]),
        ],
        window=(0.0, 100.0),
    )
    codes, names = classify_trace(trace, ClassRule(key="type"))
    samples = extract_reuse(trace, codes, min_gap=0.3)
    got = sorted(zip(np.round(samples.time, 6).tolist(), samples.censored.tolist(), [names[c] for c in samples.workload]))
    # Block 1 at t=10 is reused 0.1 s later by request 2: merged into that access.
    assert samples.n_merged == 1
    assert got == sorted(
        [
            (10.0, False, "text"),  # block 1 at 0 -> 10
            (10.0, False, "text"),  # block 2 at 0 -> 10
            (90.0, True, "text"),  # block 2 at 10, never again before the window ends at 100
            (90.0, True, "text"),  # block 3 at 10
            (89.9, True, "file"),  # block 1 at 10.1
            (70.0, True, "file"),  # block 9 at 30
        ]
    )


def test_floor_zero_keeps_concurrent_gaps():
    trace = make_trace([(0.0, "a", 1, [1]), (0.0, "a", 1, [1])], window=(0.0, 5.0))
    codes, _ = classify_trace(trace, ClassRule(key="type"))
    samples = extract_reuse(trace, codes, min_gap=0.0)
    assert sorted(samples.time.tolist()) == [0.0, 5.0]
    assert samples.censored.tolist().count(True) == 1


def test_repeated_id_within_request_counts_once():
    trace = make_trace([(0.0, "a", 1, [7, 7]), (5.0, "a", 2, [7])], window=(0.0, 10.0))
    codes, _ = classify_trace(trace, ClassRule(key="type"))
    samples = extract_reuse(trace, codes)
    assert sorted(zip(samples.time.tolist(), samples.censored.tolist())) == [(5.0, False), (5.0, True)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), min_size=1, max_size=12))
def test_next_access_matches_brute_force(requests):
    blocks = np.array([b for r in requests for b in r], dtype=np.int64)
    owner = np.array([i for i, r in enumerate(requests) for _ in r], dtype=np.int64)
    got = next_access(blocks, owner)
    for k in range(len(blocks)):
        later = [j for j in range(len(blocks)) if blocks[j] == blocks[k] and owner[j] > owner[k]]
        if not later:
            assert got[k] == -1
        else:
            first_owner = min(owner[j] for j in later)
            assert blocks[got[k]] == blocks[k] and owner[got[k]] == first_owner


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), min_size=1, max_size=12))
def test_ideal_hit_ratio_matches_brute_force(requests):
    trace = make_trace([(float(i), "a", 1, r) for i, r in enumerate(requests)])
    seen, hits, total = set(), 0, 0
    for r in requests:
        hits += sum(b in seen for b in r)
        total += len(r)
        seen.update(r)
    assert ideal_hit_ratio(trace) == hits / total


def test_repeat_marks_accesses_of_blocks_an_earlier_request_used():
    trace = make_trace([(0.0, "a", 1, [1, 2]), (5.0, "a", 2, [1, 3]), (9.0, "a", 3, [3])], window=(0.0, 20.0))
    codes, _ = classify_trace(trace, ClassRule(key="type"))
    samples = extract_reuse(trace, codes, min_gap=0.0)
    got = sorted(zip(samples.time.tolist(), samples.repeat.tolist()))
    # block 1: fresh at 0 (reused after 5), repeat at 5 (censored 15); block 2 fresh, censored 20;
    # block 3: fresh at 5 (reused after 4), repeat at 9 (censored 11).
    assert got == [(4.0, False), (5.0, False), (11.0, True), (15.0, True), (20.0, False)]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 5), st.lists(st.integers(0, 5), min_size=1, max_size=4)), min_size=1, max_size=10),
    st.sampled_from([0.0, 0.3, 1.0]),
)
def test_extract_reuse_matches_brute_force(rows, min_gap):
    rows = sorted(rows, key=lambda r: r[0])
    trace = make_trace([(t, "a", 1, blocks) for t, blocks in rows], window=(0.0, 10.0))
    codes, _ = classify_trace(trace, ClassRule(key="type"))
    samples = extract_reuse(trace, codes, min_gap=min_gap)
    expected, merged = [], 0
    for i, (t, blocks) in enumerate(rows):
        for block in dict.fromkeys(blocks):  # a repeat within one request counts once
            later = [u for u, other in rows[i + 1 :] if block in other]
            seen = any(block in other for _, other in rows[:i])
            if later and later[0] - t < min_gap:
                merged += 1
            elif later:
                expected.append((later[0] - t, False, seen))
            else:
                expected.append((10.0 - t, True, seen))
    got = list(zip(np.round(samples.time, 9).tolist(), samples.censored.tolist(), samples.repeat.tolist()))
    assert sorted(got) == sorted((round(t, 9), c, r) for t, c, r in expected)
    assert samples.n_merged == merged
