"""Replays on recorded timing: every request holds its blocks exactly as long as the server did.

A vLLM recording (``vllm serve --kv-record``, :mod:`kvprof.recording`) says for each request when
the scheduler first gave it its blocks (``scheduled``) and when it freed them (``finished``;
:mod:`kvprof.sim.recorded` reads them into a :class:`~kvprof.sim.recorded.RecordedTiming`).
Replayed on those times instead of a modelled server, the simulated prefix cache sees the
server's own concurrency: which blocks were pinned, and for how long. The eviction policy and
the capacity are the simulation's, so one recording answers "what would LRU, wa or Belady have
hit on this server".

What the replay models as the server did, per request: when scheduled, it takes its prefix hits
(at most ``(prompt - 1) // block`` blocks, as vLLM) and new blocks for the rest of its first
allocation (its prompt, or its first prefill chunk), the full ones cached at once; while it runs,
one block at each time the recording says the server gave it one (``grown``: a decode step that
started a block, a later prefill chunk); when it finishes, the blocks its output filled
(``prompt + output - 1`` tokens: the last sampled token is never written) are cached as vLLM caches
them, under the contents the recording names for them (``output_hash_ids``), so a later turn that
sends the response back hits them: first its prompt's partial last block, filled in place, then
the blocks it took while running (a recording without ``grown`` takes them at the finish, as many
as vLLM's ``allocate_slots`` took: :func:`kvprof.core.timed.blocks_at_finish`); then it frees them
all, tail first. Requests never
scheduled (aborted while waiting) take nothing and are counted as not served, and so are requests
whose prompt needs more blocks than the whole simulated cache (rejected, as on modelled timing: the
server had room for them, a smaller cache would not). The policy hears of
each request once scheduled (``admit``: its full prompt blocks) and once finished (``finish``:
all its full blocks, output included, which ``wa``'s shadows cache then as the real tier does; and its
client hint, where the policy takes hints, as the plugin's pool hears it: Python engine only). The live
counterfactual of the vLLM plugin runs the same steps as requests come and go.
"""

from __future__ import annotations

import numpy as np

from kvprof.core.timed import ADMIT, GROW
from kvprof.policy.base import finish_takes
from kvprof.sim.config import SimulationError
from kvprof.sim.metrics import metrics
from kvprof.sim.recorded import NO_TIERS, RecordedTiming


def replay_python(workload, timing: RecordedTiming, classes: list[int], gpu,
                  events: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[list[int], list[int]]:
    """The reference replay of ``events`` (:meth:`RecordedTiming.events`, or some of them) on recorded timing
    over a :class:`~kvprof.sim.cache.PrefixCache`: ``(hits, held)`` per request, as
    :func:`kvprof.core.timed.replay` computes them."""
    blocks = timing.block.tolist()
    next_use = timing.next_use.tolist()
    offsets = timing.offsets.tolist()
    n_full, n_prompt, n_new = timing.n_full.tolist(), timing.n_prompt.tolist(), timing.n_new.tolist()
    n_first, n_last = timing.n_first.tolist(), timing.n_last.tolist()
    n_lookup, n_output = workload.n_lookup.tolist(), workload.output_tokens.tolist()
    codes = workload.finish.tolist() if finish_takes(gpu.policy, "finish") else None  # how each request ended
    # each request's client hint, told as the vLLM plugin's pool applies it: at the finish, to the free that follows
    hints = workload.hints.hints() if workload.hints is not None and finish_takes(gpu.policy, "hint") else None
    n = len(n_prompt)
    hits, held, first_held, slots = [0] * n, [0] * n, [0] * n, [[] for _ in range(n)]
    for r, kind, now in zip(*(a.tolist() for a in events)):
        start, mine = offsets[r], slots[r]
        if kind == ADMIT:
            n_hit_evictable = gpu.cached_prefix(blocks, start, n_lookup[r], mine)
            hits[r] = len(mine)
            held[r] = hits[r] + min(max(n_first[r] - hits[r], 0), gpu.n_free - n_hit_evictable)
            gpu.pin_hits(mine, now, classes[r], next_use, start)
            gpu.allocate(blocks, next_use, start, hits[r], n_full[r], held[r], now, classes[r], mine)
            first_held[r] = held[r]
            gpu.policy.admit(r, blocks[start:start + n_full[r]], now, classes[r], n_lookup=n_lookup[r],
                             n_blocks=n_prompt[r])
        elif kind == GROW:  # one more block, empty until the finish (kvprof.core.timed.grow)
            if held[r] < n_prompt[r] + n_new[r] and gpu.n_free >= 1:
                gpu.allocate(blocks, next_use, start, held[r], 0, held[r] + 1, now, classes[r], mine)
                held[r] += 1
        else:
            told = {} if codes is None else {"finish": codes[r] or None}
            if hints is not None:
                told["hint"], told["held"] = hints[r], mine
            gpu.policy.finish(r, now, blocks[start:offsets[r + 1]], n_blocks=n_prompt[r] + n_new[r],
                              n_output=n_output[r], **told)
            gpu.cache_filled(blocks, next_use, start, min(n_full[r], first_held[r]), offsets[r + 1] - start, mine, now,
                             classes[r])
            more = min(n_last[r], gpu.n_free)
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
    timing = workload.timing
    if config.cpu_capacity or config.capacity_schedule:
        raise SimulationError(NO_TIERS)
    classes = workload.codes_for(policy).astype(np.int64)
    fits = timing.n_prompt <= capacity  # the others are rejected, never admitted
    request, kind, time = timing.events()
    events = request[fits[request]], kind[fits[request]], time[fits[request]]
    if engine == "compiled":
        from kvprof.core import tiers
        from kvprof.core.build import compile_policy, write_back
        from kvprof.core.timed import RecordedRequests, replay

        compiled = compile_policy(policy, capacity)
        gpu = tiers.new_device(compiled, capacity, timing.n_contents)
        requests = RecordedRequests(blocks=timing.block, offsets=timing.offsets, n_full=timing.n_full,
                                    n_prompt=timing.n_prompt, n_lookup=workload.n_lookup, n_new=timing.n_new,
                                    classes=classes, next_use=timing.next_use, n_output=workload.output_tokens,
                                    finish=workload.finish.astype(np.int64), n_first=timing.n_first,
                                    n_last=timing.n_last)
        hits, held = replay(gpu, requests, events)
        write_back(policy, compiled)
        evictions, dropped = tiers.counts(gpu)
    else:
        from kvprof.sim.cache import PrefixCache

        gpu = PrefixCache(policy, capacity)
        hits, held = (np.array(a, dtype=np.int64)
                      for a in replay_python(workload, timing, classes.tolist(), gpu, events))
        evictions, dropped = gpu.evictions, gpu.dropped
    served = np.isfinite(timing.admit) & fits
    prompt = workload.prompt_tokens
    computed = int(np.maximum(prompt - hits * workload.engine_block_size, 1)[served].sum())
    end = float(timing.release[served].max()) if served.any() else 0.0
    return metrics(workload, config.cost, policy.name, capacity, qttft=np.empty(0), served=served,
                   hits_device=int(hits.sum()), hits_host=0, computed=computed, end=end, evictions=int(evictions),
                   dropped=int(dropped), host_evictions=0)
