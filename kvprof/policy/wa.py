"""kvprof's workload-aware policy: the fitted reuse model, with shadows that keep it honest.

Its compiled twin is :mod:`kvprof.core.wa` (rows: :mod:`kvprof.core.kinds.classed`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from kvprof.models.hp import CANDIDATES
from kvprof.models.learned import LearnedModel
from kvprof.policy.base import EvictionPolicy, finished_size, request_sizes
from kvprof.policy.classed import ClassedLRUPolicy, _as_list
from kvprof.policy.finish_reason import FinishReasonLRU
from kvprof.policy.first_turn import FirstTurnLRU
from kvprof.policy.learned import LearnedPolicy
from kvprof.policy.long_output import LongOutputLRU
from kvprof.policy.orders import FrequencyOrder, ModelOrder, Order, RecencyOrder, SegmentedOrder, tier_of
from kvprof.policy.s3fifo import S3FIFOPolicy
from kvprof.policy.shadow import ChainSample, ShadowCache, scaled_size

#: Candidate orders over the row lists (see :mod:`kvprof.policy.orders`).
ROW_ORDERS = ("model", "lru", "segmented", "frequency", "strict-frequency")
#: Candidate policies with a structure of their own, kept in step with the real cache's blocks.
FOLLOWED_POLICIES: dict[str, type[EvictionPolicy]] = {"s3fifo": S3FIFOPolicy, "learned": LearnedPolicy,
                                                      "long-output": LongOutputLRU, "first-turn": FirstTurnLRU,
                                                      "finish-reason": FinishReasonLRU}
ORDER_NAMES = ROW_ORDERS + tuple(FOLLOWED_POLICIES)
if set(ORDER_NAMES) != set(CANDIDATES):  # the hp loader checks tuned start orders against CANDIDATES
    raise ImportError(f"wa's candidate orders {ORDER_NAMES} differ from kvprof.models.hp.CANDIDATES {CANDIDATES}")
#: The candidates by default, the fitted model first: followed until a shadow beats it (a file
#: tuned for the capacity names the order to start on instead). ``learned`` joins them where the
#: hp file has a predictor for the capacity, ``long-output`` where it has an output limit,
#: ``finish-reason`` where its tuning found the trace's finish codes worth following.
DEFAULT_ORDERS = ("model", "lru", "segmented", "frequency", "strict-frequency", "s3fifo")
#: The candidates where the fit window's sessions come back soon after a continued request far more often
#: than after a first one: on Mooncake's three fit windows ``wa`` over these beat its default candidates at
#: 11 of 12 points; with the default ones too its shadows could not tell the first-turn order's few percent
#: from noise on windows that short (the rule and the counts it reads: docs/results.md, "Online facts: the
#: output length and the session's turn").
FIRST_TURN_ORDERS = ("first-turn", "lru")
#: Shadows compare their hits over about this many capacities' worth of accesses (a half-life).
WINDOW_CAPACITIES = 16.0
#: A shadow must beat the leader's hits by this share before ``wa`` switches to its order.
SWITCH_MARGIN = 0.002
#: ... and by this many standard errors of the difference, estimated from the per-period differences of
#: the two shadows' hits (each period is a few requests, whose hits come in chains): on Mooncake, whose
#: 512-token blocks make each hit a lump, none of the switches the margin alone allowed led by two
#: errors, and they cost hits (docs/results.md, "`wa`'s switching").
SWITCH_ERRORS = 2.0
#: ``wa`` compares its shadows every ``max(FOLLOW_PERIOD_MIN, capacity // FOLLOW_PERIOD_SHARE)`` blocks looked up.
FOLLOW_PERIOD_MIN = 64
FOLLOW_PERIOD_SHARE = 16
#: The share of conversations the shadows see by default, in caches scaled to it
#: (:class:`~kvprof.policy.shadow.ChainSample`), but never so few that a scaled shadow holds less than
#: ``SHADOW_SAMPLE_MIN_BLOCKS`` blocks (rate 1 below that size, or when the size is not given). Measured
#: (the gist: docs/results.md, "`wa`'s shadows"): on bailian-a at 65,536 blocks, shadows at rate 0.25 and
#: 0.1 (6,554 blocks) rank the candidates as full ones do and wa's hit ratio holds; at 0.05 it does not
#: (-1.9 %). On weka's agent sessions, shadows of 8,192 blocks (rate 0.51 at 16,000 blocks, 0.82 at 10,000)
#: cost wa 1.6 % and 2.7 %, and at rate 0.1 the quality suite's sizes lose up to 19 %: so the suite's sizes
#: (up to 16,384 blocks) keep full shadows, and larger caches sample down to shadows of 16,384 blocks (rate
#: 0.25 at 65,536).
SHADOW_SAMPLE = 0.1
SHADOW_SAMPLE_MIN_BLOCKS = 16384


def candidate_orders(hp, learned: LearnedModel | None = None, output_limit: float | None = None,
                     finish_reason: bool = False) -> tuple[str, ...]:
    """The candidates ``wa`` runs on ``hp`` (a :class:`~kvprof.models.hp.HpFile`): :data:`FIRST_TURN_ORDERS`
    where its next-turn counts favour them, else :data:`DEFAULT_ORDERS` with ``learned`` where a predictor is
    given, ``long-output`` where an output limit is and ``finish-reason`` where ``finish_reason``."""
    if hp.next_turn is not None and hp.next_turn.favours_first_turn():
        return FIRST_TURN_ORDERS
    return (DEFAULT_ORDERS + (("learned",) if learned is not None else ())
            + (("long-output",) if output_limit is not None else ())
            + (("finish-reason",) if finish_reason else ()))


def default_sample(capacity: int | None) -> float:
    """The shadows' sample rate for a cache of ``capacity`` blocks (:data:`SHADOW_SAMPLE`)."""
    if not capacity:
        return 1.0
    return min(1.0, max(SHADOW_SAMPLE, SHADOW_SAMPLE_MIN_BLOCKS / capacity))


