"""Synthetic Bailian-format traces: the calibrated presets and the planted-parameter trace.

``generate`` writes requests that look, statistically, like the Alibaba Bailian traces (their
published request mix, lengths, reuse gaps and ideal hit ratio; see ``docs/synth.md``), so the
demo, the tests and the benchmarks run without the real files. ``planted`` writes a trace whose
per-type reuse parameters are known exactly, to test the profiler's fits. Both stream plain
dicts in the Bailian JSONL layout, which the reader then treats like any real trace.

How the hash ids come about: every session keeps the hash ids of its latest request; the next
turn inherits a prefix of them and appends fresh ids from one global counter (fresh ids are
handed out in timestamp order). First turns inherit the full blocks of a shared system prompt.
So an id stands for exactly one prefix (the prefix-chain property of the real trace) and only
the requests of one session, or of one shared system prompt, ever share an id.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.special import ndtri

from kvprof.atomic import atomic_open

#: Tokens per hash block in the Bailian format.
BLOCK_SIZE = 16

#: Decimal places kept on timestamps (microseconds; ties between a parent and its child are
#: ordered by turn, so a child never precedes its parent).
TIME_DECIMALS = 6


@dataclass(frozen=True)
class TypeProfile:
    """How the sessions of one request type arrive and what their prompts hold.

    A session picks one shared system prompt, then sends turns. Turn 1's prompt is the system
    prompt, an optional attached document and the first user message; turn ``k`` re-sends turn
    ``k - 1``'s prompt plus its output plus a new user message. Token counts are lognormal.

    Parameters
    ----------
    name : str
        The ``type`` field of the records (``text``, ``api`` ...).
    sessions_per_hour : float
        Sessions arrive as a Poisson process at this rate (sessions/hour), each bringing
        ``expected_turns`` requests on average, fewer for sessions that the trace's end cuts.
    continue_prob : float
        Probability, in [0, 1), that a session sends another turn after each turn.
    think_median_s, think_sigma : float
        Time between a turn's arrival and the next turn's arrival: lognormal with this median
        (seconds) and log-space standard deviation.
    user_tokens_mean, user_tokens_sigma : float
        New user text per turn (tokens, at least 1): lognormal with this mean and log-sigma.
    output_tokens_mean, output_tokens_sigma : float
        Output per turn (tokens, at least 1); re-sent as history by the next turn.
    system_prompts : int
        Size of the type's pool of shared system prompts.
    system_tokens_mean : float
        Mean system-prompt length per session (tokens), i.e. weighted by popularity. The
        pool's lengths are evenly spaced lognormal quantiles, identical for every seed so the
        calibration holds for every seed.
    system_tokens_sigma : float
        Log-space spread of the pool's lengths.
    system_zipf : float
        Popularity of the pool's prompts: rank ``r`` (1-based) is picked with probability
        proportional to ``r ** -system_zipf``.
    document_tokens_mean, document_tokens_sigma : float
        An attachment (file text, image tokens) in turn 1, re-sent by every later turn, so its
        blocks recur across the session's questions. Mean 0 means no attachment.
    max_turns : int
        Turns per session are geometric with ``continue_prob``, capped here.
    """

    name: str
    sessions_per_hour: float
    continue_prob: float
    think_median_s: float
    think_sigma: float
    user_tokens_mean: float
    user_tokens_sigma: float
    output_tokens_mean: float
    output_tokens_sigma: float
    system_prompts: int
    system_tokens_mean: float
    system_tokens_sigma: float = 0.5
    system_zipf: float = 1.0
    document_tokens_mean: float = 0.0
    document_tokens_sigma: float = 0.5
    max_turns: int = 50

    def __post_init__(self):
        if not self.name:
            raise ValueError("a type profile needs a name")
        if not 0.0 <= self.continue_prob < 1.0:
            raise ValueError(f"{self.name}: continue_prob must be in [0, 1), got {self.continue_prob}")
        positive = ("sessions_per_hour", "think_median_s", "user_tokens_mean", "output_tokens_mean")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.name}: {name} must be > 0")
        non_negative = (
            "think_sigma", "user_tokens_sigma", "output_tokens_sigma", "system_tokens_mean",
            "system_tokens_sigma", "system_zipf", "document_tokens_mean", "document_tokens_sigma",
        )  # fmt: skip
        for name in non_negative:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{self.name}: {name} must be >= 0")
        if self.system_prompts < 1 or self.max_turns < 1:
            raise ValueError(f"{self.name}: system_prompts and max_turns must be >= 1")

    @property
    def expected_turns(self) -> float:
        """Mean turns per session (geometric, capped at ``max_turns``)."""
        q = self.continue_prob
        return (1.0 - q**self.max_turns) / (1.0 - q)

    def system_pool(self) -> tuple[np.ndarray, np.ndarray]:
        """The shared system prompts: popularity (sums to 1) and length in tokens, by rank."""
        n = self.system_prompts
        popularity = np.arange(1, n + 1, dtype=float) ** -self.system_zipf
        popularity /= popularity.sum()
        quantiles = np.exp(self.system_tokens_sigma * ndtri((np.arange(n) + 0.5) / n))
        # A fixed scatter of lengths over ranks, so the most popular prompt is not always the
        # shortest, and the same pool for every seed.
        lengths = quantiles[np.random.default_rng(n).permutation(n)]
        lengths *= self.system_tokens_mean / (popularity @ lengths)
        return popularity, np.rint(lengths).astype(np.int64)


@dataclass(frozen=True)
class SynthPreset:
    """A named synthetic workload.

    Parameters
    ----------
    name : str
        Preset name (``bailian-a`` ...).
    description : str
        One line on what it imitates.
    types : tuple of TypeProfile
        One profile per request type; type names must be distinct.
    max_input_tokens : int
        Context limit: a session ends before a turn whose prompt would exceed it.
    """

    name: str
    description: str
    types: tuple[TypeProfile, ...]
    max_input_tokens: int = 131_072

    def __post_init__(self):
        names = [t.name for t in self.types]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"preset {self.name!r}: needs types with distinct names, got {names}")


# Values calibrated against the published statistics, on seeds 0-2 (docs/synth.md explains how
# each knob reaches its target).
PRESETS: dict[str, SynthPreset] = {
    "bailian-a": SynthPreset(
        name="bailian-a",
        description="Bailian trace A (to-C chat): 6 QPS, text/search/image/file, multi-turn sessions",
        types=(
            TypeProfile(
                name="text", sessions_per_hour=6_630, continue_prob=0.62,
                think_median_s=160.0, think_sigma=1.4,
                user_tokens_mean=320, user_tokens_sigma=1.2,
                output_tokens_mean=425, output_tokens_sigma=0.9,
                system_prompts=8, system_tokens_mean=450,
            ),
            TypeProfile(
                name="search", sessions_per_hour=2_390, continue_prob=0.45,
                think_median_s=175.0, think_sigma=1.4,
                user_tokens_mean=1_750, user_tokens_sigma=0.6,
                output_tokens_mean=500, output_tokens_sigma=0.8,
                system_prompts=3, system_tokens_mean=300,
            ),
            TypeProfile(
                name="image", sessions_per_hour=320, continue_prob=0.6,
                think_median_s=5.0, think_sigma=1.0,
                user_tokens_mean=80, user_tokens_sigma=0.8,
                output_tokens_mean=250, output_tokens_sigma=0.8,
                system_prompts=2, system_tokens_mean=300,
                document_tokens_mean=1_200, document_tokens_sigma=0.4,
            ),
            TypeProfile(
                name="file", sessions_per_hour=410, continue_prob=0.5,
                think_median_s=220.0, think_sigma=1.4,
                user_tokens_mean=100, user_tokens_sigma=0.8,
                output_tokens_mean=500, output_tokens_sigma=0.8,
                system_prompts=2, system_tokens_mean=400,
                document_tokens_mean=6_000, document_tokens_sigma=1.0,
            ),
        ),
    ),  # fmt: skip
    "bailian-b": SynthPreset(
        name="bailian-b",
        description="Bailian trace B (to-B API): 24 QPS, api/text, single-turn, shared system prompts",
        types=(
            TypeProfile(
                name="api", sessions_per_hour=75_050, continue_prob=0.0005,
                think_median_s=10.0, think_sigma=1.0,
                user_tokens_mean=900, user_tokens_sigma=1.0,
                output_tokens_mean=150, output_tokens_sigma=1.0,
                system_prompts=130, system_tokens_mean=1_200, system_tokens_sigma=0.8,
                system_zipf=0.85,
            ),
            TypeProfile(
                name="text", sessions_per_hour=10_950, continue_prob=0.001,
                think_median_s=60.0, think_sigma=1.0,
                user_tokens_mean=600, user_tokens_sigma=1.0,
                output_tokens_mean=300, output_tokens_sigma=0.9,
                system_prompts=4, system_tokens_mean=400,
            ),
        ),
    ),  # fmt: skip
}


@dataclass(frozen=True)
class _Plan:
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
    def concat(plans: list[_Plan]) -> _Plan:
        return _Plan(*(np.concatenate(columns) for columns in zip(*(vars(p).values() for p in plans))))

    def prefix_of_sessions(self, keep: np.ndarray) -> _Plan:
        """The rows in ``keep``, which must hold a leading run of turns of each session."""
        return _Plan(*(column[keep] for column in vars(self).values()))


class _Sessions:
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
) -> _Plan:
    """Sessions of one type over ``[0, duration)`` seconds; ``pool_base`` = first id of each pool prompt."""
    n_sessions = rng.poisson(profile.sessions_per_hour * duration / 3600.0)
    start = rng.uniform(0.0, duration, n_sessions)
    turns = np.minimum(rng.geometric(1.0 - profile.continue_prob, n_sessions), profile.max_turns)
    rows = _Sessions(turns)
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
    plan = _Plan(
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


def _emit(plan: _Plan, type_names: tuple[str, ...], first_fresh_id: int, rng) -> Iterator[dict]:
    """Stream the plan's requests as Bailian records, in timestamp order."""
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
        yield {
            "chat_id": cid,
            "parent_chat_id": pid,
            "timestamp": ts,
            "input_length": n_in,
            "output_length": n_out,
            "type": type_names[code],
            "turn": turn,
            "hash_ids": hash_ids,
        }


