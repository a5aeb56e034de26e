"""The compiled lists' batch forms against their one-id forms: the same lists after the same operations."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from kvprof.core.structs import (
    holds, move_to_back_n, new_lists, pop_front, pop_front_n, push_back, push_back_n, unlink, unlink_held_n, unlink_n,
)

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
def _unlink_each_held(lists, xs, n, was_held):
    for i in range(n):
        was_held[i] = holds(lists, xs[i])
        if was_held[i]:
            unlink(lists, xs[i])


@njit(cache=True)
def _move_to_back_each(lists, xs, n, which, was_held):
    for i in range(n):
        was_held[i] = holds(lists, xs[i])
        if was_held[i]:
            unlink(lists, xs[i])
        push_back(lists, which, xs[i])


@njit(cache=True)
def _pop_front_each(lists, which, n, out):
    for i in range(n):
        out[i] = pop_front(lists, which)


@njit(cache=True)
def _count(lists, which):
    return lists.count[which]


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


OPERATIONS = st.sampled_from(["push", "unlink", "unlink_any", "move", "pop"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(OPERATIONS, st.integers(0, N_LISTS - 1), st.lists(st.integers(-1, N_IDS + 1), max_size=8)),
                max_size=16))
def test_moves_unlinks_and_pops_leave_the_lists_as_one_id_at_a_time_would(batches):
    """``unlink_n`` (any ids, held or not, repeated), ``move_to_back_n`` (ids within the lists, held or
    not, repeated) and ``pop_front_n`` (up to the list's count), between pushes: same links, same
    counts, same flags and popped ids."""
    batch, each = new_lists(N_IDS, N_LISTS), new_lists(N_IDS, N_LISTS)
    for operation, which, ids in batches:
        if operation == "push":
            where = _arrays(batch)[2]
            xs = np.array(list(dict.fromkeys(x for x in ids if 0 <= x < N_IDS and where[x] < 0)), dtype=np.int64)
            push_back_n(batch, xs, len(xs), np.zeros(0, np.int32))
            _push_back_each(each, xs, len(xs), np.zeros(0, np.int32))
        elif operation == "unlink_any":
            xs = np.array(ids, dtype=np.int64)
            flags, expected = np.zeros(len(xs), np.bool_), np.zeros(len(xs), np.bool_)
            unlink_n(batch, xs, len(xs), flags)
            _unlink_each_held(each, xs, len(xs), expected)
            assert flags.tolist() == expected.tolist()
        elif operation == "move":
            xs = np.array([x for x in ids if 0 <= x < N_IDS], dtype=np.int64)
            flags, expected = np.zeros(len(xs), np.bool_), np.zeros(len(xs), np.bool_)
            move_to_back_n(batch, xs, len(xs), which, flags)
            _move_to_back_each(each, xs, len(xs), which, expected)
            assert flags.tolist() == expected.tolist()
        elif operation == "pop":
            n = min(len(ids), _count(each, which))
            out, expected = np.zeros(n, np.int64), np.zeros(n, np.int64)
            pop_front_n(batch, which, n, out)
            _pop_front_each(each, which, n, expected)
            assert out.tolist() == expected.tolist()
        else:
            xs = np.array(ids, dtype=np.int64)
            assert unlink_held_n(batch, xs, len(xs)) == _unlink_each(each, xs, len(xs))
        assert _state(batch) == _state(each)
