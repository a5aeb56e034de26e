"""A fleet: N replicas of the simulated vLLM server behind a router (``kvprof fleet``).

Each replica is the server ``compare`` replays (its policy, capacity, block size, cost model);
the router sends it each request on arrival. A fleet is replayed in two passes:

1. Routing, which decides the replica of every request. Routers that read only the trace
   (``round-robin``, ``session``, ``prefix-approx`` with ``load_weight`` 0) route it in one loop;
   ``recorded`` reads where a fleet of recordings says each request went
   (:func:`kvprof.sim.recorded.fleet_trace`), and its replicas replay on the servers' own timing.
   Routers that read the replicas' state (``least-loaded``, ``prefix-precise``, ``prefix-approx``
   weighing load) drive the N replicas together on the Python engine
   (:meth:`kvprof.sim.engine.Replay.steps`): before each arrival every replica runs until its
   clock reaches it, then the router reads their loads (requests waiting or running) and caches.
2. Measuring: each replica's traffic is replayed alone by the engine ``compare`` runs (the
   compiled one; the Python one for a policy honouring client hints, ``P+hints``), and under
   Belady for the bound. A replica's replay depends only on the requests it gets, so
   the second pass reproduces the first's hits (a test checks it), and one replica is exactly
   ``compare``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvprof.core import has_twin
from kvprof.models.hp import HpFile
from kvprof.policy.prefix_cache import PrefixCache
from kvprof.profiler.trace import Trace
from kvprof.sim.config import SimConfig, SimulationError
from kvprof.sim.engine import Arrivals, Replay, simulate
from kvprof.sim.hints import make_hinted_policy
from kvprof.sim.metrics import RunMetrics, metrics
from kvprof.sim.recorded import REPLICA, resolve_timing
from kvprof.sim.sample import chain_roots
from kvprof.sim.tune import tune
from kvprof.sim.workload import Workload, prepare_workload

ROUTERS = ("round-robin", "least-loaded", "session", "prefix-approx", "prefix-precise")
#: The routing a fleet of recordings had: each request where its recording says it went
#: (:func:`kvprof.sim.recorded.fleet_trace`); not in ROUTERS, which route any trace.
RECORDED = "recorded"
ORACLE = "belady"
_MASK64 = 2**64 - 1


@dataclass(frozen=True)
class RouterSpec:
    """A router and its knobs.

    ``load_weight``: how much the prefix routers weigh load against overlap (llm-d's weighted
    scorers: score = overlap / lookup blocks + load_weight * (max - load) / (max - min)).
    ``index_blocks``: blocks per replica the approximate index remembers (llm-d's
    ``lruCapacityPerServer``); None: the replica's capacity.
    """

    name: str
    load_weight: float = 1.0
    index_blocks: int | None = None

    def __post_init__(self):
        if self.name not in (*ROUTERS, RECORDED):
            raise SimulationError(f"unknown router {self.name!r}; known: {', '.join((*ROUTERS, RECORDED))}")

    @property
    def reads_replicas(self) -> bool:
        """Whether routing needs the replicas' state (so the replicas run while it routes)."""
        return self.name in ("least-loaded", "prefix-precise") or (self.name == "prefix-approx" and self.load_weight > 0)


class _Router:
    """Chooses a replica per request, in arrival order. ``choose`` gets the replicas' loads
    (waiting + running requests) and GPU caches when the router reads them, None otherwise."""

    def __init__(self, n_replicas: int):
        self.n = n_replicas
        self.turn = 0  # where ties start: round robin among equals

    def rotation(self) -> list[int]:
        order = [(self.turn + i) % self.n for i in range(self.n)]
        self.turn = (self.turn + 1) % self.n
        return order

    def choose(self, r: int, loads: list[int] | None, caches: list[PrefixCache] | None) -> int:
        raise NotImplementedError


class _RoundRobin(_Router):
    def choose(self, r, loads, caches):
        return self.rotation()[0]


class LeastLoaded(_Router):
    """Fewest requests waiting or running; ties in turn."""

    def choose(self, r, loads, caches):
        return min(self.rotation(), key=loads.__getitem__)


class _Session(_Router):
    """A consistent hash (jump hash, Lamping and Veach 2014) of the request's conversation: every
    turn of a conversation goes where its first went."""

    def __init__(self, n_replicas: int, trace: Trace):
        super().__init__(n_replicas)
        self.replica = [jump_hash(int(key), n_replicas) for key in chain_roots(trace).tolist()]

    def choose(self, r, loads, caches):
        return self.replica[r]