def _check_hours(hours: float) -> float:
    if not (hours > 0 and math.isfinite(hours)):
        raise ValueError(f"hours must be a positive number, got {hours}")
    return float(hours)


def generate(preset: str | SynthPreset, hours: float, seed: int) -> Iterator[dict]:
    """Synthetic Bailian records calibrated to a preset.

    Parameters
    ----------
    preset : str or SynthPreset
        A name in :data:`PRESETS` (``bailian-a``, ``bailian-b``) or a custom preset.
    hours : float
        Trace length in hours; arrivals fall in ``[0, 3600 * hours)`` seconds.
    seed : int
        Same seed, same trace (byte for byte once written).

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
    duration = 3600.0 * _check_hours(hours)
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(len(preset.types) + 1)]
    pools = [profile.system_pool()[1] // BLOCK_SIZE for profile in preset.types]
    pool_ends = np.cumsum([blocks.sum() for blocks in pools])
    plans = []
    for code, (profile, blocks, end, rng) in enumerate(zip(preset.types, pools, pool_ends, streams)):
        pool_base = end - np.cumsum(blocks[::-1])[::-1]  # ids [0, pool_ends[-1]) hold the system prompts
        plans.append(_plan_type(profile, code, duration, rng, pool_base, preset.max_input_tokens))
    type_names = tuple(profile.name for profile in preset.types)
    yield from _emit(_Plan.concat(plans), type_names, int(pool_ends[-1]), streams[-1])


def planted(
    params: dict[str, tuple[float, float]], hours: float, seed: int, sessions_per_hour: float = 1000.0
) -> Iterator[dict]:
    """A trace with known per-type reuse parameters, for testing the profiler's fits.

    For each type ``t`` with ``(p, lam)``, sessions arrive as a Poisson process at
    ``sessions_per_hour``. After each request the session, with probability ``p``, sends a
    follow-up of type ``t`` (turn + 1) after an ``Exp(lam)`` delay that re-sends all of the
    request's blocks and appends 1-4 new ones; otherwise it ends. Blocks never cross sessions
    and every prompt is whole blocks, so each block access of a type-``t`` request is reused
    by the next later request with probability ``p`` after an ``Exp(lam)`` gap (apart from
    follow-ups cut off by the trace's end, negligible while ``1 / lam`` is far below the
    trace length). A fit with class rule key ``type`` and no
    concurrency floor (``min_gap=0``) should recover ``p`` and ``lam`` per type.

    Parameters
    ----------
    params : dict of str to (float, float)
        Type name -> (``p`` in [0, 1), ``lam`` > 0 in 1/s).
    hours : float
        Trace length in hours.
    seed : int
        Same seed, same trace.
    sessions_per_hour : float
        Session arrival rate per type, sessions/hour.

    Yields
    ------
    dict
        Bailian records in timestamp order (see :func:`generate`).
    """
    duration = 3600.0 * _check_hours(hours)
    if not params:
        raise ValueError("planted needs at least one type")
    if not sessions_per_hour > 0:
        raise ValueError(f"sessions_per_hour must be > 0, got {sessions_per_hour}")
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(len(params) + 1)]
    plans = []
    for code, ((name, (p, lam)), rng) in enumerate(zip(params.items(), streams)):
        if not (0.0 <= p < 1.0 and lam > 0):
            raise ValueError(f"{name}: need 0 <= p < 1 and lam > 0, got p={p}, lam={lam}")
        n_sessions = rng.poisson(sessions_per_hour * duration / 3600.0)
        rows = _Sessions(rng.geometric(1.0 - p, n_sessions))
        n_rows = rows.turn.shape[0]
        delay = rng.exponential(1.0 / lam, n_rows)
        delay[rows.first_row] = 0.0
        timestamp = rows.per_row(rng.uniform(0.0, duration, n_sessions)) + rows.cumsum(delay)
        new_blocks = rng.integers(1, 5, n_rows)
        new_blocks[rows.first_row] = rng.integers(4, 13, n_sessions)
        n_blocks = rows.cumsum(new_blocks)
        plan = _Plan(
            timestamp=timestamp,
            type_code=np.full(n_rows, code, dtype=np.int32),
            turn=rows.turn,
            input_length=BLOCK_SIZE * n_blocks,
            output_length=rng.integers(1, 513, n_rows),
            inherited=rows.previous(n_blocks, 0),
            shared_base=np.zeros(n_rows, dtype=np.int64),
        )
        plans.append(plan.prefix_of_sessions(timestamp < duration))
    yield from _emit(_Plan.concat(plans), tuple(params), 0, streams[-1])


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Write records as JSON lines, atomically.

    The file appears complete or not at all: lines go to a temporary file in the same
    directory, which replaces ``path`` only once every record is written. A ``.gz`` or
    ``.zst`` suffix compresses.

    Returns
    -------
    int
        Number of records written.
    """
    path = Path(path)
    count = 0
    with atomic_open(path, "wb") as raw, _compressor(raw, path.suffix) as out:
        for record in records:
            out.write(json.dumps(record).encode() + b"\n")
            count += 1
    return count


