"""Synthetic Bailian records of a preset: sessions planned as numpy columns, then streamed in time order.

How the hash ids come about: every session keeps the hash ids of its latest request; the next
turn inherits a prefix of them and appends fresh ids from one global counter (fresh ids are
handed out in timestamp order). First turns inherit the full blocks of a shared system prompt.
So an id stands for exactly one prefix (the prefix-chain property of the real trace) and only
the requests of one session, or of one shared system prompt, ever share an id.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvprof.profiler.synth.hints import HintSpec, future_hints, hint_fields
from kvprof.profiler.synth.presets import BLOCK_SIZE, PRESETS, SynthPreset, TypeProfile

#: Decimal places kept on timestamps (microseconds; ties between a parent and its child are
#: ordered by turn, so a child never precedes its parent).
TIME_DECIMALS = 6


@dataclass(frozen=True)
class Plan:
    """Every request of a trace, one row each, rows grouped by session with turns ascending.

    ``inherited`` counts the leading blocks a request shares with its source: the previous
    turn for turn > 1, the shared prefix starting at id ``shared_base`` for turn 1. The
    remaining blocks get fresh ids.
    """

    timestamp: np.ndarray
    type_code: np.ndarray
    turn: np.ndarray
    input_length: np.ndarray
    output_length: np.ndarray
    inherited: np.ndarray
    shared_base: np.ndarray

    @staticmethod
    def concat(plans: list[Plan]) -> Plan:
        return Plan(*(np.concatenate(columns) for columns in zip(*(vars(p).values() for p in plans))))

    def prefix_of_sessions(self, keep: np.ndarray) -> Plan:
        """The rows in ``keep``, which must hold a leading run of turns of each session."""
        return Plan(*(column[keep] for column in vars(self).values()))


class Sessions:
    """Row bookkeeping for sessions of given turn counts: row -> session and turn."""

    def __init__(self, turns: np.ndarray):
        self.turns = turns
        self.first_row = np.cumsum(turns) - turns
        n_rows = int(turns.sum())
        self.turn = np.arange(n_rows) - np.repeat(self.first_row, turns) + 1

    def per_row(self, per_session: np.ndarray) -> np.ndarray:
        return np.repeat(per_session, self.turns)

    def cumsum(self, values: np.ndarray) -> np.ndarray:
        """Running sum of ``values`` within each session."""
        total = np.cumsum(values)
        return total - self.per_row(total[self.first_row] - values[self.first_row])

    def previous(self, values: np.ndarray, first: np.ndarray | int) -> np.ndarray:
        """``values`` of each row's previous turn; ``first`` for turn-1 rows."""
        out = np.empty_like(values)
        out[1:] = values[:-1]
        out[self.first_row] = first
        return out


def _lognormal_mean(rng, mean: float, sigma: float, size: int) -> np.ndarray:
    """Lognormal draws with the given mean (the median is ``mean * exp(-sigma**2 / 2)``)."""
    return rng.lognormal(math.log(mean) - sigma * sigma / 2.0, sigma, size)


def _tokens(rng, mean: float, sigma: float, size: int, minimum: int) -> np.ndarray:
    if mean == 0:
        return np.zeros(size, dtype=np.int64)
    return np.maximum(minimum, np.rint(_lognormal_mean(rng, mean, sigma, size))).astype(np.int64)


