"""The recorded timing of a vLLM recording: when the server held which blocks, request by request.

A vLLM recording (``vllm serve --kv-record``, :mod:`kvprof.recording`) says for each request when
the scheduler first gave it its blocks (``scheduled``) and when it freed them (``finished``).
:func:`recorded_timing` turns those times into a :class:`RecordedTiming`, which
:func:`~kvprof.sim.workload.prepare_workload` builds beside the workload; :func:`timing_absent`,
:func:`resolve_timing` and :func:`recorded_times` say whether, and why not, a replay can run on
it. The replay on it is :mod:`kvprof.sim.timed`'s; this module holds only the data, so the
workload and the replay both import it and neither imports the other.

The recordings of several servers are one fleet trace (:func:`fleet_trace`, ``kvprof fleet DIR1
DIR2 ...``): their requests on one clock, each with the replica that received it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvprof.core.timed import ADMIT, FINISH, GROW, blocks_at_finish
from kvprof.profiler.records import GROWN, OUTPUT_HASH_IDS
from kvprof.profiler.reuse import next_access
from kvprof.profiler.trace import Trace
from kvprof.recording import CHAT_IDS_PER_START, FILE, Recording, RecordingError
from kvprof.sim.cache import NO_BLOCK as NONE
from kvprof.sim.config import SimulationError

#: Trace fields a recording adds (seconds, the timestamps' clock).
SCHEDULED, FINISHED = "scheduled", "finished"
#: The field of a fleet trace saying which replica (server, and data-parallel rank of it) received a request.
REPLICA = "replica"


@dataclass(frozen=True, eq=False)
class RecordedTiming:
    """When each request of a :class:`~kvprof.sim.workload.Workload` held which blocks.

    Invariants: ``admit <= release`` wherever ``admit`` is finite (NaN: never scheduled), and every
    grow time of a request lies in ``[admit, release]``. Request ``r``'s blocks, by depth, are
    ``block[offsets[r]:offsets[r + 1]]``: its prompt's ``n_full[r]`` full blocks (the workload's),
    then the blocks full at its finish (the first may be its prompt's partial last block, which its
    output filled in place), each the content the recording names for it (``output_hash_ids``: a
    later prompt that sends the response back hits it) or else a content no other request names,
    then ``NONE`` for a partial last prompt block its output did not fill. It holds
    ``n_prompt[r] + n_new[r]`` blocks at its finish, as vLLM's ``allocate_slots`` has it:
    ``ceil(written / block)`` blocks in all and ``written // block`` of them full, where
    ``written = prompt + output - 1`` (the last sampled token's KV is never computed). It takes
    ``n_first[r]`` of them when scheduled, one more at each of its grow times (``grow_request``,
    ``grow_time``: when the server gave it a block while it decoded, or a later prefill chunk, as
    the recording's ``grown`` says), and ``n_last[r]`` more at its finish: a recording without
    ``grown`` takes its prompt's blocks when scheduled and the rest at its finish.

    Attributes
    ----------
    admit, release : float64 arrays, shape (n,)
        Seconds since the evaluation window's start.
    n_full, n_prompt, n_new, n_first, n_last : int64 arrays, shape (n,)
    offsets : int64 array, shape (n + 1,)
    block : int64 array
        Dense content ids (the workload's, then fresh ones), ``NONE`` for partial prompt blocks.
    next_use : float64 array
        Admission time of the next request using the same content (Belady), ``inf`` if none.
    grow_request : int64 array, grow_time : float64 array
        One entry per block taken while running, by request and then time.
    """

    admit: np.ndarray
    release: np.ndarray
    n_full: np.ndarray
    n_prompt: np.ndarray
    n_new: np.ndarray
    n_first: np.ndarray
    n_last: np.ndarray
    offsets: np.ndarray
    block: np.ndarray
    next_use: np.ndarray
    grow_request: np.ndarray
    grow_time: np.ndarray

    @property
    def n_contents(self) -> int:
        return int(self.block.max()) + 1 if self.block.size else 0

    def events(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(request, kind, time)`` of every admission (kind :data:`ADMIT`), grow (:data:`GROW`) and finish
        (:data:`FINISH`), in the order they happened: by time; at one time, as a vLLM step runs them: the
        finishes of requests admitted earlier (vLLM frees finished requests before it schedules the next
        step), then the grows of running requests (it schedules running requests before waiting ones),
        then admissions, then the grows and finishes of requests admitted at that very time; then by
        request. A grow at its request's finish time comes before that finish."""
        scheduled = np.flatnonzero(np.isfinite(self.admit))
        admit, release = self.admit[scheduled], self.release[scheduled]
        grows = np.isfinite(self.admit[self.grow_request])
        grower, grow_time = self.grow_request[grows], self.grow_time[grows]
        grow_rank = np.where(grow_time == self.admit[grower], 1.5,
                             np.where(grow_time == self.release[grower], -0.5, 0.5))
        request = np.concatenate([scheduled, scheduled, grower])
        kind = np.concatenate([np.full(scheduled.size, ADMIT, np.int8), np.full(scheduled.size, FINISH, np.int8),
                               np.full(grower.size, GROW, np.int8)])
        time = np.concatenate([admit, release, grow_time])
        rank = np.concatenate([np.ones(scheduled.size), np.where(release == admit, 2, 0), grow_rank])
        order = np.lexsort((request, rank, time))
        return request[order], kind[order], time[order]


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
        raise SimulationError(NO_TIERS)
    recorded_times(trace)
    return "recorded"


#: Why a replay on recorded timing refuses a CPU tier and a capacity schedule.
NO_TIERS = ("a replay on recorded timing has no CPU tier and no capacity schedule (the recording says nothing of "
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

    ``origin`` is the workload's time zero; ``offsets``/``block`` its prompt's full blocks (at the
    trace's own block size: recorded timing applies at no other).

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
    n_new, n_filled = blocks_at_finish(prompt, output, n_full, n_prompt, size)
    length = np.maximum(n_full + n_filled, n_prompt)
    new_offsets = np.zeros(offsets.size, dtype=np.int64)
    np.cumsum(length, out=new_offsets[1:])
    owner = np.repeat(np.arange(n_full.size), length)
    depth = np.arange(new_offsets[-1]) - new_offsets[owner]
    new_block = np.full(new_offsets[-1], NONE, dtype=np.int64)
    new_block[depth < n_full[owner]] = block
    from_output = (depth >= n_full[owner]) & (depth < (n_full + n_filled)[owner])
    filled_owner = owner[from_output]
    new_block[from_output] = _output_contents(trace, offsets, block, n_filled, depth[from_output] - n_full[filled_owner],
                                              filled_owner)
    next_use = np.full(new_block.size, math.inf)
    cached = new_block != NONE
    nxt = next_access(new_block[cached], owner[cached])
    reused = nxt >= 0
    later = np.full(nxt.size, math.inf)
    later[reused] = admit[owner[cached][nxt[reused]]]
    next_use[cached] = np.where(np.isnan(later), math.inf, later)
    n_total = n_prompt + n_new
    grow_request, grow_time, n_grown = _grows(trace, origin, n_total, admit, release)
    recorded = n_grown >= 0  # the recording says when the request took its blocks
    n_first = np.where(recorded, n_total - np.maximum(n_grown, 0), n_prompt)
    n_last = np.where(recorded, 0, n_new)
    as_int = {name: a.astype(np.int64) for name, a in (("n_full", n_full), ("n_prompt", n_prompt), ("n_new", n_new),
                                                        ("n_first", n_first), ("n_last", n_last))}
    return RecordedTiming(admit=admit, release=release, offsets=new_offsets, block=new_block, next_use=next_use,
                          grow_request=grow_request, grow_time=grow_time, **as_int)


def _output_contents(trace, offsets: np.ndarray, block: np.ndarray, n_filled: np.ndarray, index: np.ndarray,
                     owner: np.ndarray) -> np.ndarray:
    """The contents of the output-filled blocks ``index`` (0: the first past the prompt's full ones) of
    requests ``owner``: the prompts' numbering where the recording's ``output_hash_ids`` name a hash a
    prompt has, a fresh number per other named hash, a fresh one each for blocks it does not name."""
    first_fresh = int(block.max()) + 1 if block.size else 0
    named = trace.extra.get(OUTPUT_HASH_IDS)
    hashes = np.full(index.size, NONE, np.int64)
    have = np.zeros(index.size, bool)
    if named is not None:
        lengths = np.array([0 if ids is None else min(len(ids), k) for ids, k in zip(named.tolist(), n_filled.tolist())],
                           np.int64)
        have = index < lengths[owner]
        if have.any():
            flat = np.concatenate([ids[:k] for ids, k in zip(named.tolist(), lengths.tolist()) if k])
            starts = np.zeros(lengths.size, np.int64)
            np.cumsum(lengths[:-1], out=starts[1:])
            hashes[have] = flat[starts[owner[have]] + index[have]]
    contents = np.empty(index.size, np.int64)
    if have.any():
        # the prompts' own numbering (np.unique's, as Workload.block), then the hashes no prompt has
        prompt_hashes = np.unique(trace.hash_ids[_prompt_positions(trace, offsets)])
        at = np.minimum(np.searchsorted(prompt_hashes, hashes[have]), max(prompt_hashes.size - 1, 0))
        known = prompt_hashes.size > 0
        in_prompts = (prompt_hashes[at] == hashes[have]) if known else np.zeros(int(have.sum()), bool)
        unknown, inverse = np.unique(hashes[have][~in_prompts], return_inverse=True)
        numbers = np.empty(int(have.sum()), np.int64)
        numbers[in_prompts] = at[in_prompts]
        numbers[~in_prompts] = first_fresh + inverse.reshape(-1)
        contents[have] = numbers
        first_fresh += unknown.size
    contents[~have] = np.arange(first_fresh, first_fresh + int((~have).sum()))
    return contents


def _prompt_positions(trace, offsets: np.ndarray) -> np.ndarray:
    """Where the prompts' full blocks (``offsets``: their counts, at the trace's block size) are in ``trace.hash_ids``."""
    lengths = np.diff(offsets)
    owner = np.repeat(np.arange(lengths.size), lengths)
    return trace.hash_offsets[owner] + np.arange(offsets[-1]) - offsets[owner]


def _grows(trace, origin: float, n_total: np.ndarray, admit: np.ndarray, release: np.ndarray):
    """``(grow_request, grow_time, n_grown)`` from the recording's ``grown`` times: one event per block each
    request took after its first ones (at most ``n_total`` of them, in time order, kept within its
    ``[admit, release]``), ``n_grown`` -1 for a request the recording gives no times for."""
    n = n_total.size
    column = trace.extra.get(GROWN)
    n_grown = np.full(n, -1, np.int64)
    if column is None:
        return np.zeros(0, np.int64), np.zeros(0), n_grown
    times = [None if t is None else np.sort(np.asarray(t, np.float64))[:k] for t, k in zip(column.tolist(), n_total.tolist())]
    n_grown = np.array([-1 if t is None else t.size for t in times], np.int64)
    counts = np.maximum(n_grown, 0)
    grow_request = np.repeat(np.arange(n, dtype=np.int64), counts)
    grow_time = np.concatenate([t for t in times if t is not None and t.size] or [np.zeros(0)]) - origin
    grow_time = np.minimum(np.maximum(grow_time, admit[grow_request]), release[grow_request])
    return grow_request, grow_time, n_grown


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


@dataclass(frozen=True)
class FleetTrace:
    """The recordings of a fleet's servers as one trace.

    Invariant: ``trace.extra[REPLICA][i]`` is the replica that received request ``i``, in
    ``range(len(replicas))``; ``replicas[k]`` names replica ``k`` (its recording and rank).
    ``unshared`` is None when every server start recorded its block ids under one shared key
    (``--kv-record-key``: a prefix has the same ids on every replica), else why not;
    ``n_keys`` is how many different keys the starts drew or shared (a prefix gets as many
    different ids at most).
    """

    trace: Trace
    replicas: tuple[str, ...]
    unshared: str | None = None
    n_keys: int = 1


def fleet_trace(parts: Sequence[tuple[str, Trace, Recording]]) -> FleetTrace:
    """One trace of the recordings ``(directory, trace read from it, its recording.json)`` of a
    fleet's servers: every request on the clock of the earliest ``origin``, chat ids kept apart,
    with the replica that received it in ``extra[REPLICA]``: each recording's data-parallel ranks
    (one for a server without data parallelism), in the order given.

    Raises
    ------
    RecordingError
        A recording at another block size or of another model than the first's (naming its
        ``recording.json`` and the field), or one directory given twice.
    """
    first_dir, first_trace, first = parts[0]
    model = first.starts[0].model
    seen: dict[str, str] = {}
    for directory, trace, recording in parts:
        where = f"{directory}/{FILE}"
        real = os.path.realpath(directory)
        if real in seen:
            raise RecordingError(where, f"is the recording {seen[real]} again: give each server's recording once")
        seen[real] = directory
        if recording.block_size != first.block_size:
            raise RecordingError(where, f"{recording.block_size}-token blocks, but {first_dir} recorded "
                                        f"{first.block_size}-token blocks: the servers of one fleet hash the same "
                                        f"blocks (the same --block-size)", where="block_size")
        for i, start in enumerate(recording.starts):
            if start.model != model:
                raise RecordingError(where, f"the server served {start.model!r}, but {first_dir} served {model!r}: "
                                            f"one fleet serves one model", where=f"starts[{i}].model")
    origin = min(recording.origin for _, _, recording in parts)
    names: list[str] = []
    replica, shifted = [], []
    chat_base = 0
    for directory, trace, recording in parts:
        # each rank of a data-parallel server is a replica of its own (its own scheduler and cache)
        replica.append(len(names) + np.searchsorted(recording.ranks, trace.extra["rank"]))
        names += [directory + (f" rank {rank}" if len(recording.ranks) > 1 else "") for rank in recording.ranks]
        shifted.append(_on_clock(trace, recording.origin - origin, chat_base))
        chat_base += len(recording.starts) * CHAT_IDS_PER_START
    merged = _concatenate(shifted, first_trace)
    merged = dataclasses.replace(merged, extra={**merged.extra, REPLICA: np.concatenate(replica).astype(np.int64)})
    recordings = [(directory, recording) for directory, _, recording in parts]
    return FleetTrace(merged.select(np.argsort(merged.timestamp, kind="stable")), tuple(names),
                      unshared_keys(recordings), distinct_keys(recordings))


def unshared_keys(recordings: Sequence[tuple[str, Recording]]) -> str | None:
    """Why the block ids of ``recordings`` (``(directory, recording.json)``) do not name a prefix alike
    on every server, None when all their starts shared one key (``vllm serve --kv-record-key``)."""
    keys = {}
    for directory, recording in recordings:
        for i, start in enumerate(recording.starts):
            if start.key_id is None:
                return (f"{directory} (start {i}{f', rank {start.rank}' if start.rank else ''}) drew its own key "
                        f"for its block ids")
            keys.setdefault(start.key_id, directory)
    if len(keys) > 1:
        first, second = list(keys.values())[:2]
        return f"{first} and {second} recorded under different --kv-record-key files"
    return None


def distinct_keys(recordings: Sequence[tuple[str, Recording]]) -> int:
    """How many different block-id keys the starts of ``recordings`` used: one per shared key file
    (``key_id``), one per start that drew a key of its own."""
    starts = [start for _, recording in recordings for start in recording.starts]
    return len({start.key_id for start in starts if start.key_id is not None}) + sum(
        start.key_id is None for start in starts)


def _on_clock(trace: Trace, shift: float, chat_base: int) -> Trace:
    """``trace`` with its times ``shift`` seconds later and its chat ids ``chat_base`` higher."""
    extra = dict(trace.extra)
    if GROWN in extra:
        extra[GROWN] = np.array([None] * trace.n_requests, dtype=object)
        for i, times in enumerate(trace.extra[GROWN].tolist()):
            extra[GROWN][i] = None if times is None else times + shift
    for name in (SCHEDULED, FINISHED):
        if name in extra:
            column = extra[name]
            extra[name] = column + shift if column.dtype.kind == "f" else np.array(
                [None if v is None or type(v) not in (int, float) else v + shift for v in column.tolist()],
                dtype=object)  # a bad value stays for recorded_times to name
    parent = trace.parent_chat_id
    return dataclasses.replace(trace, timestamp=trace.timestamp + shift, chat_id=trace.chat_id + chat_base,
                               parent_chat_id=np.where(parent >= 0, parent + chat_base, parent),
                               window=(trace.window[0] + shift, trace.window[1] + shift), extra=extra)


def _concatenate(traces: list[Trace], first: Trace) -> Trace:
    """The requests of ``traces`` one after another (not yet in arrival order), types and extra
    fields joined (a field one trace lacks is None there)."""
    type_names = tuple(dict.fromkeys(name for trace in traces for name in trace.type_names))
    codes = [np.array([type_names.index(name) for name in trace.type_names], dtype=np.int32)[trace.type_code]
             for trace in traces]
    fields = dict.fromkeys(name for trace in traces for name in trace.extra)
    extra = {name: np.concatenate([trace.extra[name] if name in trace.extra else
                                   np.full(trace.n_requests, None, dtype=object) for trace in traces])
             for name in fields}
    lengths = np.concatenate([trace.n_blocks_per_request for trace in traces])
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    def joined(column: str) -> np.ndarray:
        return np.concatenate([getattr(trace, column) for trace in traces])

    return dataclasses.replace(
        first, timestamp=joined("timestamp"), input_length=joined("input_length"),
        output_length=joined("output_length"), chat_id=joined("chat_id"), parent_chat_id=joined("parent_chat_id"),
        type_code=np.concatenate(codes), type_names=type_names, turn=joined("turn"), hash_offsets=offsets,
        hash_ids=joined("hash_ids"), source=" + ".join(trace.source for trace in traces),
        sha256=hashlib.sha256("".join(trace.sha256 for trace in traces).encode()).hexdigest(),
        window=(min(trace.window[0] for trace in traces), max(trace.window[1] for trace in traces)), extra=extra)
