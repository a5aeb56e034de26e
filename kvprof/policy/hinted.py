"""Client hints honoured over any policy, within a budget: one layer, the same for every base order.

A request may come with a :class:`~kvprof.models.hints.Hint` (told at its ``finish``, before the free
of its blocks). At that free its blocks go to one of three places:

* ``release``: a *released* pool, evicted before anything else, oldest-freed first;
* ``retain_s > 0``, no longer than the cache's horizon (below): *retained* until ``now + retain_s``, out
  of the base order; evicted only when
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

A release that names a session (``Hint.session``) puts in the released pool only the blocks private to
that session: those whose content, since it was cached, was held by requests of that session alone;
the others (a shared prefix: a system prompt, a document other sessions read) go where an unhinted free
puts them. A release without a session releases all the request's blocks. Who held a block is learnt at
each request's finish (:meth:`HintLayer.note_held`, before its free, with all the blocks it holds: the free
itself sees only those no other request holds), and new content is told by :meth:`HintLayer.recached`.

The horizon: a retention is honoured only where the cache can afford it, where it is no longer than an
unhinted block lives in the cache now (:class:`EvictionHorizon`: the evictable blocks over the rate of
evictions, Little's law; LRU's eviction age). A retention that asks for longer would keep the block past
the time the cache gives any block, at the cost of blocks that come back sooner (the continuation oracle
evicts such a session's blocks first); its blocks go where an unhinted free puts them, and count as
``beyond_horizon``. Until the first eviction the horizon is unbounded: every retention is honoured. The
rule holds for as long as a block is retained: one whose time left grows longer than the horizon (granted
before the first eviction, or when the cache kept blocks longer) lapses into the base order then, counted
``beyond_horizon`` too (the first victims among the retained first: lowest priority, latest expiry).

Trust: a release that names its session is a claim that the session will not come back while its blocks
would still be cached, and it is judged so (:class:`ReturnRecord`): every such release, honoured or not,
is right where its session stays away for the cache's horizon after it and wrong where it comes back.
The base order's own victims are judged the same way (the sessions whose own blocks it evicts). A release
is honoured while the released sessions come back no more often than the base's victims: while releases
pick victims at least as well as the policy does (until a victim of the base is judged, as though the
base's victims never came back). So a client whose releases are no better than a coin falls back to the
policy's order, and is trusted again once its releases are right again. A release naming no session
cannot be judged and is honoured as told.

The budget: retained blocks number at most ``budget_blocks``, each tag's alone and all tags' together;
retaining one more lapses the tag's oldest retention (earliest retained) into the base order where the
tag is over, else the oldest of all where the whole is. So a client that retains everything holds at
most the budget, whatever tags it sends (a fresh tag per request included), and its other blocks, like
every unhinted block, compete in the base order for the rest of the cache.

The bookkeeping is one class, :class:`HintLayer`, over any base order: the simulator's
:class:`HintedPolicy` runs it over a reference policy, vLLM's pool over the compiled twin that orders
its free queue (tests/test_hint_pool.py: the same decisions).
"""

from __future__ import annotations

import heapq
import inspect
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from kvprof.models.hints import Hint
from kvprof.policy.base import EvictionPolicy


#: What :attr:`HintLayer._holders` keeps of a block no request held yet since it was cached, and of one
#: held by two sessions (or by a request without one).
NEW, SHARED = object(), object()


@dataclass
class HintCounters:
    """What the hints did in one replay, in blocks.

    ``retained_hits``: retained blocks hit before they lapsed (not the retentions granted);
    ``lapsed``: retentions that ran out of time; ``over_budget``: retentions lapsed by the budget; ``released_evicted``: released blocks
    evicted; ``hinted_hits``: hits on blocks that were released or retained when hit;
    ``beyond_horizon``: blocks freed with a retention longer than the cache's horizon, not retained, and
    retained blocks lapsed when their time left grew longer than it;
    ``release_declined``: blocks a release named that went to the base order, the releases not trusted.
    """

    retained_hits: int = 0
    lapsed: int = 0
    over_budget: int = 0
    released_evicted: int = 0
    hinted_hits: int = 0
    beyond_horizon: int = 0
    release_declined: int = 0


