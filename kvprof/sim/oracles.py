"""Oracle policies: an order told one fact about the future, to measure what predicting it is worth.

Each oracle is a base order (LRU, or any other policy) plus one fact about the future at each free,
read from the evaluation window itself (:class:`Future`). A freed block the fact says will not be
wanted goes to a *demoted* pool that is evicted first; the others go to the base policy, which
orders them as it always does and is asked for victims only when the demoted pool is empty. The
facts (measured in docs/results.md, "Where the headroom to Belady is"):

* ``continues``: the session of the request that frees the block sends its next request within
  the horizon ``H`` after the free (the freed chain is extended again soon); demoted otherwise,
  oldest-freed first.
* ``when``: the same fact with ``H = 0`` (only a session whose next request has already arrived
  keeps its blocks in the base order), the demoted ones ordered by when the session sends its next
  request, the latest (never: infinity) first: Belady on session arrivals instead of block uses.
* ``shared``: a later request of *another* session uses the block (a shared prefix); a block only
  its own session (or nobody) will use again is demoted, oldest-freed first.
* ``belady``: Belady's own decision: the block was evicted by Belady (same window, same capacity)
  after this free and before its next use; demoted, oldest-freed first.
* ``belady-exact``: the same, demoted blocks in the order Belady evicted them; this reproduces
  Belady's replay step for step (tests/test_oracles.py), the check that the decisions are read right.

Sessions come from the trace's ``parent_chat_id`` where it has one (Bailian, weka), else are
inferred from the block-hash chains (:func:`infer_sessions`: Mooncake).

The replay runs on the Python engine, on :class:`AccessIndexed` workloads: where the simulator
passes a block's next use to ``access``, it passes the access's index, and the policies here look
their facts up from it (the base policies are told ``next_use = inf``, as no online policy reads it).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, fields

import numpy as np

from kvprof.policy import make_policy
from kvprof.policy.base import EvictionPolicy
from kvprof.policy.belady import BeladyPolicy
from kvprof.policy.lru import LRUPolicy
from kvprof.profiler import turns
from kvprof.profiler.reuse import next_access
from kvprof.profiler.trace import Trace
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.metrics import RunMetrics
from kvprof.sim.sample import chain_roots
from kvprof.sim.workload import Workload

#: The oracles, in the order tables show them.
ORACLES = ("continues", "when", "shared", "belady", "belady-exact")


class AccessIndexed(Workload):
    """A workload whose ``next_use`` column holds each access's index instead of its next use.

    The replay passes ``next_use[k]`` to ``policy.access`` for access ``k``; the policies of this
    module read the index and look their facts up in a :class:`Future` (or, for Belady, the real
    next use). Everything else is the workload it was made from.
    """

    @classmethod
    def of(cls, workload: Workload) -> AccessIndexed:
        return cls(**{f.name: getattr(workload, f.name) for f in fields(workload)})

    @property
    def next_use(self) -> np.ndarray:
        return np.arange(self.n_accesses, dtype=np.float64)


def infer_sessions(workload: Workload) -> np.ndarray:
    """Sessions of a trace without a session field, from its block chains (int64, (n,)):
    :func:`kvprof.profiler.turns.infer_sessions` of the workload's chains."""
    return turns.infer_sessions(workload.offsets, workload.block)


def sessions_of(trace: Trace, workload: Workload) -> np.ndarray:
    """Each request's session: the trace's conversation where it has parents, else inferred."""
    if (trace.parent_chat_id >= 0).any():
        return chain_roots(trace)
    return infer_sessions(workload)


@dataclass(frozen=True, eq=False)
class Future:
    """What the oracles may be told, computed once from the evaluation window.

    Invariants: per request ``r``, ``next_arrival[r]`` is the arrival of the next request of the
    same session after ``r`` (``inf`` if none in the window); per access ``k``, ``next_use[k]``
    is the arrival of the next later request using the same block (``inf`` if none) and
    ``shared[k]`` whether some later request of another session uses it.
    """

    owner: np.ndarray  # int64 (m,): the request of each access
    session: np.ndarray  # int64 (n,)
    next_arrival: np.ndarray  # float64 (n,)
    next_use: np.ndarray  # float64 (m,)
    shared: np.ndarray  # bool (m,)

    @classmethod
    def of(cls, workload: Workload, session: np.ndarray) -> Future:
        session = np.asarray(session, dtype=np.int64)
        n = workload.n_requests
        owner = np.repeat(np.arange(n, dtype=np.int64), np.diff(workload.offsets))
        order = np.argsort(session, kind="stable")  # by session, arrival order within one
        same = session[order][1:] == session[order][:-1]
        next_arrival = np.full(n, np.inf)
        next_arrival[order[:-1][same]] = workload.arrival[order[1:][same]]
        block = workload.block
        nxt = next_access(block, owner)
        next_use = np.full(block.shape[0], np.inf)
        next_use[nxt >= 0] = workload.arrival[owner[nxt[nxt >= 0]]]
        return cls(owner, session, next_arrival, next_use, _shared_later(block, session[owner]))


