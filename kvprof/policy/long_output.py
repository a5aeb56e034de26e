"""``wa``'s long-output candidate: LRU, save that the blocks of requests with long outputs go first.

The oracle and rule benchmarks (docs/results.md, issue 24) found one thing a server knows when a
request ends that says whether its chain comes back: how much it generated. On weka's agent
sessions and on Mooncake, the blocks of requests whose output was longer than the fit window's
median (or a quartile) are reused less, and evicting them first closes part of the
best-baseline-to-Belady gap where LRU or a simple order leads. The limit is tuned per capacity
(:mod:`kvprof.sim.tune`); ``wa`` follows this order only while its shadow hits most.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from itertools import chain, islice

from kvprof.policy.base import EvictionPolicy


class LongOutputLRU(EvictionPolicy):
    """Two LRU lists: blocks freed after a request that generated more than ``limit`` tokens are evicted
    first, oldest-freed first, then the others in free order.

    A block's list is set when it is freed, by the :meth:`finish` that came before the free (the
    driver finishes a request, then frees its blocks); a free with no output length known, or
    after no finish, keeps its blocks. Invariant: every evictable block is in exactly one of
    ``_long`` and ``_kept``, each in the order its blocks were freed.

    Parameters
    ----------
    limit : float
        Output tokens above which a finished request's blocks are evicted first (>= 0).
    """

    name = "long-output"

    def __init__(self, limit: float) -> None:
        if not limit >= 0 or not math.isfinite(limit):
            raise ValueError(f"limit must be a finite number of tokens >= 0, got {limit}")
        self.limit = float(limit)
        self._long: OrderedDict[int, None] = OrderedDict()
        self._kept: OrderedDict[int, None] = OrderedDict()
        self._freeing_long = False  # set by the last finish, read by the frees after it

    def access(self, block: int, now: float, workload: int = 0, depth: int = 0, *, hit: bool = False,
               next_use: float = math.inf, content: Hashable | None = None) -> None:
        """Nothing to record: the order is set by ``finish`` and ``free``."""

    def finish(self, request: Hashable, now: float, contents: Sequence[Hashable] | None = None, *,
               n_blocks: int | None = None, n_output: int | None = None) -> None:
        self._freeing_long = n_output is not None and n_output > self.limit

    def free(self, blocks: Iterable[int], now: float) -> None:
        into = self._long if self._freeing_long else self._kept
        for block in blocks:
            into[block] = None

    def remove(self, block: int) -> None:
        if block in self._long:
            del self._long[block]
        else:
            del self._kept[block]

    def evict(self, now: float) -> int:
        queue = self._long or self._kept
        if not queue:
            raise IndexError("no evictable block")
        return queue.popitem(last=False)[0]

    def order(self, now: float, limit: int | None = None) -> list[int]:
        return list(islice(chain(self._long, self._kept), limit))

    def clear(self) -> None:
        self._long.clear()
        self._kept.clear()
        self._freeing_long = False

    def __len__(self) -> int:
        return len(self._long) + len(self._kept)

    def __contains__(self, block: int) -> bool:
        return block in self._long or block in self._kept