@dataclass
class EvictionHorizon:
    """How long an unhinted evictable block lives in the cache now: the evictable blocks over the rate of
    evictions since the first (Little's law), the age at which LRU evicts.

    Invariant: ``evicted`` blocks were evicted, the first at ``first`` (None: none yet). Whoever evicts
    counts (:meth:`count`): the hint layer's own evictions, and a caller's that bypass it (vLLM's pool
    while no hint is held, the CPU tier), so every caller measures the same horizon.
    """

    evicted: int = 0
    first: float | None = None

    def count(self, n: int, now: float) -> None:
        """``n`` blocks were evicted at ``now``."""
        if n and self.first is None:
            self.first = now
        self.evicted += n

    def seconds(self, n_evictable: int, now: float) -> float:
        """The horizon at ``now`` with ``n_evictable`` blocks evictable; inf until an eviction and time after it."""
        if not self.evicted or now <= self.first:
            return math.inf
        return n_evictable * (now - self.first) / self.evicted


class ReturnRecord:
    """Whether the sessions a kind of victim choice named come back by its deadline: how good it is.

    A choice (a release, the base order's eviction) names a session and a deadline, the cache's horizon
    after it: it is wrong where its session comes back by then, when its blocks would still have been
    cached.

    Invariant: ``_deadline`` maps each session chosen and not yet judged to its last choice's deadline,
    and ``_by_deadline`` (a heap of ``(deadline, seq, session)``, entries no longer a session's last
    dead) holds each; a judged choice counts once, as ``returned`` (its session came back by the
    deadline) or ``stayed_away`` (the deadline passed first).
    """

    def __init__(self):
        self.returned = 0
        self.stayed_away = 0
        self._deadline: dict = {}
        self._by_deadline: list = []
        self._seq = 0

    def chosen(self, session, deadline: float) -> None:
        """A choice names ``session`` until ``deadline`` (a session chosen again is judged on its last)."""
        self._seq += 1
        self._deadline[session] = (deadline, self._seq)
        heapq.heappush(self._by_deadline, (deadline, self._seq, session))

    def came_back(self, session, now: float) -> None:
        """A request of ``session`` at ``now``: its pending choice, if any, is judged."""
        chosen = self._deadline.pop(session, None)
        if chosen is not None:
            if now <= chosen[0]:
                self.returned += 1
            else:
                self.stayed_away += 1

    def age(self, now: float) -> None:
        """Choices whose deadline passed before their session came back stayed away."""
        heap, deadlines = self._by_deadline, self._deadline
        while heap and heap[0][0] < now:
            deadline, seq, session = heapq.heappop(heap)
            if deadlines.get(session) == (deadline, seq):
                del deadlines[session]
                self.stayed_away += 1

    def share_returned(self, now: float) -> float | None:
        """The share of the choices judged by ``now`` whose session came back (None: none judged)."""
        self.age(now)
        judged = self.returned + self.stayed_away
        return self.returned / judged if judged else None


