"""The replay loop of :func:`kvprof.sim.engine.simulate`, compiled.

:func:`replay` runs :class:`kvprof.sim.engine.Replay`'s loop step for step (FCFS queue, chunked
prefill budget, decode heap, capacity schedule, CPU tier) over the compiled tiers of
:mod:`kvprof.core.tiers`, so each request costs one pass of compiled code and no Python call.
The accesses come in windows of requests (:mod:`kvprof.core.stream`): the loop pauses at the top
of an engine step when it may admit a request beyond its window, and :func:`run` hands it the next
one; its state between calls lives in a :data:`state_type` struct.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from numba import njit, types
from numba.experimental import structref
from numba.typed import List

from kvprof.core import stream, structs, tiers
from kvprof.core.build import compile_policy, write_back
from kvprof.core.interrupts import compiled_call
from kvprof.core.wa import policy_admit, policy_finish
from kvprof.core.seats import give_seat, new_free, take_seat


class StateType(structs.StructType):
    pass


class State(structref.StructRefProxy):
    """Python handle of a paused replay."""


#: Everything :func:`replay` keeps between engine steps (its locals of the same names).
state_type = structs.struct(StateType, State, [
    ("qttft", types.float64[:]), ("served", types.bool_[:]), ("request_hits", types.int64[:]),
    ("seat_of", types.int64[:]), ("seats", types.ListType(types.int64[::1])),
    ("free_seats", types.int64[:]), ("n_free_seats", types.int64),
    ("prefill_r", types.int64[:]), ("prefill_left", types.int64[:]),
    ("prefill_head", types.int64), ("prefill_tail", types.int64),
    ("decoding", structs.heap_type), ("lookup", types.int64[:]),
    ("n_running", types.int64), ("hits_device", types.int64), ("hits_host", types.int64), ("computed", types.int64),
    ("waiting_head", types.int64), ("next_arrival", types.int64), ("next_change", types.int64), ("now", types.float64),
])


@njit(cache=True)
def new_state(n):
    """A replay of ``n`` requests before its first step."""
    st = structref.new(state_type)
    st.qttft = np.full(n, np.nan)
    st.served = np.zeros(n, np.bool_)
    st.request_hits = np.zeros(n, np.int64)
    st.seat_of = np.full(n, -1, np.int64)
    st.seats = List.empty_list(types.int64[::1])
    st.free_seats = new_free()
    st.n_free_seats = 0
    st.prefill_r = np.zeros(n, np.int64)  # admitted requests with uncomputed tokens, in admission order
    st.prefill_left = np.zeros(n, np.int64)
    st.prefill_head = st.prefill_tail = 0
    st.decoding = structs.new_heap(64)  # (finish time, 0, request)
    st.lookup = np.zeros(16, np.int64)
    st.n_running = st.hits_device = st.hits_host = st.computed = 0
    st.waiting_head = st.next_arrival = 0  # waiting: requests waiting_head .. next_arrival - 1
    st.next_change = 1
    st.now = 0.0
    return st


@njit(cache=True)
def first_needed(st, has_host):
    """The first request whose blocks the replay may still read: the head of the queue, or the
    oldest prefilling request when the CPU tier stores its blocks at its prefill's end."""
    if has_host and st.prefill_head < st.prefill_tail:
        return min(st.waiting_head, st.prefill_r[st.prefill_head])
    return st.waiting_head


