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

from kvprof.models.learned import LearnedModel, gap_bin, log_bin
from kvprof.policy.base import EvictionPolicy
from kvprof.policy.orders import tier_of


class FreeFeatures:
    """What a freed block's features need, kept per block since its allocation (no history of
    contents that left the pool): its cell, depth and hits at its latest access, the turn of the
    chain it was left the tail (or the tail's parent) of and when, the block that last continued
    past it and how often that changed. The parent counts because a prompt's last block is
    usually partial: the next turn's prompt holds it with more tokens, another content.

    Invariant: for every block accessed since it was last allocated, ``cell``, ``depth`` and
    ``hits`` are those of its latest access; ``turn[b]`` and ``tail_at[b]`` are the turn and the
    time of the latest free since then that left ``b`` the deepest block of its call or one
    above it (absent: none did); ``child[b]`` is the block one deeper than ``b`` in the latest free call holding
    both, and ``fanout[b]`` how many frees since the allocation found a child different from the one before.
    """

    def __init__(self, n_cells: int, n_tiers: int) -> None:
        self.n_cells, self.n_tiers = n_cells, n_tiers
        self.cell: dict[int, int] = {}
        self.depth: dict[int, int] = {}
        self.hits: dict[int, int] = {}
        self.turn: dict[int, int] = {}
        self.tail_at: dict[int, float] = {}
        self.child: dict[int, int] = {}
        self.fanout: dict[int, int] = {}

    def access(self, block: int, workload: int, depth: int, hit: bool) -> None:
        self.cell[block] = workload if 0 <= workload < self.n_cells else self.n_cells - 1
        self.depth[block] = depth
        if hit:
            self.hits[block] = self.hits.get(block, 0) + 1
            return
        self.hits[block] = 0  # allocated anew: what the block's former content did is forgotten
        for chain_state in (self.turn, self.tail_at, self.child, self.fanout):
            chain_state.pop(block, None)

    def chain_turn(self, blocks: list[int], tail: int, now: float) -> tuple[int, float]:
        """The turn of the chain one free call ends and the seconds since its previous turn (-1: none).

        The previous tail is the call's block of the latest turn (the first on a tie); the call
        extends it unless it is the call's own tail (the chain freed again, not extended)."""
        previous, previous_turn = -1, 0
        for block in blocks:
            if self.turn.get(block, 0) > previous_turn:
                previous, previous_turn = block, self.turn[block]
        if previous < 0:
            return 1, -1.0
        return previous_turn + (previous != tail), now - self.tail_at[previous]

    def _count_children(self, blocks: list[int]) -> None:
        """Each block's child in the call is its neighbour in the list one deeper (either side)."""
        depth = self.depth
        for i, block in enumerate(blocks):
            wanted = depth.get(block, 0) + 1
            for j in (i - 1, i + 1):
                if 0 <= j < len(blocks) and depth.get(blocks[j], 0) == wanted:
                    if self.child.get(block, -1) != blocks[j]:
                        self.child[block] = blocks[j]
                        self.fanout[block] = self.fanout.get(block, 0) + 1
                    break

    def of_free(self, blocks: list[int], now: float) -> list[tuple[int, ...]]:
        """The feature bins (:data:`~kvprof.models.learned.FEATURES` order) of each block of one free
        call, recording the call: its tail's turn and the children it shows."""
        if not blocks:
            return []
        depth = self.depth
        deepest = max(depth.get(b, 0) for b in blocks)
        tail = next(b for b in blocks if depth.get(b, 0) == deepest)
        turn, gap = self.chain_turn(blocks, tail, now)
        self._count_children(blocks)
        for block in blocks:  # the tail and its parent: a prompt's last block is partial, so the next turn
            if depth.get(block, 0) >= deepest - 1:  # continues past the parent, not the tail
                self.turn[block], self.tail_at[block] = turn, now
        turn_bin, gap_bin_ = log_bin(turn), gap_bin(gap)
        return [(self.cell.get(b, self.n_cells - 1), min(tier_of(self.hits.get(b, 0)), self.n_tiers - 1),
                 log_bin(depth.get(b, 0)), log_bin(deepest - depth.get(b, 0)), turn_bin, gap_bin_,
                 log_bin(self.fanout.get(b, 0))) for b in blocks]

    def clear(self) -> None:
        for state in (self.cell, self.depth, self.hits, self.turn, self.tail_at, self.child, self.fanout):
            state.clear()


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
        self._tables = model.tables()
        self._lists: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(model.n_buckets)]
        self._bucket: dict[int, int] = {}
        self._freed_at: dict[int, float] = {}

    def access(self, block: int, now: float, workload: int = 0, depth: int = 0, *, hit: bool = False,
               next_use: float = math.inf, content: Hashable | None = None) -> None:
        self._features.access(block, workload, depth, hit)

    def bucket(self, *bins: int) -> int:
        """The bucket of a block with these feature bins (:data:`~kvprof.models.learned.FEATURES`
        order): how many edges its log-odds reach."""
        log_odds = self.model.bias
        for table, k in zip(self._tables, bins):
            log_odds += table[k]
        return sum(1 for edge in self._edges if log_odds >= edge)

    def free(self, blocks: Iterable[int], now: float) -> None:
        blocks = blocks if isinstance(blocks, list) else list(blocks)
        for block, features in zip(blocks, self._features.of_free(blocks, now)):
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