class WorkloadAwarePolicy(ClassedLRUPolicy):
    """Per-row LRU lists ordered by the fitted reuse model, or by the candidate whose shadow hits most.

    Rows are request cells times reuse tiers: a block belongs to the cell of the request that
    touched it last (the hp file's workload cells; the last cell is the default one) and to the
    tier of its hit count (:func:`~kvprof.policy.orders.tier_of`; a block recomputed from a
    remembered content keeps its count). Every access stamps the block (allocation, each hit,
    the free), so a block ages from its last use.

    The *model* order scores a list head by P(reused within H | row, idle age) under the row's
    cure-fraction mixture of exponentials; ties go to the deeper block, then the older access.
    The other candidates (:data:`ORDER_NAMES`) are LRU, segmented LRU (never-hit blocks first),
    frequency tiers with an ARC-like adaptive weight and strict frequency tiers, all over the
    same lists, S3-FIFO, whose queues are kept in step with the real cache's blocks, and
    LRU that evicts the blocks of requests with long outputs first
    (:class:`~kvprof.policy.long_output.LongOutputLRU`, told each output length at :meth:`finish`).

    With the safety net on, a :class:`~kvprof.policy.shadow.ShadowCache` per candidate is fed every
    request the real cache admits (:meth:`admit`: its whole chain of block contents) and finishes
    (:meth:`finish`), at the real cache's size (as given, else the most blocks it has held), and counts
    the hits that candidate would have had on that traffic. Every ``capacity / 16`` blocks looked up
    ``wa`` follows the candidate whose shadow has the most hits over the last ``WINDOW_CAPACITIES``
    capacities of lookups (exponentially weighted), switching only for a lead above ``switch_margin``
    and above ``switch_errors`` standard errors of the difference: the windowed sum of the two shadows'
    per-period differences in hits, whose variance is estimated by the same sum of their squares
    (weights squared), as if the difference had no mean. A shadow still differs from the real cache in
    timing (requests queue and run as long as the real cache's hits let them) and a switch costs the
    real cache a transition its shadow never pays. With ``calibrated``, each shadow's score is also
    scaled by what following it was worth: times (real hits + C) / (its shadow's hits + C) over the
    lookups its candidate led (same weighting; ``C`` = the cache's size in hits, so an untried candidate
    counts at face value). So when the profile is wrong or the traffic drifts, ``wa`` ends up on the
    best simple order by itself; where the model is right it stays on the model. Without :meth:`admit`
    calls (a driver that does not make them) ``wa`` keeps its first candidate.

    Invariants (on top of :class:`ClassedLRUPolicy`'s): every followed policy holds exactly the
    evictable blocks the lists hold; ``_pinned[b]`` is true exactly for blocks accessed and not
    freed since, ``_held`` counts them; the ghost remembers the hit counts of at most as many
    evicted contents as the most blocks seen.

    Cost: eviction scores the list heads (O(rows)); each access, free and removal is repeated
    in each followed policy; each admitted request of the shadows' sample is looked up and
    allocated in each shadow (O(its blocks)); memory is the per-block tables, the ghost, each
    shadow's table of contents (at most the cache's size) and, when sampling, the chain sample's
    memory of the last :data:`~kvprof.policy.shadow.CHAIN_MEMORY_CAPACITIES` caches' worth of
    admitted contents: all bounded by the cache's size.

    Parameters
    ----------
    p : array_like, shape (cells, tiers)
        Probability that a block of the row is ever reused.
    weights, rates : array_like, shape (cells, tiers, k)
        Mixture components of each row (weight 0 pads rows with fewer components).
    horizon : float
        H, seconds, > 0.
    orders : sequence of str
        Candidates (:data:`ORDER_NAMES`), the first followed from the start.
    safety_net : bool
        Run shadows and follow the best candidate; without it the first is used throughout.
    capacity : int, optional
        The real cache's size in blocks, also the shadows' (default: the most blocks seen).
    switch_margin : float, optional
        The share by which a shadow must beat the leader's score before ``wa`` follows it
        (default: :data:`SWITCH_MARGIN` when the policy is built).
    switch_errors : float, optional
        The standard errors of the difference by which it must lead too (default: :data:`SWITCH_ERRORS`
        when the policy is built; 0: the margin alone).
    calibrated : bool
        Scale each shadow's score by the real hits over its own while its candidate led.
    shadow_sample : float, optional
        The share of conversations the shadows see, in (0, 1] (default: :func:`default_sample`
        of ``capacity``): below 1 each shadow is fed only
        the requests of a spatial sample of chains (:class:`~kvprof.policy.shadow.ChainSample`,
        the same for every shadow) at the real cache's size times the share, rounded up, and its
        hits count as hits over the share (an estimate of the whole traffic's); the calibration
        is off then (a sampled shadow misses the real hits by the sample's error as well).
    learned : LearnedModel, optional
        The ``learned`` candidate's predictor (required when ``orders`` names it).
    output_limit : float, optional
        The ``long-output`` candidate's limit in output tokens (required when ``orders`` names it).
    """

    name = "wa"
    keyed_by = "cell"
    tunable = True
    stamps_allocation = True
    stamps_free = True
    class_follows_hits = True

    def __init__(self, p, weights, rates, horizon: float, *, orders=DEFAULT_ORDERS, safety_net: bool = True,
                 capacity: int | None = None, switch_margin: float | None = None,
                 switch_errors: float | None = None, calibrated: bool = True,
                 shadow_sample: float | None = None, learned: LearnedModel | None = None,
                 output_limit: float | None = None) -> None:
        p = np.asarray(p, dtype=np.float64)
        weights = np.asarray(weights, dtype=np.float64)
        rates = np.asarray(rates, dtype=np.float64)
        if p.ndim != 2 or weights.ndim != 3 or weights.shape[:2] != p.shape or weights.shape != rates.shape:
            raise ValueError(f"p must be (cells, tiers) and weights, rates (cells, tiers, k); got {p.shape}, "
                             f"{weights.shape}, {rates.shape}")
        if not (np.all((p >= 0) & (p <= 1)) and np.all(weights >= 0) and np.all((rates >= 0) & np.isfinite(rates))):
            raise ValueError("p must lie in [0, 1], weights and rates be finite and >= 0")
        unknown = [name for name in orders if name not in ORDER_NAMES]
        if not orders or unknown or len(set(orders)) != len(orders):
            raise ValueError(f"orders must name distinct candidates of {', '.join(ORDER_NAMES)}; got {list(orders)}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0 seconds, got {horizon}")
        if "learned" in orders and (learned is None or len(learned.cell) != p.shape[0]):
            raise ValueError(f"the learned candidate needs a predictor with one weight per cell ({p.shape[0]})")
        if "long-output" in orders and output_limit is None:
            raise ValueError("the long-output candidate needs an output_limit (tokens)")
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
        if switch_margin is None:  # read when built, as the window and period are
            switch_margin = SWITCH_MARGIN
        if not switch_margin >= 0:
            raise ValueError(f"switch_margin must be >= 0, got {switch_margin}")
        if switch_errors is None:
            switch_errors = SWITCH_ERRORS
        if not switch_errors >= 0:
            raise ValueError(f"switch_errors must be >= 0, got {switch_errors}")
        self.n_cells, self.n_tiers = p.shape
        super().__init__(p.size)
        self._default = (self.n_cells - 1) * self.n_tiers  # the default cell's first tier
        self.p, self.weights, self.rates, self.horizon = p, weights, rates, float(horizon)
        self.order_names = tuple(orders)
        self.capacity = capacity or 0
        self.switch_margin = float(switch_margin)
        self.switch_errors = float(switch_errors)
        self.calibrated = bool(calibrated)
        self.learned = learned
        self.output_limit = output_limit
        self._sample = ChainSample(default_sample(capacity) if shadow_sample is None else shadow_sample)
        self._orders: list[Order | None] = [self._row_order(name) for name in orders]
        self._followed = {i: self._new_followed(name) for i, name in enumerate(orders) if name in FOLLOWED_POLICIES}
        self._hits = np.zeros(0, dtype=np.int64)
        self._pinned = np.zeros(0, dtype=bool)
        self._content: dict[int, Hashable] = {}
        self._held = 0
        self._most = 0  # the most blocks held or evictable at once: the cache's size, as seen
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()
        self._ghosts_by_tier = [0] * self.n_tiers
        self._shadows = []
        if safety_net and len(orders) > 1:
            self._shadows = [ShadowCache(self._new_followed(name) if name in FOLLOWED_POLICIES else
                                         WorkloadAwarePolicy(p, weights, rates, horizon, orders=(name,), safety_net=False),
                                         scaled_size(self.capacity, self._sample.rate))
                             for name in orders]
            # Adaptive orders learn in their shadows; the real cache borrows the leader's.
            self._orders = [None if name in FOLLOWED_POLICIES else shadow.policy._orders[0]
                            for name, shadow in zip(orders, self._shadows)]
        self._shadow_score = [0.0] * len(self._shadows)
        self._shadow_seen = [0] * len(self._shadows)
        self._unweighed = 0  # lookups admitted since the shadows were last compared
        self._real_hits = self._real_seen = 0
        self._real_led = [0.0] * len(self._shadows)  # the real cache's hits while each candidate led ...
        self._shadow_led = [0.0] * len(self._shadows)  # ... and its shadow's over the same accesses
        # windowed sums of the products of two shadows' hits in a period (weights squared): their
        # differences' second moments, for the standard error of a lead
        self._moments = np.zeros((len(self._shadows), len(self._shadows)))
        self._lead(0)

    def _row_order(self, name: str) -> Order | None:
        if name == "model":
            cells = self.p.size
            return ModelOrder(self.p.reshape(-1), self.weights.reshape(cells, -1), self.rates.reshape(cells, -1),
                              self.horizon)
        if name == "lru":
            return RecencyOrder()
        if name == "segmented":
            return SegmentedOrder(self.n_tiers)
        if name == "frequency":
            return FrequencyOrder(self.n_tiers, beta=1.0, adaptive=True)
        if name == "strict-frequency":
            return FrequencyOrder(self.n_tiers, beta=4.0, adaptive=False)
        return None  # a followed policy

    def _new_followed(self, name: str) -> EvictionPolicy:
        if name == "learned":
            return LearnedPolicy(self.learned)
        if name == "long-output":
            return LongOutputLRU(self.output_limit)
        return FOLLOWED_POLICIES[name]()

    def _lead(self, index: int) -> None:
        self.leader = index
        self._order = self._orders[index]
        self._leading_policy = self._followed.get(index)

    @classmethod
    def from_hp(cls, hp, horizon: float | None = None, capacity: int | None = None, **kwargs) -> WorkloadAwarePolicy:
        """Build from a :class:`kvprof.models.hp.HpFile`: its cells, tiers, models and horizon.

        With ``capacity`` (blocks: the real cache's size, also the shadows'), the file's tuning for
        the nearest tuned capacity sets the horizon, the candidate to start on and the candidates
        it adds: ``learned`` where it has a predictor, ``long-output`` where it has an output limit
        (:meth:`~kvprof.models.hp.HpFile.tuned`). Where the file's next-turn counts favour it
        (:meth:`~kvprof.models.next_turn.NextTurnRates.favours_first_turn`), the candidates are
        :data:`FIRST_TURN_ORDERS` instead, at any capacity.
        ``horizon`` (seconds) overrides both, e.g. for a sweep over H; other keywords go to the
        constructor.
        """
        tuned = hp.tuned(capacity)
        if horizon is None:
            horizon = tuned.get("horizon_s", hp.horizon)
        learned, output_limit = tuned.get("learned"), tuned.get("long_output_tokens")
        if learned is not None:
            kwargs.setdefault("learned", learned)
        if output_limit is not None:
            kwargs.setdefault("output_limit", output_limit)
        if "orders" not in kwargs:
            orders = candidate_orders(hp, learned, output_limit, bool(tuned.get("finish_reason")))
            start = tuned.get("start", orders[0])
            if start in orders and orders != FIRST_TURN_ORDERS:  # where the counts decide, first-turn leads
                orders = (start, *(name for name in orders if name != start))
            kwargs["orders"] = orders
        p, weights, rates = hp.reuse_rows()
        return cls(p, weights, rates, horizon, capacity=capacity, **kwargs)

    @property
    def order_name(self) -> str:
        """Name of the candidate eviction follows now."""
        return self.order_names[self.leader]

    def shadow_hits(self) -> dict[str, int]:
        """Hits each candidate's shadow has counted so far (empty without the safety net)."""
        return {name: shadow.hits for name, shadow in zip(self.order_names, self._shadows)}

    # -- per-block state -------------------------------------------------------------------
    def _grow(self, block: int) -> None:
        have = len(self._hits)
        super()._grow(block)
        size = len(self._stamp)
        self._hits = np.concatenate([self._hits, np.zeros(size - have, dtype=np.int64)])
        self._pinned = np.concatenate([self._pinned, np.zeros(size - have, dtype=bool)])

    def access(
        self,
        block: int,
        now: float,
        workload: int = 0,
        depth: int = 0,
        *,
        hit: bool = False,
        next_use: float = math.inf,
        content: Hashable | None = None,
    ) -> None:
        if block >= len(self._stamp):
            self._grow(block)
        if not 0 <= workload < self.n_cells:
            workload = self.n_cells - 1
        if hit:
            hits = self._hits.item(block) + 1
            self._real_hits += 1
        else:
            hits = self._recall(content) if content is not None else 0
            if content is not None:
                self._content[block] = content
        self._hits[block] = hits
        self._class[block] = workload * self.n_tiers + self._tier(hits)
        self._stamp[block] = now
        self._depth[block] = depth
        if not self._pinned.item(block):
            self._pinned[block] = True
            self._held += 1
        for policy in self._followed.values():
            policy.access(block, now, workload, depth, hit=hit, next_use=next_use, content=content)

    def _tier(self, hits: int) -> int:
        return min(tier_of(hits), self.n_tiers - 1)

    def _recall(self, content: Hashable) -> int:
        """Hit count of newly allocated content: one more than when it was evicted, if remembered."""
        evicted = self._ghost.pop(content, None)
        if evicted is None:
            return 0
        tier = self._tier(evicted)
        self._ghosts_by_tier[tier] -= 1
        if not self._shadows and self._order is not None:  # with shadows, each learns from its own ghost
            self._order.ghost_hit(tier, self._ghosts_by_tier)
        return evicted + 1

    def free(self, blocks: Iterable[int], now: float) -> None:
        blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
        super().free(blocks, now)
        for policy in self._followed.values():
            policy.free(blocks, now)
        pinned = self._pinned
        for block in blocks:
            if pinned.item(block):
                pinned[block] = False
                self._held -= 1
        self._most = max(self._most, self._held + len(self))

    def remove(self, block: int) -> None:
        super().remove(block)
        for policy in self._followed.values():
            policy.remove(block)

    # -- eviction --------------------------------------------------------------------------
    def _key(self, row: int, block: int, stamp: float, now: float) -> tuple:
        return self._order.key(row, stamp, self._depth.item(block), now)

    def evict_n(self, n: int, now: float) -> list[int]:
        if self._leading_policy is None:
            victims = _as_list(self._fifos.merge(n, self._key, now, self.uniform_runs))
        else:
            victims = self._leading_policy.evict_n(n, now)
            for block in victims:
                self._fifos.remove(block)
        for index, policy in self._followed.items():
            if policy is not self._leading_policy:
                for block in victims:
                    policy.remove(block)
        self._remember(victims)
        return victims

    def evict_n_array(self, n: int, now: float) -> np.ndarray:
        return np.asarray(self.evict_n(n, now), dtype=np.int64)

    def order(self, now: float, limit: int | None = None) -> list[int]:
        if self._leading_policy is not None:
            return self._leading_policy.order(now, limit)
        return super().order(now, limit)

    def _remember(self, victims: list[int]) -> None:
        """Put the victims' contents in the ghost with their hit counts, oldest forgotten first."""
        ghost, by_tier, content_of, hits = self._ghost, self._ghosts_by_tier, self._content, self._hits
        for block in victims:
            content = content_of.pop(block, None)
            if content is None:
                continue
            count = hits.item(block)
            previous = ghost.pop(content, None)
            if previous is not None:
                by_tier[self._tier(previous)] -= 1
            ghost[content] = count
            by_tier[self._tier(count)] += 1
        while len(ghost) > self._most:
            by_tier[self._tier(ghost.popitem(last=False)[1])] -= 1

    # -- the safety net --------------------------------------------------------------------
    def admit(self, request: Hashable, contents: Sequence[Hashable], now: float, workload: int = 0, *,
              n_lookup: int | None = None, n_blocks: int | None = None) -> None:
        """Feed the shadows the request; now and then follow the candidate whose shadow hits most."""
        if not self._shadows:
            return
        n_lookup, n_blocks = request_sizes(contents, n_lookup, n_blocks)
        if request in self._shadows[0].held:
            raise ValueError(f"request {request!r} was admitted before and has not finished")
        if not 0 <= workload < self.n_cells:
            workload = self.n_cells - 1
        size = self._size()
        if self._sample.admits(contents, size):
            limit = scaled_size(size, self._sample.rate)
            for shadow in self._shadows:
                if shadow.limit < limit:  # no capacity given: the most blocks seen
                    shadow.set_limit(limit, now)
                shadow.admit(request, contents, now, workload, n_lookup, n_blocks)
        self._unweighed += n_lookup
        if self._unweighed >= max(FOLLOW_PERIOD_MIN, size // FOLLOW_PERIOD_SHARE):
            self._weigh(self._unweighed, size)
            self._unweighed = 0

    def finish(self, request: Hashable, now: float, contents: Sequence[Hashable] | None = None, *,
               n_blocks: int | None = None, n_output: int | None = None, finish: int | None = None) -> None:
        """Tell the followed policies (the real cache's free comes next); free the request's slots in
        every shadow (after caching what it filled since admission)."""
        n_blocks = finished_size(contents, n_blocks)
        for policy in self._followed.values():
            policy.finish(request, now, contents, n_blocks=n_blocks, n_output=n_output, finish=finish)
        for shadow in self._shadows:
            shadow.finish(request, now, () if contents is None else contents, n_blocks, n_output, finish)

    def _size(self) -> int:
        """The real cache's size in blocks: as given, else the most blocks it has held at once (now included)."""
        return self.capacity or max(self._most, self._held + len(self))

    def _weigh(self, lookups: int, size: int) -> None:
        """Add the shadows' hits since the last call to their windowed scores; follow the best."""
        keep = 0.5 ** (lookups / max(WINDOW_CAPACITIES * size, 1.0))
        real_gained = self._real_hits - self._real_seen
        self._real_seen = self._real_hits
        prior = float(max(size, 1))
        # A sampled shadow misses the real hits by the sample's own error too, which the
        # calibration would take for what following its candidate was worth: off when sampling.
        calibrated = self.calibrated and self._sample.rate >= 1.0
        gains, factors = np.zeros(len(self._shadows)), np.ones(len(self._shadows))
        for i, shadow in enumerate(self._shadows):
            gained = gains[i] = (shadow.hits - self._shadow_seen[i]) / self._sample.rate  # hits in the whole traffic
            self._shadow_seen[i] = shadow.hits
            self._shadow_score[i] = self._shadow_score[i] * keep + gained
            self._real_led[i] *= keep
            self._shadow_led[i] *= keep
            if i == self.leader:
                self._real_led[i] += real_gained
                self._shadow_led[i] += gained
            if calibrated:
                factors[i] = (self._real_led[i] + prior) / (self._shadow_led[i] + prior)
        self._moments *= keep * keep
        self._moments += np.outer(gains, gains)
        corrected = np.asarray(self._shadow_score) * factors
        best, leader = int(np.argmax(corrected)), self.leader
        lead = corrected[best] - corrected[leader]
        if lead > corrected[leader] * self.switch_margin and lead > self.switch_errors * self._lead_error(best, factors):
            self._lead(best)

    def _lead_error(self, best: int, factors: np.ndarray) -> float:
        """The standard error of ``best``'s corrected score minus the leader's, from the periods' moments."""
        leader, moments = self.leader, self._moments
        variance = (factors[best] ** 2 * moments[best, best] + factors[leader] ** 2 * moments[leader, leader]
                    - 2.0 * factors[best] * factors[leader] * moments[best, leader])
        return math.sqrt(max(variance, 0.0))

    def clear(self) -> None:
        super().clear()
        for policy in self._followed.values():
            policy.clear()
        self._hits[:] = 0
        self._pinned[:] = False
        self._held = 0
        self._content.clear()
        self._ghost.clear()
        self._ghosts_by_tier = [0] * self.n_tiers
