"""A trace whose per-type reuse parameters are known exactly, to test the profiler's fits."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvprof.profiler.synth.generator import Plan, Sessions, check_hours, emit
from kvprof.profiler.synth.presets import BLOCK_SIZE


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
    duration = 3600.0 * check_hours(hours)
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
        rows = Sessions(rng.geometric(1.0 - p, n_sessions))
        n_rows = rows.turn.shape[0]
        delay = rng.exponential(1.0 / lam, n_rows)
        delay[rows.first_row] = 0.0
        timestamp = rows.per_row(rng.uniform(0.0, duration, n_sessions)) + rows.cumsum(delay)
        new_blocks = rng.integers(1, 5, n_rows)
        new_blocks[rows.first_row] = rng.integers(4, 13, n_sessions)
        n_blocks = rows.cumsum(new_blocks)
        plan = Plan(
            timestamp=timestamp,
            type_code=np.full(n_rows, code, dtype=np.int32),
            turn=rows.turn,
            input_length=BLOCK_SIZE * n_blocks,
            output_length=rng.integers(1, 513, n_rows),
            inherited=rows.previous(n_blocks, 0),
            shared_base=np.zeros(n_rows, dtype=np.int64),
        )
        plans.append(plan.prefix_of_sessions(timestamp < duration))
    yield from emit(Plan.concat(plans), tuple(params), 0, streams[-1])