class HintLayer:
    """The released and retained pools over a base order: the bookkeeping of the hint layer.

    ``base`` is any order of the evictable blocks that are not hinted, reached through a small
    interface: ``free(blocks, now)``, ``evict_n(n, now)``, ``order(now, limit)``, ``clear()``,
    ``len`` and ``in``, and ``take(block)``, which takes an evictable block back (default
    ``base.remove``; vLLM's pool passes its compiled twin's deferred ``take``). :class:`HintedPolicy`
    runs it over a reference policy, vLLM's pool (:mod:`kvprof.vllm.block_pool`) over the compiled
    twin that orders its free queue: the same decisions over the same base.

    Invariant: every evictable block is in exactly one of ``_released`` (free order), ``_retained``
    (block -> its heap entry's sequence number; its tag's ``_by_tag`` order and ``_oldest``, the order
    of all, hold it too) and the base. ``_retention`` holds the ``(expiry, priority, tag)`` of every cached block with a
    retention that has neither lapsed nor been evicted, evictable or held by a hit. Heap entries
    whose sequence number is no longer the block's are dead and skipped. :attr:`active` is False
    exactly when the layer holds nothing (no released block, no retention): then every call is
    the base's, and a caller on a hot path may call the base directly.

    Sessions: until a request names one, :attr:`tracks_sessions` is False and ``_holders`` empty (no
    work per block). From then on ``_holders[block]`` is the one session whose requests alone held the
    block's content since it was cached (:data:`NEW`: none yet, :data:`SHARED`: two sessions, or a
    request without one); a block without an entry counts as shared (its content was cached before
    sessions were tracked). A release naming session ``s`` puts a block in ``_released`` only where
    ``_holders[block] == s``: it never demotes a block another session, or a request naming none,
    held. Entries go when a block is evicted through the layer or discarded, and restart at
    :meth:`recached`: ``_holders`` holds at most one entry per block id.
    """

    def __init__(self, base, budget_blocks: int | None = None, take=None):
        if budget_blocks is not None and budget_blocks < 0:
            raise ValueError(f"a hint budget is >= 0 blocks, got {budget_blocks}")
        self.base = base
        self.budget_blocks = budget_blocks
        self.counters = HintCounters()
        self.horizon = EvictionHorizon()
        self.released_record = ReturnRecord()  # the sessions releases named
        self.evicted_record = ReturnRecord()  # the sessions whose own blocks the base order evicted
        self._take_from_base = base.remove if take is None else take
        self._released: OrderedDict[int, None] = OrderedDict()
        self._retained: dict[int, int] = {}  # block -> seq of its live heap entries
        self._retention: dict[int, tuple[float, int, int]] = {}  # block -> (expiry, priority, tag)
        self._by_tag: dict[int, OrderedDict[int, None]] = {}  # tag -> its retained blocks, earliest retained first
        self._oldest: OrderedDict[int, None] = OrderedDict()  # every retained block, earliest retained first
        self._expiries: list[tuple[float, int, int]] = []  # (expiry, seq, block)
        self._victims: list[tuple[int, float, int, int]] = []  # (priority, -expiry, seq, block)
        self._seq = 0
        self.tracks_sessions = False
        self._holders: dict[int, object] = {}  # block -> the one session that held it, NEW or SHARED

    def carry_from(self, before: HintLayer) -> None:
        """Go on with ``before``'s counts and horizon: a layer over a reloaded policy (its counts are
        counters on /metrics; the horizon measures the cache, not the policy)."""
        self.counters, self.horizon = before.counters, before.horizon
        self.released_record, self.evicted_record = before.released_record, before.evicted_record

    @property
    def active(self) -> bool:
        """Whether the layer holds anything: a released block or a retention (evictable or held)."""
        return bool(self._released) or bool(self._retention)

    def free_hinted(self, blocks: Iterable[int], now: float, hint: Hint | None) -> None:
        """``blocks`` become evictable, freed by a request with ``hint`` (None: none)."""
        self._lapse(now)
        retains = hint is not None and hint.retains
        beyond = retains and hint.retain_s > self.horizon.seconds(len(self), now)
        retains = retains and not beyond
        releases = hint is not None and hint.release  # never with a retention (Hint's invariant)
        declined = releases and hint.session is not None and not self._release_trusted(hint.session, now)
        to_base = []
        for block in blocks:
            self.counters.beyond_horizon += beyond
            retention = self._retention.get(block)
            if retention is not None and retention[0] <= now:  # ran out while a hit held the block
                del self._retention[block]
                retention = None
            if retains:
                expiry = now + hint.retain_s if retention is None else max(retention[0], now + hint.retain_s)
                self._retain(block, expiry, hint.priority, hint.tag, now)
            elif retention is not None:
                self._retain(block, *retention, now)
            elif releases and (hint.session is None or self._holders.get(block, SHARED) == hint.session):
                if declined:
                    self.counters.release_declined += 1
                    to_base.append(block)
                else:
                    self._released[block] = None
            else:
                to_base.append(block)
        if to_base:
            self.base.free(to_base, now)

    def take(self, block: int, hit: bool = True) -> None:
        """An evictable block is taken back: by a hit (counted where it was hinted), or, with ``hit``
        False, to be freed again in a new place (a tier that re-orders a block counts no hit)."""
        if block in self._released:
            del self._released[block]
            self.counters.hinted_hits += hit
        elif block in self._retained:
            self._unretain(block)
            self.counters.retained_hits += hit
            self.counters.hinted_hits += hit
        else:
            self._take_from_base(block)

    def recached(self, block: int) -> None:
        """New content in ``block``'s slot: an old retention was the old content's, and no one held it yet."""
        self._retention.pop(block, None)
        if self.tracks_sessions:
            self._holders[block] = NEW

    def recached_all(self, blocks: Iterable[int]) -> None:
        """:meth:`recached` of each of ``blocks``."""
        for block in blocks:
            self.recached(block)

    def tracks(self, session) -> bool:
        """Whether a request of ``session`` (None: naming none) tells :meth:`note_held` what it held: once
        any request named a session, every request does (a caller may skip listing its blocks otherwise)."""
        return session is not None or self.tracks_sessions

    def note_held(self, blocks: Iterable[int], session, now: float) -> None:
        """A request of ``session`` (None: naming none) finishes holding ``blocks`` (all of them, shared
        ones too) at ``now``: each is private to ``session`` only where no one else held it since it was
        cached; and ``session`` came back, which judges its last choice as a victim (:meth:`_release_trusted`)."""
        if not self.tracks(session):
            return
        self.tracks_sessions = True
        if session is not None:
            self.released_record.came_back(session, now)
            self.evicted_record.came_back(session, now)
        holders = self._holders
        for block in blocks:
            before = holders.get(block, SHARED)
            if before is not SHARED and (session is None or (before is not NEW and before != session)):
                holders[block] = SHARED
            elif before is NEW:
                holders[block] = session

    def discard(self, block: int) -> None:
        """Forget an evictable block, its retention too, counting nothing (no-op if not evictable)."""
        self._holders.pop(block, None)
        if block in self._released:
            del self._released[block]
        elif block in self._retained:
            self._unretain(block)
            del self._retention[block]
        elif block in self.base:
            self.base.remove(block)

    def evict_n(self, n: int, now: float) -> list[int]:
        """``n`` victims, first victim first: released blocks (oldest freed first), then the base's, then
        retained ones (lowest priority, then latest expiry first). IndexError, changing nothing, when
        fewer than ``n`` blocks are evictable."""
        if n > len(self):
            raise IndexError(f"{n} victims asked for, {len(self)} evictable")
        self._lapse(now)
        released = self._released
        out = [released.popitem(last=False)[0] for _ in range(min(n, len(released)))]
        self.counters.released_evicted += len(out)
        from_base = min(n - len(out), len(self.base))
        by_base = self.base.evict_n(from_base, now) if from_base else []
        self.count_evicted(n, now, by_base)
        out.extend(by_base)
        while len(out) < n:
            _, _, seq, block = heapq.heappop(self._victims)
            if self._retained.get(block) == seq:
                self._unretain(block)
                del self._retention[block]
                out.append(block)
        if self._holders:
            for block in out:
                self._holders.pop(block, None)
        return out

    def evict_chosen(self, blocks: list[int], now: float) -> None:
        """Evict ``blocks`` (each evictable), taken from :meth:`order` by a caller that must skip some
        (the CPU tier's protected chunks): counted and judged as :meth:`evict_n` counts its own victims,
        the horizon read with the released and the base's victims gone and the retained ones not yet."""
        by_base, retained = [], []
        for block in blocks:
            if block in self._released:
                del self._released[block]
                self.counters.released_evicted += 1
            elif block in self._retained:
                retained.append(block)
            else:
                self.base.remove(block)
                by_base.append(block)
        self.count_evicted(len(blocks), now, by_base)
        for block in retained:
            self._unretain(block)
            del self._retention[block]
        if self._holders:
            for block in blocks:
                self._holders.pop(block, None)

    def count_evicted(self, n: int, now: float, by_base: Iterable[int] = ()) -> None:
        """``n`` blocks were evicted at ``now``, ``by_base`` those of them the base order chose: the
        horizon counts them all, and the sessions that alone held the base's victims are victims the
        base chose (:meth:`_release_trusted`). A caller that evicts from the base without the layer
        (vLLM's pool while no hint is held, the CPU tier) tells it here, so every caller judges alike."""
        self.horizon.count(n, now)
        holders = self._holders
        if holders:
            deadline = None
            for block in by_base:
                session = holders.pop(block, SHARED)
                if session is not SHARED and session is not NEW:
                    if deadline is None:
                        deadline = now + self.horizon.seconds(len(self), now)
                    self.evicted_record.chosen(session, deadline)

    def _release_trusted(self, session, now: float) -> bool:
        """Whether a release naming ``session`` is honoured now: while the sessions releases named come
        back within the horizon no more often than those whose blocks the base order evicted, so a release
        picks victims at least as well as the base does. Every release naming a session is judged, honoured
        or not, so a client's word is trusted again once it is right again. Before any is judged a release
        is honoured; before any of the base's victims is, they count as never coming back (trust is earned
        against the strictest yardstick until the base's own record exists)."""
        released, evicted = self.released_record.share_returned(now), self.evicted_record.share_returned(now)
        self.released_record.chosen(session, now + self.horizon.seconds(len(self), now))
        return released is None or released <= (evicted or 0.0)

    def order(self, now: float, limit: int | None = None) -> list[int]:
        """The eviction order (first victim first), as :meth:`evict_n` would take it now."""
        self._lapse(now)
        out = list(islice(self._released, limit))
        if limit is not None and len(out) == limit:
            return out
        out.extend(self.base.order(now, None if limit is None else limit - len(out)))  # the base's first only
        if limit is not None and len(out) == limit:
            return out
        retained = sorted((entry for entry in self._victims if self._retained.get(entry[3]) == entry[2]))
        out.extend(islice((entry[3] for entry in retained), None if limit is None else limit - len(out)))
        return out

    def clear(self) -> None:
        self.base.clear()
        for pool in (self._released, self._retained, self._retention, self._by_tag, self._oldest, self._holders):
            pool.clear()
        self._expiries.clear()
        self._victims.clear()

    def __len__(self) -> int:
        return len(self._released) + len(self._retained) + len(self.base)

    def __contains__(self, block: int) -> bool:
        return block in self._released or block in self._retained or block in self.base

    @property
    def n_released(self) -> int:
        """Blocks released now (evictable, evicted first)."""
        return len(self._released)

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
        self._oldest[block] = None
        if self.budget_blocks is not None:
            over = held if len(held) > self.budget_blocks else self._oldest if len(self._oldest) > self.budget_blocks \
                else None
            if over is not None:
                self._lapse_one(next(iter(over)), now)
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
        del self._oldest[block]

    def _lapse_one(self, block: int, when: float) -> None:
        self._unretain(block)
        del self._retention[block]
        self.base.free([block], when)

    def _lapse(self, now: float) -> None:
        """Retentions whose time has passed go to the base order, earliest expiry first; then those whose
        time left is longer than the horizon now, the first victims among the retained first (a retention
        granted before the cache first evicted, or when the horizon was longer)."""
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expiry, seq, block = heapq.heappop(heap)
            if self._retained.get(block) == seq:
                self._lapse_one(block, expiry)
                self.counters.lapsed += 1
        victims = self._victims
        if not victims:
            return
        horizon = self.horizon.seconds(len(self), now)
        while victims:
            _, neg_expiry, seq, block = victims[0]
            if self._retained.get(block) != seq:
                heapq.heappop(victims)  # dead
            elif -neg_expiry - now > horizon:
                heapq.heappop(victims)
                self._lapse_one(block, now)
                self.counters.beyond_horizon += 1
            else:
                break