@njit(cache=True)
def replay(st, gpu, host, has_host, arrival, output, finish, prompt, offsets, blocks, next_use, base, loaded,
           n_lookup, n_total, classes, host_classes, schedule_t, schedule_c, ebs, step_overhead, prefill_rate,
           max_batched, max_seqs, decode, time_per_token, host_load_s, check):
    """Replay requests from the state ``st`` on; return True when every request is done, False
    (paused at the top of an engine step) when a request at or past ``loaded`` may be admitted.

    ``blocks``/``next_use`` hold the accesses of requests ``first_needed(st) .. loaded - 1``,
    access ``j`` at ``j - base``. The other parameters are the workload's arrays (``finish``: each
    request's finish code, 0 unknown) and the cost model's numbers as ``Replay`` reads them;
    ``schedule_t``/``schedule_c`` the capacity schedule (its first entry already applied to
    ``gpu``); ``check`` verifies both tiers' invariants after every admission and release. ``st``
    ends with ``qttft``, ``served``, ``hits_device``, ``hits_host``, ``computed``, ``now`` (the
    end) and ``request_hits`` (each request's device hits, the length of the prefix it found).
    """
    n = len(arrival)
    qttft, served, request_hits, seat_of, seats = st.qttft, st.served, st.request_hits, st.seat_of, st.seats
    free_seats, n_free_seats = st.free_seats, st.n_free_seats
    prefill_r, prefill_left, prefill_head, prefill_tail = st.prefill_r, st.prefill_left, st.prefill_head, st.prefill_tail
    decoding, lookup = st.decoding, st.lookup
    n_running, hits_device, hits_host, computed = st.n_running, st.hits_device, st.hits_host, st.computed
    waiting_head, next_arrival, next_change, now = st.waiting_head, st.next_arrival, st.next_change, st.now
    done = False
    while True:
        while next_change < len(schedule_t) and schedule_t[next_change] <= now:
            tiers.set_limit(gpu, schedule_c[next_change], now)
            next_change += 1
        while decoding.n and decoding.a[0] <= now:
            r = structs.heap_pop(decoding)
            _release(gpu, host, has_host, seats, seat_of[r], n_total[r], output[r], finish[r], now, check)
            free_seats, n_free_seats = give_seat(free_seats, n_free_seats, seat_of[r])
            n_running -= 1
        while next_arrival < n and arrival[next_arrival] <= now:
            next_arrival += 1
        if loaded < min(next_arrival, waiting_head + max_seqs - n_running):
            break  # this step may admit a request whose blocks are not here yet

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
            start, stop = offsets[r] - base, offsets[r + 1] - base
            if n_total[r] > len(lookup):
                lookup = np.zeros(max(n_total[r], 2 * len(lookup)), np.int64)
            n_device, n_hit_evictable = tiers.cached_prefix(gpu, blocks, start, n_lookup[r], lookup)
            # Hit blocks that are evictable now stop being free once pinned.
            if n_total[r] - n_device > tiers.n_free(gpu) - n_hit_evictable:
                break
            n_host = tiers.cached_run(host, blocks, start + n_device, start + n_lookup[r]) if has_host else 0
            seat, n_free_seats = take_seat(seats, free_seats, n_free_seats, n_total[r])
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
                done = True
                break
            now = max(now, pending)
            continue

        now += step_overhead + step_tokens / prefill_rate + host_loads * host_load_s
        while prefill_head < prefill_tail and not prefill_left[prefill_head]:
            r = prefill_r[prefill_head]
            prefill_head += 1
            qttft[r] = now - arrival[r]
            if has_host:  # the connector offloads the computed prompt's full blocks
                tiers.store(host, blocks, next_use, offsets[r] - base, offsets[r + 1] - offsets[r], now,
                            host_classes[r])
            if decode:
                structs.heap_push(decoding, now + output[r] * time_per_token, 0.0, r, r)
            else:
                _release(gpu, host, has_host, seats, seat_of[r], n_total[r], output[r], finish[r], now, check)
                free_seats, n_free_seats = give_seat(free_seats, n_free_seats, seat_of[r])
                n_running -= 1
    st.lookup, st.free_seats, st.n_free_seats = lookup, free_seats, n_free_seats
    st.prefill_head, st.prefill_tail = prefill_head, prefill_tail
    st.n_running, st.hits_device, st.hits_host, st.computed = n_running, hits_device, hits_host, computed
    st.waiting_head, st.next_arrival, st.next_change, st.now = waiting_head, next_arrival, next_change, now
    return done


@njit(cache=True)
def _release(gpu, host, has_host, seats, seat, n, n_output, code, now, check):
    policy_finish(gpu.policy, seat, now, seats[seat][:0], 0, n_output, code)  # no contents: admit had them all
    tiers.release(gpu, seats[seat], n, now)
    if check:
        _check(gpu, host, has_host)


@njit(cache=True)
def _check(gpu, host, has_host):
    tiers.check_device(gpu)
    if has_host:
        tiers.check_host(host)


