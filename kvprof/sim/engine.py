"""The replay loop: requests arrive at trace times, queue FCFS, pin blocks, compute, free.

One call of :func:`simulate` replays a whole :class:`~kvprof.sim.workload.Workload` through one
GPU tier (and optionally a CPU tier) under one policy. It reads no clock and draws no random
numbers, so the same inputs always give the same metrics.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections import deque
from collections.abc import Callable

import numpy as np

from kvprof.core import has_twin
from kvprof.policy.base import EvictionPolicy, finish_takes
from kvprof.sim.cache import HostCache, PrefixCache
from kvprof.sim.config import SimConfig, SimulationError
from kvprof.sim.metrics import RunMetrics, metrics
from kvprof.sim.timed import simulate_recorded
from kvprof.sim.workload import Workload


#: Called after every admission and every release with the two tiers (tests check invariants).
Observer = Callable[[PrefixCache, "HostCache | None"], None]


def simulate(
    workload: Workload,
    policy: EvictionPolicy,
    capacity: int,
    config: SimConfig = SimConfig(),
    *,
    host_policy: EvictionPolicy | None = None,
    observer: Observer | None = None,
    engine: str | None = None,
) -> RunMetrics:
    """Replay ``workload`` through a prefix cache of ``capacity`` engine blocks under ``policy``.

    Parameters
    ----------
    workload : Workload
        Prepared with the same engine block size as ``config.engine_block_size``.
    policy : EvictionPolicy
        A fresh policy instance for the GPU tier (it is mutated).
    capacity : int
        GPU blocks; ignored when ``config.capacity_schedule`` is given.
    config : SimConfig
    host_policy : EvictionPolicy or None
        Fresh policy for the CPU tier; required when ``config.cpu_capacity > 0``.
    observer : callable or None
        ``observer(gpu, host)`` after every admission and release (Python engine only).
    engine : {"compiled", "python"} or None
        ``"compiled"`` runs the whole replay in :mod:`kvprof.core` on the compiled twins of the
        policies (built from the instances given, which are then not driven; ``wa``'s leader and
        shadow hits are written back to them); ``"python"`` drives the instances themselves, one
        call per block, and is the reference the compiled engine is tested against. None: compiled
        when every policy given has a twin and no observer is given.

    Returns
    -------
    RunMetrics

    Raises
    ------
    SimulationError
        Mismatched workload and config, a capacity <= 0, a CPU tier without a policy, or
        ``engine="compiled"`` for a policy without a twin or with an observer.
    """
    if (workload.engine_block_size, workload.rate_scale) != (config.engine_block_size, config.rate_scale):
        raise SimulationError(
            f"workload was prepared for {workload.engine_block_size}-token blocks at rate x{workload.rate_scale:g}, "
            f"config says {config.engine_block_size} at x{config.rate_scale:g}"
        )
    schedule = list(config.capacity_schedule) or [(0.0, capacity)]
    if schedule[0][1] <= 0:
        raise SimulationError(f"capacity must be > 0 blocks, got {schedule[0][1]}")
    if config.cpu_capacity and host_policy is None:
        raise SimulationError("a CPU tier needs its own policy instance")
    policies = [policy, host_policy] if config.cpu_capacity else [policy]
    compiled = all(map(has_twin, policies)) and observer is None
    if engine is None:
        engine = "compiled" if compiled else "python"
    if engine not in ("compiled", "python"):
        raise SimulationError(f"engine must be 'compiled' or 'python', got {engine!r}")
    if _recorded(config, workload):
        if observer is not None or (engine == "compiled" and not compiled):
            raise SimulationError("a replay on recorded timing runs the compiled twins or the Python policies, "
                                  "without an observer")
        return simulate_recorded(workload, policy, schedule[0][1], config, engine)
    if engine == "compiled":
        if not compiled:
            raise SimulationError("the compiled engine needs policies with compiled twins and no observer")
        from kvprof.core.engine import run  # numba is imported only when a compiled replay runs

        outcome = run(workload, policy, host_policy, config, schedule)
        return metrics(workload, config.cost, policy.name, schedule[0][1], **outcome)
    gpu = PrefixCache(policy, schedule[0][1])
    host = HostCache(host_policy, config.cpu_capacity) if config.cpu_capacity else None
    return Replay(workload, gpu, host, config, schedule, observer).run()


def _recorded(config: SimConfig, workload: Workload) -> bool:
    """Whether the replay runs on the workload's recorded timing (``config.timing``; ``auto``: where
    it has usable recorded times and no CPU tier or schedule asks for what they cannot say)."""
    if config.timing == "model":
        return False
    if workload.timing_error or (config.timing == "recorded" and workload.timing is None):
        raise SimulationError(workload.timing_problem if workload.timing_error else
                              f"--timing recorded: {workload.timing_problem}")
    return workload.timing is not None and (config.timing == "recorded" or not (config.cpu_capacity
                                                                                 or config.capacity_schedule))


class Replay:
    """State of one replay between engine steps.

    Invariants: ``waiting`` holds arrived, unadmitted requests in arrival order (FCFS, the head
    blocks the rest, as vLLM's scheduler does without preemption); ``prefilling`` holds admitted
    requests with uncomputed prompt tokens in admission order, so only its head can be part-done;
    every admitted, unfinished request has its slots in ``held``.
    """

    def __init__(self, workload, gpu, host, config, schedule, observer):
        self.w = workload
        self.gpu = gpu
        self.host = host
        self.cost = config.cost
        self.schedule = schedule
        self.observer = observer
        self.ebs = workload.engine_block_size
        # Python lists index several times faster than numpy arrays in the per-block loops.
        self.blocks = workload.block.tolist()
        self.next_use = workload.next_use.tolist()
        self.offsets = workload.offsets.tolist()
        self.n_lookup = workload.n_lookup.tolist()
        self.n_total = workload.blocks_needed(config.cost.decode).tolist()
        # What each tier's policy is told a request's workload is (its class or its cell).
        self.classes = workload.codes_for(gpu.policy).tolist()
        self.host_classes = workload.codes_for(host.policy).tolist() if host else None
        self.prompt = workload.prompt_tokens.tolist()
        self.output = workload.output_tokens.tolist()
        self.finish = workload.finish.tolist()
        self.tells_finish = finish_takes(gpu.policy, "finish")
        self.hints = _hints_for(gpu.policy, workload)
        self.held: dict[int, list[int]] = {}

    def over(self, gpu: PrefixCache) -> Replay:
        """A replay of the same workload through another GPU tier (no CPU tier), sharing the
        read-only per-request columns: one replica of a fleet (:mod:`kvprof.sim.fleet`)."""
        replica = copy.copy(self)
        replica.gpu, replica.host, replica.held = gpu, None, {}
        replica.tells_finish = finish_takes(gpu.policy, "finish")
        replica.hints = _hints_for(gpu.policy, self.w)
        return replica

    def admit(self, r: int, now: float) -> tuple[int, int] | None:
        """Give request ``r`` its blocks if the GPU has room.

        Returns
        -------
        (device hits, host hits) in blocks, or None when the GPU cannot hold the request now.
        """
        gpu, host = self.gpu, self.host
        start, stop = self.offsets[r], self.offsets[r + 1]
        n_lookup = self.n_lookup[r]
        slots: list[int] = []
        n_hit_evictable = gpu.cached_prefix(self.blocks, start, n_lookup, slots)
        n_device = len(slots)
        # Hit blocks that are evictable now stop being free once pinned.
        if self.n_total[r] - n_device > gpu.n_free - n_hit_evictable:
            return None
        n_host = host.cached_run(self.blocks, start + n_device, start + n_lookup) if host else 0
        workload = self.classes[r]
        gpu.pin_hits(slots, now, workload, self.next_use, start)
        gpu.allocate(self.blocks, self.next_use, start, n_device, stop - start, self.n_total[r], now, workload, slots)
        gpu.policy.admit(r, self.blocks[start:stop], now, workload, n_lookup=n_lookup, n_blocks=self.n_total[r])
        if n_host:
            host.load(self.blocks, self.next_use, start, n_device, n_device + n_host, now, self.host_classes[r])
        self.held[r] = slots
        if self.observer:
            self.observer(gpu, host)
        return n_device, n_host

    def finish_prefill(self, r: int, now: float) -> None:
        """Request ``r`` computed its prompt: the connector offloads its full blocks to the CPU tier."""
        if self.host:
            start, stop = self.offsets[r], self.offsets[r + 1]
            self.host.store(self.blocks, self.next_use, start, range(stop - start), now, self.host_classes[r])

    def release(self, r: int, now: float) -> None:
        told = {"finish": self.finish[r] or None} if self.tells_finish else {}
        if self.hints is not None:
            told["hint"], told["held"] = self.hints[r], self.held[r]
        self.gpu.policy.finish(r, now, n_output=self.output[r], **told)
        self.gpu.release(self.held.pop(r), now)
        if self.observer:
            self.observer(self.gpu, self.host)

    def run(self) -> RunMetrics:
        steps = self.steps(Arrivals(self.w.arrival.tolist()))
        for _ in steps:  # every arrival is known at once: the loop never pauses
            pass
        return metrics(self.w, self.cost, self.gpu.policy.name, self.schedule[0][1], **self.outcome)

    def steps(self, arrivals: Arrivals):
        """The replay loop, as a generator: it pauses (yields the requests it holds, waiting or
        running) whenever its clock reaches ``arrivals.horizon``, the first arrival not yet known;
        then ``outcome`` holds the raw counts :func:`~kvprof.sim.metrics.metrics` reads."""
        w, gpu, cost, ebs = self.w, self.gpu, self.cost, self.ebs
        n = w.n_requests
        arrival = arrivals.arrival
        output = self.output
        prompt = self.prompt
        schedule = self.schedule
        qttft = np.full(n, math.nan)
        served = np.zeros(n, dtype=bool)
        waiting: deque[int] = deque()
        prefilling: deque[list[int]] = deque()  # [request, uncomputed prompt tokens]
        decoding: list[tuple[float, int]] = []  # heap of (finish time, request)
        n_running = hits_device = hits_host = computed = 0
        next_change = 1
        now = 0.0
        while True:
            while now >= arrivals.horizon:
                yield len(waiting) + n_running
            while next_change < len(schedule) and schedule[next_change][0] <= now:
                gpu.set_limit(schedule[next_change][1], now)
                next_change += 1
            while decoding and decoding[0][0] <= now:
                self.release(heapq.heappop(decoding)[1], now)
                n_running -= 1
            arrivals.move(now, waiting)

            # One engine step: running prefills first, then admissions while the budget lasts.
            budget = cost.max_batched_tokens
            for entry in prefilling:
                take = min(entry[1], budget)
                entry[1] -= take
                budget -= take
                if not budget:
                    break
            host_loads = 0
            while waiting and budget and n_running < cost.max_num_seqs:
                r = waiting[0]
                hits = self.admit(r, now)
                if hits is None:
                    break
                waiting.popleft()
                served[r] = True
                n_running += 1
                hits_device += hits[0]
                hits_host += hits[1]
                host_loads += hits[1]
                # At least one token: vLLM recomputes the prompt's last token (n_lookup excludes it).
                uncached = max(prompt[r] - (hits[0] + hits[1]) * ebs, 1)
                computed += uncached
                take = min(uncached, budget)
                budget -= take
                prefilling.append([r, uncached - take])
            step_tokens = cost.max_batched_tokens - budget

            if not step_tokens:
                if waiting and not decoding and next_change >= len(schedule):
                    # Nothing runs and the cache never grows again: the head can never fit.
                    waiting.popleft()
                    continue
                pending = [arrivals.next_time()]
                if decoding:
                    pending.append(decoding[0][0])
                if next_change < len(schedule):
                    pending.append(schedule[next_change][0])
                if min(pending) == math.inf:
                    break
                now = max(now, min(pending))
                continue

            now += (
                cost.step_overhead_s
                + step_tokens / cost.prefill_tokens_per_s
                + host_loads * cost.host_load_s_per_block
            )
            while now >= arrivals.horizon:  # a router sees this step's requests running until it ends
                yield len(waiting) + n_running
            while prefilling and not prefilling[0][1]:
                r = prefilling.popleft()[0]
                qttft[r] = now - arrival[r]
                self.finish_prefill(r, now)
                if cost.decode:
                    heapq.heappush(decoding, (now + output[r] * cost.time_per_output_token_s, r))
                else:
                    self.release(r, now)
                    n_running -= 1
        host_evictions = self.host.evictions if self.host else 0
        self.outcome = {"qttft": qttft[served], "served": served, "hits_device": hits_device, "hits_host": hits_host,
                        "computed": computed, "end": now, "evictions": gpu.evictions, "dropped": gpu.dropped,
                        "host_evictions": host_evictions}


def _hints_for(policy: EvictionPolicy, workload: Workload) -> list | None:
    """Each request's hint (None: none) where the policy takes hints (``finish``'s ``hint``) and the
    workload carries them; None otherwise (nothing is told)."""
    if workload.hints is None or not finish_takes(policy, "hint"):
        return None
    return workload.hints.hints()


class Arrivals:
    """The requests arriving at one replay, in arrival order, as far as they are known.

    Invariant: ``pending`` holds the known requests not yet moved to the replay's queue, in
    arrival order, none arriving after ``horizon``, the earliest time a request not yet known may
    arrive (infinity once all are known, as for a whole workload).
    """

    def __init__(self, arrival: list[float], requests=None, horizon: float = math.inf):
        self.arrival = arrival
        self.pending = deque(range(len(arrival)) if requests is None else requests)
        self.horizon = horizon

    def move(self, now: float, waiting: deque) -> None:
        """Append the requests arrived by ``now`` to ``waiting``."""
        pending, arrival = self.pending, self.arrival
        while pending and arrival[pending[0]] <= now:
            waiting.append(pending.popleft())

    def next_time(self) -> float:
        """When the next request may arrive (infinity: none will)."""
        return self.arrival[self.pending[0]] if self.pending else self.horizon
