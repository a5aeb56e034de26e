"""The compiled cores' per-block tables: a kind keeps only the tables it reads, ids in int32.

What the plugin holds per block of vLLM's pool (issue 20, section 1): ``lru``'s core is its
queue's three links, 12 bytes a block; a simulated tier (the live counterfactual's) adds its
pool's three int32 slot tables. Decisions do not depend on this (the differential tests of
tests/test_core_policies.py drive every kind against its reference); here the layout is checked.
"""

from __future__ import annotations

import pytest
from numba import njit

from kvprof.core import tiers
from kvprof.core.build import compile_policy
from kvprof.core.kinds import KIND, NAMES
from kvprof.core.policies import new_core, reserve_blocks
from kvprof.core.structs import MAX_ID
from kvprof.policy import make_policy

N = 1000


@njit
def _common_tables(core):
    """Lengths and item sizes of the common per-block tables (the queue's links first)."""
    q = core.q
    return ((len(q.nxt), q.nxt.itemsize), (len(q.prv), q.prv.itemsize), (len(q.where), q.where.itemsize),
            (len(core.content), core.content.itemsize), (len(core.stamp), core.stamp.itemsize),
            (len(core.depth), core.depth.itemsize), (len(core.row), core.row.itemsize))


@njit
def _n_blocks(core):
    return core.n_blocks


@njit
def _pool_tables(pool):
    return ((len(pool.slot_block), pool.slot_block.itemsize), (len(pool.refs), pool.refs.itemsize),
            (len(pool.empty), pool.empty.itemsize))


@njit
def _main(policy):
    return policy.main


#: The common per-block tables each kind reads, besides the queue's links (all but Belady).
READS = {"s3fifo": {"content"}, "arc": {"content"}, "belady": {"depth"},
         "classed": {"content", "stamp", "depth", "row"}, "learned": {"stamp", "depth", "row"}}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n_blocks", [N, 0])  # sized at the start, or grown by reserve_blocks
def test_a_kind_keeps_only_the_common_tables_it_reads(name, n_blocks):
    core = new_core(KIND[name], n_blocks, 1, 0)
    reserve_blocks(core, N)
    covered = _n_blocks(core)
    assert covered >= N
    nxt, prv, where, content, stamp, depth, row = _common_tables(core)
    for table in (nxt, prv, where):
        assert table == ((0 if name == "belady" else covered), 4)
    kept = {"content": content, "stamp": stamp, "depth": depth, "row": row}
    for field, table in kept.items():
        length = covered if field in READS.get(name, ()) else 0
        assert table == (length, 8 if field == "stamp" else 4), field


def test_lru_holds_twelve_bytes_a_block():
    policy = compile_policy(make_policy("lru"), N)
    per_block = sum(length * itemsize for length, itemsize in _common_tables(_main(policy))) / N
    assert per_block == 12


def test_a_simulated_tier_holds_three_int32_tables_a_slot():
    gpu = tiers.new_device(compile_policy(make_policy("lru"), N), N, 64)
    assert _pool_tables(gpu) == ((N, 4),) * 3


def test_more_ids_than_int32_holds_is_refused():
    with pytest.raises(ValueError, match="2\\*\\*31"):
        new_core(KIND["lru"], MAX_ID + 1, 1, 0)
    core = new_core(KIND["lru"], 16, 1, 0)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        reserve_blocks(core, MAX_ID + 1)


def test_s3fifo_counts_fit_int8():
    from kvprof.core.kinds.s3fifo import set_ratios

    core = new_core(KIND["s3fifo"], 16, 2, 1)
    with pytest.raises(ValueError, match="int8"):
        set_ratios(core, 0.1, 0.9, 128)
    set_ratios(core, 0.1, 0.9, 127)  # the highest cap int8 holds