def _compressor(raw, suffix: str):
    """A binary writer over ``raw`` that compresses by file suffix; closing it leaves ``raw`` open."""
    if suffix == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="wb", mtime=0)  # mtime 0: same records, same bytes
    if suffix == ".zst":
        import zstandard

        return zstandard.ZstdCompressor().stream_writer(raw, closefd=False)
    return _Unclosed(raw)


class _Unclosed:
    """Pass-through writer whose ``close`` leaves the underlying file to its owner."""

    def __init__(self, raw):
        self.write = raw.write

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure(records: Iterable[dict]) -> dict:
    """The statistics the presets are calibrated to, computed from records.

    A block access is reused when a later request (a later record) carries the same hash id;
    its gap is the time between the two arrivals. Accesses are attributed to the type of the
    request that made them.

    Returns
    -------
    dict
        JSON-ready: ``n_requests``; ``duration_s`` (first to last arrival); ``qps``;
        ``requests_by_type``; ``mean_input_tokens``, ``mean_output_tokens``;
        ``multi_turn_fraction`` (requests with turn > 1); ``ideal_hit_ratio`` (accesses whose
        id appeared in an earlier request / all accesses); ``hit_share_first_turn`` (share of
        those hits made by turn-1 requests); ``reuse_fraction_by_type`` (accesses reused
        later / accesses); ``median_gap_s_by_type``, ``mean_gap_s_by_type``;
        ``reuses_within_10s``, ``reuses_within_600s`` (fractions of gaps); ``lifespan_p90_s``
        (90th percentile over distinct blocks of last minus first access time);
        ``top10_block_reuse_share`` (share of reuses made by the 10 % most reused blocks).
    """
    timestamp, type_code, turn, input_length, output_length, n_blocks, hash_chunks = ([] for _ in range(7))
    type_names: dict[str, int] = {}
    for record in records:
        timestamp.append(record["timestamp"])
        type_code.append(type_names.setdefault(record["type"], len(type_names)))
        turn.append(record["turn"])
        input_length.append(record["input_length"])
        output_length.append(record["output_length"])
        n_blocks.append(len(record["hash_ids"]))
        hash_chunks.append(np.array(record["hash_ids"], dtype=np.int64))
    n = len(timestamp)
    if n == 0:
        raise ValueError("no records to measure")
    timestamp = np.array(timestamp, dtype=float)
    type_code = np.array(type_code)
    names = tuple(type_names)

    # Accesses sorted by id, ties kept in request order: consecutive equal ids are an access
    # and its next use.
    access_request = np.repeat(np.arange(n), n_blocks)
    order = np.argsort(np.concatenate(hash_chunks), kind="stable")
    ids = np.concatenate(hash_chunks)[order]
    request = access_request[order]
    reused = np.append(ids[1:] == ids[:-1], False)  # this access has a next use
    is_hit = np.insert(reused[:-1], 0, False)  # an earlier access exists
    gap = timestamp[request[1:]] - timestamp[request[:-1]]
    gap = gap[reused[:-1]]
    gap_type = type_code[request[:-1][reused[:-1]]]
    access_type = type_code[request]

    first = np.flatnonzero(~is_hit)
    last = np.append(first[1:], ids.shape[0]) - 1
    lifespan = timestamp[request[last]] - timestamp[request[first]]
    reuses_per_block = np.sort(last - first)[::-1]
    top = max(1, math.ceil(0.1 * first.shape[0]))

    def by_type(values: np.ndarray, codes: np.ndarray, statistic) -> dict[str, float]:
        return {name: float(statistic(values[codes == c])) for c, name in enumerate(names) if np.any(codes == c)}

    n_hits = int(is_hit.sum())
    return {
        "n_requests": n,
        "duration_s": float(timestamp[-1] - timestamp[0]),
        "qps": n / float(timestamp[-1] - timestamp[0]) if n > 1 else 0.0,
        "requests_by_type": {name: int(np.sum(type_code == c)) for c, name in enumerate(names)},
        "mean_input_tokens": float(np.mean(input_length)),
        "mean_output_tokens": float(np.mean(output_length)),
        "multi_turn_fraction": float(np.mean(np.array(turn) > 1)),
        "ideal_hit_ratio": n_hits / ids.shape[0] if ids.shape[0] else 0.0,
        "hit_share_first_turn": float(np.sum(is_hit & (np.array(turn)[request] == 1)) / n_hits) if n_hits else 0.0,
        "reuse_fraction_by_type": by_type(reused, access_type, np.mean),
        "median_gap_s_by_type": by_type(gap, gap_type, np.median),
        "mean_gap_s_by_type": by_type(gap, gap_type, np.mean),
        "reuses_within_10s": float(np.mean(gap <= 10.0)) if gap.shape[0] else 0.0,
        "reuses_within_600s": float(np.mean(gap <= 600.0)) if gap.shape[0] else 0.0,
        "lifespan_p90_s": float(np.percentile(lifespan, 90)) if lifespan.shape[0] else 0.0,
        "top10_block_reuse_share": float(reuses_per_block[:top].sum() / n_hits) if n_hits else 0.0,
    }