def run(workload, policy, host_policy, config, schedule, check: bool = False, per_request: bool = False,
        chunk: int = stream.CHUNK_REQUESTS) -> dict:
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
    chunk : int
        Requests whose accesses are numbered (and their next uses read) at a time; any size gives
        the same replay, number for number.

    Returns
    -------
    dict
        ``qttft`` (served requests), ``served``, ``hits_device``, ``hits_host``, ``computed``,
        ``end``, ``evictions``, ``dropped``, ``host_evictions`` (and ``request_hits``).
    """
    cost = config.cost
    peak = max(c for _, c in schedule)
    gpu_policy = compile_policy(policy, peak)
    gpu = tiers.new_device(gpu_policy, schedule[0][1], 0)
    has_host = bool(config.cpu_capacity)
    # Without a CPU tier the loop still takes one (never used) to keep one compiled signature.
    host_reference = host_policy if has_host else policy
    host_compiled = compile_policy(host_reference, config.cpu_capacity) if has_host else gpu_policy
    host = tiers.new_host(host_compiled, config.cpu_capacity, 0)
    classes = workload.codes_for(policy).astype(np.int64)
    host_classes = workload.codes_for(host_reference).astype(np.int64)
    n_total = workload.blocks_needed(cost.decode).astype(np.int64)
    schedule_t = np.array([t for t, _ in schedule], dtype=np.float64)
    schedule_c = np.array([c for _, c in schedule], dtype=np.int64)
    st = new_state(workload.n_requests)
    offsets = workload.offsets
    contents = stream.new_table(1024)
    blocks, next_use, first, loaded = np.zeros(0, np.int64), np.zeros(0), 0, 0
    future = policy.offline or (has_host and host_policy.offline)
    with stream.next_uses(workload, chunk) if future else _no_next_uses() as later:
        while not compiled_call(replay, st, gpu, host, has_host, workload.arrival, workload.output_tokens,
                                workload.finish, workload.prompt_tokens, offsets, blocks, next_use, offsets[first], loaded,
                                workload.n_lookup, n_total, classes, host_classes, schedule_t, schedule_c,
                                workload.engine_block_size, cost.step_overhead_s, cost.prefill_tokens_per_s,
                                cost.max_batched_tokens, cost.max_num_seqs, cost.decode,
                                cost.time_per_output_token_s, cost.host_load_s_per_block, check):
            # The next window: the requests still needed, and the next chunk after the loaded ones.
            keep = first_needed(st, has_host)  # <= loaded: nothing is read before it is loaded
            stop = min(loaded + chunk, workload.n_requests)
            new_blocks = np.empty(offsets[stop] - offsets[loaded], np.int64)
            n_contents = stream.number(contents, workload.engine_hashes(loaded, stop), new_blocks)
            tiers.reserve_contents(gpu, n_contents)
            if has_host:
                tiers.reserve_host_contents(host, n_contents)
            kept = slice(offsets[keep] - offsets[first], offsets[loaded] - offsets[first])
            blocks = np.concatenate([blocks[kept], new_blocks])
            tiers.recycle_contents(contents, gpu, host, has_host, blocks)
            new_next_use = later.read(offsets[loaded], offsets[stop]) if later else np.full(new_blocks.size, np.inf)
            next_use = np.concatenate([next_use[kept], new_next_use])
            first, loaded = keep, stop
    write_back(policy, gpu_policy)
    if has_host:
        write_back(host_policy, host_compiled)
    evictions, dropped = tiers.counts(gpu)
    host_evictions = tiers.counts_host(host) if has_host else 0
    qttft, served, request_hits, hits_device, hits_host, computed, end = _outcome(st)
    outcome = {"qttft": qttft[served], "served": served, "hits_device": int(hits_device),
               "hits_host": int(hits_host), "computed": int(computed), "end": float(end),
               "evictions": int(evictions), "dropped": int(dropped), "host_evictions": int(host_evictions)}
    if per_request:
        outcome["request_hits"] = request_hits
    return outcome


@njit(cache=True)
def _outcome(st):
    return st.qttft, st.served, st.request_hits, st.hits_device, st.hits_host, st.computed, st.now


@contextmanager
def _no_next_uses():
    """No next uses: no policy reads the future."""
    yield None
