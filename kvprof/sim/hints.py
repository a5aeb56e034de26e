"""Hints to replay: the trace's own, or those an agent runtime would send from how each response ended.

A replay honours hints through :class:`~kvprof.policy.hinted.HintedPolicy` over a base policy (named
``<base>+hints``), told each request's hint from the workload (:attr:`Workload.hints`). Only the
Python engine tells hints: the compiled engine and the vLLM plugin do not honour them yet.

``stop`` hints (:func:`stop_hints`) are what a runtime knows when a response arrives (weka's ``stop``,
:mod:`kvprof.models.finish`): after a tool call it asks to retain the session's blocks for the fitted
retention (``hp.retention``, :mod:`kvprof.models.retention`: the wait that catches a share of the
returns, for the request's class); after an end of turn it releases them, or retains them for that
kind's own figure (``end_turn="retain"``); other requests send no hint. Every request names its
session (its conversation's first ``chat_id``), so an end of turn releases only the blocks that
conversation alone held, not a system prompt or a document other conversations read.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvprof.models.finish import END_OF_TURN, TOOL_CALL
from kvprof.models.hints import HINT_FIELDS, HintColumns
from kvprof.policy import make_policy
from kvprof.policy.base import EvictionPolicy
from kvprof.policy.hinted import HintedPolicy
from kvprof.profiler.classes import classify_trace
from kvprof.profiler.trace import Trace
from kvprof.sim.config import SimulationError
from kvprof.sim.sample import chain_roots

#: The suffix of a policy name replayed with hints (``lru+hints``).
HINTED = "+hints"
#: What an end of turn sends as a ``stop`` hint.
END_TURN_HINTS = ("release", "retain")
#: What a tool call sends: a retention for the fitted time, or nothing (the policy orders its blocks).
TOOL_CALL_HINTS = ("retain", "none")


def is_hinted(name: str) -> bool:
    return name.endswith(HINTED)


def base_name(name: str) -> str:
    """The base policy of a (possibly hinted) policy name."""
    return name[: -len(HINTED)] if is_hinted(name) else name


def make_hinted_policy(name: str, hp, capacity: int, budget_blocks: int | None = None) -> EvictionPolicy:
    """``make_policy(name)``, or for ``<base>+hints`` the hint layer over ``base`` with a budget of
    ``budget_blocks`` retained blocks, per tag and in all (None: no budget)."""
    base = make_policy(base_name(name), hp, capacity)
    return HintedPolicy(base, budget_blocks=budget_blocks) if is_hinted(name) else base


def with_hints(trace: Trace, hints: HintColumns | None) -> Trace:
    """The trace with ``hints`` as its hint fields (None: without any)."""
    extra = {name: column for name, column in trace.extra.items() if name not in HINT_FIELDS}
    if hints is not None:
        extra.update(hints.to_extra())
    return dataclasses.replace(trace, extra=extra)


def stop_hints(trace: Trace, hp, share: float = 0.9, end_turn: str = "release",
               tool_call: str = "retain") -> HintColumns:
    """The hints a runtime sends from each request's ``stop`` and the hp file's fitted retention: after a
    tool call a retention catching ``share`` of the returns of the request's class (``tool_call``
    ``"none"``: no hint), after an end of turn a release or that kind's own retention (``end_turn``).

    Raises
    ------
    SimulationError
        A trace without ``stop``; where a hint retains, an hp file without ``retention`` or without
        ``share`` among its shares, or whose class rule the trace does not fit; an ``end_turn`` other
        than those of :data:`END_TURN_HINTS` or a ``tool_call`` other than those of :data:`TOOL_CALL_HINTS`.
    """
    if end_turn not in END_TURN_HINTS:
        raise SimulationError(f"an end of turn sends one of {', '.join(END_TURN_HINTS)}, not {end_turn!r}")
    if tool_call not in TOOL_CALL_HINTS:
        raise SimulationError(f"a tool call sends one of {', '.join(TOOL_CALL_HINTS)}, not {tool_call!r}")
    finish = trace.finish
    if not (finish != 0).any():
        raise SimulationError("stop hints need the trace's 'stop' field (how each response ended); it has none")
    kinds = ([("tool_call", TOOL_CALL)] if tool_call == "retain" else []) + (
        [("end_turn", END_OF_TURN)] if end_turn == "retain" else [])
    retained = {}
    if kinds:
        retention = getattr(hp, "retention", None)
        if retention is None:
            raise SimulationError("stop hints that retain need the hp file's retention figures (kvprof fit on a "
                                  "trace whose requests name their parents)")
        if share not in retention.shares:
            raise SimulationError(f"the hp file has retention for shares "
                                  f"{', '.join(f'{s:g}' for s in retention.shares)}, not {share!r}")
        at = retention.shares.index(share)
        try:
            codes, names = classify_trace(trace, hp.class_rule)
        except ValueError as exc:  # a class field the trace lacks: said as the replay says it
            raise SimulationError(f"the hp file's class rule does not fit the trace: {exc}") from None
        retained = {code: np.array([_seconds(retention.row(name, kind), at) for name in names])[codes]
                    for kind, code in kinds}
    columns = HintColumns.empty(trace.n_requests)
    for code, seconds in retained.items():
        chosen = finish == code
        columns.retain_s[chosen] = seconds[chosen]
    if end_turn == "release":
        columns.release[finish == END_OF_TURN] = True
    columns.session[:] = [root if root >= 0 else None for root in chain_roots(trace).tolist()]
    return columns


def _seconds(row, at: int) -> float:
    """A row's retention at share index ``at`` (0: no row, or nothing returned)."""
    return 0.0 if row is None or row.seconds[at] is None else float(row.seconds[at])
