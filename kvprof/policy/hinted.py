"""Client hints honoured over any policy, within a budget: one layer, the same for every base order.

A request may come with a :class:`~kvprof.models.hints.Hint` (told at its ``finish``, before the free
of its blocks). At that free its blocks go to one of three places:

* ``release``: a *released* pool, evicted before anything else, oldest-freed first;
* ``retain_s > 0``: *retained* until ``now + retain_s``, out of the base order; evicted only when
  the released pool and the base are empty, lowest priority first, then latest expiry first: a
  retention is the client's word on when it will want the blocks back, and the one wanted last is
  Belady's victim (measured against earliest expiry first and oldest-retained first in
  docs/hints.md: earliest expiry evicts the blocks wanted soonest). Retention is soft: when its
  time passes the block lapses into the base order (freed into the base then: lapses are applied
  lazily, before each free, evict or order, in expiry order). A block keeps its retention while a
  hit holds it: a later free (hinted or not) retains it again until the later of the two expiries,
  so the hit itself extends nothing, the hinted free that follows it does (where SGLang's proposal
  extends a retention on the hit). A release does not cancel a live retention (another request's
  claim on a shared block);
* no hint, and no live retention: the base order, exactly as without the layer.

The budget: a tag's retained blocks number at most ``budget_blocks``; retaining one more lapses the
tag's oldest retention (earliest retained) into the base order, so a client that retains everything
holds at most its budget and its other blocks compete in the base order like anyone's.
"""

from __future__ import annotations

import heapq
import inspect
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, islice

from kvprof.models.hints import Hint
from kvprof.policy.base import EvictionPolicy


@dataclass
class HintCounters:
    """What the hints did in one replay, in blocks.

    ``honoured``: retained blocks hit before they lapsed; ``lapsed``: retentions that ran out of
    time; ``over_budget``: retentions lapsed by the budget; ``released_evicted``: released blocks
    evicted; ``hinted_hits``: hits on blocks that were released or retained when hit.
    """

    honoured: int = 0
    lapsed: int = 0
    over_budget: int = 0
    released_evicted: int = 0
    hinted_hits: int = 0


