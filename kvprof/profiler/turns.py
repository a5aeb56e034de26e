"""Sessions inferred from the block chains, and how soon each kind of request is followed by its session's
next one (:class:`kvprof.models.next_turn.NextTurnRates`).

A trace need not say which requests form a conversation (Mooncake's does not): a request whose chain
extends an earlier request's whole chain continues that request's session. The first-turn candidate
(:class:`kvprof.policy.first_turn.FirstTurnLRU`) infers the same online, from the chains it sees freed.
"""

from __future__ import annotations

import numpy as np

from kvprof.models.next_turn import NEXT_TURN_HORIZON_S, NextTurnRates


def infer_sessions(offsets: np.ndarray, blocks: np.ndarray, tails: np.ndarray | None = None) -> np.ndarray:
    """Each request's session (int64, one per request), from chains ``blocks[offsets[r]:offsets[r + 1]]``
    in arrival order.

    A request continues the latest earlier request whose whole chain is a prefix of its own (the deepest
    such prefix) and that no other request continues yet: a session is a linear chain of requests, each
    extending the one before. A request with no such predecessor (or no block) starts a session; its id is
    the request's index.

    ``tails[r]`` is request ``r``'s last block (-1: none), by default its chain's last. Given, each chain
    may hold only the blocks that are some request's tail, in chain order: only those can end an earlier
    chain, so the sessions are the same (a sharded fit reads no more of the chains).
    """
    blocks, offsets = blocks.tolist(), offsets.tolist()
    tails = None if tails is None else tails.tolist()
    session = np.arange(len(offsets) - 1, dtype=np.int64)
    open_tail: dict[int, int] = {}  # last block of a chain not continued yet -> its request
    for r in range(len(offsets) - 1):
        chain = blocks[offsets[r]:offsets[r + 1]]
        for block in reversed(chain):
            parent = open_tail.pop(block, None)
            if parent is not None:
                session[r] = session[parent]
                break
        tail = (chain[-1] if chain else -1) if tails is None else tails[r]
        if tail >= 0:
            open_tail[tail] = r
    return session


def full_blocks(trace) -> np.ndarray:
    """How many of each request's blocks are full (int64): a server caches those only."""
    return np.minimum(np.diff(trace.hash_offsets), trace.input_length // trace.block_size)


def next_turn_rates(trace, horizon_s: float = NEXT_TURN_HORIZON_S) -> NextTurnRates:
    """On ``trace`` (a :class:`~kvprof.profiler.trace.Trace`, in arrival order): the requests that began
    and that continued their session (:func:`infer_sessions` on the chains of their full prompt blocks,
    the blocks a server caches and the first-turn candidate sees), and how many of each were followed by
    their session's next request within ``horizon_s`` (:func:`count_next_turns`)."""
    n_full = full_blocks(trace)
    offsets = np.concatenate([[0], np.cumsum(n_full)])
    kept = np.repeat(trace.hash_offsets[:-1] - offsets[:-1], n_full) + np.arange(offsets[-1])
    return count_next_turns(infer_sessions(offsets, trace.hash_ids[kept]), trace.timestamp, horizon_s)


def count_next_turns(session: np.ndarray, timestamp: np.ndarray, horizon_s: float) -> NextTurnRates:
    """The requests (in arrival order, at ``timestamp``) that began and continued their ``session``, and how
    many of each their session's next request followed within ``horizon_s``. Requests closer than that to
    the last arrival are left out: whether they were followed is not known yet."""
    n = len(session)
    began = session == np.arange(n)
    order = np.argsort(session, kind="stable")  # each session's requests together, in arrival order
    wait = np.full(n, np.inf)
    same = session[order[1:]] == session[order[:-1]]
    wait[order[:-1][same]] = timestamp[order[1:][same]] - timestamp[order[:-1][same]]
    known = timestamp <= (timestamp.max() - horizon_s if n else 0.0)
    followed = wait <= horizon_s
    return NextTurnRates(float(horizon_s), int((known & began).sum()), int((known & began & followed).sum()),
                         int((known & ~began).sum()), int((known & ~began & followed).sum()))
