"""The compiled row merge (:func:`kvprof.core.kinds.classed._merge`) against the reference's with
many rows: nine cells of every reuse tier, enough blocks for most rows to hold some, and runs of
blocks freed together (ties on stamp and depth, broken by the row) merged in long ``evict_n`` calls."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.twin import CompiledTwin
from kvprof.policy.wa import ROW_ORDERS
from tests.test_core_policies import run_side_by_side
from tests.test_policies import wa_policy

N_CELLS = 9
P = [0.6, 0.4, 0.2, 0.3, 0.9, 0.1, 0.5, 0.7, 0.05]
LAM = [0.5, 0.05, 0.01, 0.02, 0.3, 0.001, 0.1, 0.2, 1.0]
LONG_OPS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6), st.integers(0, 10**6)),
                    min_size=60, max_size=200)


@pytest.mark.parametrize("order", ROW_ORDERS)
@settings(max_examples=30, deadline=None)
@given(ops=LONG_OPS, num_blocks=st.integers(40, 120))
def test_a_merge_of_many_rows_evicts_what_the_reference_evicts(order, ops, num_blocks):
    def policy():
        return wa_policy(P, LAM, orders=(order,))

    run_side_by_side(policy(), CompiledTwin(policy()), ops, num_blocks, n_classes=N_CELLS)