def _shared_later(block: np.ndarray, session: np.ndarray) -> np.ndarray:
    """Whether a later access of each access's block comes from another session (bool, (m,))."""
    order = np.lexsort((np.arange(block.shape[0]), block))  # by block, access order within one
    shared = np.zeros(block.shape[0], dtype=bool)
    blocks, sessions = block[order].tolist(), session[order].tolist()
    later_sessions: tuple[int, int] | None = None  # (min, max) session after the current position
    for i in range(len(order) - 1, -1, -1):
        if i + 1 == len(order) or blocks[i + 1] != blocks[i]:
            later_sessions = None
        s = sessions[i]
        if later_sessions is not None:
            shared[order[i]] = later_sessions != (s, s)
            later_sessions = (min(later_sessions[0], s), max(later_sessions[1], s))
        else:
            later_sessions = (s, s)
    return shared


class ToldPolicy(EvictionPolicy):
    """A base policy plus a demoted pool that is evicted first: an oracle's order.

    Invariant: every evictable block is in exactly one of the two: the base policy, or
    ``_demoted`` (one live heap entry per block, its key ``_live[block]``; dead entries are
    skipped). ``evict`` takes the demoted pool's smallest key while it has one, then the base's
    victim. ``verdict`` decides at each free; it sees the block's latest access index, the request
    that frees it and the time.
    """

    offline = True

    def __init__(self, base: EvictionPolicy, name: str):
        self.base = base
        self.name = name
        self.keyed_by = base.keyed_by
        self._latest: dict[int, int] = {}  # block -> index of its latest access
        self._freeing = -1  # the request whose blocks the next free releases
        self._demoted: list[tuple[float, int, int]] = []  # (key, free seq, block)
        self._live: dict[int, tuple[float, int]] = {}
        self._freed = 0

    def verdict(self, access: int, request: int, now: float) -> float | None:
        """None: keep in the base order; a number: demote, evicted before larger keys."""
        raise NotImplementedError

    def access(self, block: int, now: float, workload: int = 0, depth: int = 0, *, hit: bool = False,
               next_use: float = math.inf, content: Hashable | None = None) -> None:
        self._latest[block] = int(next_use)  # the access index (AccessIndexed)
        self.base.access(block, now, workload, depth, hit=hit, content=content)

    def admit(self, request, contents, now, workload=0, *, n_lookup=None, n_blocks=None) -> None:
        self.base.admit(request, contents, now, workload, n_lookup=n_lookup, n_blocks=n_blocks)

    def finish(self, request, now, contents=None, *, n_blocks=None, n_output=None) -> None:
        self._freeing = request
        self.base.finish(request, now, contents, n_blocks=n_blocks, n_output=n_output)

    def free(self, blocks: Iterable[int], now: float) -> None:
        kept = []
        for block in blocks:
            key = self.verdict(self._latest[block], self._freeing, now)
            if key is None:
                kept.append(block)
                continue
            self._freed += 1
            self._live[block] = (key, self._freed)
            heapq.heappush(self._demoted, (key, self._freed, block))
        if kept:
            self.base.free(kept, now)

    def remove(self, block: int) -> None:
        if self._live.pop(block, None) is None:
            self.base.remove(block)

    def evict(self, now: float) -> int:
        heap, live = self._demoted, self._live
        while heap:
            key, seq, block = heapq.heappop(heap)
            if live.get(block) == (key, seq):
                del live[block]
                return block
        return self.base.evict(now)

    def clear(self) -> None:
        self.base.clear()
        self._latest.clear()
        self._demoted.clear()
        self._live.clear()

    def __len__(self) -> int:
        return len(self._live) + len(self.base)

    def __contains__(self, block: int) -> bool:
        return block in self._live or block in self.base


class Continues(ToldPolicy):
    """Demotes a block whose session sends no request within ``horizon`` seconds of the free."""

    def __init__(self, base: EvictionPolicy, future: Future, horizon: float):
        super().__init__(base, f"continues+{base.name}")
        self.next_arrival = future.next_arrival.tolist()
        self.horizon = horizon

    def verdict(self, access, request, now):
        return None if self.next_arrival[request] <= now + self.horizon else self._freed


class When(ToldPolicy):
    """Demotes a block whose session's next request has not arrived, latest next arrival first."""

    def __init__(self, base: EvictionPolicy, future: Future):
        super().__init__(base, f"when+{base.name}")
        self.next_arrival = future.next_arrival.tolist()

    def verdict(self, access, request, now):
        arrival = self.next_arrival[request]
        return None if arrival <= now else -arrival


class Shared(ToldPolicy):
    """Demotes a block no later request of another session uses."""

    def __init__(self, base: EvictionPolicy, future: Future):
        super().__init__(base, f"shared+{base.name}")
        self.shared = future.shared.tolist()

    def verdict(self, access, request, now):
        return None if self.shared[access] else self._freed