class _Prefix(_Router):
    """Overlap (leading blocks of the request found on the replica, over its lookup blocks)
    weighed against load as llm-d's scorers are; the best score wins, ties in turn."""

    def __init__(self, n_replicas: int, workload: Workload, blocks: list[int], load_weight: float):
        super().__init__(n_replicas)
        self.blocks = blocks
        self.offsets = workload.offsets.tolist()
        self.n_lookup = workload.n_lookup.tolist()
        self.load_weight = load_weight

    def overlap(self, j: int, r: int, caches) -> int:
        raise NotImplementedError

    def choose(self, r, loads, caches):
        lookup = self.n_lookup[r]
        overlap = [self.overlap(j, r, caches) / lookup if lookup else 0.0 for j in range(self.n)]
        if loads is not None and self.load_weight:
            low, high = min(loads), max(loads)
            spread = high - low
            scores = [o + self.load_weight * ((high - load) / spread if spread else 1.0)
                      for o, load in zip(overlap, loads)]
        else:
            scores = overlap
        return max(self.rotation(), key=scores.__getitem__)


class PrefixPrecise(_Prefix):
    """Reads each replica's real cache, as KV events tell llm-d's precise scorer or Dynamo's router."""

    def overlap(self, j, r, caches):
        start = self.offsets[r]
        return len(_slots(caches[j], self.blocks, start, self.n_lookup[r]))


class PrefixApprox(_Prefix):
    """Reads an index of the blocks it sent each replica, an LRU of ``index_blocks`` per replica
    (llm-d's approximate prefix scorer): it never learns what the replica evicted."""

    def __init__(self, n_replicas, workload, blocks, load_weight, index_blocks: int):
        super().__init__(n_replicas, workload, blocks, load_weight)
        self.index: list[OrderedDict] = [OrderedDict() for _ in range(n_replicas)]
        self.index_blocks = index_blocks

    def overlap(self, j, r, caches):
        index, blocks = self.index[j], self.blocks
        start = self.offsets[r]
        depth = 0
        while depth < self.n_lookup[r] and blocks[start + depth] in index:
            depth += 1
        return depth

    def choose(self, r, loads, caches):
        j = super().choose(r, loads, caches)
        index = self.index[j]
        for block in self.blocks[self.offsets[r]:self.offsets[r + 1]]:
            index[block] = None
            index.move_to_end(block)
        while len(index) > self.index_blocks:
            index.popitem(last=False)
        return j


def _slots(cache: PrefixCache, blocks: list[int], start: int, n_lookup: int) -> list[int]:
    out: list[int] = []
    cache.cached_prefix(blocks, start, n_lookup, out)
    return out


def jump_hash(key: int, buckets: int) -> int:
    """Lamping and Veach's jump consistent hash of a 64-bit ``key`` into ``buckets``: adding a
    bucket moves only 1/buckets of the keys."""
    key &= _MASK64
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & _MASK64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


@dataclass(frozen=True)
class Routing:
    """Which replica each request went to; ``live_hits`` the device hits each replica counted
    while routing (only for routers that read the replicas, which ran then)."""

    replica: np.ndarray
    live_hits: tuple[int, ...] | None = None


def route(trace: Trace, workload: Workload, hp, spec: RouterSpec, replicas: int, policy: str, capacity: int,
          config: SimConfig, replica_hps: Sequence | None = None, hint_budget: int | None = None) -> Routing:
    """The replica of every request of ``workload`` (prepared from ``trace`` with ``hp``) under
    ``spec``; replica ``j`` runs ``replica_hps[j]`` (default: ``hp``) when the replicas run, a
    ``P+hints`` policy with ``hint_budget`` retained blocks at most (None: no budget).

    Raises
    ------
    SimulationError
        Belady behind a router that reads the replicas (its future depends on routing not yet done).
    """
    if replicas < 1:
        raise SimulationError(f"a fleet needs at least one replica, got {replicas}")
    if spec.name == RECORDED:
        return Routing(recorded_replicas(trace, replicas))
    n = workload.n_requests
    blocks = workload.block.tolist() if spec.name.startswith("prefix") else []
    if spec.name == "round-robin":
        router: _Router = _RoundRobin(replicas)
    elif spec.name == "least-loaded":
        router = LeastLoaded(replicas)
    elif spec.name == "session":
        router = _Session(replicas, trace)
    elif spec.name == "prefix-precise":
        router = PrefixPrecise(replicas, workload, blocks, spec.load_weight)
    else:
        router = PrefixApprox(replicas, workload, blocks, spec.load_weight, spec.index_blocks or capacity)
    chosen = np.empty(n, dtype=np.int64)
    if not spec.reads_replicas:
        for r in range(n):
            chosen[r] = router.choose(r, None, None)
        return Routing(chosen)
    if policy == ORACLE:
        raise SimulationError(f"belady cannot run behind {spec.name}: it reads each replica's future traffic, which "
                              f"this router decides as it goes (belady is reported as each replica's bound instead)")
    hps = list(replica_hps or [hp] * replicas)
    workloads = {id(hp): workload}  # replicas of one hp file share its columns
    for other in hps:
        if id(other) not in workloads:
            workloads[id(other)] = prepare_workload(trace, other, config.engine_block_size, config.rate_scale)
    return _route_live(router, [(workloads[id(one)], one) for one in hps], policy, capacity, config, chosen,
                       hint_budget)


