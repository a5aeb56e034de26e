"""Multi-turn session statistics from ``parent_chat_id`` chains.

A block of turn ``k`` of a conversation is reused mostly when the conversation goes on, so the
chance of another turn after turn ``k`` is a prior for the reuse probability ``p`` of class
``<type>_<k>`` where that class has little data of its own.
"""

from __future__ import annotations

import re

import numpy as np

#: Turns per session are reported up to this many (longer sessions are rare and noisy).
MAX_TURNS = 20

_TURN_CLASS = re.compile(r"^(?P<type>.+)_(?P<turn>\d+)\+?$")


def _parent_rows(chat_id: np.ndarray, parent_chat_id: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose parent request is in the trace, and the parent's row for each of them."""
    order = np.argsort(chat_id, kind="stable")
    sorted_ids = chat_id[order]
    position = np.minimum(np.searchsorted(sorted_ids, parent_chat_id), max(sorted_ids.size - 1, 0))
    found = (parent_chat_id >= 0) & (sorted_ids.size > 0) & (sorted_ids[position] == parent_chat_id)
    return np.flatnonzero(found), order[position[found]]


def next_request_rows(chat_id: np.ndarray, parent_chat_id: np.ndarray) -> np.ndarray:
    """Each request's session's next request: the row of its earliest child (the rows in arrival
    order), -1 where none is in the trace (int64)."""
    n = chat_id.shape[0]
    child_rows, parent_rows = _parent_rows(chat_id, parent_chat_id)
    following = np.full(n, n, dtype=np.int64)
    np.minimum.at(following, parent_rows, child_rows)
    following[following == n] = -1
    return following


def _summary(values: np.ndarray) -> dict | None:
    if values.size == 0:
        return None
    return {"mean": float(values.mean()), "median": float(np.median(values)), "p90": float(np.quantile(values, 0.9))}


def session_stats(trace) -> dict:
    """Per request type: sessions, turns per session, chance of another turn, think time.

    A session is a chain of requests linked by ``parent_chat_id``. The chance of another turn
    after turn ``k`` is the fraction of turn-``k`` requests with a child request in the trace, and
    the turn-count survival is the product of these, ``S(1) = 1``,
    ``S(k + 1) = S(k) * p_next_turn[k]`` (a life table). Turn numbers come from the trace's
    ``turn`` column, so a session whose first turns precede the trace still contributes the
    turns it has in the trace, at their true turn numbers, and counts as one session from its
    first request in the trace. A conversation cut off by the end of the window counts as ended,
    which lowers ``p_next_turn`` slightly (by about think time / window length).

    Parameters
    ----------
    trace : kvprof.profiler.trace.Trace

    Returns
    -------
    dict of str to dict
        Keyed by request type name (``""`` for traces without types), each with
        ``n_requests``, ``n_sessions`` (int); ``survival`` (list of float, ``S(k)`` for
        ``k = 1..K``); ``p_next_turn`` (list of float, index ``k - 1`` for turn ``k``);
        ``think_time_s``: ``{"mean", "median", "p90"}`` of child minus parent arrival times,
        seconds, or None without any parent-child pair. ``K`` is the largest turn such that
        every turn ``1..K`` has a request, capped at :data:`MAX_TURNS`.
    """
    child_rows, parent_rows = _parent_rows(trace.chat_id, trace.parent_chat_id)
    has_child = np.zeros(trace.n_requests, dtype=bool)
    has_child[parent_rows] = True
    is_first_seen = np.ones(trace.n_requests, dtype=bool)
    is_first_seen[child_rows] = False
    think_time = trace.timestamp[child_rows] - trace.timestamp[parent_rows]
    turn = np.clip(trace.turn, 1, MAX_TURNS + 1)

    out = {}
    for code, type_name in enumerate(trace.type_names):
        of_type = trace.type_code == code
        requests = np.bincount(turn[of_type], minlength=MAX_TURNS + 2)[1 : MAX_TURNS + 1]
        continued = np.bincount(turn[of_type & has_child], minlength=MAX_TURNS + 2)[1 : MAX_TURNS + 1]
        n_turns = int(np.argmin(requests > 0)) if np.any(requests == 0) else MAX_TURNS
        p_next_turn = continued[:n_turns] / requests[:n_turns]
        survival = np.concatenate(([1.0], np.cumprod(p_next_turn)[:-1])) if n_turns else np.empty(0)
        out[type_name] = {
            "n_requests": int(of_type.sum()),
            "n_sessions": int((of_type & is_first_seen).sum()),
            "survival": survival.tolist(),
            "p_next_turn": p_next_turn.tolist(),
            "think_time_s": _summary(think_time[trace.type_code[child_rows] == code]),
        }
    return out


def turn_continuation_prior(stats: dict, type_name: str, turn: int) -> float | None:
    """P(another turn after turn ``turn``) for a request type, from :func:`session_stats` output.

    Parameters
    ----------
    stats : dict
        :func:`session_stats` output (possibly read back from an hp file).
    type_name : str
    turn : int
        1-based turn.

    Returns
    -------
    float or None
        None where the type or the turn has no data.
    """
    p_next_turn = stats.get(type_name, {}).get("p_next_turn", [])
    return float(p_next_turn[turn - 1]) if 1 <= turn <= len(p_next_turn) else None


def class_continuation_prior(stats: dict, class_name: str) -> float | None:
    """:func:`turn_continuation_prior` for a ``type_turn`` class name (``text_3``; ``text_5+`` uses turn 5).

    Returns None for names that are not ``<type>_<turn>`` or have no data.
    """
    match = _TURN_CLASS.match(class_name)
    if match is None:
        return None
    return turn_continuation_prior(stats, match["type"], int(match["turn"]))
