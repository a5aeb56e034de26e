"""The twin of the policies with rows (:class:`kvprof.policy.classed.ClassedLRUPolicy`): ``wa-paper``
(:class:`~kvprof.policy.wa_paper.PublishedWorkloadAwarePolicy`) and ``wa``'s rows
(:class:`~kvprof.policy.wa.WorkloadAwarePolicy`, without its followed policies and shadows:
:mod:`kvprof.core.wa`), hit counts and ghost.

List ``r`` of the queue holds row ``r`` in free order; eviction merges the rows' heads by the
row order's keys (``evict_n``), an evictable block's by the common ``stamp`` (the stamp it was
freed with: the protocol removes a block before an access or a merge sees it again). State:
``wa_hits`` (per block: hits since allocation, or since the content was last evicted and
recalled, saturating at :data:`HITS_CAP`), ``wa_pinned`` (per block: held by a running request,
counted in ``held``), ``ghost_value`` (per content: the hit count it was evicted with, saturated
alike), the cells, tiers and row order,
the fitted model's and the published score's tables, and ``key0..2`` (the sort key of each
row's head). ``n_cells``, ``n_tiers`` and ``tier_of`` are read by :mod:`~kvprof.core.kinds.learned`
too, with the same meaning.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types

from kvprof.core.structs import (
    NONE, grown, holds, move_to_back_n, pop_front_n, push_back_n, unlink, unlink_held_n, unlink_n,
)
from kvprof.policy import orders

#: Row orders of a core with rows (:mod:`kvprof.policy.orders`, and wa-paper's published score).
ORDER_MODEL, ORDER_RECENCY, ORDER_FREQUENCY, ORDER_PAPER, ORDER_SEGMENTED = range(5)

#: Hit counts are kept per block and per ghost as int8, saturating here: only their tier is read
#: (:func:`tier`), the same for every count from the tier table's last index on, so a count
#: capped at or above that index decides alike (:func:`set_wa` checks the table fits).
HITS_CAP = np.iinfo(np.int8).max

FIELDS = [
    ("wa_hits", types.int8[:]), ("wa_pinned", types.boolean[:]),
    ("ghost_value", types.int8[:]),
    ("n_cells", types.int64), ("n_tiers", types.int64),
    ("wa", types.boolean), ("stamps_allocation", types.boolean), ("stamps_free", types.boolean),
    ("class_follows_hits", types.boolean),
    ("order", types.int64), ("beta", types.float64), ("adaptive", types.boolean), ("step", types.float64),
    ("beta_max", types.float64), ("learns", types.boolean),
    ("model_p", types.float64[:]), ("model_k", types.int64[:]), ("model_weight", types.float64[:, :]),
    ("model_rate", types.float64[:, :]), ("model_within", types.float64[:, :]),
    ("paper_scale", types.float64[:]), ("paper_lam", types.float64[:]),
    ("tier_of", types.int64[:]), ("ghosts_by_tier", types.int64[:]), ("held", types.int64), ("most", types.int64),
    ("key0", types.float64[:]), ("key1", types.float64[:]), ("key2", types.float64[:]),
]
COMMON = ("q", "content", "stamp", "depth", "row")


def lists(policy) -> tuple[int, int]:
    return policy.n_classes, 1


def configure(core, policy) -> None:
    """Rows, and wa-paper's published score or wa's cells, tiers, model and leading order."""
    from kvprof.policy.wa_paper import PublishedWorkloadAwarePolicy

    set_rows(core, policy._default, policy.stamps_allocation, policy.stamps_free, policy.class_follows_hits)
    if isinstance(policy, PublishedWorkloadAwarePolicy):
        set_paper(core, np.array(policy._scale, dtype=np.float64), np.array(policy._lam, dtype=np.float64))
        return
    set_wa(core, policy.n_cells, policy.n_tiers, tier_table(), *_model_table(policy._row_order("model")))
    order = policy._orders[0]
    if order is not None:
        # Without shadows the leading order learns from the policy's own ghost (wa's _recall).
        frequency = order if isinstance(order, orders.FrequencyOrder) else orders.FrequencyOrder(policy.n_tiers, 0.0)
        set_order(core, order_kind(order), not policy._shadows, frequency.beta, frequency.adaptive,
                  frequency.step, frequency.beta_max)


def order_kind(order) -> int:
    """The compiled row order of a reference order (:mod:`kvprof.policy.orders`)."""
    if isinstance(order, orders.ModelOrder):
        return ORDER_MODEL
    if isinstance(order, orders.RecencyOrder):
        return ORDER_RECENCY
    if isinstance(order, orders.SegmentedOrder):
        return ORDER_SEGMENTED
    if isinstance(order, orders.FrequencyOrder):
        return ORDER_FREQUENCY
    raise TypeError(f"no compiled row order for {type(order).__name__}")


def tier_table() -> np.ndarray:
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


@njit(cache=True)
def init(core):
    """Every parameter neutral (recency order, one cell, one tier); ``core.n_rows`` set already."""
    n_lists = core.n_rows
    core.wa_hits = np.zeros(0, np.int8)
    core.wa_pinned = np.zeros(0, np.bool_)
    core.ghost_value = np.zeros(0, np.int8)
    core.n_cells = 1
    core.n_tiers = 1
    core.wa = False
    core.stamps_allocation = False
    core.stamps_free = False
    core.class_follows_hits = False
    core.order = ORDER_RECENCY
    core.beta = 0.0
    core.adaptive = False
    core.step = 0.0
    core.beta_max = 0.0
    core.learns = False
    core.model_p = np.zeros(0)
    core.model_k = np.zeros(0, np.int64)
    core.model_weight = np.zeros((0, 0))
    core.model_rate = np.zeros((0, 0))
    core.model_within = np.zeros((0, 0))
    core.paper_scale = np.zeros(0)
    core.paper_lam = np.zeros(0)
    core.tier_of = np.zeros(1, np.int64)
    core.ghosts_by_tier = np.zeros(1, np.int64)
    core.held = 0
    core.most = 0
    core.key0 = np.zeros(n_lists)
    core.key1 = np.zeros(n_lists)
    core.key2 = np.zeros(n_lists)


@njit(cache=True)
def reserve(core, n):
    if n > len(core.wa_hits):
        core.wa_hits = grown(core.wa_hits, n, 0)
        core.wa_pinned = grown(core.wa_pinned, n, False)


@njit(cache=True)
def free_n(core, blocks, n, now):
    """Free ``blocks[:n]`` in order, each to the back of its row; then wa's pins released and
    the most blocks held or evictable (``core.size`` counts them already)."""
    if core.stamps_free:
        stamp = core.stamp
        for i in range(n):
            stamp[blocks[i]] = now
    push_back_n(core.q, blocks, n, core.row)
    if not core.wa:
        return
    pinned = core.wa_pinned
    released = 0
    for i in range(n):
        if pinned[blocks[i]]:
            pinned[blocks[i]] = False
            released += 1
    core.held -= released
    core.most = max(core.most, core.held + core.size)


# -- classed: rows, wa's hit counts and ghost ---------------------------------------------------
@njit(cache=True)
def tier(core, hits):
    """Reuse tier of ``hits`` (``orders.tier_of`` capped at the core's tiers)."""
    table = core.tier_of
    t = table[hits] if hits < len(table) else table[len(table) - 1]
    return min(t, core.n_tiers - 1)


@njit(cache=True)
def tiers_by_hits(core):
    """``tier(core, hits)`` for every hit count ``0 .. HITS_CAP``, as a table (tier's rule written
    out, not called: a call per count would cost more than the batch it serves saves)."""
    table, top = core.tier_of, core.n_tiers - 1
    out = np.empty(HITS_CAP + 1, np.int64)
    for hits in range(HITS_CAP + 1):
        out[hits] = min(table[hits] if hits < len(table) else table[len(table) - 1], top)
    return out


@njit(cache=True)
def access(core, block, now, workload, depth, hit, content):
    if not core.wa:  # wa-paper
        if not 0 <= workload <= core.default_row:
            workload = core.default_row
        if hit:
            core.stamp[block] = now
            if core.class_follows_hits:
                core.row[block] = workload
        else:
            core.stamp[block] = now if core.stamps_allocation else -np.inf
            core.row[block] = workload
        core.depth[block] = depth
        return
    if not 0 <= workload < core.n_cells:
        workload = core.n_cells - 1
    if hit:
        hits = min(np.int64(core.wa_hits[block]) + 1, HITS_CAP)
    else:
        hits = _recall(core, content) if content >= 0 else 0
        if content >= 0:
            core.content[block] = content
    core.wa_hits[block] = hits
    core.row[block] = workload * core.n_tiers + tier(core, hits)
    core.stamp[block] = now
    core.depth[block] = depth
    if not core.wa_pinned[block]:
        core.wa_pinned[block] = True
        core.held += 1


@njit(cache=True)
def access_n(core, blocks, depths, contents, n, now, workload, hit):
    """``access`` of ``blocks[i]`` at ``depths[i]`` with ``contents[i]`` for ``i < n``, in order
    (wa's: the tables read once per batch, not once per block)."""
    if not core.wa:
        for i in range(n):
            access(core, blocks[i], now, workload, depths[i], hit, contents[i])
        return
    if not 0 <= workload < core.n_cells:
        workload = core.n_cells - 1
    wa_hits, row, stamp, depth, pinned, content_of = (
        core.wa_hits, core.row, core.stamp, core.depth, core.wa_pinned, core.content)
    tier_of_hits = tiers_by_hits(core)
    if not hit:  # _recall's rule, the ghost's unlinks first in one batch (nothing below reads the ghost's lists)
        recalled = np.empty(n, np.bool_)
        unlink_n(core.g, contents, n, recalled)
        ghost_value, by_tier = core.ghost_value, core.ghosts_by_tier
        learning = core.learns and core.order == ORDER_FREQUENCY and core.adaptive
    cell_row = workload * core.n_tiers
    pinned_now = 0
    for i in range(n):
        block = blocks[i]
        if hit:
            hits = min(np.int64(wa_hits[block]) + 1, HITS_CAP)
        else:
            content = contents[i]
            hits = 0
            if recalled[i]:
                evicted = ghost_value[content]
                by_tier[tier_of_hits[evicted]] -= 1
                if learning:
                    _ghost_hit(core, tier_of_hits[evicted])
                hits = min(np.int64(evicted) + 1, HITS_CAP)
            if content >= 0:
                content_of[block] = content
        wa_hits[block] = hits
        row[block] = cell_row + tier_of_hits[hits]
        stamp[block] = now
        depth[block] = depths[i]
        if not pinned[block]:
            pinned[block] = True
            pinned_now += 1
    core.held += pinned_now


@njit(cache=True)
def _recall(core, content):
    """Hit count of newly allocated content: one more than when it was evicted, if remembered."""
    if not holds(core.g, content):
        return 0
    unlink(core.g, content)
    evicted = core.ghost_value[content]
    t = tier(core, evicted)
    core.ghosts_by_tier[t] -= 1
    if core.learns and core.order == ORDER_FREQUENCY and core.adaptive:
        _ghost_hit(core, t)
    return min(np.int64(evicted) + 1, HITS_CAP)


@njit(cache=True)
def _ghost_hit(core, t):
    """``FrequencyOrder.ghost_hit``: move beta as ARC moves its target."""
    by_tier = core.ghosts_by_tier
    fresh = by_tier[0]
    reused = 0
    for k in range(1, len(by_tier)):
        reused += by_tier[k]
    if t == 0:
        core.beta = max(0.0, core.beta - core.step * max(1.0, reused / max(fresh, 1)))
    else:
        core.beta = min(core.beta_max, core.beta + core.step * max(1.0, fresh / max(reused, 1)))


@njit(cache=True)
def remember(core, victims, at, n):
    """Put the victims' contents in wa's ghost with their hit counts, oldest forgotten first."""
    content_of, wa_hits, ghost_value = core.content, core.wa_hits, core.ghost_value  # (read once: no count per victim)
    contents = np.empty(n, np.int64)
    counts = np.empty(n, np.int8)
    k = 0
    for i in range(at, at + n):
        block = victims[i]
        content = content_of[block]
        if content < 0:
            continue
        content_of[block] = NONE
        contents[k], counts[k] = content, wa_hits[block]
        k += 1
    g, by_tier = core.g, core.ghosts_by_tier
    was_held = np.empty(k, np.bool_)
    move_to_back_n(g, contents, k, 0, was_held)
    tier_of_hits = tiers_by_hits(core)
    for i in range(k):
        content, count = contents[i], counts[i]
        if was_held[i]:
            by_tier[tier_of_hits[ghost_value[content]]] -= 1
        ghost_value[content] = count
        by_tier[tier_of_hits[count]] += 1
    n_forgotten = max(g.count[0] - core.most, 0)
    forgotten = np.empty(n_forgotten, np.int64)
    pop_front_n(g, 0, n_forgotten, forgotten)
    for content in forgotten:
        by_tier[tier_of_hits[ghost_value[content]]] -= 1


# -- classed: the merge of the row lists --------------------------------------------------------
@njit(cache=True)
def model_score(core, row, age):
    """``ModelOrder.score``: P(reused within H | row, idle ``age`` s), operation for operation."""
    p = core.model_p[row]
    k = core.model_k[row]
    if p <= 0.0 or k == 0:
        return 0.0
    rates, weights, within_h = core.model_rate[row], core.model_weight[row], core.model_within[row]
    slowest = rates[0]
    for j in range(1, k):
        slowest = min(slowest, rates[j])
    surviving = 0.0
    within = 0.0
    for j in range(k):
        share = weights[j] * math.exp(-(rates[j] - slowest) * age) if rates[j] > slowest else weights[j]
        surviving += share
        within += share * within_h[j]
    if p >= 1.0:
        return within / surviving
    exponent = (slowest * age if slowest > 0.0 else 0.0) - math.log(p) + math.log1p(-p)
    return within / (math.exp(exponent) + surviving) if exponent < 700.0 else 0.0


@njit(cache=True)
def _score(core, row, stamp, now):
    """First element of the sort key of a head of ``row`` pushed with ``stamp``."""
    order = core.order
    if order == ORDER_RECENCY:
        return stamp
    if order == ORDER_SEGMENTED:
        return 1.0 if row % core.n_tiers else 0.0
    age = now - stamp
    if order == ORDER_FREQUENCY:
        return core.beta * (row % core.n_tiers) - math.log(age + 1e-3 if age > 0.0 else 1e-3)
    if age <= 0.0:
        age = 0.0
    if order == ORDER_MODEL:
        return model_score(core, row, age)
    scale = core.paper_scale[row]
    return scale * math.exp(-core.paper_lam[row] * age) if scale else 0.0


@njit(cache=True)
def _key(order, score, stamp, depth):
    """The sort key after ``score`` of a head accessed or freed at ``stamp``, at ``depth`` (the row last)."""
    if order == ORDER_PAPER:  # (score, row): blocks freed together leave together
        return score, 0.0, 0.0
    if order == ORDER_SEGMENTED:  # (segment, stamp, -depth, row)
        return score, stamp, -float(depth)
    return score, -float(depth), stamp  # (score, -depth, stamp, row): the deeper block, then the older access


@njit(cache=True)
def _merge(core, n, now, out, at):
    """The greedy merge of the rows (``ClassFifos.merge``): ``n`` times the head with the lowest key.

    Keys are computed once per head; a run of blocks pushed with one stamp shares its score, so
    only a new stamp is scored again. The rows are walked from their heads, then the victims
    unlinked in one batch (the same lists as popping each; arrays read once: no count per victim).
    """
    q, order, n_rows = core.q, core.order, core.n_rows
    nxt, stamp, depth = q.nxt, core.stamp, core.depth
    key0, key1, key2 = core.key0, core.key1, core.key2
    front, left = q.head.copy(), q.count.copy()  # each row's head and length, as if popped
    for r in range(n_rows):
        if left[r]:
            head = front[r]
            key0[r], key1[r], key2[r] = _key(order, _score(core, r, stamp[head], now), stamp[head], depth[head])
    first, need = at, n
    while need:
        best = second = NONE
        for r in range(n_rows):
            if not left[r]:
                continue
            if best == NONE or (key0[r], key1[r], key2[r], r) < (key0[best], key1[best], key2[best], best):
                best, second = r, best
            elif second == NONE or (key0[r], key1[r], key2[r], r) < (key0[second], key1[second], key2[second], second):
                second = r
        while True:
            block = front[best]
            out[at] = block
            at += 1
            need -= 1
            front[best] = nxt[block]
            left[best] -= 1
            if not need or not left[best]:
                break
            head = front[best]
            score = key0[best] if stamp[head] == stamp[block] else _score(core, best, stamp[head], now)
            key0[best], key1[best], key2[best] = _key(order, score, stamp[head], depth[head])
            if second != NONE and not ((key0[best], key1[best], key2[best], best)
                                       < (key0[second], key1[second], key2[second], second)):
                break
    unlink_held_n(q, out[first:first + n], n)
    core.size -= n


@njit(cache=True)
def evict_n(core, n, now, out, at):
    """``n`` victims into ``out[at:at + n]``, taken off ``size``; wa remembers their contents in its ghost."""
    _merge(core, n, now, out, at)
    if core.wa:
        remember(core, out, at, n)


# -- configuration (struct fields cannot be set from Python) ------------------------------------
@njit(cache=True)
def set_rows(core, default_row, stamps_allocation, stamps_free, class_follows_hits):
    """The row rules (:class:`kvprof.policy.classed.ClassedLRUPolicy`)."""
    core.default_row = default_row
    core.row[:] = default_row
    core.stamps_allocation, core.stamps_free, core.class_follows_hits = stamps_allocation, stamps_free, class_follows_hits


@njit(cache=True)
def set_paper(core, scale, lam):
    """wa-paper's published score per class: ``scale e^(-lam age)``."""
    core.order = ORDER_PAPER
    core.paper_scale, core.paper_lam = scale, lam


@njit(cache=True)
def set_wa(core, n_cells, n_tiers, tier_of, model_p, model_k, model_weight, model_rate, model_within):
    """wa's cells, tiers and fitted model (``ModelOrder``'s per-row floats)."""
    if len(tier_of) - 1 > HITS_CAP:
        raise ValueError("wa's tier table reaches past the int8 hit counts' cap (kvprof.cells.TIER_EDGES too high)")
    core.wa = True
    core.n_cells, core.n_tiers = n_cells, n_tiers
    core.tier_of = tier_of
    core.ghosts_by_tier = np.zeros(n_tiers, np.int64)
    core.model_p, core.model_k = model_p, model_k
    core.model_weight, core.model_rate, core.model_within = model_weight, model_rate, model_within


@njit(cache=True)
def set_order(core, order, learns, beta, adaptive, step, beta_max):
    """The row order eviction follows, and whether it learns from this core's own ghost."""
    core.order, core.learns = order, learns
    core.beta, core.adaptive, core.step, core.beta_max = beta, adaptive, step, beta_max
