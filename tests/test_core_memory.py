"""The compiled cores' per-block tables: a kind keeps only the tables it reads, ids in int32.

What the plugin holds per block of vLLM's pool (issue 20, section 1): ``lru``'s core is its
queue's three links, 12 bytes a block; a simulated tier (the live counterfactual's) adds its
pool's two int32 slot tables, for the slots its traffic used so far. Decisions do not depend on
this (the differential tests of tests/test_core_policies.py drive every kind against its
reference); here the layout is checked.
"""

from __future__ import annotations

import pytest
from numba import njit

from kvprof.core import tiers
from kvprof.core.build import compile_policy
from kvprof.core.kinds import KIND, NAMES
from kvprof.core.policies import new_core, reserve_blocks
from kvprof.core.prefix_cache import MIN_SLOTS, first_size
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
         "classed": {"content", "stamp", "depth", "row"}, "learned": {"stamp", "depth", "row"},
         "first_turn": {"content", "depth"}}


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


def test_a_simulated_tier_holds_two_int32_tables_a_slot():
    """``slot_block`` and ``refs``; its never-used slots are a range on the empty stack (no table)."""
    gpu = tiers.new_device(compile_policy(make_policy("lru"), N), N, 64)
    assert _pool_tables(gpu) == ((N, 4), (N, 4), (16, 4))


@pytest.mark.parametrize("capacity", [0, 1, 4096, 8191, 8192, 8193, 50_000, 500_000, 2**20])
def test_a_pools_first_tables_double_to_within_its_capacity(capacity):
    first = first_size(capacity)
    if capacity < 2 * MIN_SLOTS:
        assert first == capacity
        return
    assert MIN_SLOTS <= first < 2 * MIN_SLOTS
    size = first
    while size < capacity:
        size *= 2
    assert size - capacity < size // first  # fewer than 2**k to spare after k doublings


def test_a_simulated_tier_holds_tables_for_the_slots_it_used():
    """Past ``2 * MIN_SLOTS`` slots, the tables cover :func:`first_size`'s slots at first and double as the
    never-used slots are handed out, lowest first, ending at the capacity."""
    from kvprof.core.prefix_cache import pop_empty

    capacity = 50_000
    gpu = tiers.new_device(compile_policy(make_policy("lru"), first_size(capacity)), capacity, 64)
    assert first_size(capacity) == 6250
    assert _pool_tables(gpu)[:2] == ((6250, 4), (6250, 4))
    taken = [pop_empty(gpu) for _ in range(6251)]
    assert taken == list(range(6251)) and _pool_tables(gpu)[:2] == ((12500, 4), (12500, 4))
    for _ in range(capacity - 6251):
        pop_empty(gpu)
    assert _pool_tables(gpu)[:2] == ((capacity, 4), (capacity, 4))


@njit
def _n_empty(pool):
    return pool.n_empty


def test_the_empty_slots_are_a_stack():
    """Slots taken and put back come out as from a list of every slot, top slot 0 (what the simulated
    tier, wa's shadows and the Python ``PrefixCache`` hand out): the never-used ones as a range."""
    import random

    from kvprof.core.prefix_cache import pop_empty, push_empty

    n = 64  # small: the never-used range runs out on the way
    gpu = tiers.new_device(compile_policy(make_policy("lru"), n), n, 64)
    model, taken, rng = list(range(n - 1, -1, -1)), [], random.Random(0)
    for _ in range(4000):
        if model and (not taken or rng.random() < 0.55):
            taken.append(pop_empty(gpu))
            assert taken[-1] == model.pop()
        else:
            slot = taken.pop(rng.randrange(len(taken)))
            push_empty(gpu, slot)
            model.append(slot)
        assert _n_empty(gpu) == len(model)
    assert sorted(taken + model) == list(range(n))


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


@njit
def _classed_tables(core):
    """Item sizes of a classed core's own per-block tables, and how many blocks they cover."""
    return (len(core.wa_hits), core.wa_hits.itemsize, core.wa_pinned.itemsize, core.ghost_value.itemsize)


def test_wa_main_core_holds_thirty_four_bytes_a_block():
    """The queue's links 12, content 4, stamp 8, depth 4, row 4, a hit count 1 and a pin 1: an
    evictable block's key reads the common stamp (no copy of it per block)."""
    from tests.test_policies import LAM, P, wa_policy

    main = _main(compile_policy(wa_policy(P, LAM), N))
    common = sum(length * itemsize for length, itemsize in _common_tables(main)) / N
    covered, hits, pinned, ghost = _classed_tables(main)
    assert covered == N and (hits, pinned, ghost) == (1, 1, 1)
    assert common + hits + pinned == 34