def recorded_replicas(trace: Trace, replicas: int) -> np.ndarray:
    """The replica each request of a fleet of recordings went to (``trace.extra[REPLICA]``).

    Raises
    ------
    SimulationError
        A trace that is not a fleet of recordings, or one of more than ``replicas`` replicas.
    """
    replica = trace.extra.get(REPLICA)
    if replica is None:
        raise SimulationError(f"{RECORDED} routing replays the recordings of a fleet's servers "
                              f"(kvprof fleet DIR1 DIR2 ...); {trace.source or 'this trace'} is none")
    replica = np.asarray(replica, dtype=np.int64)
    if replica.size and not 0 <= replica.min() <= replica.max() < replicas:
        raise SimulationError(f"the recordings hold {int(replica.max()) + 1} replicas, not {replicas}")
    return replica


def _route_live(router: _Router, replicas: list[tuple[Workload, object]], policy: str, capacity: int,
                config: SimConfig, chosen: np.ndarray, hint_budget: int | None) -> Routing:
    """Route while the replicas (each a workload and its hp file) run on the Python engine, each
    paused at every arrival."""
    first: dict[int, Replay] = {}  # per workload, the replica whose columns the others share
    runs = []
    for workload, hp in replicas:
        gpu = PrefixCache(make_hinted_policy(policy, hp, capacity, hint_budget), capacity)
        shared = first.get(id(workload))
        runs.append(shared.over(gpu) if shared else Replay(workload, gpu, None, config, [(0.0, capacity)], None))
        first.setdefault(id(workload), runs[-1])
    arrival = replicas[0][0].arrival.tolist()
    n = len(arrival)
    feeds = [Arrivals(arrival, (), arrival[0]) for _ in runs]
    steps = [run.steps(feed) for run, feed in zip(runs, feeds)]
    held = [next(step) for step in steps]  # every replica until the first arrival
    caches = [run.gpu for run in runs]
    for r in range(n):
        loads = [h + len(feed.pending) for h, feed in zip(held, feeds)]
        j = router.choose(r, loads, caches)
        chosen[r] = j
        feeds[j].pending.append(r)
        horizon = arrival[r + 1] if r + 1 < n else math.inf
        for i, (feed, step) in enumerate(zip(feeds, steps)):
            feed.horizon = horizon
            held[i] = next(step, 0)
    return Routing(chosen, tuple(int(run.outcome["hits_device"]) for run in runs))


