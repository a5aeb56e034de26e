"""A compiled policy behind the :class:`~kvprof.policy.base.EvictionPolicy` interface.

What drivers that speak the interface run (the vLLM adaptor, the differential tests): one
compiled call per protocol call, by address (:mod:`kvprof.core.handle`, ~0.15 us a call), with
batch forms for what vLLM does in batches (a chain of accesses, removals on prefix hits). The
simulator's compiled engine drives the core directly instead.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from kvprof.core import handle
from kvprof.core.build import compile_policy
from kvprof.core.seats import Seats
from kvprof.core.shadow_feed import ShadowFeed
from kvprof.core.wa import outcome
from kvprof.models.finish import UNKNOWN
from kvprof.policy.base import EvictionPolicy, finished_size, request_sizes

#: The chain of a request that holds no seat: nothing to number.
NO_NUMBERS = np.zeros(0, np.int64)


def output_code(n_output: int | None) -> int:
    """A request's output length as the compiled core takes it: -1 for unknown."""
    return -1 if n_output is None else int(n_output)


#: Content numbers kept per block of the pool (and at least :data:`MIN_CONTENTS`); see :class:`CompiledTwin`.
CONTENTS_PER_BLOCK = 16
MIN_CONTENTS = 1 << 16


class CompiledTwin(EvictionPolicy):
    """The compiled twin of a fresh reference policy, same name, same decisions.

    Invariants: ``_content_id`` numbers contents densely, below ``max_contents`` (the core keys
    its ghosts and shadows by content number), so two contents are equal here exactly when they
    are equal for the reference, as long as no more than ``max_contents`` distinct contents were
    seen. Past that, the number of the content seen first is given to the new one: memory stays
    bounded in a server that runs for weeks, at the price that a content first seen
    ``max_contents`` contents ago may be taken for another in a ghost or shadow (all of them
    together hold about 9 times the pool's blocks, so with the default this is rare and only
    shifts the safety net's statistics; the cache itself never depends on it). ``_taken`` lists
    blocks taken back with :meth:`take` that the core still holds as evictable, and every method
    that reaches the core hands them to it first, so the core sees the same operations in the
    same order as the reference would; ``_seats`` numbers the running requests (:meth:`admit`
    to :meth:`finish`) with the lowest numbers free, the ids the core knows them by;
    ``_size`` is the number of evictable blocks (the core's count less ``_taken``), kept here
    because every change of it passes through this class; ``_block_content[b]`` is the content
    number block ``b`` was last accessed with (what :meth:`remembered` gives for a hit, so a
    prefix hit costs no key lookup per block), kept only where the core does not keep a cached
    block's content itself (``_contents_in_core``: then it is empty and :meth:`remembered`
    reads the core's; empty too where the core reads no contents: ``reads_contents`` False, and
    then a driver may pass -1 for every content). ``keeps_touches``: the core keeps when each block
    was last accessed or freed and at what depth; where it does not, ``_notes`` keeps them for
    the blocks below ``n_blocks`` (when, depth; else empty), beside each one's hits since its last
    access that was not a hit (up to :data:`~kvprof.core.handle.HITS_NOTED`), all written by the
    compiled calls that access or free (:func:`kvprof.core.handle.notes_at`), so that
    :meth:`touches` and :meth:`hits_since_cached` answer for every policy and a driver need not
    keep them too. ``shadow_feed``, once :meth:`feed_shadows_in_background` was called, takes every
    admission and finish (:class:`~kvprof.core.shadow_feed.ShadowFeed`), and every eviction and
    reading of the shadows goes through it first (its thread lives until :meth:`close`, which
    whoever drops such a twin calls, and which ends it for good).

    Parameters
    ----------
    reference : EvictionPolicy
        A fresh instance of a class with a twin (:data:`kvprof.core.build.TWINS`); kept as
        :attr:`reference`, only read (:meth:`clear` compiles it again).
    n_blocks : int
        Block ids expected, to size the tables once (they grow past it if needed).
    max_contents : int, optional
        Content numbers in use at most; default ``max(16 n_blocks, 65536)``.
    """

    def __init__(self, reference: EvictionPolicy, n_blocks: int = 0, max_contents: int | None = None) -> None:
        self.name = reference.name
        self.keyed_by = reference.keyed_by
        self.reference = reference
        self._n_blocks = n_blocks
        self.max_contents = max_contents or max(CONTENTS_PER_BLOCK * n_blocks, MIN_CONTENTS)
        self._content_id: OrderedDict[Hashable, int] = OrderedDict()
        self._seats = Seats()
        self._taken: list[int] = []
        #: ``take(block)``: :meth:`remove` of a block the caller knows is evictable, applied
        #: before the next call that reaches the core (vLLM takes back a free block on every
        #: prefix hit: one list append here instead of a compiled call each). A block that was
        #: not evictable raises KeyError at that next call. Bound to the list, so no Python frame.
        self.take = self._taken.append
        self._out = np.empty(16, dtype=np.int64)  # victims of one call: grown to the most asked for
        self.shadow_feed: ShadowFeed | None = None
        self._build()
        self.keeps_touches = handle.keeps_touches_of(self._address)
        self.reads_contents = handle.reads_contents_of(self._address)
        self._contents_in_core = handle.keeps_contents_of(self._address)
        # content numbers < 2**31; empty where the core keeps them or reads none (an access then notes nothing here)
        self._notes_contents = self.reads_contents and not self._contents_in_core
        self._block_content = np.full(max(n_blocks, 16) if self._notes_contents else 0, -1, dtype=np.int32)
        kept = 0 if self.keeps_touches else n_blocks
        self._notes = (np.full(kept, -np.inf), np.zeros(kept, np.int64), np.zeros(n_blocks, np.int8))
        at, depth, hits = self._notes  # where the compiled calls find them (handle.notes_at)
        self._notes_table = np.array([at.ctypes.data, depth.ctypes.data, kept, hits.ctypes.data, n_blocks], np.int64)
        self._notes_address = self._notes_table.ctypes.data

    def _build(self) -> None:
        self.handle = compile_policy(self.reference, self._n_blocks)
        self._address = handle.address_of(self.handle)  # valid while self.handle lives
        self._size = 0
        if self.shadow_feed is not None:
            self.shadow_feed.close()
            self.shadow_feed = ShadowFeed(self.handle)

    def feed_shadows_in_background(self) -> None:
        """Feed ``wa``'s shadows on a thread of their own from now on (see :mod:`kvprof.core.shadow_feed`:
        the same decisions; an admission or finish no longer waits for the shadows, an eviction
        only where it reads what they decide). Nothing for a policy without shadows."""
        if self.shadow_feed is None and self.safety_net() is not None:
            self.shadow_feed = ShadowFeed(self.handle)

    def close(self) -> None:
        """Stop the shadows' thread, if any (the policy is dropped)."""
        if self.shadow_feed is not None:
            self.shadow_feed.close()
            self.shadow_feed = None  # a later clear() starts none

    def _apply_taken(self) -> None:
        taken = np.fromiter(self._taken, np.int64, len(self._taken))  # (a third faster than np.array of a list)
        self._taken.clear()
        first_absent = handle.remove_n(self._address, taken, len(taken))
        self._size = handle.size(self._address)
        if first_absent >= 0:
            raise KeyError(f"block {taken[first_absent]} was taken back but was not evictable")

    def _contents(self, contents: Iterable[Hashable | None]) -> list[int]:
        get, number = self._content_id.get, self._number
        return [-1 if c is None else n if (n := get(c)) is not None else number(c) for c in contents]

    def numbers(self, contents: Iterable[Hashable | None]) -> np.ndarray:
        """The content numbers the core knows ``contents`` by (numbering the new ones, in order):
        what :meth:`admit_numbered` and :meth:`finish_numbered` take, for a caller that keeps a
        request's numbers instead of looking its chain up again."""
        return np.array(self._contents(contents), dtype=np.int64)

    def _number(self, content: Hashable) -> int:
        """A number for a content not seen yet: the next one, or the oldest one's past ``max_contents``."""
        ids = self._content_id
        number = len(ids) if len(ids) < self.max_contents else ids.popitem(last=False)[1]
        ids[content] = number
        return number

    # -- the protocol ----------------------------------------------------------------------
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
        ids = self._content_id
        content_id = -1 if content is None else ids[content] if content in ids else self._number(content)
        self.access_one(block, depth, content_id, now, workload, hit=hit, next_use=next_use)

    def access_one(self, block: int, depth: int, number: int, now: float, workload: int, *, hit: bool = False,
                   next_use: float = math.inf) -> None:
        """:meth:`access` with the content as its :meth:`numbers` number (-1: none): one compiled call,
        no array (a decode step caches one block a request)."""
        if self._taken:
            self._apply_taken()
        if self._notes_contents:
            if block < len(self._block_content):
                self._block_content[block] = number
            else:  # the table grows (a simulator's pool)
                self._remember_contents(np.array([block], dtype=np.int64), np.array([number], dtype=np.int64))
        handle.access(self._address, block, float(now), workload, depth, hit, float(next_use), number,
                      self._notes_address)

    def access_chain(self, blocks: Sequence[int], depths: Sequence[int], contents: Sequence[Hashable | None],
                     now: float, workload: int, *, hit: bool) -> None:
        """``access(blocks[i], now, workload, depths[i], hit=hit, content=contents[i])`` for each
        ``i`` in order, in one compiled call."""
        if len(blocks):
            self.access_numbered(np.array(blocks, dtype=np.int64), np.array(depths, dtype=np.int64),
                                 self.numbers(contents), now, workload, hit=hit)

    def access_numbered(self, blocks: np.ndarray, depths: np.ndarray, numbers: np.ndarray, now: float,
                        workload: int, *, hit: bool) -> None:
        """:meth:`access_chain` with the contents as :meth:`numbers` (int64 arrays, one compiled call)."""
        if self._taken:
            self._apply_taken()
        n = len(blocks)
        if n:
            self._remember_contents(blocks, numbers)
            handle.access_n(self._address, blocks, depths, numbers, n, float(now), workload, hit, self._notes_address)

    def remembered(self, blocks: np.ndarray) -> np.ndarray | None:
        """The content numbers ``blocks`` (int64) were cached with (last accessed with, where the core
        keeps none), or None if one of them has none: what a prefix hit passes (a cached block's
        content has not changed since it was cached). Where the core reads no contents, -1 for each."""
        if not self.reads_contents:
            return np.full(len(blocks), -1, dtype=np.int64)
        if self._contents_in_core:
            numbers = np.empty(len(blocks), dtype=np.int64)
            return numbers if handle.contents_of(self._address, blocks, numbers) else None
        if len(blocks) and int(blocks.max()) >= len(self._block_content):
            return None
        numbers = self._block_content[blocks].astype(np.int64)
        return None if len(numbers) and numbers.min() < 0 else numbers

    def _remember_contents(self, blocks: np.ndarray, numbers: np.ndarray) -> None:
        if not self._notes_contents:
            return
        try:  # the table is as long as the pool: a block beyond it only where the pool grows (a simulator's)
            self._block_content[blocks] = numbers
        except IndexError:
            top = int(blocks.max()) + 1
            grown = np.full(max(top, 2 * len(self._block_content)), -1, dtype=np.int32)
            grown[: len(self._block_content)] = self._block_content
            self._block_content = grown
            self._block_content[blocks] = numbers

    def touches(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """When each of ``blocks`` (int64) was last accessed or freed (the ``now`` of that call) and the
        depth of its last access (``-inf`` and 0 for a block never accessed)."""
        if self._taken:
            self._apply_taken()
        stamps, depths = np.empty(len(blocks)), np.empty(len(blocks), dtype=np.int64)
        if self.keeps_touches:
            handle.touches(self._address, blocks, stamps, depths)
        else:
            touched_at, touched_depth, _ = self._notes
            known = (blocks >= 0) & (blocks < len(touched_at))
            stamps[:], depths[:] = -np.inf, 0
            stamps[known], depths[known] = touched_at[blocks[known]], touched_depth[blocks[known]]
        return stamps, depths

    def hits_since_cached(self, blocks: np.ndarray) -> np.ndarray:
        """How many times each of ``blocks`` (int64, below ``n_blocks``) was accessed as a hit since its
        last access that was not one, up to :data:`~kvprof.core.handle.HITS_NOTED` (int8)."""
        return self._notes[2][blocks]

    def admit(self, request: Hashable, contents: Sequence[Hashable], now: float, workload: int = 0, *,
              n_lookup: int | None = None, n_blocks: int | None = None) -> None:
        n_lookup, n_blocks = request_sizes(contents, n_lookup, n_blocks)
        if request in self._seats:
            raise ValueError(f"request {request!r} was admitted before and has not finished")
        self.admit_numbered(request, self.numbers(contents), now, workload, n_lookup=n_lookup, n_blocks=n_blocks)

    def admit_numbered(self, request: Hashable, numbers: np.ndarray, now: float, workload: int, *, n_lookup: int,
                       n_blocks: int) -> None:
        """:meth:`admit` with the chain as :meth:`numbers` and its sizes given; ``numbers`` is the
        policy's from now on (a shadow feed reads it later), the caller does not change it."""
        if request in self._seats:
            raise ValueError(f"request {request!r} was admitted before and has not finished")
        seat = self._seats.take(request)
        if self.shadow_feed is None:
            handle.admit(self._address, seat, numbers, n_lookup, n_blocks, float(now), workload)
        else:
            self.shadow_feed.admit(seat, numbers, n_lookup, n_blocks, float(now), workload)

    def finish(self, request: Hashable, now: float, contents: Sequence[Hashable] | None = None, *,
               n_blocks: int | None = None, n_output: int | None = None, finish: int | None = None) -> None:
        n_blocks = finished_size(contents, n_blocks)
        numbers = self.numbers(() if contents is None else contents) if request in self._seats else NO_NUMBERS
        self.finish_numbered(request, now, numbers, n_blocks=n_blocks, n_output=n_output, finish=finish)

    def finish_numbered(self, request: Hashable, now: float, numbers: np.ndarray, *, n_blocks: int,
                        n_output: int | None = None, finish: int | None = None) -> None:
        """:meth:`finish` with the chain as :meth:`numbers` and the size given (``numbers``: as
        :meth:`admit_numbered`'s). The cores hear ``n_output`` (tokens generated) and ``finish`` (how the
        response ended, :mod:`kvprof.models.finish`; None: not known) even for a request never
        admitted, as the reference's followed policies do; its shadows know none."""
        seat = self._seats.give(request)
        n_output, code = output_code(n_output), finish or UNKNOWN
        if seat < 0:
            handle.count_finish(self._address, n_output, code)
        elif self.shadow_feed is None:
            handle.finish(self._address, seat, float(now), numbers, n_blocks, n_output, code)
        else:
            self.shadow_feed.finish(seat, float(now), numbers, n_blocks, n_output, code)

    def free(self, blocks: Iterable[int], now: float) -> None:
        if self._taken:
            self._apply_taken()
        if not isinstance(blocks, (list, tuple, np.ndarray)):
            blocks = list(blocks)
        n = len(blocks)
        if n == 1:
            handle.free_one(self._address, blocks[0], float(now), self._notes_address)
        elif n:
            handle.free(self._address, np.asarray(blocks, dtype=np.int64), n, float(now), self._notes_address)
        self._size += n

    def remove(self, block: int) -> None:
        if self._taken:
            self._apply_taken()
        if not handle.remove(self._address, block):
            raise KeyError(block)
        self._size -= 1

    def evict(self, now: float) -> int:
        self._ready_to_evict(1)
        self._size -= 1
        return handle.evict_one(self._address, float(now))

    def evict_n(self, n: int, now: float) -> list[int]:
        if n == 1:  # a decode step's block: the call without an array
            return [self.evict(now)]
        if n > len(self._out):
            self._out = np.empty(max(n, 2 * len(self._out)), dtype=np.int64)
        return self._evict_into(self._out, n, now)[:n].tolist()

    def evict_n_array(self, n: int, now: float) -> np.ndarray:
        return self._evict_into(np.empty(n, dtype=np.int64), n, now)

    def _evict_into(self, out: np.ndarray, n: int, now: float) -> np.ndarray:
        if n:
            self._ready_to_evict(n)
            handle.evict_n(self._address, n, float(now), out)
            self._size -= n
        return out

    def _ready_to_evict(self, n: int) -> None:
        """Before ``n`` > 0 victims are taken: IndexError, changing nothing, if fewer are evictable; else
        the core holds what it must decide on (blocks taken back, the shadows' decisions it reads)."""
        if n > len(self):
            raise IndexError(f"{n} victims asked for, {len(self)} evictable")
        if self._taken:
            self._apply_taken()
        if self.shadow_feed is not None:
            self.shadow_feed.before_eviction()

    def order(self, now: float, limit: int | None = None) -> list[int]:
        if self._taken:
            self._apply_taken()
        n = len(self) if limit is None else min(limit, len(self))
        out = np.empty(n, dtype=np.int64)
        if n:
            if self.shadow_feed is not None:
                self.shadow_feed.before_eviction()
            handle.order(self._address, n, float(now), out)
        return out.tolist()

    def tell_output(self, n_output: int | None) -> None:
        """Tell the cores how many tokens the request whose blocks are freed next generated (None: the
        frees to come are no finished request's, e.g. a preempted one's): ``finish``'s part for them."""
        handle.count_finish(self._address, output_code(n_output), UNKNOWN)

    def safety_net(self, wait: bool = True) -> tuple[int, np.ndarray] | None:
        """``wa``'s leading candidate (its index in ``reference.order_names``) and each shadow's
        hits so far; None for a policy without a safety net. With the shadows on a thread of their
        own and not ``wait``, as of the last batch that thread finished (no wait: for metrics)."""
        if not getattr(self.reference, "_shadows", None):
            return None
        if self.shadow_feed is not None:
            if not wait:
                leader, hits = self.shadow_feed.latest()
                return int(leader), hits
            self.shadow_feed.settle()
        leader, hits = outcome(self.handle)
        return int(leader), hits

    def clear(self) -> None:
        self._content_id.clear()
        self._seats.clear()
        self._taken.clear()
        self._block_content.fill(-1)
        for table, empty in zip(self._notes, (-np.inf, 0, 0)):
            table.fill(empty)
        self._build()

    def __len__(self) -> int:
        return self._size - len(self._taken)

    def __contains__(self, block: int) -> bool:
        if self._taken:
            self._apply_taken()
        return handle.contains(self._address, block)