@pytest.mark.parametrize("order", ["frequency", "model", "segmented"])
def test_hit_counts_past_the_int8_cap_decide_as_the_reference(order):
    """wa's hit counts saturate at ``HITS_CAP``: only their tier is read, the same from the tier
    table's end on, so blocks hit far more often than that (and their contents recalled from the
    ghost) leave in the reference's order."""
    from kvprof.core.kinds.classed import HITS_CAP
    from kvprof.core.twin import CompiledTwin
    from tests.test_policies import LAM, P, wa_policy

    reference = wa_policy(P, LAM, orders=(order,))
    twin = CompiledTwin(wa_policy(P, LAM, orders=(order,)), 8)
    hits_of = {0: 3 * HITS_CAP, 1: HITS_CAP, 2: HITS_CAP + 1, 3: 4, 4: 0, 5: 2 * HITS_CAP + 7}
    for policy in (reference, twin):
        now = 0.0
        for block, hits in hits_of.items():
            policy.access(block, now, block % 4, block, content=f"c{block}")
            for _ in range(hits):
                now += 0.25
                policy.access(block, now, block % 4, block, hit=True, content=f"c{block}")
        policy.free(list(hits_of), now)
    assert twin.order(now + 1.0) == reference.order(now + 1.0)
    victims = twin.evict_n(4, now + 1.0)
    assert victims == reference.evict_n(4, now + 1.0)
    for policy in (reference, twin):  # recalled from the ghost: one more than the (capped) count
        for k, block in enumerate(victims):
            policy.access(block, now + 2.0, block % 4, block, content=f"c{victims[-1 - k]}")
        policy.free(victims, now + 3.0)
    assert twin.order(now + 4.0) == reference.order(now + 4.0)


def test_a_compiled_wa_keeps_no_slots_in_its_reference_shadows():
    """A twin's reference is only compiled: its shadows make their slot lists when first fed."""
    from kvprof.core.twin import CompiledTwin
    from tests.test_policies import LAM, WA_ORDERS, P, wa_policy

    twin = CompiledTwin(wa_policy(P, LAM, orders=WA_ORDERS, safety_net=True, capacity=N), N)
    shadows = twin.reference._shadows
    assert shadows and all(shadow.limit > 2 and "slot_block" not in vars(shadow) for shadow in shadows)
    first = shadows[0]
    first.admit("r", ["a", "b"], 0.0, 0, 2, 2)
    assert first.n_live == len(first.slot_block) == first.limit and first.held["r"] == [0, 1]


def test_a_shadow_raised_before_it_is_fed_numbers_its_slots_as_an_eager_one():
    """``set_limit`` before the first admission: the slots it adds follow the capacity's, as when
    the capacity's slots were made at construction."""
    from kvprof.policy.lru import LRUPolicy
    from kvprof.policy.prefix_cache import PrefixCache
    from kvprof.policy.shadow import ShadowCache

    shadow, eager = ShadowCache(LRUPolicy(), 3), PrefixCache(LRUPolicy(), 3)
    for cache in (shadow, eager):
        cache.set_limit(5, 0.0)
    assert (shadow.empty, shadow.n_live, shadow.limit) == (eager.empty, eager.n_live, eager.limit) == ([2, 1, 0, 3, 4], 5, 5)
    shadow.check()


@pytest.mark.parametrize("name", ["first-turn", "s3fifo", "arc", "wa"])
def test_a_twin_keeps_its_blocks_contents_only_where_its_core_does_not(name):
    """A prefix hit passes the content a block was cached with (``remembered``): a twin whose core keeps
    it (the kinds with ghosts) reads the core's and keeps no table of its own (4 bytes a block less); one
    whose core reads contents but keeps none (first-turn) keeps the table."""
    import numpy as np

    from kvprof.core.twin import CompiledTwin
    from tests.test_policies import LAM, P, build, wa_policy

    twin = CompiledTwin(wa_policy(P, LAM) if name == "wa" else build(name), N)
    assert twin._block_content.nbytes == (4 * N if name == "first-turn" else 0)
    twin.access(2, 0.0, content="a")
    twin.access(2, 1.0, hit=True, content="a")
    assert twin.remembered(np.array([2], dtype=np.int64)).tolist() == twin.numbers(["a"]).tolist()
    assert twin.remembered(np.array([2, 3], dtype=np.int64)) is None  # 3 was never cached
    assert twin.remembered(np.array([100 * N], dtype=np.int64)) is None  # past the tables
    twin.clear()
    assert twin.remembered(np.array([2], dtype=np.int64)) is None


@pytest.mark.parametrize("name", ["lru", "lfu", "sieve"])
def test_a_twin_whose_core_reads_no_contents_keeps_none(name):
    """lru, lfu and sieve decide without contents: their twins keep no table of them (4 bytes a block less)."""
    from kvprof.core.twin import CompiledTwin
    from tests.test_policies import build

    twin = CompiledTwin(build(name), N)
    assert not twin.reads_contents and twin._block_content.nbytes == 0
