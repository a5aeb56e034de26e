"""SIEVE: the rule of the paper (a visited bit, a hand that stays where it stopped), and its order.

The protocol and the twin's decisions are held for SIEVE as for every registered policy
(``tests/test_policies.py::test_policy_keeps_the_protocol``, ``tests/test_core_policies.py``);
here is what is SIEVE's own.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.twin import CompiledTwin
from kvprof.policy.sieve import SIEVEPolicy


def queue(*blocks, visited=(), policy=None):
    """A SIEVE policy (or its twin) holding ``blocks`` freed in that order, ``visited`` hit since allocation."""
    policy = SIEVEPolicy() if policy is None else policy
    for block in blocks:
        policy.access(block, 0.0)
    for block in visited:
        policy.access(block, 0.0, hit=True)
    policy.free(blocks, 0.0)
    return policy


@pytest.mark.parametrize("twin", [False, True])
def test_the_paper_example_a_visited_block_survives_and_the_hand_stays(twin):
    policy = queue(0, 1, 2, 3, 4, visited=(0, 1), policy=CompiledTwin(SIEVEPolicy()) if twin else None)
    assert policy.evict(1.0) == 2  # 0 and 1 were visited: passed over, their bits cleared
    policy.access(5, 1.0)
    policy.free([5], 1.0)
    assert policy.evict(1.0) == 3  # the hand stayed after 2; it did not go back to the front
    assert policy.order(1.0) == [4, 5, 0, 1]  # on to the newest, then from the front again


def test_removing_the_block_under_the_hand_moves_the_hand_to_the_next_newer():
    policy = queue(1, 2, 3, 4, visited=(1,))
    assert policy.evict(0.0) == 2  # the hand now on 3
    policy.remove(3)  # a hit takes 3 back: the hand moves to 4
    policy.free([3], 0.0)  # 3 freed again goes to the back
    assert policy.order(0.0) == [4, 3, 1]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_the_eviction_order_is_unvisited_from_the_hand_then_the_rest_from_the_hand(n, data):
    """With the hand at position h: the unvisited blocks from h to the back, then those from the
    front to h, then the visited ones in the same two runs (each lost its bit when passed)."""
    blocks = list(range(n))
    visited = data.draw(st.sets(st.sampled_from(blocks)))
    first_victims = data.draw(st.integers(0, n - 1))
    policy = queue(*blocks)
    for _ in range(first_victims):  # move the hand: evict from the front, then free the victims again
        policy.free([policy.evict(0.0)], 0.0)
    for block in visited:
        policy.access(block, 0.0, hit=True)
    order = []
    block = policy._front
    while block is not None:
        order.append(block)
        block = policy._next[block]
    h = 0 if policy._hand is None else order.index(policy._hand)
    runs = order[h:], order[:h]
    expected = [b for run in runs for b in run if b not in visited] + [b for run in runs for b in run if b in visited]
    assert policy.order(0.0) == expected