@dataclass(frozen=True)
class FleetRun:
    """One configuration's outcome: per replica its metrics under the policy and under Belady.

    Invariant: ``runs`` and ``bounds`` have one entry per replica, in replica order; ``qttft``
    holds the modelled queued TTFT of every served request of the fleet (none on ``timing``
    ``recorded``: the servers' own schedule, which models no queueing).
    """

    router: str
    policy: str
    replicas: int
    capacity: int
    runs: tuple[RunMetrics, ...]
    bounds: tuple[RunMetrics, ...]
    qttft: np.ndarray = field(repr=False)
    live_hits: tuple[int, ...] | None = None
    hp_per_replica: bool = False
    timing: str = "model"

    @property
    def fleet_token_hit_ratio(self) -> float:
        prompt = sum(run.prompt_tokens for run in self.runs)
        return sum(run.cached_tokens for run in self.runs) / prompt if prompt else 0.0

    @property
    def belady_token_hit_ratio(self) -> float:
        prompt = sum(run.prompt_tokens for run in self.bounds)
        return sum(run.cached_tokens for run in self.bounds) / prompt if prompt else 0.0

    @property
    def load_imbalance(self) -> float:
        """Max over mean of the prompt tokens each replica computed (its prefill work)."""
        work = [run.prompt_tokens - run.cached_tokens for run in self.runs]
        mean = sum(work) / len(work)
        return max(work) / mean if mean else 1.0

    def to_dict(self) -> dict:
        """The configuration's row (docs/fleet.md): the fleet's totals, then per replica lists."""
        q = self.qttft
        p50, p90, p99 = np.percentile(q, [50, 90, 99]) if q.size else (math.nan,) * 3
        prompt = sum(run.prompt_tokens for run in self.runs)
        cached = sum(run.cached_tokens for run in self.runs)
        return {
            "policy": self.policy,
            "hp": "per-replica" if self.hp_per_replica else "fleet",
            "router": self.router,
            "timing": self.timing,
            "replicas": self.replicas,
            "capacity": self.capacity,
            "n_requests": sum(run.n_requests for run in self.runs),
            "n_rejected": sum(run.n_rejected for run in self.runs),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "token_hit_ratio": self.fleet_token_hit_ratio,
            "fleet_token_hit_ratio": self.fleet_token_hit_ratio,
            "belady_token_hit_ratio": self.belady_token_hit_ratio,
            "load_imbalance": self.load_imbalance,
            "qttft_mean_s": float(q.mean()) if q.size else math.nan,
            "qttft_p50_s": float(p50),
            "qttft_p90_s": float(p90),
            "qttft_p99_s": float(p99),
            "qttft_overloaded": any(run.qttft_overloaded for run in self.runs),
            "replica_requests": [run.n_requests for run in self.runs],
            "replica_token_hit_ratios": [run.token_hit_ratio for run in self.runs],
            "replica_belady_token_hit_ratios": [run.token_hit_ratio for run in self.bounds],
            "replica_offered_loads": [run.offered_load for run in self.runs],
            "hints": self._hint_counts(),
        }

    def _hint_counts(self) -> dict | None:
        """A ``P+hints`` configuration's hint counts summed over its replicas (an idle one has none), None for
        another policy."""
        counts = [run.hints for run in self.runs if run.hints is not None]
        return {name: sum(c[name] for c in counts) for name in counts[0]} if counts else None


def label(policy: str, router: str, replicas: int, hp: str = "fleet") -> str:
    """What plots and ``show`` call a configuration (their ``policy``): ``lru, session x8``, and
    ``wa, session x8, hp per-replica`` for one hp file per replica."""
    return f"{policy}, {router} x{replicas}" + (f", hp {hp}" if hp != "fleet" else "")


def run_fleet(trace: Trace, workload: Workload, hp, spec: RouterSpec, replicas: int, policy: str, capacity: int,
              config: SimConfig, replica_hps: Sequence | None = None,
              hint_max_fraction: float | None = None) -> FleetRun:
    """Route ``trace`` (prepared as ``workload`` with ``hp``) over ``replicas`` servers of
    ``capacity`` blocks under ``policy``, then replay each replica's share alone, under ``policy``
    and Belady. Replica ``j`` runs ``replica_hps[j]`` when given (:func:`fit_per_replica`), else ``hp``.
    ``P+hints`` honours the trace's hints, each replica's retained blocks at most ``hint_max_fraction``
    of its cache (None: no budget), as ``compare`` replays one server."""
    config = _model_timed(config)
    budget = None if hint_max_fraction is None else int(hint_max_fraction * capacity)
    if spec.name == RECORDED:  # the servers' own timing where the trace has it, as compare's --timing auto
        config = dataclasses.replace(config, timing=resolve_timing("auto", trace, config.engine_block_size,
                                                                   config.rate_scale))
    hps = list(replica_hps or [hp] * replicas)
    routing = route(trace, workload, hp, spec, replicas, policy, capacity, config, hps, budget)
    runs, bounds, qttft = [], [], []
    for j, replica_hp in enumerate(hps):
        rows = routing.replica == j
        share = workload if rows.all() and replica_hp is hp else _share(trace, rows, replica_hp, config)
        for name, out in ((policy, runs), (ORACLE, bounds)):
            if share is None:
                out.append(_idle(name, capacity))
                continue
            replica_policy = make_hinted_policy(name, replica_hp, capacity, budget)
            if config.timing == "recorded":  # no modelled queueing: no QTTFT to pool
                out.append(_with_hint_counts(simulate(share, replica_policy, capacity, config), replica_policy))
                continue
            outcome = _replayed_alone(share, replica_policy, capacity, config)
            out.append(_with_hint_counts(metrics(share, config.cost, name, capacity, **outcome), replica_policy))
            if name == policy:
                qttft.append(outcome["qttft"])
    return FleetRun(spec.name, policy, replicas, capacity, tuple(runs), tuple(bounds),
                    np.concatenate(qttft) if qttft else np.empty(0), routing.live_hits, replica_hps is not None,
                    config.timing)


