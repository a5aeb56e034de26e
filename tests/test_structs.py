"""The compiled lists' batch forms against their one-id forms: the same lists after the same operations."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from kvprof.core.structs import holds, new_lists, push_back, push_back_n, unlink, unlink_held_n

N_IDS, N_LISTS = 12, 3


@njit(cache=True)
def _push_back_each(lists, xs, n, list_of):
    for i in range(n):
        push_back(lists, list_of[xs[i]] if len(list_of) else 0, xs[i])


@njit(cache=True)
def _unlink_each(lists, xs, n):
    for i in range(n):
        if not holds(lists, xs[i]):
            return i
        unlink(lists, xs[i])
    return n


@njit(cache=True)
def _arrays(lists):
    return lists.nxt, lists.prv, lists.where, lists.head, lists.tail, lists.count


def _state(lists) -> tuple:
    return tuple(array.tolist() for array in _arrays(lists))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, N_IDS + 1), max_size=8)), max_size=12),
       st.lists(st.integers(0, N_LISTS - 1), min_size=N_IDS, max_size=N_IDS), st.booleans())
def test_batches_leave_the_lists_as_one_id_at_a_time_would(batches, list_numbers, by_id):
    """Pushes of ids in no list (to a list per id, or all to list 0) and unlinks that stop at the
    first id in no list (including ids past the lists' size): same links, same counts, same stops."""
    list_of = np.array(list_numbers if by_id else [], dtype=np.int32)
    batch, each = new_lists(N_IDS, N_LISTS), new_lists(N_IDS, N_LISTS)
    for pushing, ids in batches:
        if pushing:
            where = _arrays(batch)[2]
            xs = np.array(list(dict.fromkeys(x for x in ids if x < N_IDS and where[x] < 0)), dtype=np.int64)
            push_back_n(batch, xs, len(xs), list_of)
            _push_back_each(each, xs, len(xs), list_of)
        else:
            xs = np.array(ids, dtype=np.int64)
            assert unlink_held_n(batch, xs, len(xs)) == _unlink_each(each, xs, len(xs))
        assert _state(batch) == _state(each)