class BeladyTold(ToldPolicy):
    """Demotes a block Belady evicted between this free and its next use: oldest-freed first, or
    (``exact``) in Belady's own eviction order."""

    def __init__(self, base: EvictionPolicy, evicted_seq: np.ndarray, exact: bool = False):
        super().__init__(base, f"belady{'-exact' if exact else ''}+{base.name}")
        self.evicted_seq = evicted_seq.tolist()
        self.exact = exact

    def verdict(self, access, request, now):
        seq = self.evicted_seq[access]
        if seq < 0:
            return None
        return seq if self.exact else self._freed


class BeladyRecorder(BeladyPolicy):
    """Belady on an :class:`AccessIndexed` replay, recording which access each victim last had.

    ``evicted_seq[k]`` is the position in Belady's eviction sequence of the eviction that ended
    the stay begun by access ``k`` (-1: that stay ended in a hit or the window's end); ``hit[k]``
    whether access ``k`` was a hit.
    """

    name = "belady"

    def __init__(self, next_use: np.ndarray):
        super().__init__()
        self.future_use = next_use.tolist()
        self.evicted_seq = np.full(len(self.future_use), -1, dtype=np.int64)
        self.hit = np.zeros(len(self.future_use), dtype=bool)
        self._latest: dict[int, int] = {}
        self._evictions = 0

    def access(self, block, now, workload=0, depth=0, *, hit=False, next_use=math.inf, content=None) -> None:
        index = int(next_use)
        self._latest[block] = index
        self.hit[index] = hit
        super().access(block, now, workload, depth, hit=hit, next_use=self.future_use[index], content=content)

    def evict(self, now: float) -> int:
        block = super().evict(now)
        self.evicted_seq[self._latest[block]] = self._evictions
        self._evictions += 1
        return block


class EvictionAges(LRUPolicy):
    """LRU, recording how long each victim had been evictable (its age at eviction)."""

    def __init__(self) -> None:
        super().__init__()
        self._freed_at: dict[int, float] = {}
        self.ages: list[float] = []

    def free(self, blocks, now):
        blocks = list(blocks)
        for block in blocks:
            self._freed_at[block] = now
        super().free(blocks, now)

    def evict(self, now):
        block = super().evict(now)
        self.ages.append(now - self._freed_at[block])
        return block

    def evict_n(self, n, now):
        if n > len(self):
            raise IndexError(f"{n} victims asked for, {len(self)} evictable")
        return [self.evict(now) for _ in range(n)]

    def horizon(self) -> float:
        """The median age at eviction (``inf`` if nothing was evicted): LRU's characteristic time."""
        return float(np.median(self.ages)) if self.ages else math.inf


def replay(workload: AccessIndexed, policy: EvictionPolicy, capacity: int, config: SimConfig) -> RunMetrics:
    """One Python-engine replay of an access-indexed workload."""
    return simulate(workload, policy, capacity, config, engine="python")


@dataclass(frozen=True)
class Reference:
    """What the oracles of one capacity are told, from a Belady and an LRU replay of the window."""

    capacity: int
    horizon: float  # LRU's median age at eviction, seconds
    evicted_seq: np.ndarray  # BeladyRecorder.evicted_seq
    lru: float  # token hit ratios of the two replays (Python engine)
    belady: float


def reference(workload: AccessIndexed, future: Future, capacity: int, config: SimConfig) -> Reference:
    ages = EvictionAges()
    lru = replay(workload, ages, capacity, config)
    recorder = BeladyRecorder(future.next_use)
    belady = replay(workload, recorder, capacity, config)
    return Reference(capacity, ages.horizon(), recorder.evicted_seq, lru.token_hit_ratio, belady.token_hit_ratio)


def make_oracle(name: str, base: EvictionPolicy, future: Future, ref: Reference) -> ToldPolicy:
    """The oracle ``name`` (one of :data:`ORACLES`) over ``base``, told from ``future`` and ``ref``."""
    if name == "continues":
        return Continues(base, future, ref.horizon)
    if name == "when":
        return When(base, future)
    if name == "shared":
        return Shared(base, future)
    if name in ("belady", "belady-exact"):
        return BeladyTold(base, ref.evicted_seq, exact=name == "belady-exact")
    raise ValueError(f"unknown oracle {name!r}; known: {', '.join(ORACLES)}")


def run_oracle(workload: AccessIndexed, future: Future, ref: Reference, name: str, base: str, hp,
               config: SimConfig) -> RunMetrics:
    """Replay the oracle ``name`` over a fresh ``base`` policy at ``ref``'s capacity."""
    policy = make_oracle(name, make_policy(base, hp, ref.capacity), future, ref)
    return replay(workload, policy, ref.capacity, config)



def reference_task(shared: tuple, capacity: int) -> Reference:
    """:func:`reference` as a :func:`kvprof.parallel.run_tasks` task; ``shared`` is
    ``(workload, future, hp, config)``."""
    workload, future, _, config = shared
    return reference(workload, future, capacity, config)


def oracle_task(shared: tuple, name: str, base: str, capacity: int) -> float:
    """The token hit ratio of oracle ``name`` over ``base`` at ``capacity`` (a run_tasks task);
    ``shared`` is ``(workload, future, hp, config, {capacity: Reference})``."""
    workload, future, hp, config, references = shared
    return run_oracle(workload, future, references[capacity], name, base, hp, config).token_hit_ratio