def _with_hint_counts(run: RunMetrics, policy) -> RunMetrics:
    """``run`` with what ``policy``'s hint layer did (a ``P+hints`` replica's), as ``compare``'s runs carry it."""
    counters = getattr(policy, "counters", None)
    return run if counters is None else dataclasses.replace(run, hints=dataclasses.asdict(counters))


def _replayed_alone(share: Workload, policy, capacity: int, config: SimConfig) -> dict:
    """The raw counts (:func:`~kvprof.sim.metrics.metrics`' arguments) of one replica's replay of its
    ``share`` on the engine ``simulate`` picks: the compiled one where the policy has a twin, else the
    Python one (a policy honouring hints)."""
    schedule = [(0.0, capacity)]
    if has_twin(policy):
        from kvprof.core.engine import run  # numba is imported only when a compiled replay runs

        return run(share, policy, None, config, schedule)
    replay = Replay(share, PrefixCache(policy, capacity), None, config, schedule, None)
    replay.run()
    return replay.outcome


def replica_shares(fit_window: Trace, spec: RouterSpec, replicas: int, capacity: int,
                   config: SimConfig) -> list[Trace | None]:
    """The traffic ``spec`` sends each of ``replicas`` replicas of ``capacity`` blocks in
    ``fit_window`` (routed with every replica under lru, which reads no hp file): per replica the
    requests it got, in the window's bounds, or None where it got none. What :func:`fit_per_replica`
    and ``kvprof fit --replica`` fit on."""
    workload = prepare_workload(fit_window, None, config.engine_block_size, config.rate_scale)
    routing = route(fit_window, workload, None, spec, replicas, "lru", capacity, _model_timed(config))
    return [fit_window.select(rows, window=fit_window.window) if rows.any() else None
            for rows in (routing.replica == j for j in range(replicas))]


def fit_per_replica(fit_window: Trace, spec: RouterSpec, replicas: int, capacity: int, config: SimConfig,
                    fallback, fit: Callable[[Trace], HpFile]) -> tuple:
    """One hp file per replica, ``fit`` (the profiler's ``fit_trace``, which ``sim`` does not
    import: docs/CONTRACTS.md) on its :func:`replica_shares` share and tuned for ``capacity``, as
    ``compare`` fits and tunes one on the whole window; ``fallback`` for a replica the router sent
    nothing."""
    config = _model_timed(config)
    shares = replica_shares(fit_window, spec, replicas, capacity, config)
    return tuple(routed(tune(fit(share), share, [capacity], config, refit=fit), spec, replicas, j)
                 if share is not None else fallback for j, share in enumerate(shares))


def routed(hp, spec: RouterSpec, replicas: int, replica: int):
    """``hp`` with its provenance saying which replica's traffic it was fitted on, behind what."""
    return dataclasses.replace(hp, provenance={**hp.provenance, "routed": {
        "router": spec.name, "load_weight": spec.load_weight, "index_blocks": spec.index_blocks,
        "replicas": replicas, "replica": replica}})


def _model_timed(config: SimConfig) -> SimConfig:
    """``config``'s engine block, cost model and rate scale, timed by the cost model as a fleet is."""
    return SimConfig(engine_block_size=config.engine_block_size, cost=config.cost, rate_scale=config.rate_scale,
                     timing="model")


def _share(trace: Trace, rows: np.ndarray, hp, config: SimConfig) -> Workload | None:
    """The workload of the requests ``rows`` of ``trace`` (None if there are none)."""
    if not rows.any():
        return None
    return prepare_workload(trace.select(rows, window=trace.window), hp, config.engine_block_size, config.rate_scale)


def _idle(policy: str, capacity: int) -> RunMetrics:
    """The metrics of a replica the router sent nothing."""
    nan = math.nan
    return RunMetrics(policy, capacity, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0.0, 0, 0, 0, nan, nan, nan, nan, 0.0, 0.0,
                      False)
