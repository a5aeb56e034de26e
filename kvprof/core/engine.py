"""The replay loop of :func:`kvprof.sim.engine.simulate`, compiled.

:func:`replay` runs :class:`kvprof.sim.engine._Replay`'s loop step for step (FCFS queue, chunked
prefill budget, decode heap, capacity schedule, CPU tier) over the compiled tiers of
:mod:`kvprof.core.tiers`, so each request costs one pass of compiled code and no Python call.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvprof.core import structs, tiers
from kvprof.core.build import compile_policy, write_back
from kvprof.core.policy import policy_admit, policy_finish


@njit(cache=True)
def replay(gpu, host, has_host, arrival, output, prompt, offsets, blocks, next_use, n_lookup, n_total,
           classes, host_classes, schedule_t, schedule_c, ebs, step_overhead, prefill_rate, max_batched,
           max_seqs, decode, time_per_token, host_load_s, check):
    """Replay every request; return ``(qttft, served, hits_device, hits_host, computed, end, request_hits)``
    (``request_hits``: each request's device hits, the length of the prefix it found).

    Parameters are the workload's arrays and the cost model's numbers as ``_Replay`` reads them;
    ``schedule_t``/``schedule_c`` the capacity schedule (its first entry already applied to
    ``gpu``); ``check`` verifies both tiers' invariants after every admission and release.
    """
    n = len(arrival)
    qttft = np.full(n, np.nan)
    served = np.zeros(n, np.bool_)
    request_hits = np.zeros(n, np.int64)
    seat_of = np.full(n, -1, np.int64)
    seats = [np.zeros(0, np.int64) for _ in range(0)]
    free_seats = np.zeros(16, np.int64)
    n_free_seats = 0
    prefill_r = np.zeros(n, np.int64)  # admitted requests with uncomputed tokens, in admission order
    prefill_left = np.zeros(n, np.int64)
    prefill_head = prefill_tail = 0
    decoding = structs.new_heap(64)  # (finish time, 0, request)
    lookup = np.zeros(16, np.int64)
    n_running = hits_device = hits_host = computed = 0
    waiting_head = next_arrival = 0  # waiting: requests waiting_head .. next_arrival - 1
    next_change = 1
    now = 0.0
    while True:
        while next_change < len(schedule_t) and schedule_t[next_change] <= now:
            tiers.set_limit(gpu, schedule_c[next_change], now)
            next_change += 1
        while decoding.n and decoding.a[0] <= now:
            r = structs.heap_pop(decoding)
            _release(gpu, host, has_host, seats, seat_of[r], n_total[r], now, check)
            free_seats, n_free_seats = _give_back(free_seats, n_free_seats, seat_of[r])
            n_running -= 1
        while next_arrival < n and arrival[next_arrival] <= now:
            next_arrival += 1

        # One engine step: running prefills first, then admissions while the budget lasts.
        budget = max_batched
        for i in range(prefill_head, prefill_tail):
            take = min(prefill_left[i], budget)
            prefill_left[i] -= take
            budget -= take
            if not budget:
                break
        host_loads = 0
        while waiting_head < next_arrival and budget and n_running < max_seqs:
            r = waiting_head
            start, stop = offsets[r], offsets[r + 1]
            if n_total[r] > len(lookup):
                lookup = np.zeros(max(n_total[r], 2 * len(lookup)), np.int64)
            n_device, n_hit_evictable = tiers.cached_prefix(gpu, blocks, start, n_lookup[r], lookup)
            # Hit blocks that are evictable now stop being free once pinned.
            if n_total[r] - n_device > tiers.n_free(gpu) - n_hit_evictable:
                break
            n_host = tiers.cached_run(host, blocks, start + n_device, start + n_lookup[r]) if has_host else 0
            if n_free_seats:
                n_free_seats -= 1
                seat = free_seats[n_free_seats]
            else:
                seat = len(seats)
                seats.append(np.zeros(0, np.int64))
            if len(seats[seat]) < n_total[r]:
                seats[seat] = np.zeros(max(n_total[r], 2 * len(seats[seat])), np.int64)
            slots = seats[seat]
            slots[:n_device] = lookup[:n_device]
            seat_of[r] = seat
            tiers.pin_hits(gpu, slots, n_device, now, classes[r], next_use, start)
            tiers.allocate(gpu, blocks, next_use, start, n_device, stop - start, n_total[r], now, classes[r], slots)
            policy_admit(gpu.policy, seat, blocks[start:stop], n_lookup[r], n_total[r], now, classes[r])
            if n_host:
                tiers.load(host, blocks, next_use, start, n_device, n_device + n_host, now, host_classes[r])
            if check:
                _check(gpu, host, has_host)
            waiting_head += 1
            served[r] = True
            request_hits[r] = n_device
            n_running += 1
            hits_device += n_device
            hits_host += n_host
            host_loads += n_host
            # At least one token: vLLM recomputes the prompt's last token (n_lookup excludes it).
            uncached = max(prompt[r] - (n_device + n_host) * ebs, 1)
            computed += uncached
            take = min(uncached, budget)
            budget -= take
            prefill_r[prefill_tail] = r
            prefill_left[prefill_tail] = uncached - take
            prefill_tail += 1
        step_tokens = max_batched - budget

        if not step_tokens:
            if waiting_head < next_arrival and not decoding.n and next_change >= len(schedule_t):
                waiting_head += 1  # nothing runs and the cache never grows again: the head never fits
                continue
            pending = np.inf
            if next_arrival < n:
                pending = min(pending, arrival[next_arrival])
            if decoding.n:
                pending = min(pending, decoding.a[0])
            if next_change < len(schedule_t):
                pending = min(pending, schedule_t[next_change])
            if pending == np.inf:
                break
            now = max(now, pending)
            continue

        now += step_overhead + step_tokens / prefill_rate + host_loads * host_load_s
        while prefill_head < prefill_tail and not prefill_left[prefill_head]:
            r = prefill_r[prefill_head]
            prefill_head += 1
            qttft[r] = now - arrival[r]
            if has_host:  # the connector offloads the computed prompt's full blocks
                tiers.store(host, blocks, next_use, offsets[r], offsets[r + 1] - offsets[r], now, host_classes[r])
            if decode:
                structs.heap_push(decoding, now + output[r] * time_per_token, 0.0, r, r)
            else:
                _release(gpu, host, has_host, seats, seat_of[r], n_total[r], now, check)
                free_seats, n_free_seats = _give_back(free_seats, n_free_seats, seat_of[r])
                n_running -= 1
    return qttft, served, hits_device, hits_host, computed, now, request_hits


@njit(cache=True)
def _release(gpu, host, has_host, seats, seat, n, now, check):
    policy_finish(gpu.policy, seat, now, seats[seat][:0], 0)  # no contents: admit had them all
    tiers.release(gpu, seats[seat], n, now)
    if check:
        _check(gpu, host, has_host)


@njit(cache=True)
def _give_back(free_seats, n_free, seat):
    if n_free == len(free_seats):
        free_seats = structs.grown(free_seats, n_free + 1, 0)
    free_seats[n_free] = seat
    return free_seats, n_free + 1


@njit(cache=True)
def _check(gpu, host, has_host):
    tiers.check_device(gpu)
    if has_host:
        tiers.check_host(host)


def run(workload, policy, host_policy, config, schedule, check: bool = False, per_request: bool = False) -> dict:
    """Replay ``workload`` with the compiled twins of ``policy`` (and ``host_policy``).

    Parameters
    ----------
    workload : kvprof.sim.workload.Workload
    policy, host_policy : EvictionPolicy
        Fresh reference instances; they are not driven, but ``wa``'s leader and shadow hits are
        written back to them at the end (:func:`kvprof.core.build.write_back`).
    config : kvprof.sim.config.SimConfig
    schedule : list of (float, int)
        The capacity schedule, its first entry the starting capacity.
    check : bool
        Verify both tiers' invariants after every admission and release (raises AssertionError).
    per_request : bool
        Also return ``request_hits``: each request's device hits (int64, 0 if never served).

    Returns
    -------
    dict
        ``qttft`` (served requests), ``served``, ``hits_device``, ``hits_host``, ``computed``,
        ``end``, ``evictions``, ``dropped``, ``host_evictions`` (and ``request_hits``).
    """
    cost = config.cost
    blocks, n_contents = _by_first_use(workload.block)
    peak = max(c for _, c in schedule)
    gpu_policy = compile_policy(policy, peak)
    gpu = tiers.new_device(gpu_policy, schedule[0][1], n_contents)
    has_host = bool(config.cpu_capacity)
    # Without a CPU tier the loop still takes one (never used) to keep one compiled signature.
    host_reference = host_policy if has_host else policy
    host_compiled = compile_policy(host_reference, config.cpu_capacity) if has_host else gpu_policy
    host = tiers.new_host(host_compiled, config.cpu_capacity, n_contents if has_host else 0)
    classes = workload.codes_for(policy).astype(np.int64)
    host_classes = workload.codes_for(host_reference).astype(np.int64)
    qttft, served, hits_device, hits_host, computed, end, request_hits = replay(
        gpu, host, has_host, workload.arrival, workload.output_tokens, workload.prompt_tokens, workload.offsets,
        blocks, workload.next_use, workload.n_lookup, workload.blocks_needed(cost.decode).astype(np.int64),
        classes, host_classes, np.array([t for t, _ in schedule], dtype=np.float64),
        np.array([c for _, c in schedule], dtype=np.int64), workload.engine_block_size, cost.step_overhead_s,
        cost.prefill_tokens_per_s, cost.max_batched_tokens, cost.max_num_seqs, cost.decode,
        cost.time_per_output_token_s, cost.host_load_s_per_block, check)
    write_back(policy, gpu_policy)
    if has_host:
        write_back(host_policy, host_compiled)
    evictions, dropped = tiers.counts(gpu)
    host_evictions = tiers.counts_host(host) if has_host else 0
    outcome = {"qttft": qttft[served], "served": served, "hits_device": int(hits_device),
               "hits_host": int(hits_host), "computed": int(computed), "end": float(end), "evictions": int(evictions),
               "dropped": int(dropped), "host_evictions": int(host_evictions)}
    if per_request:
        outcome["request_hits"] = request_hits
    return outcome


@njit(cache=True)
def _by_first_use(blocks):
    """``blocks`` renumbered in order of first use, and how many distinct ones there are.

    Policies compare contents only for equality, so any renumbering gives the same decisions;
    this one keeps the tables indexed by content (the tiers' maps, ghosts, shadows) dense where
    the replay is: new contents take the next free numbers instead of random ones.
    """
    top = 0
    for b in blocks:
        top = max(top, b + 1)
    rank = np.full(top, -1, np.int64)
    out = np.empty(len(blocks), np.int64)
    n = 0
    for j in range(len(blocks)):
        if rank[blocks[j]] < 0:
            rank[blocks[j]] = n
            n += 1
        out[j] = rank[blocks[j]]
    return out, n
