"""Sessions inferred from the block chains, and how soon each kind of request is followed by its session's
next one (:class:`kvprof.models.next_turn.NextTurnRates`).

A trace need not say which requests form a conversation (Mooncake's does not): a request whose chain
extends an earlier request's whole chain continues that request's session. The first-turn candidate
(:class:`kvprof.policy.first_turn.FirstTurnLRU`) infers the same online, from the chains it sees freed.
"""

from __future__ import annotations

import numpy as np

from kvprof.models.next_turn import NEXT_TURN_HORIZON_S, NextTurnRates


def infer_sessions(offsets: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Each request's session (int64, one per request), from chains ``blocks[offsets[r]:offsets[r + 1]]``
    in arrival order.

    A request continues the latest earlier request whose whole chain is a prefix of its own (the deepest
    such prefix) and that no other request continues yet: a session is a linear chain of requests, each
    extending the one before. A request with no such predecessor (or no block) starts a session; its id is
    the request's index.
    """
    blocks, offsets = blocks.tolist(), offsets.tolist()
    session = np.arange(len(offsets) - 1, dtype=np.int64)
    open_tail: dict[int, int] = {}  # last block of a chain not continued yet -> its request
    for r in range(len(offsets) - 1):
        chain = blocks[offsets[r]:offsets[r + 1]]
        for block in reversed(chain):
            parent = open_tail.pop(block, None)
            if parent is not None:
                session[r] = session[parent]
                break
        if chain:
            open_tail[chain[-1]] = r
    return session


def next_turn_rates(trace, horizon_s: float = NEXT_TURN_HORIZON_S) -> NextTurnRates:
    """On ``trace`` (a :class:`~kvprof.profiler.trace.Trace`, in arrival order): the requests that began
    and that continued their session (:func:`infer_sessions` on the chains of their full prompt blocks,
    the blocks a server caches and the first-turn candidate sees), and how many of each
    were followed by their session's next request within ``horizon_s``. Requests closer than that to the
    last arrival are left out: whether they were followed is not known yet."""
    starts, counts = trace.hash_offsets[:-1], np.diff(trace.hash_offsets)
    n_full = np.minimum(counts, trace.input_length // trace.block_size)  # a server caches full blocks only
    offsets = np.concatenate([[0], np.cumsum(n_full)])
    session = infer_sessions(offsets, trace.hash_ids[np.repeat(starts - offsets[:-1], n_full) + np.arange(offsets[-1])])
    n = len(session)
    began = session == np.arange(n)
    order = np.lexsort((np.arange(n), session))  # each session's requests together, in arrival order
    wait = np.full(n, np.inf)
    same = session[order[1:]] == session[order[:-1]]
    wait[order[:-1][same]] = trace.timestamp[order[1:][same]] - trace.timestamp[order[:-1][same]]
    known = trace.timestamp <= (trace.timestamp.max() - horizon_s if n else 0.0)
    followed = wait <= horizon_s
    return NextTurnRates(float(horizon_s), int((known & began).sum()), int((known & began & followed).sum()),
                         int((known & ~began).sum()), int((known & ~began & followed).sum()))