class HintedPolicy(HintLayer, EvictionPolicy):
    """``base``'s order plus a released pool evicted first and a retained pool evicted last
    (:class:`HintLayer`), told each request's hint at its ``finish``: the simulator's hint layer.

    Invariant: :class:`HintLayer`'s, and ``_hint`` is the hint of the request whose blocks the next
    free releases, ``_held`` the blocks that request holds (both None once that free happened).
    """

    def __init__(self, base: EvictionPolicy, budget_blocks: int | None = None):
        HintLayer.__init__(self, base, budget_blocks)
        self.name = f"{base.name}+hints"
        self.keyed_by = base.keyed_by
        self.offline = base.offline
        self._tells_finish = "finish" in inspect.signature(base.finish).parameters
        self._hint: Hint | None = None
        self._held: Sequence[int] | None = None

    def admit(self, request, contents, now, workload=0, *, n_lookup=None, n_blocks=None) -> None:
        self.base.admit(request, contents, now, workload, n_lookup=n_lookup, n_blocks=n_blocks)

    def finish(self, request: Hashable, now: float, contents: Sequence[Hashable] | None = None, *,
               n_blocks: int | None = None, n_output: int | None = None, finish: int | None = None,
               hint: Hint | None = None, held: Sequence[int] | None = None) -> None:
        """As the base's, and ``hint`` (None: none) applies to the free that follows; ``held`` is the
        request's blocks, which tell the layer who held them (:meth:`HintLayer.note_held`): now, and again
        at that free (a replay may add the output's blocks in between; a free may not come, where
        another request holds every block)."""
        self._hint, self._held = hint, held
        if held is not None:
            self.note_held(held, None if hint is None else hint.session, now)
        if self._tells_finish:
            self.base.finish(request, now, contents, n_blocks=n_blocks, n_output=n_output, finish=finish)
        else:
            self.base.finish(request, now, contents, n_blocks=n_blocks, n_output=n_output)

    def access(self, block: int, now: float, workload: int = 0, depth: int = 0, *, hit: bool = False,
               next_use: float = math.inf, content: Hashable | None = None) -> None:
        if not hit:
            self.recached(block)
        self.base.access(block, now, workload, depth, hit=hit, next_use=next_use, content=content)

    def free(self, blocks: Iterable[int], now: float) -> None:
        hint, held, self._hint, self._held = self._hint, self._held, None, None
        if held is not None:
            self.note_held(held, None if hint is None else hint.session, now)
        self.free_hinted(blocks, now, hint)

    def remove(self, block: int) -> None:
        self.take(block)

    def evict(self, now: float) -> int:
        if not len(self):
            raise IndexError("no evictable block")
        return self.evict_n(1, now)[0]