def _plan_type(
    profile: TypeProfile, code: int, duration: float, rng, pool_base: np.ndarray, max_input_tokens: int
) -> Plan:
    """Sessions of one type over ``[0, duration)`` seconds; ``pool_base`` = first id of each pool prompt."""
    n_sessions = rng.poisson(profile.sessions_per_hour * duration / 3600.0)
    start = rng.uniform(0.0, duration, n_sessions)
    turns = np.minimum(rng.geometric(1.0 - profile.continue_prob, n_sessions), profile.max_turns)
    rows = Sessions(turns)
    n_rows = rows.turn.shape[0]

    think = rng.lognormal(math.log(profile.think_median_s), profile.think_sigma, n_rows)
    think[rows.first_row] = 0.0
    timestamp = rows.per_row(start) + rows.cumsum(think)

    popularity, system_tokens = profile.system_pool()
    system = rng.choice(profile.system_prompts, n_sessions, p=popularity)
    document = _tokens(rng, profile.document_tokens_mean, profile.document_tokens_sigma, n_sessions, 1)
    user = _tokens(rng, profile.user_tokens_mean, profile.user_tokens_sigma, n_rows, 1)
    output = _tokens(rng, profile.output_tokens_mean, profile.output_tokens_sigma, n_rows, 1)

    # Each turn adds the previous turn's output and a new user message to the prompt.
    growth = user + rows.previous(output, 0)
    growth[rows.first_row] += system_tokens[system] + document
    input_length = rows.cumsum(growth)
    # Only full blocks carry over: the partial last block of a prompt is re-hashed once the
    # next turn's tokens fill it.
    inherited = rows.previous(input_length // BLOCK_SIZE, 0)
    inherited[rows.first_row] = system_tokens[system] // BLOCK_SIZE
    plan = Plan(
        timestamp=timestamp,
        type_code=np.full(n_rows, code, dtype=np.int32),
        turn=rows.turn,
        input_length=input_length,
        output_length=output,
        inherited=inherited,
        shared_base=rows.per_row(pool_base[system]),
    )
    # Both grow with the turn, so this keeps a leading run of every session's turns.
    return plan.prefix_of_sessions((timestamp < duration) & (input_length <= max_input_tokens))


def emit(plan: Plan, type_names: tuple[str, ...], first_fresh_id: int, rng, hints: HintSpec | None = None,
         hint_rng=None) -> Iterator[dict]:
    """Stream the plan's requests as Bailian records, in timestamp order; with ``hints``, each with
    the hint fields :func:`~kvprof.profiler.synth.hints.future_hints` makes from its session's future."""
    n = plan.timestamp.shape[0]
    if n == 0:
        return
    timestamp = np.round(plan.timestamp - plan.timestamp.min(), TIME_DECIMALS)
    order = np.lexsort((plan.turn, timestamp))  # ties: the parent (lower turn) first
    n_blocks = -(-plan.input_length // BLOCK_SIZE)
    fresh = n_blocks - plan.inherited
    fresh_start = first_fresh_id + np.cumsum(fresh[order]) - fresh[order]
    chat_id = rng.permutation(n)  # randomised ids, as in the published files
    parent_chat_id = np.where(plan.turn > 1, np.roll(chat_id, 1), -1)
    is_last_turn = np.append(plan.turn[1:] == 1, True)
    hinted = None
    if hints is not None:  # the plan's rows are sessions' turns in order: the next row is the next request
        gap = np.where(is_last_turn, np.inf, np.append(timestamp[1:], np.inf) - timestamp)
        first = np.flatnonzero(plan.turn == 1)
        session = chat_id[first[np.cumsum(plan.turn == 1) - 1]]  # the chat id of the session's first request
        hinted = future_hints(gap, plan.type_code, hints, hint_rng, session)

    columns = (chat_id, parent_chat_id, timestamp, plan.input_length, plan.output_length,
               plan.type_code, plan.turn, plan.inherited, plan.shared_base, fresh, is_last_turn)  # fmt: skip
    rows = zip(order.tolist(), fresh_start.tolist(), *(c[order].tolist() for c in columns))
    live: dict[int, list[int]] = {}  # row -> hash ids, for requests whose session continues
    for row, start, cid, pid, ts, n_in, n_out, code, turn, inherited, shared, n_fresh, last in rows:
        if turn == 1:
            hash_ids = list(range(shared, shared + inherited))
        else:
            hash_ids = live.pop(row - 1)[:inherited]
        hash_ids.extend(range(start, start + n_fresh))
        if not last:
            live[row] = hash_ids.copy()  # a copy: the caller may modify the record it gets
        record = {
            "chat_id": cid,
            "parent_chat_id": pid,
            "timestamp": ts,
            "input_length": n_in,
            "output_length": n_out,
            "type": type_names[code],
            "turn": turn,
            "hash_ids": hash_ids,
        }
        if hinted is not None:
            record.update(hint_fields(hinted, row))
        yield record


def check_hours(hours: float) -> float:
    if not (hours > 0 and math.isfinite(hours)):
        raise ValueError(f"hours must be a positive number, got {hours}")
    return float(hours)


def generate(preset: str | SynthPreset, hours: float, seed: int, hints: HintSpec | None = None) -> Iterator[dict]:
    """Synthetic Bailian records calibrated to a preset.

    Parameters
    ----------
    preset : str or SynthPreset
        A name in :data:`PRESETS` (``bailian-a``, ``bailian-b``) or a custom preset.
    hours : float
        Trace length in hours; arrivals fall in ``[0, 3600 * hours)`` seconds.
    seed : int
        Same seed, same trace (byte for byte once written).
    hints : HintSpec or None
        Add client hints made from each session's future (:mod:`kvprof.profiler.synth.hints`); the
        requests are the same as without them.

    Yields
    ------
    dict
        Records in timestamp order with the Bailian fields: chat_id, parent_chat_id,
        timestamp (s), input_length and output_length (tokens), type, turn, hash_ids
        (``ceil(input_length / 16)`` prefix-chained block ids).
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    duration = 3600.0 * check_hours(hours)
    # One stream more for the hints: the first ones (the trace's) are the same with or without it.
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(len(preset.types) + 2)]
    pools = [profile.system_pool()[1] // BLOCK_SIZE for profile in preset.types]
    pool_ends = np.cumsum([blocks.sum() for blocks in pools])
    plans = []
    for code, (profile, blocks, end, rng) in enumerate(zip(preset.types, pools, pool_ends, streams)):
        pool_base = end - np.cumsum(blocks[::-1])[::-1]  # ids [0, pool_ends[-1]) hold the system prompts
        plans.append(_plan_type(profile, code, duration, rng, pool_base, preset.max_input_tokens))
    type_names = tuple(profile.name for profile in preset.types)
    yield from emit(Plan.concat(plans), type_names, int(pool_ends[-1]), streams[-2], hints, streams[-1])
