"""``wa``'s learned candidate: evict what Belady would have evicted, as a fitted predictor says.

The predictor (:class:`kvprof.models.learned.LearnedModel`) was trained on the fit window by
replaying it under Belady and labelling each freed block by whether Belady's cache still held it
at its next use (Hawkeye's OPT labels). Here each freed block is put in a bucket by its
predicted probability; eviction takes, among the buckets' oldest blocks, the one freed longest
ago, a block of bucket ``k`` counted as freed ``k * credit_s`` later: predicted cache-averse
blocks go first, each bucket in LRU order, and a predicted friendly block idle past its credit
goes before fresher averse ones.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable
import heapq
from itertools import islice

from kvprof.models.learned import LearnedModel, log_bin
from kvprof.policy.base import EvictionPolicy
from kvprof.policy.orders import tier_of


class FreeFeatures:
    """What a freed block's features need, recorded at each access: its cell, depth and hits since allocation.

    Invariant: for every block accessed since it was last allocated, ``cell``, ``depth`` and
    ``hits`` are those of its latest access.
    """

    def __init__(self, n_cells: int, n_tiers: int) -> None:
        self.n_cells, self.n_tiers = n_cells, n_tiers
        self.cell: dict[int, int] = {}
        self.depth: dict[int, int] = {}
        self.hits: dict[int, int] = {}

    def access(self, block: int, workload: int, depth: int, hit: bool) -> None:
        self.cell[block] = workload if 0 <= workload < self.n_cells else self.n_cells - 1
        self.depth[block] = depth
        self.hits[block] = self.hits.get(block, 0) + 1 if hit else 0

    def of_free(self, blocks: list[int]) -> list[tuple[int, int, int, int]]:
        """(cell, tier, depth bin, tail-distance bin) of each block of one free call."""
        depth = self.depth
        deepest = max((depth.get(b, 0) for b in blocks), default=0)
        return [(self.cell.get(b, self.n_cells - 1), min(tier_of(self.hits.get(b, 0)), self.n_tiers - 1),
                 log_bin(depth.get(b, 0)), log_bin(deepest - depth.get(b, 0))) for b in blocks]

    def clear(self) -> None:
        self.cell.clear()
        self.depth.clear()
        self.hits.clear()


class LearnedPolicy(EvictionPolicy):
    """Buckets by predicted probability of Belady keeping the block; LRU with a credit per bucket.

    Invariant: ``_bucket`` maps each evictable block to the bucket whose list holds it; each
    list is in free order (a free call's blocks in the order given, tail first), so its head has
    the lowest key ``freed_at + bucket * credit_s`` of the list.

    Parameters
    ----------
    model : LearnedModel
        Its cell weights index ``access``'s ``workload`` (the hp file's cells, the default last).
    """

    name = "learned"
    keyed_by = "cell"

    def __init__(self, model: LearnedModel) -> None:
        self.model = model
        self._features = FreeFeatures(len(model.cell), len(model.tier))
        self._edges = [float(e) for e in model.log_odds_edges()]
        self._lists: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(model.n_buckets)]
        self._bucket: dict[int, int] = {}
        self._freed_at: dict[int, float] = {}

    def access(self, block: int, now: float, workload: int = 0, depth: int = 0, *, hit: bool = False,
               next_use: float = math.inf, content: Hashable | None = None) -> None:
        self._features.access(block, workload, depth, hit)

    def bucket(self, cell: int, tier: int, depth_bin: int, tail_bin: int) -> int:
        """The bucket of a block with these feature bins: how many edges its log-odds reach."""
        m = self.model
        log_odds = m.bias + m.cell[cell] + m.tier[tier] + m.depth[depth_bin] + m.tail[tail_bin]
        return sum(1 for edge in self._edges if log_odds >= edge)

    def free(self, blocks: Iterable[int], now: float) -> None:
        blocks = blocks if isinstance(blocks, list) else list(blocks)
        for block, features in zip(blocks, self._features.of_free(blocks)):
            bucket = self.bucket(*features)
            self._bucket[block] = bucket
            self._freed_at[block] = now
            self._lists[bucket][block] = None

    def remove(self, block: int) -> None:
        bucket = self._bucket.pop(block)
        del self._lists[bucket][block]

    def _key(self, bucket: int, block: int) -> float:
        return self._freed_at[block] + bucket * self.model.credit_s

    def evict(self, now: float) -> int:
        heads = [(self._key(k, next(iter(queue))), k) for k, queue in enumerate(self._lists) if queue]
        if not heads:
            raise IndexError("no evictable block")
        block = self._lists[min(heads)[1]].popitem(last=False)[0]
        del self._bucket[block], self._freed_at[block]
        return block

    def order(self, now: float, limit: int | None = None) -> list[int]:
        merged = heapq.merge(*([(self._key(k, block), k, i, block) for i, block in enumerate(queue)]
                               for k, queue in enumerate(self._lists)))
        return [entry[3] for entry in islice(merged, limit)]

    def clear(self) -> None:
        self._features.clear()
        for queue in self._lists:
            queue.clear()
        self._bucket.clear()
        self._freed_at.clear()

    def __len__(self) -> int:
        return len(self._bucket)

    def __contains__(self, block: int) -> bool:
        return block in self._bucket
