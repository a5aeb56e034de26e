"""Replays on recorded timing: every request holds its blocks exactly as long as the server did.

A vLLM recording (``vllm serve --kv-record``, :mod:`kvprof.recording`) says for each request when
the scheduler first gave it its blocks (``scheduled``) and when it freed them (``finished``).
Replayed on those times instead of a modelled server, the simulated prefix cache sees the
server's own concurrency: which blocks were pinned, and for how long. The eviction policy and
the capacity are the simulation's, so one recording answers "what would LRU, wa or Belady have
hit on this server".

What the replay models as the server did, per request: when scheduled, it takes its prefix hits
(at most ``(prompt - 1) // block`` blocks, as vLLM) and new blocks for the rest of its prompt, the
full ones cached at once; when it finishes, the blocks its output filled (``prompt + output - 1``
tokens: the last sampled token is never written), cached too as vLLM caches them, though no
later prompt of the recording names them; then it frees them all, tail first. Requests never
scheduled (aborted while waiting) take nothing and are counted as not served. The policy hears of
each request once scheduled (``admit``: its full prompt blocks) and once finished (``finish``:
all its full blocks, output included, which ``wa``'s shadows cache then as the real tier does). The live
counterfactual of the vLLM plugin runs the same two steps as requests come and go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvprof.profiler.reuse import next_access
from kvprof.sim.cache import NO_BLOCK as NONE
from kvprof.sim.config import SimulationError

#: Trace fields a recording adds (seconds, the timestamps' clock).
SCHEDULED, FINISHED = "scheduled", "finished"


@dataclass(frozen=True, eq=False)
class RecordedTiming:
    """When each request of a :class:`~kvprof.sim.workload.Workload` held which blocks.

    Invariants: ``admit <= release`` wherever ``admit`` is finite (NaN: never scheduled). Request
    ``r``'s blocks, by depth, are ``block[offsets[r]:offsets[r + 1]]``: its prompt's ``n_full[r]``
    full blocks (the workload's), ``NONE`` for its partial last prompt block if it has one (so
    ``n_prompt[r]`` blocks are taken when it is scheduled), then the blocks its output filled, each
    a content no other request names; at its finish it takes ``n_new[r]`` more blocks, those
    first ones cached.

    Attributes
    ----------
    admit, release : float64 arrays, shape (n,)
        Seconds since the evaluation window's start.
    n_full, n_prompt, n_new : int64 arrays, shape (n,)
    offsets : int64 array, shape (n + 1,)
    block : int64 array
        Dense content ids (the workload's, then fresh ones), ``NONE`` for partial prompt blocks.
    next_use : float64 array
        Admission time of the next request using the same content (Belady), ``inf`` if none.
    """

    admit: np.ndarray
    release: np.ndarray
    n_full: np.ndarray
    n_prompt: np.ndarray
    n_new: np.ndarray
    offsets: np.ndarray
    block: np.ndarray
    next_use: np.ndarray

    @property
    def n_contents(self) -> int:
        return int(self.block.max()) + 1 if self.block.size else 0

    def events(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(request, admits, time)`` of every admission and finish, in the order they happened:
        by time; at one time, the finishes of requests admitted earlier (vLLM frees finished
        requests before it schedules the next step), then admissions, then the finishes of
        requests admitted at that very time; then by request."""
        scheduled = np.flatnonzero(np.isfinite(self.admit))
        admit, release = self.admit[scheduled], self.release[scheduled]
        request = np.concatenate([scheduled, scheduled])
        admits = np.concatenate([np.ones(scheduled.size, bool), np.zeros(scheduled.size, bool)])
        time = np.concatenate([admit, release])
        rank = np.concatenate([np.ones(scheduled.size), np.where(release == admit, 2, 0)])
        order = np.lexsort((request, rank, time))
        return request[order], admits[order], time[order]


def timing_absent(trace, engine_block_size: int, rate_scale: float) -> str | None:
    """Why a replay of ``trace`` at ``engine_block_size`` and ``rate_scale`` has no recorded timing,
    None when it has (the values may still be bad: :func:`recorded_times` says)."""
    if SCHEDULED not in trace.extra or FINISHED not in trace.extra:
        return ("the trace has no recorded timing (the scheduled and finished times of a `vllm serve --kv-record` "
                "recording)")
    if engine_block_size != trace.block_size:
        return (f"the recorded times are the server's, at its {trace.block_size}-token blocks; a replay at "
                f"{engine_block_size}-token blocks would change them (leave out --block-size, or pass --timing model)")
    if rate_scale != 1.0:
        return "the recorded times are the server's, at its own rate (leave out --rate-scale, or pass --timing model)"
    return None


def resolve_timing(requested: str, trace, engine_block_size: int, rate_scale: float = 1.0, cpu_capacity: int = 0,
                   capacity_schedule=()) -> str:
    """What a replay under ``--timing requested`` runs: ``"recorded"`` or ``"model"``.

    ``auto`` is recorded where the trace has usable recorded times and nothing asks for what a
    recording cannot say (a CPU tier, a capacity schedule), else modelled; bad recorded values
    are an error wherever recorded timing would run.

    Raises
    ------
    SimulationError
        ``recorded`` without recorded timing, with a CPU tier or a schedule; bad recorded values.
    """
    if requested == "model":
        return "model"
    absent = timing_absent(trace, engine_block_size, rate_scale)
    if requested == "auto" and (absent is not None or cpu_capacity or capacity_schedule):
        return "model"
    if absent is not None:
        raise SimulationError(f"--timing recorded: {absent}")
    if cpu_capacity or capacity_schedule:
        raise SimulationError(_NO_TIERS)
    recorded_times(trace)
    return "recorded"


_NO_TIERS = ("a replay on recorded timing has no CPU tier and no capacity schedule (the recording says nothing of "
             "how they would have changed the server's timing): pass --timing model for those")


def recorded_times(trace) -> tuple[np.ndarray, np.ndarray]:
    """``(scheduled, finished)`` of every request of a recording, seconds on the trace's clock
    (scheduled NaN: never scheduled, an aborted request).

    Raises
    ------
    SimulationError
        A time that is not a finite number of seconds (a boolean is not one), a missing finished
        time, a missing scheduled time of a request that did not finish aborted, or a request that
        finished before it was scheduled; the message names the request and says how to go on.
    """
    admit = _seconds(trace, SCHEDULED)
    release = _seconds(trace, FINISHED)
    reason = trace.extra.get("finish_reason")
    # A recording says why each request finished; a trace without the field is taken at its word.
    aborted = np.ones(trace.n_requests, dtype=bool) if reason is None else np.array(
        [r == "abort" for r in reason.tolist()], dtype=bool)
    for bad, problem in ((np.isnan(release), "has no finished time (the field is missing or null)"),
                         (np.isnan(admit) & ~aborted, "has no scheduled time (missing or null) but was not aborted "
                                                      "(only a request aborted while waiting is never scheduled)"),
                         (np.isfinite(admit) & ~(release >= admit), "finished before it was scheduled")):
        if bad.any():
            i = int(np.argmax(bad))
            raise SimulationError(f"{_request(trace, i)} {problem} (scheduled "
                                  f"{admit[i]:g} s, finished {release[i]:g} s): its recorded timing cannot be replayed; "
                                  f"pass --timing model")
    return admit, release


def recorded_timing(trace, origin: float, offsets: np.ndarray, block: np.ndarray, prompt: np.ndarray,
                    output: np.ndarray, engine_block_size: int) -> RecordedTiming:
    """The recorded timing of ``trace``'s requests (it has the fields: :func:`timing_absent`).

    ``origin`` is the workload's time zero; ``offsets``/``block`` its prompt's full blocks.

    Raises
    ------
    SimulationError
        Bad recorded values (:func:`recorded_times`).
    """
    admit, release = recorded_times(trace)
    admit, release = admit - origin, release - origin
    size = engine_block_size
    n_full = np.diff(offsets)
    n_prompt = np.maximum(-(-prompt // size), n_full)
    written = prompt + np.maximum(output, 1) - 1  # tokens whose KV the request computes
    n_output_full = np.maximum(written // size - n_full, 0)
    n_new = np.maximum(-(-written // size) - n_prompt, n_output_full)
    length = n_prompt + n_output_full
    new_offsets = np.zeros(offsets.size, dtype=np.int64)
    np.cumsum(length, out=new_offsets[1:])
    owner = np.repeat(np.arange(n_full.size), length)
    depth = np.arange(new_offsets[-1]) - new_offsets[owner]
    new_block = np.full(new_offsets[-1], NONE, dtype=np.int64)
    new_block[depth < n_full[owner]] = block
    from_output = depth >= n_prompt[owner]
    first_fresh = int(block.max()) + 1 if block.size else 0
    new_block[from_output] = np.arange(first_fresh, first_fresh + int(from_output.sum()))
    next_use = np.full(new_block.size, math.inf)
    cached = new_block != NONE
    nxt = next_access(new_block[cached], owner[cached])
    reused = nxt >= 0
    later = np.full(nxt.size, math.inf)
    later[reused] = admit[owner[cached][nxt[reused]]]
    next_use[cached] = np.where(np.isnan(later), math.inf, later)
    return RecordedTiming(admit=admit, release=release, n_full=n_full.astype(np.int64),
                          n_prompt=n_prompt.astype(np.int64), n_new=n_new.astype(np.int64), offsets=new_offsets,
                          block=new_block, next_use=next_use)


def _seconds(trace, name: str) -> np.ndarray:
    """The trace's column ``name`` as float64 seconds (missing or null: NaN).

    Raises
    ------
    SimulationError
        A value that is not a finite number (a boolean, a string, inf).
    """
    column = trace.extra[name]
    if column.dtype.kind in "fiu":
        values = column.astype(np.float64)
    else:  # objects (null somewhere), or booleans
        values = np.full(column.shape, math.nan)
        for i, v in enumerate(column.tolist()):
            if v is not None:
                if type(v) not in (int, float):
                    raise SimulationError(f"{_request(trace, i)}: {name} must be a number of seconds or null, "
                                          f"got {type(v).__name__} {v!r:.40}")
                values[i] = v
    if np.isinf(values).any():
        i = int(np.argmax(np.isinf(values)))
        raise SimulationError(f"{_request(trace, i)}: {name} must be a finite number of seconds or null, "
                              f"got {float(values[i])!r}")
    return values


def _request(trace, i: int) -> str:
    return f"request {int(trace.chat_id[i])}" + (f" of {trace.source}" if trace.source else "")


def replay_python(workload, timing: RecordedTiming, classes: list[int], gpu) -> tuple[list[int], list[int]]:
    """The reference replay on recorded timing over a :class:`~kvprof.sim.cache.PrefixCache`:
    ``(hits, held)`` per request, as :func:`kvprof.core.timed.replay` computes them."""
    blocks = timing.block.tolist()
    next_use = timing.next_use.tolist()
    offsets = timing.offsets.tolist()
    n_full, n_prompt, n_new = timing.n_full.tolist(), timing.n_prompt.tolist(), timing.n_new.tolist()
    n_lookup = workload.n_lookup.tolist()
    n = len(n_prompt)
    hits, held, slots = [0] * n, [0] * n, [[] for _ in range(n)]
    for r, admits, now in zip(*(a.tolist() for a in timing.events())):
        start, mine = offsets[r], slots[r]
        if admits:
            n_hit_evictable = gpu.cached_prefix(blocks, start, n_lookup[r], mine)
            hits[r] = len(mine)
            held[r] = hits[r] + min(n_prompt[r] - hits[r], gpu.n_free - n_hit_evictable)
            gpu.pin_hits(mine, now, classes[r], next_use, start)
            gpu.allocate(blocks, next_use, start, hits[r], n_full[r], held[r], now, classes[r], mine)
            gpu.policy.admit(r, blocks[start:start + n_full[r]], now, classes[r], n_lookup=n_lookup[r],
                             n_blocks=n_prompt[r])
        else:
            gpu.policy.finish(r, now, blocks[start:offsets[r + 1]], n_blocks=n_prompt[r] + n_new[r])
            more = min(n_new[r], gpu.n_free)
            gpu.allocate(blocks, next_use, start, held[r], offsets[r + 1] - start, held[r] + more, now, classes[r],
                         mine)
            held[r] += more
            gpu.release(mine, now)
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
        raise SimulationError(_NO_TIERS)
    classes = workload.codes_for(policy).astype(np.int64)
    if engine == "compiled":
        from kvprof.core import tiers
        from kvprof.core.build import compile_policy, write_back
        from kvprof.core.timed import replay

        compiled = compile_policy(policy, capacity)
        gpu = tiers.new_device(compiled, capacity, timing.n_contents)
        hits, held = replay(gpu, timing.block, timing.offsets, timing.n_full, timing.n_prompt, workload.n_lookup,
                            timing.n_new, classes, timing.next_use, *timing.events(), False)
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
