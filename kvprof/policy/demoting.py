"""Two LRU lists, one evicted first: the shape of ``wa``'s candidates that demote whole requests.

``long-output`` demotes the blocks of requests that generated a long output, ``first-turn`` those of
requests that began their session; each sets :attr:`DemotingLRU._demoting` before a free, by its own
rule, and the lists are kept here once.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from itertools import chain, islice

from kvprof.policy.base import EvictionPolicy


class DemotingLRU(EvictionPolicy):
    """Blocks freed while ``_demoting`` is set are evicted first, oldest-freed first, then the others
    in free order. A subclass sets ``_demoting`` before each free (at the ``finish`` before it, or in
    ``free`` itself); it starts unset.

    Invariant: every evictable block is in exactly one of ``_demoted`` and ``_kept``, each in the
    order its blocks were freed.
    """

    def __init__(self) -> None:
        self._demoted: OrderedDict[int, None] = OrderedDict()
        self._kept: OrderedDict[int, None] = OrderedDict()
        self._demoting = False

    def access(self, block: int, now: float, workload: int = 0, depth: int = 0, *, hit: bool = False,
               next_use: float = math.inf, content: Hashable | None = None) -> None:
        """Nothing to record: the order is set by the frees."""

    def free(self, blocks: Iterable[int], now: float) -> None:
        into = self._demoted if self._demoting else self._kept
        for block in blocks:
            into[block] = None

    def remove(self, block: int) -> None:
        if block in self._demoted:
            del self._demoted[block]
        else:
            del self._kept[block]

    def evict(self, now: float) -> int:
        queue = self._demoted or self._kept
        if not queue:
            raise IndexError("no evictable block")
        return queue.popitem(last=False)[0]

    def order(self, now: float, limit: int | None = None) -> list[int]:
        return list(islice(chain(self._demoted, self._kept), limit))

    def clear(self) -> None:
        self._demoted.clear()
        self._kept.clear()
        self._demoting = False

    def __len__(self) -> int:
        return len(self._demoted) + len(self._kept)

    def __contains__(self, block: int) -> bool:
        return block in self._demoted or block in self._kept
