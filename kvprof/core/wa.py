"""A compiled policy as the drivers see it: one core, or ``wa`` with its followed cores and shadows.

The twin of :mod:`kvprof.policy.wa` (its shadows are :mod:`kvprof.core.shadow`, beside
:mod:`kvprof.policy.shadow`); every other policy is one core of :mod:`kvprof.core.kinds`.

``Policy`` wraps the core that orders the real cache's blocks (``main``). For every policy but
``wa`` that is all. For ``wa`` (:class:`kvprof.policy.wa.WorkloadAwarePolicy`) it adds what
the reference keeps beside its rows: the followed policies (cores over the same blocks, kept in
step; one of them may lead eviction), one :class:`~kvprof.core.shadow.Shadow` per candidate order (a pool of
:mod:`kvprof.core.prefix_cache` over that candidate's core, fed whole requests:
:class:`kvprof.policy.shadow.ShadowCache`), the shadows' windowed hit scores and the leader.

Invariants: every followed core holds exactly the blocks ``main`` holds; ``order_kind[i]`` is
candidate ``i``'s row order, or -1 when ``order_followed[i]`` names the followed core it is;
``leader`` is the candidate eviction follows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.experimental import structref
from numba.typed import List

from kvprof.core import structs
from kvprof.core.copiers import copy_core
from kvprof.core.policies import (
    ORDER_FREQUENCY, core_access, core_access_n, core_contains, core_evict_n, core_finish, core_finish_reason, core_free,
    core_remove, core_remove_held_n, core_type, remember,
)
from kvprof.core.prefix_cache import mark_pool, register_pool_protocol, set_limit
from kvprof.core.shadow import shadow_admit, shadow_finish, shadow_type
from kvprof.core.structs import NONE, grown
from kvprof.policy.shadow import CHAIN_MEMORY_CAPACITIES


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
    ("unweighed", types.int64),  # blocks looked up since the shadows were last compared
    ("real_hits", types.int64),
    ("real_seen", types.int64),
    ("real_led", types.float64[:]),
    ("shadow_led", types.float64[:]),
    ("moments", types.float64[:, :]),  # windowed products of two shadows' hits per period (wa's _moments)
    ("window_capacities", types.float64),
    ("switch_margin", types.float64),
    ("switch_errors", types.float64),
    ("period_min", types.int64),
    ("period_share", types.int64),
    ("capacity", types.int64),  # the real cache's size (0: the most blocks seen)
    ("calibrated", types.boolean),
    ("never", types.float64[:]),  # next uses of shadow blocks: inf (only Belady reads them)
    # the shadows' sample of chains (kvprof.policy.shadow.ChainSample)
    ("sample_rate", types.float64),
    ("sample_below", types.uint64),
    ("chain_of", types.int64[:]),  # content -> chain (NONE: never admitted)
    ("continued", types.boolean[:]),  # content -> some request had a new content after it
    ("chain_admitted", types.int64[:]),  # content -> index of its last admission (remembered: >= chain_horizon)
    ("n_admitted", types.int64),
    ("chain_horizon", types.int64),
    ("n_chains", types.int64),
])


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
    policy.unweighed = 0
    policy.real_hits = 0
    policy.real_seen = 0
    policy.real_led = np.zeros(len(shadows))
    policy.shadow_led = np.zeros(len(shadows))
    policy.moments = np.zeros((len(shadows), len(shadows)))
    policy.window_capacities = 1.0
    policy.switch_margin = 0.0
    policy.switch_errors = 0.0
    policy.period_min = 1
    policy.period_share = 1
    policy.capacity = 0
    policy.calibrated = False
    policy.never = np.full(16, np.inf)
    policy.sample_rate = 1.0
    policy.sample_below = np.uint64(0)
    policy.chain_of = np.full(16, NONE, np.int64)
    policy.continued = np.zeros(16, np.bool_)
    policy.chain_admitted = np.zeros(16, np.int64)
    policy.n_admitted = 0
    policy.chain_horizon = 0
    policy.n_chains = 0
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


@njit(cache=True)
def policy_access_n(policy, blocks, depths, contents, next_uses, n, now, workload, hit):
    """``policy_access`` of ``blocks[i]`` at ``depths[i]`` with ``contents[i]`` and ``next_uses[i]``
    for ``i < n``, in order: each core takes the whole batch in one call (the cores are apart, so
    the order between them does not matter, only each one's own)."""
    main = policy.main
    core_access_n(main, blocks, depths, contents, next_uses, n, now, workload, hit)
    if not main.wa:
        return
    if hit:
        policy.real_hits += n
    if not 0 <= workload < main.n_cells:
        workload = main.n_cells - 1
    for core in policy.followed:
        core_access_n(core, blocks, depths, contents, next_uses, n, now, workload, hit)


@njit(cache=True)
def policy_free(policy, blocks, n, now):
    """``EvictionPolicy.free`` of ``blocks[:n]`` (tail first)."""
    main = policy.main
    core_free(main, blocks, n, now)
    for core in policy.followed:
        core_free(core, blocks, n, now)


@njit(cache=True)
def policy_remove(policy, block):
    """``EvictionPolicy.remove`` of an evictable block."""
    core_remove(policy.main, block)
    for core in policy.followed:
        core_remove(core, block)


@njit(cache=True)
def policy_remove_held_n(policy, blocks, n):
    """``policy_remove`` of ``blocks[:n]`` in order, stopping at the first that is not evictable:
    how many were removed (each core in one call: they hold the same blocks)."""
    removed = core_remove_held_n(policy.main, blocks, n)
    for core in policy.followed:
        core_remove_held_n(core, blocks, removed)
    return removed


@njit(cache=True)
def policy_contains(policy, block):
    return core_contains(policy.main, block)


@njit(cache=True)
def eviction_reads_shadows(policy):
    """Whether :func:`evicting_core` reads the leading shadow (its beta) now."""
    main = policy.main
    return (main.wa and len(policy.shadows) > 0 and policy.order_followed[policy.leader] == NONE
            and main.order == ORDER_FREQUENCY)


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
    if eviction_reads_shadows(policy):  # adaptive orders learn in their shadows
        main.beta = policy.shadows[policy.leader].policy.beta
    return main, NONE


@njit(cache=True)
def policy_evict_n(policy, n, now, out, at):
    """``EvictionPolicy.evict_n`` into ``out[at:at + n]``."""
    main = policy.main
    source, leading = evicting_core(policy)
    core_evict_n(source, n, now, out, at)
    if not main.wa:
        return
    victims = out[at:at + n]
    if leading != NONE:
        core_remove_held_n(main, victims, n)
        remember(main, out, at, n)
    for j in range(len(policy.followed)):
        if j != leading:
            core_remove_held_n(policy.followed[j], victims, n)


@njit(cache=True)
def policy_order(policy, n, now, out):
    """The first ``n`` victims ``policy_evict_n`` would take at ``now``, into ``out[:n]``; the
    policy is unchanged (they are evicted from a copy of the core eviction takes them from)."""
    source, _ = evicting_core(policy)
    core_evict_n(copy_core(source), n, now, out, 0)


@njit(cache=True, nogil=True)  # nogil: the plugin's background thread calls it (kvprof.vllm.observe)
def policy_admit(policy, seat, contents, n_lookup, n_blocks, now, workload):
    """``EvictionPolicy.admit`` of the request numbered ``seat`` (unique among running requests)
    with chain ``contents``: feed the shadows; now and then follow the candidate whose shadow hits most.

    Two parts, which :class:`kvprof.core.shadow_feed.ShadowFeed` runs on two threads: what the
    real cache knows (:func:`count_admit`) and what the shadows do (:func:`feed_admit`, then
    :func:`_weigh` where a follow checkpoint falls)."""
    if not len(policy.shadows):
        return
    size, workload, lookups = count_admit(policy, n_lookup, workload)
    feed_admit(policy, seat, contents, n_lookup, n_blocks, now, workload, size)
    if lookups:
        _weigh(policy, lookups, size, policy.real_hits)


@njit(cache=True)
def count_admit(policy, n_lookup, workload):
    """The real cache's part of an admission: the size the shadows take, ``workload`` as the
    cores know it, and the blocks looked up since the last follow checkpoint if this admission
    is one (else 0; the count starts again)."""
    main = policy.main
    if not 0 <= workload < main.n_cells:
        workload = main.n_cells - 1
    size = policy.capacity if policy.capacity else max(main.most, main.held + main.size)
    policy.unweighed += n_lookup
    lookups = 0
    if policy.unweighed >= max(policy.period_min, size // policy.period_share):
        lookups = policy.unweighed
        policy.unweighed = 0
    return size, workload, lookups


@njit(cache=True)
def feed_admit(policy, seat, contents, n_lookup, n_blocks, now, workload, size):
    """The shadows' part of an admission to a real cache of ``size`` blocks: it reads and writes
    only the shadows, ``never`` and the chain sample (never what the real cache's calls touch)."""
    if n_blocks > len(policy.never):
        policy.never = np.full(max(n_blocks, 2 * len(policy.never)), np.inf)
    if in_sample(policy, contents, size):
        limit = scaled_size(size, policy.sample_rate)
        for shadow in policy.shadows:
            if shadow.limit < limit:  # no capacity given: the most blocks seen
                set_limit(shadow, limit, now)
            shadow_admit(shadow, seat, contents, n_lookup, n_blocks, now, workload, policy.never)


@njit(cache=True)
def mixed(number):
    """``kvprof.policy.shadow.mixed``: splitmix64's finalizer, in uint64."""
    z = np.uint64(number)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True)
def scaled_size(size, rate):
    """``kvprof.policy.shadow.scaled_size``."""
    return size if rate >= 1.0 else int(math.ceil(size * rate))


@njit(cache=True)
def in_sample(policy, contents, size):
    """``ChainSample.admits``: number the chain of a request admitted with ``contents`` to a real
    cache of ``size`` blocks; whether it is in the shadows' sample."""
    if policy.sample_rate >= 1.0:
        return True
    top = -1
    for content in contents:
        top = max(top, content)
    if top >= len(policy.chain_of):
        policy.chain_of = grown(policy.chain_of, top + 1, NONE)
        policy.continued = grown(policy.continued, top + 1, False)
        policy.chain_admitted = grown(policy.chain_admitted, top + 1, 0)
    chain_of, continued, admitted = policy.chain_of, policy.continued, policy.chain_admitted
    horizon = max(policy.chain_horizon, policy.n_admitted - CHAIN_MEMORY_CAPACITIES * max(size, 1))  # chain_memory
    policy.chain_horizon = horizon
    chain = NONE
    for depth in range(len(contents)):
        content = contents[depth]
        known = chain_of[content] != NONE and admitted[content] >= horizon
        admitted[content] = policy.n_admitted
        policy.n_admitted += 1
        if known:
            continue
        if chain == NONE:
            if depth and not continued[contents[depth - 1]]:
                chain = chain_of[contents[depth - 1]]
            else:
                chain = policy.n_chains
                policy.n_chains += 1
        if depth:
            continued[contents[depth - 1]] = True
        chain_of[content] = chain
        continued[content] = False
    if chain == NONE:
        if len(contents):
            chain = chain_of[contents[len(contents) - 1]]
        else:
            chain = policy.n_chains
            policy.n_chains += 1
    return mixed(chain) < policy.sample_below


@njit(cache=True, nogil=True)  # nogil: the plugin's background thread calls it (kvprof.vllm.observe)
def policy_finish(policy, seat, now, contents, n_blocks, n_output, code=0):
    """``EvictionPolicy.finish`` of the request numbered ``seat`` (``contents`` empty: none given),
    which generated ``n_output`` tokens (-1: unknown) and ended as ``code`` says
    (:mod:`kvprof.models.finish`; 0: unknown).

    Two parts, as :func:`policy_admit`'s: what the real cache's cores hear (:func:`count_finish`)
    and what the shadows do (:func:`feed_finish`)."""
    count_finish(policy, n_output, code)
    feed_finish(policy, seat, now, contents, n_blocks, n_output, code)


@njit(cache=True)
def count_finish(policy, n_output, code=0):
    """The real cache's part of a finish: its cores hear the output length and, where known, how the
    response ended (the free comes next)."""
    core_finish(policy.main, n_output)
    if code:
        core_finish_reason(policy.main, code)
    for core in policy.followed:
        core_finish(core, n_output)
        if code:
            core_finish_reason(core, code)


@njit(cache=True)
def feed_finish(policy, seat, now, contents, n_blocks, n_output, code=0):
    """The shadows' part of a finish, as :func:`feed_admit`'s: it touches what that touches."""
    if n_blocks > len(policy.never):
        policy.never = np.full(max(n_blocks, 2 * len(policy.never)), np.inf)
    for shadow in policy.shadows:
        shadow_finish(shadow, seat, now, contents, n_blocks, n_output, policy.never, code)


@njit(cache=True)
def _weigh(policy, lookups, size, real_hits):
    """Add the shadows' hits since the last call to their windowed scores; follow the best.

    ``real_hits``: ``policy.real_hits`` at the checkpoint (a shadow feed weighs later, while the
    real cache counts on)."""
    shadows = policy.shadows
    keep = 0.5 ** (lookups / max(policy.window_capacities * size, 1.0))
    real_gained = real_hits - policy.real_seen
    policy.real_seen = real_hits
    prior = float(max(size, 1))
    calibrated = policy.calibrated and policy.sample_rate >= 1.0  # off when sampling (wa's _weigh)
    score, seen, real_led, shadow_led = policy.shadow_score, policy.shadow_seen, policy.real_led, policy.shadow_led
    n, leader = len(shadows), policy.leader
    gains, factors = np.zeros(n), np.ones(n)
    best = 0
    best_corrected = leader_corrected = 0.0
    for i in range(n):
        gained = gains[i] = (shadows[i].hits - seen[i]) / policy.sample_rate  # hits in the whole traffic
        seen[i] = shadows[i].hits
        score[i] = score[i] * keep + gained
        real_led[i] *= keep
        shadow_led[i] *= keep
        if i == leader:
            real_led[i] += real_gained
            shadow_led[i] += gained
        if calibrated:
            factors[i] = (real_led[i] + prior) / (shadow_led[i] + prior)
        corrected = score[i] * factors[i]
        if i == 0 or corrected > best_corrected:
            best, best_corrected = i, corrected
        if i == leader:
            leader_corrected = corrected
    moments = policy.moments
    for i in range(n):
        for j in range(n):
            moments[i, j] = moments[i, j] * (keep * keep) + gains[i] * gains[j]
    lead_by = best_corrected - leader_corrected
    if lead_by > leader_corrected * policy.switch_margin:
        variance = (factors[best] ** 2 * moments[best, best] + factors[leader] ** 2 * moments[leader, leader]
                    - 2.0 * factors[best] * factors[leader] * moments[best, leader])
        if lead_by > policy.switch_errors * np.sqrt(max(variance, 0.0)):
            lead(policy, best)


@njit(cache=True)
def lead(policy, index):
    """Follow candidate ``index`` from now on."""
    policy.leader = index
    if policy.order_kind[index] != NONE:
        policy.main.order = policy.order_kind[index]


@njit(cache=True)
def mark_core(core, live):
    """Mark in ``live`` (a flag per content number) the contents ``core`` holds: its blocks' and its ghosts'."""
    for content in core.content:
        if content != NONE:
            live[content] = True
    where = core.g.where
    for content in range(min(len(where), len(live))):
        if where[content] != NONE:
            live[content] = True


@njit(cache=True)
def mark_policy(policy, live):
    """Mark in ``live`` every content number ``policy`` holds: in its cores, shadows and chain sample."""
    mark_core(policy.main, live)
    for core in policy.followed:
        mark_core(core, live)
    for shadow in policy.shadows:
        mark_pool(shadow, live)
        mark_core(shadow.policy, live)
    chain_of, admitted = policy.chain_of, policy.chain_admitted
    for content in range(min(len(chain_of), len(live))):
        if chain_of[content] != NONE and admitted[content] >= policy.chain_horizon:
            live[content] = True


@njit(cache=True)
def policy_size(policy):
    return policy.main.size


def empty_cores():
    """An empty typed list of cores (followed policies, or shadows' cores)."""
    return List.empty_list(core_type)


def empty_shadows():
    return List.empty_list(shadow_type)


@njit(cache=True)
def set_safety_net(policy, window_capacities, switch_margin, switch_errors, period_min, period_share, capacity,
                   calibrated, sample_rate, sample_below):
    """wa's constants for comparing shadows (:mod:`kvprof.policy.wa`), the real cache's size and
    the shadows' sample (its rate and the threshold of mixed chain numbers in it)."""
    policy.window_capacities, policy.switch_margin, policy.switch_errors = window_capacities, switch_margin, switch_errors
    policy.period_min, policy.period_share = period_min, period_share
    policy.capacity, policy.calibrated = capacity, calibrated
    policy.sample_rate, policy.sample_below = sample_rate, sample_below


@njit(cache=True)
def outcome(policy):
    """The leader and each shadow's hits."""
    hits = np.zeros(len(policy.shadows), np.int64)
    for i in range(len(policy.shadows)):
        hits[i] = policy.shadows[i].hits
    return policy.leader, hits


register_pool_protocol(PolicyType, policy_access, policy_access_n, policy_free, policy_remove, policy_remove_held_n,
                       policy_evict_n, policy_contains, policy_size)
