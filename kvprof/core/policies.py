"""The compiled twins of the single-structure policies: one ``Core`` struct, one ``kind`` each.

A ``Core`` holds one policy's state in arrays (per block, per content, per list), and the
functions below run its protocol (``core_access``, ``core_free``, ``core_remove``,
``core_evict_n``) with the reference classes' rules, decision for decision. Each kind's state
and rules live in its module of :mod:`kvprof.core.kinds` (one per twin of
:data:`kvprof.registry.REGISTERED`); here are the fields every kind shares and the protocol's
frame (tables grown, ``size`` kept), around :mod:`kvprof.core.dispatch`, which calls each kind's
operations and is generated from the registry (numba compiles calls, it looks nothing up).

One struct for every kind, rather than a struct per kind: ``wa``'s composite keeps followed
cores of different kinds in one typed list and its shadows' pools are typed by the core
(:mod:`kvprof.core.wa`), and numba's typed lists and struct fields hold one type. So the
struct is the union of the kinds' fields, each named after the kind that owns it, and a core
grows only the per-block tables of its own kind.

Invariant of every kind: ``size`` counts the evictable blocks, exactly those the driver freed
and neither removed nor evicted since. Per-block tables grow on demand (``reserve_blocks``) and
cover blocks ``0 .. n_blocks - 1``, save the common ones a kind never reads, which stay empty
(its ``COMMON`` says which it reads: ``lru``'s core is its queue's links alone); contents are
dense ids >= 0, -1 for none. Ids, depths and rows are int32 per block (below
:data:`~kvprof.core.structs.MAX_ID`); times stay float64, since they are compared.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.experimental import structref

from kvprof.core import structs
from kvprof.core.dispatch import (
    ARC, CLASSED, S3FIFO, access_kind, access_kind_n, bounds_ghosts, contains_kind, evict_kind_n, finish_kind,
    finish_reason_kind, free_kind_n, init_kinds, remove_kind, removes_alone, reserve_kind, uses_content, uses_depth,
    uses_queue, uses_row, uses_stamp,
)
from kvprof.core.kinds import NAMES, module
from kvprof.core.kinds.classed import (  # noqa: F401 (wa's composite and the builders read them here)
    ORDER_FREQUENCY, ORDER_MODEL, ORDER_PAPER, ORDER_RECENCY, ORDER_SEGMENTED, remember,
)
from kvprof.core.prefix_cache import register_pool_protocol
from kvprof.core.structs import NONE, grown, unlink_held_n


class CoreType(structs.StructType):
    pass


class Core(structref.StructRefProxy):
    """Python handle of a compiled core."""


#: The fields of every kind: what a block holds and where it waits.
COMMON_FIELDS = [
    ("kind", types.int64),
    ("size", types.int64),
    ("q", structs.lists_type),  # evictable blocks
    ("g", structs.lists_type),  # ghosts: contents
    ("n_blocks", types.int64),  # the per-block tables cover blocks 0 .. n_blocks - 1
    ("content", types.int32[:]),  # per block: its content id (-1: none)
    ("stamp", types.float64[:]),  # per block: when it was last accessed or freed, as its kind keeps time
    ("depth", types.int32[:]),  # per block: its depth in its chain
    ("row", types.int32[:]),  # per block: the list it is freed to, for kinds with rows
    ("n_rows", types.int64), ("default_row", types.int64),
    ("most_evictable", types.int64),  # the most blocks evictable at once (bounds the ghosts)
]

core_type = structs.struct(CoreType, Core, COMMON_FIELDS + [field for name in NAMES for field in module(name).FIELDS])


@njit(cache=True)
def new_core(kind, n_blocks, n_lists, n_ghost_lists):
    """A core of ``kind`` with every table empty and every parameter neutral; builders set them."""
    core = structref.new(core_type)
    core.kind = kind
    core.size = 0
    structs.check_ids(n_blocks)
    core.n_blocks = n_blocks
    core.q = structs.new_lists(n_blocks if uses_queue(kind) else 0, n_lists)
    core.g = structs.new_lists(0, n_ghost_lists)
    core.content = np.full(n_blocks if uses_content(kind) else 0, NONE, np.int32)
    core.stamp = np.full(n_blocks if uses_stamp(kind) else 0, -np.inf)
    core.depth = np.zeros(n_blocks if uses_depth(kind) else 0, np.int32)
    core.n_rows = n_lists
    core.default_row = n_lists - 1
    core.row = np.zeros(n_blocks if uses_row(kind) else 0, np.int32)
    core.most_evictable = 0
    init_kinds(core)
    reserve_kind(core, n_blocks)
    return core


@njit(cache=True)
def reserve_blocks(core, n):
    """Make the per-block tables cover blocks ``0 .. n - 1`` (doubling)."""
    if n <= core.n_blocks:
        return
    n = max(n, 2 * core.n_blocks, 16)
    structs.check_ids(n)
    core.n_blocks = n
    kind = core.kind
    if uses_queue(kind):
        structs.reserve_ids(core.q, n)
    if uses_content(kind):
        core.content = grown(core.content, n, NONE)
    if uses_stamp(kind):
        core.stamp = grown(core.stamp, n, -np.inf)
    if uses_depth(kind):
        core.depth = grown(core.depth, n, 0)
    if uses_row(kind):
        core.row = grown(core.row, n, core.default_row)
    reserve_kind(core, n)  # a kind's tables cover at least the common ones


@njit(cache=True)
def reserve_contents(core, n):
    """Make the ghost tables cover contents ``0 .. n - 1``."""
    if n > len(core.g.where):
        structs.reserve_ids(core.g, n)  # (raises past MAX_ID)
        core.ghost_value = grown(core.ghost_value, n, 0)


# -- the protocol -------------------------------------------------------------------------------
@njit(cache=True)
def core_access(core, block, now, workload, depth, hit, next_use, content):
    """``EvictionPolicy.access`` (``content`` -1 for None)."""
    if block >= core.n_blocks:
        reserve_blocks(core, block + 1)
    kind = core.kind
    if content >= 0 and uses_content(kind):  # the kinds with ghosts keep contents
        reserve_contents(core, content + 1)
    access_kind(core, block, now, workload, depth, hit, next_use, content)


@njit(cache=True)
def core_access_n(core, blocks, depths, contents, next_uses, n, now, workload, hit):
    """``core_access`` of ``blocks[i]`` at ``depths[i]`` with ``contents[i]`` and ``next_uses[i]`` for
    ``i < n``, in order: the tables grown first, as the calls one by one would grow them."""
    kind = core.kind
    keeps_contents = uses_content(kind)
    n_blocks, n_contents = core.n_blocks, len(core.g.where)
    for i in range(n):  # (no call per block where nothing grows)
        if blocks[i] >= n_blocks:
            reserve_blocks(core, blocks[i] + 1)
            n_blocks = core.n_blocks
        if keeps_contents and contents[i] >= n_contents:
            reserve_contents(core, contents[i] + 1)
            n_contents = len(core.g.where)
    access_kind_n(core, blocks, depths, contents, next_uses, n, now, workload, hit)


@njit(cache=True)
def core_free(core, blocks, n, now):
    """``EvictionPolicy.free`` of ``blocks[:n]``, in that order."""
    for i in range(n):
        if blocks[i] >= core.n_blocks:
            reserve_blocks(core, blocks[i] + 1)
    core.size += n
    free_kind_n(core, blocks, n, now)
    if bounds_ghosts(core.kind):
        core.most_evictable = max(core.most_evictable, core.size)


@njit(cache=True)
def core_finish(core, n_output):
    """``EvictionPolicy.finish`` as a core hears it: how many tokens the request whose free comes next
    generated (-1: unknown); ``long-output`` listens, and ``finish-reason`` hears that the request's ending
    is not known (:func:`core_finish_reason` may tell it next)."""
    finish_kind(core, n_output)


@njit(cache=True)
def core_finish_reason(core, code):
    """After :func:`core_finish`, where the driver knows it: how the request's response ended (a code
    of :mod:`kvprof.models.finish`, 0: unknown), which its free comes next; only ``finish-reason``
    listens. A driver that cannot tell skips it: the core then takes the ending as unknown."""
    finish_reason_kind(core, code)


@njit(cache=True)
def core_contains(core, block):
    return contains_kind(core, block)


@njit(cache=True)
def core_remove(core, block):
    """``EvictionPolicy.remove`` of an evictable block."""
    remove_kind(core, block)
    core.size -= 1


@njit(cache=True)
def core_remove_held_n(core, blocks, n):
    """``core_remove`` of ``blocks[:n]`` in order, stopping at the first that is not evictable: how
    many were removed."""
    if removes_alone(core.kind):
        for i in range(n):
            if not core_contains(core, blocks[i]):
                return i
            core_remove(core, blocks[i])
        return n
    removed = unlink_held_n(core.q, blocks, n)
    core.size -= removed
    return removed


@njit(cache=True)
def core_evict_n(core, n, now, out, at):
    """Evict ``n`` blocks into ``out[at:at + n]``, first victim first (``evict_n``)."""
    evict_kind_n(core, n, now, out, at)


@njit(cache=True)
def core_size(core):
    return core.size


register_pool_protocol(CoreType, core_access, core_access_n, core_free, core_remove, core_remove_held_n, core_evict_n,
                       core_contains, core_size)


# -- what a driver may read back of a block rather than keep it too (kvprof.vllm.block_pool) ----
@njit(cache=True)
def keeps_touches(core):
    """Whether ``stamp[b]`` is the ``now`` of block ``b``'s last access or free and ``depth[b]`` the depth of
    its last access: a classed core that stamps both (``wa``; not ``wa-paper``, which stamps neither)."""
    return core.kind == CLASSED and core.stamps_free and (core.wa or core.stamps_allocation)


@njit(cache=True)
def keeps_contents(core):
    """Whether ``content[b]`` is the content block ``b`` was cached with (its last access that was not a hit
    gave one) until it is evicted: the kinds with ghosts, save ``wa-paper``'s classed core (no ghost)."""
    return core.kind == S3FIFO or core.kind == ARC or (core.kind == CLASSED and core.wa)
