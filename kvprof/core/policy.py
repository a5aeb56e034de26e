"""A compiled policy as the drivers see it: one core, or ``wa`` with its followed cores and shadows.

``Policy`` wraps the core that orders the real cache's blocks (``main``). For every policy but
``wa`` that is all. For ``wa`` (:class:`kvprof.policy.wa.WorkloadAwarePolicy`) it adds what
the reference keeps beside its rows: the followed policies (cores over the same blocks, kept in
step; one of them may lead eviction), one :class:`Shadow` per candidate order, the shadows'
windowed hit scores and the leader.

Invariants: every followed core holds exactly the blocks ``main`` holds; ``order_kind[i]`` is
candidate ``i``'s row order, or -1 when ``order_followed[i]`` names the followed core it is;
``leader`` is the candidate eviction follows.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.experimental import structref
from numba.typed import List

from kvprof.core import structs
from kvprof.core.policies import (
    ORDER_FREQUENCY, core_access, core_contains, core_evict_n, core_free, core_remove, core_type, remember,
)
from kvprof.core.structs import NONE, grown

class ShadowType(structs.StructType):
    pass


class Shadow(structref.StructRefProxy):
    """Python handle of a compiled shadow cache."""


shadow_type = structs.struct(ShadowType, Shadow, [
    ("core", core_type),
    ("slot_of", types.int64[:]),  # content -> slot, -1: not held
    ("content_of", types.int64[:]),  # slot -> content it holds or held last
    ("n_slots", types.int64),
    ("free_slots", types.int64[:]),  # stack of slots whose content was evicted
    ("n_free", types.int64),
    ("pinned", types.boolean[:]),
    ("n_held", types.int64),  # contents held
    ("hits", types.int64),
    ("capacity", types.int64),
    ("chain_depth", types.int64),
    ("batch_share", types.int64),
    ("victims", types.int64[:]),
])

class PolicyType(structs.StructType):
    pass


class Policy(structref.StructRefProxy):
    """Python handle of a compiled policy."""


policy_type = structs.struct(PolicyType, Policy, [
    ("main", core_type),
    ("followed", types.ListType(core_type)),
    ("order_kind", types.int64[:]),
    ("order_followed", types.int64[:]),
    ("shadows", types.ListType(shadow_type)),
    ("leader", types.int64),
    ("shadow_score", types.float64[:]),
    ("shadow_seen", types.int64[:]),
    ("accesses", types.int64),
    ("real_hits", types.int64),
    ("real_seen", types.int64),
    ("real_led", types.float64[:]),
    ("shadow_led", types.float64[:]),
    ("window_capacities", types.float64),
    ("switch_margin", types.float64),
    ("period_min", types.int64),
    ("period_share", types.int64),
    ("contents", types.int64[:]),  # scratch: contents of the blocks being freed
])


# -- shadows ------------------------------------------------------------------------------------
@njit(cache=True)
def new_shadow(core, batch_share):
    """:class:`kvprof.policy.shadow.ShadowCache` over ``core`` (a fresh core; it sees slot numbers).

    Invariant: every content with a slot (``slot_of``) is pinned or evictable in ``core``.
    """
    shadow = structref.new(shadow_type)
    shadow.core = core
    shadow.slot_of = np.full(0, NONE, np.int64)
    shadow.content_of = np.full(0, NONE, np.int64)
    shadow.n_slots = 0
    shadow.free_slots = np.zeros(16, np.int64)
    shadow.n_free = 0
    shadow.pinned = np.zeros(0, np.bool_)
    shadow.n_held = 0
    shadow.hits = 0
    shadow.capacity = 0
    shadow.chain_depth = -1
    shadow.batch_share = batch_share
    shadow.victims = np.zeros(16, np.int64)
    return shadow


@njit(cache=True)
def shadow_access(shadow, content, now, workload, depth):
    """``ShadowCache.access``: a request of the real cache uses ``content`` at ``depth``, pinning it."""
    if content >= len(shadow.slot_of):
        shadow.slot_of = grown(shadow.slot_of, content + 1, NONE)
    slot = shadow.slot_of[content]
    chained = depth == 0 or depth == shadow.chain_depth + 1
    if slot != NONE:
        if chained:
            shadow.hits += 1
            shadow.chain_depth = depth
        if not shadow.pinned[slot]:
            core_remove(shadow.core, slot)
        core_access(shadow.core, slot, now, workload, depth, True, np.inf, content)
    else:
        slot = _take_slot(shadow, now)
        shadow.slot_of[content] = slot
        shadow.content_of[slot] = content
        shadow.n_held += 1
        core_access(shadow.core, slot, now, workload, depth, False, np.inf, content)
    shadow.pinned[slot] = True


@njit(cache=True)
def _take_slot(shadow, now):
    core = shadow.core
    excess = shadow.n_held + 1 - shadow.capacity
    if excess > shadow.capacity // shadow.batch_share and core.size:
        n = min(excess, core.size)
        if n > len(shadow.victims):
            shadow.victims = np.zeros(max(n, 2 * len(shadow.victims)), np.int64)
        core_evict_n(core, n, now, shadow.victims, 0)
        if shadow.n_free + n > len(shadow.free_slots):
            shadow.free_slots = grown(shadow.free_slots, shadow.n_free + n, 0)
        for i in range(n):
            slot = shadow.victims[i]
            shadow.slot_of[shadow.content_of[slot]] = NONE
            shadow.n_held -= 1
            shadow.free_slots[shadow.n_free] = slot
            shadow.n_free += 1
    if shadow.n_free:
        shadow.n_free -= 1
        return shadow.free_slots[shadow.n_free]
    slot = shadow.n_slots
    if slot >= len(shadow.content_of):
        shadow.content_of = grown(shadow.content_of, slot + 1, NONE)
        shadow.pinned = grown(shadow.pinned, slot + 1, False)
    shadow.n_slots += 1
    return slot


@njit(cache=True)
def shadow_release(shadow, contents, n, now):
    """``ShadowCache.release``: the real cache freed blocks holding ``contents[:n]`` (tail first)."""
    freed = np.empty(n, np.int64)
    k = 0
    for i in range(n):
        content = contents[i]
        if 0 <= content < len(shadow.slot_of):
            slot = shadow.slot_of[content]
            if slot != NONE and shadow.pinned[slot]:
                shadow.pinned[slot] = False
                freed[k] = slot
                k += 1
    if k:
        core_free(shadow.core, freed, k, now)


# -- the policy ---------------------------------------------------------------------------------
@njit(cache=True)
def new_policy(main, followed, order_kind, order_followed, shadows, leader):
    """A policy whose safety-net constants are neutral; :mod:`kvprof.core.build` sets them."""
    policy = structref.new(policy_type)
    policy.main = main
    policy.followed = followed
    policy.order_kind = order_kind
    policy.order_followed = order_followed
    policy.shadows = shadows
    policy.leader = leader
    policy.shadow_score = np.zeros(len(shadows))
    policy.shadow_seen = np.zeros(len(shadows), np.int64)
    policy.accesses = 0
    policy.real_hits = 0
    policy.real_seen = 0
    policy.real_led = np.zeros(len(shadows))
    policy.shadow_led = np.zeros(len(shadows))
    policy.window_capacities = 1.0
    policy.switch_margin = 0.0
    policy.period_min = 1
    policy.period_share = 1
    policy.contents = np.zeros(16, np.int64)
    return policy


@njit(cache=True)
def policy_access(policy, block, now, workload, depth, hit, next_use, content):
    """``EvictionPolicy.access`` (``content`` -1 for None)."""
    main = policy.main
    core_access(main, block, now, workload, depth, hit, next_use, content)
    if not main.wa:
        return
    if hit:
        policy.real_hits += 1
    if not 0 <= workload < main.n_cells:
        workload = main.n_cells - 1
    for core in policy.followed:
        core_access(core, block, now, workload, depth, hit, next_use, content)
    if content >= 0 and len(policy.shadows):
        _follow(policy, content, now, workload, depth)


@njit(cache=True)
def policy_free(policy, blocks, n, now):
    """``EvictionPolicy.free`` of ``blocks[:n]`` (tail first)."""
    main = policy.main
    core_free(main, blocks, n, now)
    for core in policy.followed:
        core_free(core, blocks, n, now)
    if len(policy.shadows):
        if n > len(policy.contents):
            policy.contents = np.zeros(max(n, 2 * len(policy.contents)), np.int64)
        for i in range(n):
            policy.contents[i] = main.content[blocks[i]]
        for shadow in policy.shadows:
            shadow_release(shadow, policy.contents, n, now)


@njit(cache=True)
def policy_remove(policy, block):
    """``EvictionPolicy.remove`` of an evictable block."""
    core_remove(policy.main, block)
    for core in policy.followed:
        core_remove(core, block)


@njit(cache=True)
def policy_contains(policy, block):
    return core_contains(policy.main, block)


@njit(cache=True)
def evicting_core(policy):
    """The core victims are taken from and its index among the followed cores (-1: ``main``).

    For ``main`` under a frequency order learned in the shadows, ``main`` takes the leading
    shadow's beta first, as every eviction does.
    """
    main = policy.main
    if not main.wa:
        return main, NONE
    leading = policy.order_followed[policy.leader]
    if leading != NONE:
        return policy.followed[leading], leading
    if len(policy.shadows) and main.order == ORDER_FREQUENCY:  # adaptive orders learn in their shadows
        main.beta = policy.shadows[policy.leader].core.beta
    return main, NONE


@njit(cache=True)
def policy_evict_n(policy, n, now, out, at):
    """``EvictionPolicy.evict_n`` into ``out[at:at + n]``."""
    main = policy.main
    source, leading = evicting_core(policy)
    core_evict_n(source, n, now, out, at)
    if not main.wa:
        return
    if leading != NONE:
        for i in range(at, at + n):
            core_remove(main, out[i])
        remember(main, out, at, n)
    for j in range(len(policy.followed)):
        if j != leading:
            core = policy.followed[j]
            for i in range(at, at + n):
                core_remove(core, out[i])


copy_core = structs.deep_copier(core_type, {structs.lists_type: structs.copy_lists, structs.heap_type: structs.copy_heap})


@njit
def policy_order(policy, n, now, out):
    """The first ``n`` victims ``policy_evict_n`` would take at ``now``, into ``out[:n]``; the
    policy is unchanged (they are evicted from a copy of the core eviction takes them from)."""
    source, _ = evicting_core(policy)
    core_evict_n(copy_core(source), n, now, out, 0)


@njit(cache=True)
def _follow(policy, content, now, workload, depth):
    """Feed the shadows one access; now and then follow the candidate whose shadow hits most."""
    most = policy.main.most
    shadows = policy.shadows
    for shadow in shadows:
        if shadow.capacity < most:
            shadow.capacity = most
        shadow_access(shadow, content, now, workload, depth)
    policy.accesses += 1
    period = max(policy.period_min, most // policy.period_share)
    if policy.accesses % period:
        return
    keep = 0.5 ** (period / max(policy.window_capacities * most, 1.0))
    real_gained = policy.real_hits - policy.real_seen
    policy.real_seen = policy.real_hits
    prior = float(max(most, 1))
    score, seen, real_led, shadow_led = policy.shadow_score, policy.shadow_seen, policy.real_led, policy.shadow_led
    best = 0
    best_corrected = leader_corrected = 0.0
    for i in range(len(shadows)):
        gained = shadows[i].hits - seen[i]
        seen[i] = shadows[i].hits
        score[i] = score[i] * keep + gained
        real_led[i] *= keep
        shadow_led[i] *= keep
        if i == policy.leader:
            real_led[i] += real_gained
            shadow_led[i] += gained
        corrected = score[i] * (real_led[i] + prior) / (shadow_led[i] + prior)
        if i == 0 or corrected > best_corrected:
            best, best_corrected = i, corrected
        if i == policy.leader:
            leader_corrected = corrected
    if best_corrected > leader_corrected * (1.0 + policy.switch_margin):
        lead(policy, best)


@njit(cache=True)
def lead(policy, index):
    """Follow candidate ``index`` from now on."""
    policy.leader = index
    if policy.order_kind[index] != NONE:
        policy.main.order = policy.order_kind[index]


@njit(cache=True)
def policy_size(policy):
    return policy.main.size


def empty_cores():
    """An empty typed list of cores (followed policies, or shadows' cores)."""
    return List.empty_list(core_type)


def empty_shadows():
    return List.empty_list(shadow_type)


@njit(cache=True)
def set_safety_net(policy, window_capacities, switch_margin, period_min, period_share):
    """wa's constants for comparing shadows (:mod:`kvprof.policy.wa`)."""
    policy.window_capacities, policy.switch_margin = window_capacities, switch_margin
    policy.period_min, policy.period_share = period_min, period_share


@njit(cache=True)
def outcome(policy):
    """The leader and each shadow's hits."""
    hits = np.zeros(len(policy.shadows), np.int64)
    for i in range(len(policy.shadows)):
        hits[i] = policy.shadows[i].hits
    return policy.leader, hits
