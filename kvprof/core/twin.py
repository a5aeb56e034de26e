"""A compiled policy behind the :class:`~kvprof.policy.base.EvictionPolicy` interface.

What drivers that speak the interface run (the vLLM adaptor, the differential tests): one
compiled call per protocol call, by address (:mod:`kvprof.core.handle`, ~0.15 us a call), with
batch forms for what vLLM does in batches (a chain of accesses, removals on prefix hits). The
simulator's compiled engine drives the core directly instead.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from kvprof.core import handle
from kvprof.core.build import compile_policy
from kvprof.policy.base import EvictionPolicy


class CompiledTwin(EvictionPolicy):
    """The compiled twin of a fresh reference policy, same name, same decisions.

    Invariants: ``_content_id`` numbers the contents seen so far densely (the core keys its
    ghosts and shadows by content number), so two contents are equal here exactly when they
    are equal for the reference; ``_taken`` lists blocks taken back with :meth:`take` that the
    core still holds as evictable, and every method that reaches the core hands them to it
    first, so the core sees the same operations in the same order as the reference would;
    ``_size`` is the number of evictable blocks (the core's count less ``_taken``), kept here
    because every change of it passes through this class.

    Parameters
    ----------
    reference : EvictionPolicy
        A fresh instance of a class with a twin (:data:`kvprof.core.build.TWINS`); kept as
        :attr:`reference`, only read (:meth:`clear` compiles it again).
    n_blocks : int
        Block ids expected, to size the tables once (they grow past it if needed).
    """

    def __init__(self, reference: EvictionPolicy, n_blocks: int = 0) -> None:
        self.name = reference.name
        self.keyed_by = reference.keyed_by
        self.reference = reference
        self._n_blocks = n_blocks
        self._content_id: dict[Hashable, int] = {}
        self._taken: list[int] = []
        #: ``take(block)``: :meth:`remove` of a block the caller knows is evictable, applied
        #: before the next call that reaches the core (vLLM takes back a free block on every
        #: prefix hit: one list append here instead of a compiled call each). A block that was
        #: not evictable raises KeyError at that next call. Bound to the list, so no Python frame.
        self.take = self._taken.append
        self._out = np.empty(max(n_blocks, 16), dtype=np.int64)
        self._build()

    def _build(self) -> None:
        self.handle = compile_policy(self.reference, self._n_blocks)
        self._address = handle.address_of(self.handle)  # valid while self.handle lives
        self._size = 0

    def _apply_taken(self) -> None:
        taken = np.array(self._taken, dtype=np.int64)
        self._taken.clear()
        first_absent = handle.remove_n(self._address, taken, len(taken))
        self._size = handle.size(self._address)
        if first_absent >= 0:
            raise KeyError(f"block {taken[first_absent]} was taken back but was not evictable")

    def _contents(self, contents: Iterable[Hashable | None]) -> list[int]:
        ids = self._content_id
        return [-1 if c is None else ids.setdefault(c, len(ids)) for c in contents]

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
        if self._taken:
            self._apply_taken()
        content_id = -1 if content is None else self._content_id.setdefault(content, len(self._content_id))
        handle.access(self._address, block, float(now), workload, depth, hit, float(next_use), content_id)

    def access_chain(self, blocks: Sequence[int], depths: Sequence[int], contents: Sequence[Hashable | None],
                     now: float, workload: int, *, hit: bool) -> None:
        """``access(blocks[i], now, workload, depths[i], hit=hit, content=contents[i])`` for each
        ``i`` in order, in one compiled call."""
        if self._taken:
            self._apply_taken()
        n = len(blocks)
        if n:
            handle.access_n(self._address, np.array(blocks, dtype=np.int64), np.array(depths, dtype=np.int64),
                            np.array(self._contents(contents), dtype=np.int64), n, float(now), workload, hit)

    def free(self, blocks: Iterable[int], now: float) -> None:
        if self._taken:
            self._apply_taken()
        if not isinstance(blocks, (list, tuple, np.ndarray)):
            blocks = list(blocks)
        n = len(blocks)
        if n == 1:
            handle.free_one(self._address, blocks[0], float(now))
        elif n:
            handle.free(self._address, np.asarray(blocks, dtype=np.int64), n, float(now))
        self._size += n

    def remove(self, block: int) -> None:
        if self._taken:
            self._apply_taken()
        if not handle.remove(self._address, block):
            raise KeyError(block)
        self._size -= 1

    def evict(self, now: float) -> int:
        return self.evict_n(1, now)[0]

    def evict_n(self, n: int, now: float) -> list[int]:
        if n > len(self._out):
            self._out = np.empty(max(n, 2 * len(self._out)), dtype=np.int64)
        return self._evict_into(self._out, n, now)[:n].tolist()

    def evict_n_array(self, n: int, now: float) -> np.ndarray:
        return self._evict_into(np.empty(n, dtype=np.int64), n, now)

    def _evict_into(self, out: np.ndarray, n: int, now: float) -> np.ndarray:
        if n > len(self):
            raise IndexError(f"{n} victims asked for, {len(self)} evictable")
        if n:
            if self._taken:
                self._apply_taken()
            handle.evict_n(self._address, n, float(now), out)
            self._size -= n
        return out

    def order(self, now: float, limit: int | None = None) -> list[int]:
        if self._taken:
            self._apply_taken()
        n = len(self) if limit is None else min(limit, len(self))
        out = np.empty(n, dtype=np.int64)
        if n:
            handle.order(self._address, n, float(now), out)
        return out.tolist()

    def clear(self) -> None:
        self._content_id.clear()
        self._taken.clear()
        self._build()

    def __len__(self) -> int:
        return self._size - len(self._taken)

    def __contains__(self, block: int) -> bool:
        if self._taken:
            self._apply_taken()
        return handle.contains(self._address, block)