class HintedPolicy(EvictionPolicy):
    """``base``'s order plus a released pool evicted first and a retained pool evicted last.

    Invariant: every evictable block is in exactly one of ``_released`` (free order), ``_retained``
    (block -> its heap entry's sequence number; its tag's ``_by_tag`` order holds it too) and the
    base policy. ``_retention`` holds the ``(expiry, priority, tag)`` of every cached block with a
    retention that has neither lapsed nor been evicted, evictable or held by a hit. Heap entries
    whose sequence number is no longer the block's are dead and skipped.
    """

    def __init__(self, base: EvictionPolicy, budget_blocks: int | None = None):
        if budget_blocks is not None and budget_blocks < 0:
            raise ValueError(f"a hint budget is >= 0 blocks, got {budget_blocks}")
        self.base = base
        self.budget_blocks = budget_blocks
        self.name = f"{base.name}+hints"
        self.keyed_by = base.keyed_by
        self.offline = base.offline
        self.counters = HintCounters()
        self._tells_finish = "finish" in inspect.signature(base.finish).parameters
        self._hint: Hint | None = None  # the hint of the request whose blocks the next free releases
        self._released: OrderedDict[int, None] = OrderedDict()
        self._retained: dict[int, int] = {}  # block -> seq of its live heap entries
        self._retention: dict[int, tuple[float, int, int]] = {}  # block -> (expiry, priority, tag)
        self._by_tag: dict[int, OrderedDict[int, None]] = {}  # tag -> its retained blocks, earliest retained first
        self._expiries: list[tuple[float, int, int]] = []  # (expiry, seq, block)
        self._victims: list[tuple[int, float, int, int]] = []  # (priority, -expiry, seq, block)
        self._seq = 0

    # Requests ---------------------------------------------------------------------------------

    def admit(self, request, contents, now, workload=0, *, n_lookup=None, n_blocks=None) -> None:
        self.base.admit(request, contents, now, workload, n_lookup=n_lookup, n_blocks=n_blocks)

    def finish(self, request: Hashable, now: float, contents: Sequence[Hashable] | None = None, *,
               n_blocks: int | None = None, n_output: int | None = None, finish: int | None = None,
               hint: Hint | None = None) -> None:
        """As the base's, and ``hint`` (None: none) applies to the free that follows."""
        self._hint = hint
        if self._tells_finish:
            self.base.finish(request, now, contents, n_blocks=n_blocks, n_output=n_output, finish=finish)
        else:
            self.base.finish(request, now, contents, n_blocks=n_blocks, n_output=n_output)

    # Blocks -----------------------------------------------------------------------------------

    def access(self, block: int, now: float, workload: int = 0, depth: int = 0, *, hit: bool = False,
               next_use: float = math.inf, content: Hashable | None = None) -> None:
        if not hit:  # new content in the slot: an old retention was the old content's
            self._retention.pop(block, None)
        self.base.access(block, now, workload, depth, hit=hit, next_use=next_use, content=content)

    def free(self, blocks: Iterable[int], now: float) -> None:
        self._lapse(now)
        hint, self._hint = self._hint, None
        to_base = []
        for block in blocks:
            retention = self._retention.get(block)
            if retention is not None and retention[0] <= now:  # ran out while a hit held the block
                del self._retention[block]
                retention = None
            if hint is not None and hint.retains:
                expiry = now + hint.retain_s if retention is None else max(retention[0], now + hint.retain_s)
                self._retain(block, expiry, hint.priority, hint.tag, now)
            elif retention is not None:
                self._retain(block, *retention, now)
            elif hint is not None and hint.release:
                self._released[block] = None
            else:
                to_base.append(block)
        if to_base:
            self.base.free(to_base, now)

    def remove(self, block: int) -> None:
        if block in self._released:
            del self._released[block]
            self.counters.hinted_hits += 1
        elif block in self._retained:
            self._unretain(block)
            self.counters.honoured += 1
            self.counters.hinted_hits += 1
        else:
            self.base.remove(block)

    def discard(self, block: int) -> None:
        """Forget an evictable block, its retention too, counting nothing (no-op if not evictable)."""
        if block in self._released:
            del self._released[block]
        elif block in self._retained:
            self._unretain(block)
            del self._retention[block]
        elif block in self.base:
            self.base.remove(block)

    def evict(self, now: float) -> int:
        self._lapse(now)
        if self._released:
            self.counters.released_evicted += 1
            return self._released.popitem(last=False)[0]
        if len(self.base):
            return self.base.evict(now)
        while self._victims:
            _, _, seq, block = heapq.heappop(self._victims)
            if self._retained.get(block) == seq:
                self._unretain(block)
                del self._retention[block]
                return block
        raise IndexError("no evictable block")

    def order(self, now: float, limit: int | None = None) -> list[int]:
        """The eviction order (first victim first), as ``evict`` would take it now."""
        self._lapse(now)
        retained = sorted((entry for entry in self._victims if self._retained.get(entry[3]) == entry[2]))
        blocks = chain(self._released, self.base.order(now, None), (entry[3] for entry in retained))
        return list(islice(blocks, limit))

    def clear(self) -> None:
        self.base.clear()
        for pool in (self._released, self._retained, self._retention, self._by_tag):
            pool.clear()
        self._expiries.clear()
        self._victims.clear()

    def __len__(self) -> int:
        return len(self._released) + len(self._retained) + len(self.base)

    def __contains__(self, block: int) -> bool:
        return block in self._released or block in self._retained or block in self.base

    @property
    def n_retained(self) -> int:
        """Blocks retained now (evictable, held out of the base order)."""
        return len(self._retained)

    def retained_of(self, tag: int) -> int:
        """Blocks retained now for ``tag``."""
        return len(self._by_tag.get(tag, ()))

    # Retention --------------------------------------------------------------------------------

    def _retain(self, block: int, expiry: float, priority: int, tag: int, now: float) -> None:
        self._seq += 1
        if len(self._victims) > 2 * len(self._retained) + 1024:
            self._compact()
        self._retained[block] = self._seq
        self._retention[block] = (expiry, priority, tag)
        heapq.heappush(self._expiries, (expiry, self._seq, block))
        heapq.heappush(self._victims, (priority, -expiry, self._seq, block))
        held = self._by_tag.setdefault(tag, OrderedDict())
        held[block] = None
        if self.budget_blocks is not None and len(held) > self.budget_blocks:
            oldest = next(iter(held))
            self._lapse_one(oldest, now)
            self.counters.over_budget += 1

    def _compact(self) -> None:
        """Drop the heaps' dead entries (hits and lapses leave them), so they stay as long as the pool."""
        retained = self._retained
        for name in ("_expiries", "_victims"):
            live = [entry for entry in getattr(self, name) if retained.get(entry[-1]) == entry[-2]]
            heapq.heapify(live)
            setattr(self, name, live)

    def _unretain(self, block: int) -> None:
        """Take a retained block out of the pool (its retention stays in ``_retention``)."""
        del self._retained[block]
        del self._by_tag[self._retention[block][2]][block]

    def _lapse_one(self, block: int, when: float) -> None:
        self._unretain(block)
        del self._retention[block]
        self.base.free([block], when)

    def _lapse(self, now: float) -> None:
        """Retentions whose time has passed go to the base order, earliest expiry first."""
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expiry, seq, block = heapq.heappop(heap)
            if self._retained.get(block) == seq:
                self._lapse_one(block, expiry)
                self.counters.lapsed += 1
