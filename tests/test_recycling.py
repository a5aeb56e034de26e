"""Content numbers recycled (kvprof.core.stream): a number names one content while anything holds it,
and the numbering stays within a multiple of what is held, however many contents pass."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core import stream


def numbered(table, hashes) -> np.ndarray:
    out = np.empty(len(hashes), np.int64)
    stream.number(table, np.asarray(hashes, np.int64), out)
    return out


@settings(max_examples=100, deadline=None)
@given(rounds=st.lists(st.tuples(st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(-3, 40), max_size=60),
                                 st.integers(0, 2**32 - 1)), min_size=1, max_size=12))
def test_a_kept_content_keeps_its_number_and_a_forgotten_ones_number_goes_to_a_new_content(rounds):
    table = stream.new_table(16)
    number_of: dict[int, int] = {}  # the contents kept, with their numbers
    for hashes, seed in rounds:
        for h, n in zip(hashes, numbered(table, hashes)):
            assert number_of.setdefault(h, int(n)) == n, "a kept content changed number"
        assert len(set(number_of.values())) == len(number_of), "two contents share a number"
        _, top, _ = stream.sizes(table)
        assert all(0 <= n < top for n in number_of.values())
        keep = np.random.default_rng(seed).random(top) < 0.5
        stream.forget_unmarked(table, keep)
        number_of = {h: n for h, n in number_of.items() if keep[n]}
        assert stream.sizes(table)[0] == len(number_of)
        n_free = int((~keep).sum())  # a number marked but naming nothing stays taken until a later sweep
    _, top, _ = stream.sizes(table)
    fresh = numbered(table, [2**62 + i for i in range(n_free)])
    assert stream.sizes(table)[1] == top and not set(fresh.tolist()) & set(number_of.values()), \
        "free numbers are reused first"


def test_numbers_stay_within_twice_what_is_held_however_many_contents_pass():
    table = stream.new_table(16)
    held = np.zeros(0, np.int64)  # the last 500 contents numbered are held, as a cache of 500 would
    for first in range(0, 200_000, 1000):
        held = np.concatenate([held, numbered(table, np.arange(first, first + 1000))])[-500:]
        if stream.due(table):
            live = np.zeros(stream.sizes(table)[1], np.bool_)
            live[held] = True
            stream.forget_unmarked(table, live)
    _, top, entries = stream.sizes(table)
    assert top <= 2 * stream.MIN_SWEEP + 1000 and entries <= 8 * stream.MIN_SWEEP
