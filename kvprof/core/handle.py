"""The compiled policy's protocol called from Python by address: the fast way in for per-call drivers.

numba types a structref argument in Python code (~0.5 us a call, more than the operation itself),
an int in C. So a driver that calls the core once per vLLM event (the vLLM adaptor, through
:class:`kvprof.core.twin.CompiledTwin`) passes the policy's address, an int from
:func:`address_of`, and each function here turns it back into the policy with :func:`policy_at`.
The address stays valid while the Python handle (:class:`kvprof.core.wa.Policy`) lives;
whoever holds the address must hold the handle.

Every function is the :mod:`kvprof.core.wa` function of the same name with the policy behind
an address, plus batch forms vLLM's events come in (a chain of accesses, a batch of removals).
Those that access or free blocks also note, in the twin's tables at ``notes_address``
(:func:`notes_at`), what a reload reads back of each block: when it was last accessed or freed,
the depth of its last access (where the policy's core keeps neither) and its hits since its last
access that was not a hit; so a driver keeps no per-block table of its own.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvprof.core import wa as core
from kvprof.core.dispatch import uses_content
from kvprof.core.policies import keeps_contents, keeps_touches
from kvprof.core.wa import policy_type


@intrinsic
def _address(typingctx, policy):
    def codegen(context, builder, sig, args):
        struct = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0])
        return builder.ptrtoint(struct.meminfo, ir.IntType(64))

    return types.int64(policy), codegen


@intrinsic
def policy_at(typingctx, address):
    """The policy whose meminfo is at ``address`` (a new reference)."""

    def codegen(context, builder, sig, args):
        struct = cgutils.create_struct_proxy(policy_type)(context, builder)
        struct.meminfo = builder.inttoptr(args[0], struct.meminfo.type)
        policy = struct._getvalue()
        context.nrt.incref(builder, policy_type, policy)
        return policy

    return policy_type(types.int64), codegen


@njit(cache=True)
def address_of(policy):
    """The address :func:`policy_at` takes (valid while ``policy``'s Python handle lives)."""
    return _address(policy)


#: Hits since a block's last access that was not a hit are noted up to this many (int8).
HITS_NOTED = 127


@intrinsic
def _pointer(typingctx, address):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


@njit(cache=True)
def notes_at(notes_address):
    """The twin's tables found through ``notes_address`` (:class:`kvprof.core.twin.CompiledTwin` keeps
    them; an address is an int, which a call takes faster than arrays): five int64s there give the
    address of when each block was last accessed or freed (float64), of the depth of its last access
    (int64), their length (0 where the core keeps both), the address of its hits since its last miss
    (int8) and that table's length."""
    at_address, depth_address, n_touched, hits_address, n_hits = carray(_pointer(notes_address), 5, np.int64)
    return (carray(_pointer(at_address), n_touched, np.float64), carray(_pointer(depth_address), n_touched, np.int64),
            carray(_pointer(hits_address), n_hits, np.int8))


@njit(cache=True)
def _note_access(notes, block, now, depth, hit):
    touched_at, touched_depth, hits = notes
    if 0 <= block < len(touched_at):
        touched_at[block] = now
        touched_depth[block] = depth
    if 0 <= block < len(hits):
        hits[block] = min(hits[block] + 1, HITS_NOTED) if hit else 0


@njit(cache=True)
def _note_free(notes, blocks, n, now):
    touched_at = notes[0]
    for i in range(n):
        if 0 <= blocks[i] < len(touched_at):
            touched_at[blocks[i]] = now


@njit(cache=True)
def access(address, block, now, workload, depth, hit, next_use, content, notes_address):
    core.policy_access(policy_at(address), block, now, workload, depth, hit, next_use, content)
    _note_access(notes_at(notes_address), block, now, depth, hit)


@njit(cache=True)
def access_n(address, blocks, depths, contents, n, now, workload, hit, notes_address):
    """``access`` of ``blocks[i]`` at ``depths[i]`` with ``contents[i]`` for ``i < n``, in order."""
    core.policy_access_n(policy_at(address), blocks, depths, contents, np.full(n, np.inf), n, now, workload, hit)
    notes = notes_at(notes_address)
    for i in range(n):
        _note_access(notes, blocks[i], now, depths[i], hit)


@njit(cache=True)
def admit(address, seat, contents, n_lookup, n_blocks, now, workload):
    core.policy_admit(policy_at(address), seat, contents, n_lookup, n_blocks, now, workload)


@njit(cache=True)
def finish(address, seat, now, contents, n_blocks, n_output, code):
    core.policy_finish(policy_at(address), seat, now, contents, n_blocks, n_output, code)


@njit(cache=True)
def count_finish(address, n_output, code):
    """``wa.count_finish``: the real cache's cores hear the output length and the finish code."""
    core.count_finish(policy_at(address), n_output, code)


# -- wa's shadows fed on a thread of their own (kvprof.core.shadow_feed) --------------------------
FEED_ADMIT, FEED_FINISH = 0, 1


@njit(cache=True)
def count_admit(address, n_lookup, workload):
    """``wa.count_admit`` and the real cache's hits so far: (size, workload, lookups, real hits)."""
    policy = policy_at(address)
    size, workload, lookups = core.count_admit(policy, n_lookup, workload)
    return size, workload, lookups, policy.real_hits


@njit(cache=True, nogil=True)
def feed_n(address, numbers, nows, starts, contents, first, at):
    """The shadows' part of the admissions and finishes ``first`` on, in order: item ``i`` is
    ``numbers[i]`` (kind, seat, n_lookup or a finish's n_output, n_blocks, workload, size, lookups, real hits; see
    :meth:`kvprof.core.shadow_feed.ShadowFeed.admit`), ``nows[i]`` and the chain
    ``contents[starts[i]:starts[i + 1]]``. ``at[0]`` is the item being done (where an error stopped)."""
    policy = policy_at(address)
    for i in range(first, len(nows)):
        at[0] = i
        item, chain = numbers[i], contents[starts[i]:starts[i + 1]]
        if item[0] == FEED_ADMIT:
            core.feed_admit(policy, item[1], chain, item[2], item[3], nows[i], item[4], item[5])
            if item[6]:
                core._weigh(policy, item[6], item[5], item[7])
        else:
            core.feed_finish(policy, item[1], nows[i], chain, item[3], item[2], item[4])


@njit(cache=True)
def eviction_reads_shadows(address):
    """Whether an eviction reads a shadow now (``wa.evicting_core``: a frequency leader's beta)."""
    return core.eviction_reads_shadows(policy_at(address))


@njit(cache=True)
def free(address, blocks, n, now, notes_address):
    core.policy_free(policy_at(address), blocks, n, now)
    _note_free(notes_at(notes_address), blocks, n, now)


@njit(cache=True)
def free_one(address, block, now, notes_address):
    blocks = np.empty(1, np.int64)
    blocks[0] = block
    core.policy_free(policy_at(address), blocks, 1, now)
    _note_free(notes_at(notes_address), blocks, 1, now)


@njit(cache=True)
def remove(address, block):
    """``remove`` if ``block`` is evictable; whether it was."""
    policy = policy_at(address)
    if not core.policy_contains(policy, block):
        return False
    core.policy_remove(policy, block)
    return True


@njit(cache=True)
def remove_n(address, blocks, n):
    """``remove`` of ``blocks[:n]`` in order, stopping at the first that is not evictable;
    its index, or -1 when all were removed."""
    removed = core.policy_remove_held_n(policy_at(address), blocks, n)
    return -1 if removed == n else removed


@njit(cache=True)
def evict_n(address, n, now, out):
    core.policy_evict_n(policy_at(address), n, now, out, 0)


@njit(cache=True)
def evict_one(address, now):
    """:func:`evict_n` of one block, the victim returned: no array crosses from Python (an array
    argument costs the dispatcher more than the eviction itself)."""
    out = np.empty(1, np.int64)
    core.policy_evict_n(policy_at(address), 1, now, out, 0)
    return out[0]


@njit(cache=True)
def order(address, n, now, out):
    core.policy_order(policy_at(address), n, now, out)


@njit(cache=True)
def size(address):
    return core.policy_size(policy_at(address))


@njit(cache=True)
def contains(address, block):
    return core.policy_contains(policy_at(address), block)


# -- what a driver reads back rather than keep it too (kvprof.vllm.block_pool) -------------------
@njit(cache=True)
def keeps_touches_of(address):
    """Whether the policy's main core keeps each block's last touch and depth, which :func:`touches`
    reads (:func:`~kvprof.core.policies.keeps_touches`)."""
    return keeps_touches(policy_at(address).main)


@njit(cache=True)
def touches(address, blocks, stamps, depths):
    """When each of ``blocks`` was last accessed or freed and the depth of its last access, into
    ``stamps`` and ``depths`` (-inf and 0 for a block past the tables: never accessed)."""
    main = policy_at(address).main
    for i in range(len(blocks)):
        block = blocks[i]
        if 0 <= block < len(main.stamp):
            stamps[i], depths[i] = main.stamp[block], main.depth[block]
        else:
            stamps[i], depths[i] = -np.inf, 0


@njit(cache=True)
def keeps_contents_of(address):
    """Whether the policy's main core keeps the content each block was cached with, which
    :func:`contents_of` reads (:func:`~kvprof.core.policies.keeps_contents`)."""
    return keeps_contents(policy_at(address).main)


@njit(cache=True)
def reads_contents_of(address):
    """Whether the policy's decisions read the contents accesses pass: its main core keeps them, or it
    is ``wa``'s composite (its followed cores, ghosts and shadows go by content). Where not, a driver
    may pass -1 (none) for every content and number nothing."""
    main = policy_at(address).main
    return main.wa or uses_content(main.kind)


@njit(cache=True)
def contents_of(address, blocks, out):
    """The content each of ``blocks`` was cached with, into ``out`` (-1: none); whether all have one."""
    table = policy_at(address).main.content
    known = True
    for i in range(len(blocks)):
        block = blocks[i]
        out[i] = table[block] if 0 <= block < len(table) else -1
        if out[i] < 0:
            known = False
    return known
