"""Per-class LRU lists merged on a score: the engine shared by ``wa`` and ``wa-paper``."""

from __future__ import annotations

import heapq
import math
from abc import abstractmethod
from collections.abc import Hashable, Iterable

import numpy as np

from kvprof.models.score import published_score
from kvprof.policy.base import EvictionPolicy
from kvprof.policy.fifos import Candidates, ClassFifos

#: Up to this many blocks, eviction runs the merge one head at a time and free pushes one block at
#: a time, in Python; above, numpy's fixed cost per call pays off and both run in bulk.
ONE_BY_ONE_EVICT = 64
ONE_BY_ONE_FREE = 24


class ClassedLRUPolicy(EvictionPolicy):
    """Evictable blocks in one LRU list per workload class; the lowest-keyed list head goes first.

    Invariant: an evictable block sits in exactly one class list, the one its class named when it
    was freed, and each list keeps free order. Victims only ever come off a list's front, so the
    eviction order is the greedy merge of the lists: repeatedly evict the head with the lowest
    key. Three routines compute that one merge, by cost: :meth:`evict` takes the lowest head,
    :meth:`_evict_few` pops a heap of heads for a few victims, and :meth:`_merge` places runs of
    blocks in bulk with numpy for many victims and for :meth:`order`; all rank on the same keys,
    so ``evict_n(n)`` is always ``n`` calls of ``evict()`` (a property test holds them to a
    one-head-at-a-time reference).

    Subclasses say how a block is scored and stamped and which class it keeps; that is all that
    separates ``wa`` from ``wa-paper``:

    * ``score(cls, age)``: the score, lowest evicted first, non-increasing in age. Both eviction
      paths below call this one scalar function, so they agree to the last bit (numpy's and
      libm's ``exp`` differ in the last bit on about 5% of inputs).
    * ``_key(cls, block, now)``: a block's full sort key, ``(score, ..., cls)``; the class index
      last, so no two heads are equal. Ages are ``max(now - stamp, 0)``: a stamp after ``now``
      (a clock that stepped back) counts as an access just now.
    * ``_tie_keys(blocks)``: the middle of ``_key`` as arrays, least significant first (numpy
      ``lexsort`` order), for the batched path.
    * ``stamps_allocation``: allocation stamps the last access with ``now``; otherwise with
      ``-inf`` ("never hit"). Hits always stamp ``now``.
    * ``stamps_free``: ``free`` stamps the last access with ``now``.
    * ``class_follows_hits``: a hit moves the block to the hitting request's class; otherwise
      the class of the request that allocated the block stays.

    Parameters
    ----------
    p : array_like, shape (classes,)
        Per-class probability that a block is ever reused, in [0, 1].
    lam : array_like, shape (classes,)
        Per-class reuse rate lambda, 1/s, >= 0.
    horizon : float
        Seconds ahead over which a reuse counts (H), > 0, may be ``inf``.

    The last class is the default one (``HpFile.table()`` puts it last): a block whose class
    index is outside the table, or that was never accessed, belongs to it. Blocks are small
    non-negative ints (vLLM block ids, simulator slots): per-block state lives in arrays indexed
    by block id.
    """

    stamps_allocation: bool
    stamps_free: bool
    class_follows_hits: bool

    def __init__(self, p, lam, horizon: float) -> None:
        p = np.asarray(p, dtype=float)
        lam = np.asarray(lam, dtype=float)
        if p.ndim != 1 or p.shape != lam.shape or p.size == 0:
            raise ValueError(f"p and lam must be equal-length 1-d arrays, got shapes {p.shape} and {lam.shape}")
        if not (np.all((p >= 0) & (p <= 1)) and np.all((lam >= 0) & np.isfinite(lam))):
            raise ValueError("each p must lie in [0, 1] and each lam be finite and >= 0")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0 seconds, got {horizon}")
        self.p = p
        self.lam = lam
        self.horizon = float(horizon)
        # 1 - e^(-lam H), the chance that a reuse still to come lands within H.
        # Plain float lists: the scalar score indexes them, numpy scalars would be slower.
        self._p = p.tolist()
        self._lam = lam.tolist()
        self._span = published_score(1.0, lam, 0.0, horizon).tolist()
        self._default = p.size - 1
        # The class a hit by class c gives the block (with class_follows_hits): c unless a
        # subclass keeps hit blocks in rows of their own.
        self._hit_class = list(range(p.size))
        self._fifos = ClassFifos(p.size)
        self._class = np.zeros(0, dtype=np.int64)
        self._stamp = np.zeros(0, dtype=np.float64)
        self._depth = np.zeros(0, dtype=np.int64)

    @property
    def n_classes(self) -> int:
        """Number of classes, the default one included."""
        return len(self.p)

    @abstractmethod
    def score(self, workload: int, age: float) -> float:
        """Score of a block of class ``workload`` last accessed ``age`` seconds ago (lower goes first).

        Non-increasing in age: with stamps in free order, a list's scores then rise towards its
        back and the merge has only a few runs to place.
        """

    @abstractmethod
    def _key(self, cls: int, block: int, now: float) -> tuple:
        """Sort key of ``block`` at the head of class list ``cls``; ends with ``cls``."""

    def _tie_keys(self, blocks: np.ndarray) -> tuple[np.ndarray, ...]:
        """The keys between score and class in :meth:`_key`, as arrays, least significant first."""
        return ()

    def _grow(self, block: int) -> None:
        have = len(self._stamp)
        size = max(block + 1, 2 * have, 64)
        self._class = np.concatenate([self._class, np.full(size - have, self._default, dtype=np.int64)])
        self._stamp = np.concatenate([self._stamp, np.full(size - have, -math.inf)])
        self._depth = np.concatenate([self._depth, np.zeros(size - have, dtype=np.int64)])
        self._fifos.reserve(size)

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
        if not 0 <= workload <= self._default:
            workload = self._default
        if hit:
            self._stamp[block] = now
            if self.class_follows_hits:
                self._class[block] = self._hit_class[workload]
        else:
            self._stamp[block] = now if self.stamps_allocation else -math.inf
            self._class[block] = workload
        self._depth[block] = depth

    def free(self, blocks: Iterable[int], now: float) -> None:
        blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
        if len(blocks) <= ONE_BY_ONE_FREE:
            for block in blocks:
                if block >= len(self._stamp):
                    self._grow(block)
                if self.stamps_free:
                    self._stamp[block] = now
                self._fifos.push_one(block, self._class.item(block))
            return
        blocks = np.array(blocks, dtype=np.int64)
        top = int(blocks.max())
        if top >= len(self._stamp):
            self._grow(top)
        if self.stamps_free:
            self._stamp[blocks] = now
        self._fifos.push(blocks, self._class[blocks])

    def remove(self, block: int) -> None:
        self._fifos.remove(block)

    def evict(self, now: float) -> int:
        if not len(self._fifos):
            raise IndexError("no evictable block")
        key = self._key
        best_key, block, at = min((key(cls, block, now), block, at) for cls, block, at in self._fifos.heads())
        self._fifos.take_prefix(best_key[-1], [block], at)
        return block

    def evict_n(self, n: int, now: float) -> list[int]:
        return self._evict_few(n, now) if n <= ONE_BY_ONE_EVICT else self.evict_n_array(n, now).tolist()

    def evict_n_array(self, n: int, now: float) -> np.ndarray:
        if n <= ONE_BY_ONE_EVICT:
            return np.array(self._evict_few(n, now), dtype=np.int64)
        if n > len(self._fifos):
            raise IndexError(f"{n} victims asked for, {len(self._fifos)} evictable")
        candidates = self._fifos.front(n)
        picked = self._merge(candidates, n, now)
        self._fifos.take(candidates, picked)
        return candidates.blocks[picked]

    def order(self, now: float) -> list[int]:
        if not len(self._fifos):
            return []
        candidates = self._fifos.front(len(self._fifos))
        return candidates.blocks[self._merge(candidates, len(self._fifos), now)].tolist()

    def _evict_few(self, n: int, now: float) -> list[int]:
        """Evict ``n`` blocks by the greedy merge itself: a heap of list heads, one pop each."""
        if n > len(self._fifos):
            raise IndexError(f"{n} victims asked for, {len(self._fifos)} evictable")
        if n <= 1:
            return [self.evict(now)] if n == 1 else []  # one: decode's call, the most frequent
        key, fifos = self._key, self._fifos
        heap = [(key(cls, block, now), block, at) for cls, block, at in fifos.heads()]
        heapq.heapify(heap)
        victims = []
        taken: dict[int, list[int]] = {}  # class -> its victims, a prefix of its list
        last: dict[int, int] = {}  # class -> buffer position of its last victim
        rows = {}  # class -> the rest of its list, opened once its head is taken
        while len(victims) < n:
            head_key, block, at = heap[0]
            cls = head_key[-1]
            victims.append(block)
            taken.setdefault(cls, []).append(block)
            if cls not in rows:
                rows[cls] = fifos.row_after(cls, at)
            following = next(rows[cls], None)
            if following is None:
                heapq.heappop(heap)
                rows[cls] = iter(())
            else:
                heapq.heapreplace(heap, (key(cls, following[0], now), *following))
            last[cls] = at
        for cls, blocks in taken.items():
            fifos.take_prefix(cls, blocks, last[cls])
        return victims

    def _merge(self, candidates: Candidates, n: int, now: float):
        """Which ``n`` candidates the greedy merge evicts, in order (indices or a slice).

        Only the first ``n`` blocks of each list can be among them. Blocks freed together share
        a stamp and so a score: the merge scores *runs* of them. When each list's scores ascend
        and no two lists share a score (the rule: stamps follow free order), every run leaves
        whole and the merge is the runs sorted by score. Otherwise (a list that does not ascend,
        equal scores in two lists: p = 0, e^(-lam a) underflowing) it ranks blocks on the full key.
        """
        blocks, classes = candidates.blocks, candidates.classes
        if classes[0] == classes[-1]:  # one list: its own order
            return slice(0, n)
        stamps = self._stamp[blocks]
        new_run = np.empty(len(blocks), dtype=bool)
        new_run[0] = True
        np.not_equal(stamps[1:], stamps[:-1], out=new_run[1:])
        new_run[1:] |= classes[1:] != classes[:-1]
        starts = np.flatnonzero(new_run)
        lengths = np.diff(starts, append=len(blocks))
        run_class = classes[starts]
        score = self.score
        ages = np.maximum(now - stamps[starts], 0.0).tolist()
        run_score = np.array([score(c, age) for c, age in zip(run_class.tolist(), ages)])
        by_key = np.lexsort((run_class, run_score))
        if self._needs_ranks(run_class, run_score, by_key):
            return np.argsort(self._ranks(blocks, classes, np.repeat(run_score, lengths)), kind="stable")[:n]
        ends = np.cumsum(lengths[by_key])
        used = int(np.searchsorted(ends, n)) + 1
        runs = by_key[:used]
        taken = lengths[runs]
        taken[-1] -= ends[used - 1] - n
        return np.repeat(starts[runs] - (ends[:used] - lengths[runs]), taken) + np.arange(n)

    @staticmethod
    def _needs_ranks(run_class, run_score, by_key) -> bool:
        """Whether sorting runs by score is not the merge: a list's scores drop, or two lists tie."""
        same_list = run_class[1:] == run_class[:-1]
        if (same_list & (run_score[1:] < run_score[:-1])).any():
            return True
        first = run_score[by_key]
        tied = first[1:] == first[:-1]
        return bool(tied.any() and (run_class[by_key][1:] != run_class[by_key][:-1])[tied].any())

    def _ranks(self, blocks, classes, scores) -> np.ndarray:
        """Each block's running maximum, within its list, of its rank on the full key.

        A block leaves the greedy merge right after the block that set its running maximum, so
        a stable sort on these ranks is the merge.
        """
        rank = np.empty(len(blocks), dtype=np.int64)
        rank[np.lexsort((classes, *self._tie_keys(blocks), scores))] = np.arange(len(blocks))
        # Lists are contiguous and in class order: lifting each by its class makes one running
        # maximum restart at every list.
        lift = classes * len(blocks)
        return np.maximum.accumulate(rank + lift) - lift

    def clear(self) -> None:
        self._fifos.clear()
        self._class[:] = self._default
        self._stamp[:] = -math.inf
        self._depth[:] = 0

    def __len__(self) -> int:
        return len(self._fifos)

    def __contains__(self, block: int) -> bool:
        return block in self._fifos
