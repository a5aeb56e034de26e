"""Compiled twins of the reference policies, built from fresh instances of their classes.

Everything a twin needs is read from the reference instance and from the policy modules when
the twin is built (parameters, fitted tables, ``wa``'s candidate orders and safety-net
constants, the tier edges), so a change there reaches the compiled core without a copy here.
"""

from __future__ import annotations

import numpy as np

from kvprof.core import has_twin
from kvprof.core.kinds import KIND, classed, module
from kvprof.core.policies import new_core
from kvprof.core.shadow import new_shadow
from kvprof.core.wa import empty_cores, empty_shadows, lead, new_policy, outcome, set_safety_net
from kvprof.policy import REGISTERED, wa as wa_module
from kvprof.policy.base import EvictionPolicy
from kvprof.policy.wa import WorkloadAwarePolicy
from kvprof.registry import REGISTERED as REGISTRATIONS

#: The twin module (:mod:`kvprof.core.kinds`) that runs each reference class, from the registry.
TWINS = {REGISTERED[r.name]: r.twin for r in REGISTRATIONS}


def compile_policy(policy: EvictionPolicy, n_blocks: int = 0):
    """The compiled twin of ``policy``, a fresh instance (nothing accessed or freed yet).

    Parameters
    ----------
    policy : EvictionPolicy
        An instance of a class in :data:`TWINS`.
    n_blocks : int
        Block ids the twin will see, to size its tables once (they grow beyond it if needed).

    Returns
    -------
    kvprof.core.wa.Policy
        An opaque handle for the functions of :mod:`kvprof.core.wa`.

    Raises
    ------
    TypeError
        For a class without a twin.
    ValueError
        For an instance that is not fresh.
    """
    if not has_twin(policy):
        raise TypeError(f"{type(policy).__name__} has no compiled twin")
    if len(policy):
        raise ValueError("only a fresh policy instance can be compiled")
    main = _core(policy, n_blocks)
    if not isinstance(policy, WorkloadAwarePolicy):
        return new_policy(main, empty_cores(), np.full(1, classed.ORDER_RECENCY, np.int64), np.full(1, -1, np.int64),
                          empty_shadows(), 0)
    followed = empty_cores()
    order_kind = np.full(len(policy.order_names), -1, np.int64)
    order_followed = np.full(len(policy.order_names), -1, np.int64)
    for i, name in enumerate(policy.order_names):
        if i in policy._followed:
            order_followed[i] = len(followed)
            followed.append(_core(policy._followed[i], n_blocks))
        else:
            order_kind[i] = classed.order_kind(policy._row_order(name))
    shadows = empty_shadows()
    for reference in policy._shadows:
        shadows.append(new_shadow(_core(reference.policy, 0), reference.limit))
    compiled = new_policy(main, followed, order_kind, order_followed, shadows, 0)
    set_safety_net(compiled, wa_module.WINDOW_CAPACITIES, policy.switch_margin, policy.switch_errors,
                   wa_module.FOLLOW_PERIOD_MIN, wa_module.FOLLOW_PERIOD_SHARE, policy.capacity, policy.calibrated,
                   policy._sample.rate, np.uint64(policy._sample.threshold))
    lead(compiled, policy.leader)
    return compiled


def _core(policy: EvictionPolicy, n_blocks: int):
    """The core of one single-structure policy (``wa`` without its followed policies and shadows)."""
    name = TWINS[type(policy)]
    kind = module(name)
    core = new_core(KIND[name], n_blocks, *kind.lists(policy))
    if hasattr(kind, "configure"):  # a kind with parameters
        kind.configure(core, policy)
    return core


def write_back(reference: EvictionPolicy, compiled) -> None:
    """Give ``reference`` what its callers read after a replay its twin ran: ``wa``'s leader and
    its shadows' hit counts (``order_name``, ``shadow_hits()``)."""
    if isinstance(reference, WorkloadAwarePolicy):
        leader, hits = outcome(compiled)
        reference._lead(int(leader))
        for shadow, count in zip(reference._shadows, hits.tolist()):
            shadow.hits = count
