"""Compiled twins of the reference policies, built from fresh instances of their classes.

Everything a twin needs is read from the reference instance and from the policy modules when
the twin is built (parameters, fitted tables, ``wa``'s candidate orders and safety-net
constants, the tier edges), so a change there reaches the compiled core without a copy here.
"""

from __future__ import annotations

import numpy as np

from kvprof.core import has_twin, policies as kinds
from kvprof.core.policy import empty_cores, empty_shadows, lead, new_policy, new_shadow, outcome, set_safety_net
from kvprof.policy import orders, wa as wa_module
from kvprof.policy.arc import ARCPolicy
from kvprof.policy.base import EvictionPolicy
from kvprof.policy.belady import BeladyPolicy
from kvprof.policy.learned import LearnedPolicy
from kvprof.policy.lfu import LFUPolicy
from kvprof.policy.lru import LRUPolicy
from kvprof.policy.s3fifo import MAX_FREQ, S3FIFOPolicy
from kvprof.policy.wa import WorkloadAwarePolicy
from kvprof.policy.wa_paper import PublishedWorkloadAwarePolicy

#: The kind of core that runs each reference class (:data:`kvprof.core.TWIN_CLASSES`).
TWINS = {LRUPolicy: kinds.LRU, LFUPolicy: kinds.LFU, S3FIFOPolicy: kinds.S3FIFO, ARCPolicy: kinds.ARC,
         BeladyPolicy: kinds.BELADY, PublishedWorkloadAwarePolicy: kinds.CLASSED, WorkloadAwarePolicy: kinds.CLASSED,
         LearnedPolicy: kinds.LEARNED}


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
    kvprof.core.policy.Policy
        An opaque handle for the functions of :mod:`kvprof.core.policy`.

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
        return new_policy(main, empty_cores(), np.full(1, kinds.ORDER_RECENCY, np.int64), np.full(1, -1, np.int64),
                          empty_shadows(), 0)
    followed = empty_cores()
    order_kind = np.full(len(policy.order_names), -1, np.int64)
    order_followed = np.full(len(policy.order_names), -1, np.int64)
    for i, name in enumerate(policy.order_names):
        if i in policy._followed:
            order_followed[i] = len(followed)
            followed.append(_core(policy._followed[i], n_blocks))
        else:
            order_kind[i] = _order_kind(policy._row_order(name))
    shadows = empty_shadows()
    for reference in policy._shadows:
        shadows.append(new_shadow(_core(reference.policy, 0), reference.limit))
    compiled = new_policy(main, followed, order_kind, order_followed, shadows, 0)
    set_safety_net(compiled, wa_module.WINDOW_CAPACITIES, policy.switch_margin, wa_module.FOLLOW_PERIOD_MIN,
                   wa_module.FOLLOW_PERIOD_SHARE, policy.capacity, policy.calibrated, policy._sample.rate,
                   np.uint64(policy._sample.threshold))
    lead(compiled, policy.leader)
    return compiled


def _order_kind(order) -> int:
    if isinstance(order, orders.ModelOrder):
        return kinds.ORDER_MODEL
    if isinstance(order, orders.RecencyOrder):
        return kinds.ORDER_RECENCY
    if isinstance(order, orders.SegmentedOrder):
        return kinds.ORDER_SEGMENTED
    if isinstance(order, orders.FrequencyOrder):
        return kinds.ORDER_FREQUENCY
    raise TypeError(f"no compiled row order for {type(order).__name__}")


def _core(policy: EvictionPolicy, n_blocks: int):
    """The core of one single-structure policy (``wa`` without its followed policies and shadows)."""
    kind = TWINS[type(policy)]
    if kind == kinds.LRU:
        return kinds.new_core(kind, n_blocks, 1, 0)
    if kind == kinds.LFU:
        return kinds.new_core(kind, n_blocks, 2, 0)
    if kind == kinds.S3FIFO:
        core = kinds.new_core(kind, n_blocks, 2, 1)
        kinds.set_s3fifo(core, policy.small_ratio, policy.ghost_ratio, MAX_FREQ)
        return core
    if kind == kinds.ARC:
        return kinds.new_core(kind, n_blocks, 2, 2)
    if kind == kinds.BELADY:
        return kinds.new_core(kind, n_blocks, 1, 0)
    if kind == kinds.LEARNED:
        model = policy.model
        core = kinds.new_core(kind, n_blocks, model.n_buckets, 0)
        kinds.set_learned(core, len(model.cell), _tier_table(), model.bias,
                          *(np.array(w, dtype=np.float64) for w in (model.cell, model.tier, model.depth, model.tail)),
                          model.log_odds_edges(), float(model.credit_s))
        return core
    core = kinds.new_core(kind, n_blocks, policy.n_classes, 1)
    kinds.set_rows(core, policy._default, policy.stamps_allocation, policy.stamps_free, policy.class_follows_hits)
    if isinstance(policy, PublishedWorkloadAwarePolicy):
        kinds.set_paper(core, np.array(policy._scale, dtype=np.float64), np.array(policy._lam, dtype=np.float64))
        return core
    kinds.set_wa(core, policy.n_cells, policy.n_tiers, _tier_table(), *_model_table(policy._row_order("model")))
    order = policy._orders[0]
    if order is not None:
        # Without shadows the leading order learns from the policy's own ghost (wa's _recall).
        frequency = order if isinstance(order, orders.FrequencyOrder) else orders.FrequencyOrder(policy.n_tiers, 0.0)
        kinds.set_order(core, _order_kind(order), not policy._shadows, frequency.beta, frequency.adaptive,
                        frequency.step, frequency.beta_max)
    return core


def _tier_table() -> np.ndarray:
    """``orders.tier_of`` as a table (its last entry for any higher count)."""
    return np.array([orders.tier_of(h) for h in range(orders.TIER_EDGES[-1] + 2)], dtype=np.int64)


def _model_table(model: orders.ModelOrder) -> tuple:
    """The model order's per-row floats (``ModelOrder._rows``), components of weight 0 left out:
    ``p``, component counts, and weights, rates and P(within H) padded to one width."""
    rows = model._rows
    k = max([len(components) for _, components in rows] + [1])
    table = np.zeros((3, len(rows), k))
    for r, (_, components) in enumerate(rows):
        for j, component in enumerate(components):
            table[:, r, j] = component
    return (np.array([p for p, _ in rows], dtype=np.float64),
            np.array([len(components) for _, components in rows], dtype=np.int64),
            *(np.ascontiguousarray(t) for t in table))


def write_back(reference: EvictionPolicy, compiled) -> None:
    """Give ``reference`` what its callers read after a replay its twin ran: ``wa``'s leader and
    its shadows' hit counts (``order_name``, ``shadow_hits()``)."""
    if isinstance(reference, WorkloadAwarePolicy):
        leader, hits = outcome(compiled)
        reference._lead(int(leader))
        for shadow, count in zip(reference._shadows, hits.tolist()):
            shadow.hits = count
