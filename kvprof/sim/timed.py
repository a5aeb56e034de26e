"""Replays on recorded timing: every request holds its blocks exactly as long as the server did.

A vLLM recording (``vllm serve --kv-record``, :mod:`kvprof.recording`) says for each request when
the scheduler first gave it its blocks (``scheduled``) and when it freed them (``finished``).
Replayed on those times instead of a modelled server, the simulated prefix cache sees the
server's own concurrency: which blocks were pinned, and for how long. The eviction policy and
the capacity are the simulation's, so one recording answers "what would LRU, wa or Belady have
hit on this server".

What the replay models as the server did, per request: it takes its prefix hits (at most
``(prompt - 1) // block`` blocks, as vLLM), then new blocks for the rest of its prompt and its
output (``prompt + output - 1`` tokens: the last sampled token is never written), all at once;
full blocks are cached at once, those filled by output tokens too (vLLM hashes and caches them,
though no later prompt names them here); on finishing it frees them tail first. Requests never
scheduled (aborted while waiting) take nothing and are counted as not served.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvprof.profiler.reuse import next_access
from kvprof.sim.config import SimulationError

#: Trace fields a recording adds (seconds, the timestamps' clock).
SCHEDULED, FINISHED = "scheduled", "finished"


@dataclass(frozen=True, eq=False)
class RecordedTiming:
    """When each request of a :class:`~kvprof.sim.workload.Workload` held its blocks, and which.

    Invariants: ``admit <= release`` wherever ``admit`` is finite (NaN: never scheduled);
    request ``r``'s blocks are ``block[offsets[r]:offsets[r + 1]]``, its prompt's full blocks (the
    workload's) followed by the blocks its output filled, each of those a content no other request
    names; ``n_cacheable == offsets[1:] - offsets[:-1] <= n_total``.

    Attributes
    ----------
    admit, release : float64 arrays, shape (n,)
        Seconds since the evaluation window's start.
    n_total : int64 array, shape (n,)
        Blocks the request holds when it finishes.
    n_cacheable : int64 array, shape (n,)
    offsets : int64 array, shape (n + 1,)
    block : int64 array
        Dense content ids (the workload's, then fresh ones).
    next_use : float64 array
        Admission time of the next request using the same content (Belady), ``inf`` if none.
    """

    admit: np.ndarray
    release: np.ndarray
    n_total: np.ndarray
    n_cacheable: np.ndarray
    offsets: np.ndarray
    block: np.ndarray
    next_use: np.ndarray

    def events(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(request, admits, time)`` of every admission and release, in the order they happened:
        by time, a release before an admission at the same time (vLLM frees finished requests
        before it schedules the next step), then by request."""
        scheduled = np.flatnonzero(np.isfinite(self.admit))
        request = np.concatenate([scheduled, scheduled])
        admits = np.concatenate([np.ones(scheduled.size, bool), np.zeros(scheduled.size, bool)])
        time = np.concatenate([self.admit[scheduled], self.release[scheduled]])
        order = np.lexsort((request, admits, time))
        return request[order], admits[order], time[order]


def recorded_timing(trace, origin: float, offsets: np.ndarray, block: np.ndarray, prompt: np.ndarray,
                    output: np.ndarray, engine_block_size: int) -> RecordedTiming | None:
    """The recorded timing of ``trace``'s requests, None when the trace has none.

    ``origin`` is the workload's time zero; ``offsets``/``block`` its prompt blocks.

    Raises
    ------
    SimulationError
        A recording whose times contradict each other (finished before scheduled, or a
        request scheduled but never finished).
    """
    if SCHEDULED not in trace.extra or FINISHED not in trace.extra:
        return None
    admit = _seconds(trace.extra[SCHEDULED]) - origin
    release = _seconds(trace.extra[FINISHED]) - origin
    bad = np.flatnonzero(np.isfinite(admit) & ~(release >= admit))
    if bad.size:
        i = int(bad[0])
        raise SimulationError(f"request {int(trace.chat_id[i])} of {trace.source} finished ({release[i] + origin:g} s) "
                              f"before it was scheduled ({admit[i] + origin:g} s)")
    n_full = np.diff(offsets)
    written = prompt + np.maximum(output, 1) - 1  # tokens whose KV the request computes
    n_total = np.maximum(-(-written // engine_block_size), -(-prompt // engine_block_size))
    n_output_full = np.maximum(written // engine_block_size - n_full, 0)
    n_cacheable = n_full + n_output_full
    new_offsets = np.zeros(offsets.size, dtype=np.int64)
    np.cumsum(n_cacheable, out=new_offsets[1:])
    owner = np.repeat(np.arange(n_full.size), n_cacheable)
    depth = np.arange(new_offsets[-1]) - new_offsets[owner]
    from_prompt = depth < n_full[owner]
    new_block = np.empty(new_offsets[-1], dtype=np.int64)
    new_block[from_prompt] = block
    first_fresh = int(block.max()) + 1 if block.size else 0
    new_block[~from_prompt] = np.arange(first_fresh, first_fresh + int((~from_prompt).sum()))
    nxt = next_access(new_block, owner)
    next_use = np.full(new_block.size, math.inf)
    reused = nxt >= 0
    next_use[reused] = admit[owner[nxt[reused]]]
    next_use[np.isnan(next_use)] = math.inf
    return RecordedTiming(admit=admit, release=release, n_total=n_total.astype(np.int64),
                          n_cacheable=n_cacheable.astype(np.int64), offsets=new_offsets, block=new_block,
                          next_use=next_use)


def _seconds(column: np.ndarray) -> np.ndarray:
    """A trace column of seconds (missing or null: NaN) as float64."""
    if column.dtype != object:
        return column.astype(np.float64)
    return np.array([math.nan if v is None else float(v) for v in column], dtype=np.float64)


def replay_python(workload, timing: RecordedTiming, classes: list[int], gpu) -> tuple[list[int], list[int]]:
    """The reference replay on recorded timing over a :class:`~kvprof.sim.cache.PrefixCache`:
    ``(hits, held)`` per request, as :func:`kvprof.core.timed.replay` computes them."""
    blocks = timing.block.tolist()
    next_use = timing.next_use.tolist()
    offsets = timing.offsets.tolist()
    n_total = timing.n_total.tolist()
    n_cacheable = timing.n_cacheable.tolist()
    n_lookup = workload.n_lookup.tolist()
    n = len(n_total)
    hits, held, slots = [0] * n, [0] * n, [[] for _ in range(n)]
    for r, admits, now in zip(*(a.tolist() for a in timing.events())):
        if not admits:
            gpu.release(slots[r], now)
            continue
        start = offsets[r]
        mine = slots[r]
        n_hit_evictable = gpu.cached_prefix(blocks, start, n_lookup[r], mine)
        hits[r] = len(mine)
        room = gpu.n_free - n_hit_evictable
        held[r] = hits[r] + min(n_total[r] - hits[r], room)
        gpu.pin_hits(mine, now, classes[r], next_use, start)
        gpu.allocate(blocks, next_use, start, hits[r], n_cacheable[r], held[r], now, classes[r], mine)
    return hits, held


def simulate_recorded(workload, policy, capacity: int, config, engine: str):
    """:func:`kvprof.sim.engine.simulate` on the workload's recorded timing (see the module).

    Raises
    ------
    SimulationError
        A CPU tier or a capacity schedule: the recording says nothing of how those would have
        changed the server's timing.
    """
    from kvprof.sim.engine import _metrics

    timing = workload.timing
    if config.cpu_capacity or config.capacity_schedule:
        raise SimulationError("a replay on recorded timing has no CPU tier and no capacity schedule "
                              "(pass --timing model for those)")
    classes = workload.codes_for(policy).astype(np.int64)
    if engine == "compiled":
        from kvprof.core import tiers
        from kvprof.core.build import compile_policy, write_back
        from kvprof.core.timed import replay

        compiled = compile_policy(policy, capacity)
        n_contents = int(timing.block.max()) + 1 if timing.block.size else 0
        gpu = tiers.new_device(compiled, capacity, n_contents)
        hits, held = replay(gpu, timing.block, timing.offsets, timing.n_cacheable, workload.n_lookup,
                            timing.n_total, classes, timing.next_use, *timing.events(), False)
        write_back(policy, compiled)
        evictions, dropped = tiers.counts(gpu)
    else:
        from kvprof.sim.cache import PrefixCache

        gpu = PrefixCache(policy, capacity)
        hits, held = (np.array(a, dtype=np.int64) for a in replay_python(workload, timing, classes.tolist(), gpu))
        evictions, dropped = gpu.evictions, gpu.dropped
    served = np.isfinite(timing.admit)
    prompt = workload.prompt_tokens
    computed = int(np.maximum(prompt - hits * workload.engine_block_size, 1)[served].sum())
    end = float(timing.release[served].max()) if served.any() else 0.0
    return _metrics(workload, config.cost, policy.name, capacity, np.empty(0), served, int(hits.sum()), 0,
                    computed, end, int(evictions), int(dropped), 0)
