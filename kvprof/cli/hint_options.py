"""The client-hint options ``kvprof compare`` and ``kvprof fleet`` share, and the hints they replay.

A command with hints replays each online policy ``P`` also as ``P+hints`` (:mod:`kvprof.sim.hints`),
honouring the evaluated requests' hints: the trace's own (``--hints trace``) or what an agent runtime
sends from each response's ``stop`` (``--hints stop``); ``--ignore-hints`` replays none.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvprof.cli.common import number_option
from kvprof.cli.output import say, table, warn
from kvprof.models.retention import SHARE
from kvprof.sim.config import SimulationError

HINT_SOURCES = ("trace", "stop")
_PANEL = "Client hints (docs/hints.md; replayed on the Python engine)"

HintsOpt = Annotated[
    str,
    typer.Option("--hints", help="Where hints come from: trace (the trace's retain_s/retain_priority/release/"
                                 "hint_tag fields, docs/cli.md) or stop (what an agent runtime sends from each "
                                 "response's stop and the hp file's fitted retention). Where there are hints, "
                                 "each online policy P is replayed also as P+hints, honouring them.",
                 rich_help_panel=_PANEL),
]
HintShareOpt = Annotated[
    Optional[float], number_option("--hint-share", bound=SHARE,
                                   help="With --hints stop: the share of a session's returns the retention asked for "
                                        "catches (one of the hp file's retention shares; default 0.9).",
                                   rich_help_panel=_PANEL),
]
HintEndTurnOpt = Annotated[
    Optional[str],
    typer.Option("--hint-end-turn", help="With --hints stop: what an end of turn sends: release (the session's "
                                         "blocks go first; the default) or retain (for the end-of-turn "
                                         "retention).", rich_help_panel=_PANEL),
]
HintToolCallOpt = Annotated[
    Optional[str],
    typer.Option("--hint-tool-call", help="With --hints stop: what a tool call sends: retain (for the fitted "
                                          "retention; the default) or none.", rich_help_panel=_PANEL),
]
HintMaxFractionOpt = Annotated[
    Optional[float],
    number_option("--hint-max-fraction", bound=SHARE,
                  help="Budget: retained blocks hold at most this share of the cache, each hint tag's and all "
                       "together; beyond it the oldest retention lapses (default: no budget).",
                  rich_help_panel=_PANEL),
]
IgnoreHintsOpt = Annotated[
    bool,
    typer.Option("--ignore-hints", help="Replay without hints: no P+hints rows (the rows without them are the "
                                        "same traffic without hints, what the hints are measured against).",
                 rich_help_panel=_PANEL),
]


def hint_options(hints: str, share: float | None, end_turn: str | None, tool_call: str | None,
                 max_fraction: float | None, ignore: bool) -> tuple[float, str, str]:
    """``--hint-share``, ``--hint-end-turn`` and ``--hint-tool-call`` with their defaults, after refusing an
    option the hint source given would ignore (as synth's hint options are)."""
    from kvprof.sim.hints import END_TURN_HINTS, TOOL_CALL_HINTS

    if hints not in HINT_SOURCES:
        raise typer.BadParameter(f"{hints!r} is not one of {', '.join(HINT_SOURCES)}", param_hint="--hints")
    if end_turn is not None and end_turn not in END_TURN_HINTS:
        raise typer.BadParameter(f"{end_turn!r} is not one of {', '.join(END_TURN_HINTS)}",
                                 param_hint="--hint-end-turn")
    if tool_call is not None and tool_call not in TOOL_CALL_HINTS:
        raise typer.BadParameter(f"{tool_call!r} is not one of {', '.join(TOOL_CALL_HINTS)}",
                                 param_hint="--hint-tool-call")
    stop_only = [name for name, value in (("--hint-share", share), ("--hint-end-turn", end_turn),
                                          ("--hint-tool-call", tool_call)) if value is not None]
    if hints != "stop" and stop_only:
        raise typer.BadParameter("applies to --hints stop only", param_hint="/".join(stop_only))
    retains = tool_call != "none" or end_turn == "retain"  # the defaults retain after a tool call
    if hints == "stop" and not retains:
        given = ["--hint-share"] * (share is not None) + ["--hint-max-fraction"] * (max_fraction is not None)
        if given:
            raise typer.BadParameter(f"--hint-tool-call none with --hint-end-turn release sends releases only: "
                                     f"nothing is retained, so {' and '.join(given)} would change nothing",
                                     param_hint="/".join(given))
    if ignore:
        given = ["--hints stop"] * (hints == "stop") + ["--hint-max-fraction"] * (max_fraction is not None)
        if given:
            raise typer.BadParameter(f"--ignore-hints replays no hints, so {' and '.join(given)} would do nothing",
                                     param_hint="--ignore-hints")
    return (0.9 if share is None else share, "release" if end_turn is None else end_turn,
            "retain" if tool_call is None else tool_call)


def check_stop_hints(trace, hp, stop: tuple[float, str, str], fits: bool) -> None:
    """Refuse, before any fit or replay, the ``--hints stop`` that :func:`kvprof.sim.hints.stop_hints` would
    refuse after them (exit 2): a trace without ``stop``; where a hint retains, an hp file without
    ``retention`` or without the share, or (``fits``: the hp file is fitted on ``trace``) a trace whose
    requests name no parent or a share the fit does not give."""
    from kvprof.models.retention import RETENTION_SHARES

    share, end_turn, tool_call = stop
    if not (trace.finish != 0).any():
        raise typer.BadParameter("stop hints need the trace's 'stop' field (how each response ended); it has none",
                                 param_hint="--hints")
    if tool_call != "retain" and end_turn != "retain":
        return
    if fits and not (trace.parent_chat_id >= 0).any():
        raise typer.BadParameter("stop hints that retain need the retention kvprof fit measures on sessions, and no "
                                 "request of the trace names a parent", param_hint="--hints")
    retention = None if fits else getattr(hp, "retention", None)
    if not fits and retention is None:
        raise typer.BadParameter("stop hints that retain need the hp file's retention figures (kvprof fit on a "
                                 "trace whose requests name their parents)", param_hint="--hints")
    shares = RETENTION_SHARES if fits else retention.shares
    if share not in shares:
        raise typer.BadParameter(f"the hp file {'fitted here has' if fits else 'has'} retention for shares "
                                 f"{', '.join(f'{s:g}' for s in shares)}, not {share!r}", param_hint="--hint-share")


def hint_table(runs):
    """What the hints did in each ``P+hints`` replay, in blocks (the hint layer's counters): why a hinted
    ratio moved from its policy's, or did not. ``runs``: ``(label, capacity, counts)``."""
    names = list(runs[0][2])
    out = table("what the hints did, in blocks (docs/hints.md)", {"policy": "left", "capacity": "right",
                                                                     **{name: "right" for name in names}})
    for policy, capacity, counts in runs:
        out.add_row(policy, f"{capacity:,}", *(f"{counts[name]:,}" for name in names))
    return out


def with_hinted_twins(names) -> tuple[str, ...]:
    """``names`` with each online policy's ``P+hints`` twin after it (an offline one is told the future already)."""
    from kvprof.policy import POLICIES
    from kvprof.sim.hints import HINTED

    return tuple(twin for name in names for twin in ((name,) if POLICIES[name].offline else (name, f"{name}{HINTED}")))


def check_hinted_policies(names, hints: str, max_fraction: float | None, ignore: bool) -> None:
    """Refuse ``--hints stop`` and ``--hint-max-fraction`` where every policy is offline (Belady reads the
    future and is replayed without hints): they would change nothing (exit 2)."""
    from kvprof.policy import POLICIES

    given = ["--hints stop"] * (hints == "stop") + ["--hint-max-fraction"] * (max_fraction is not None)
    if given and not ignore and all(POLICIES[name].offline for name in names):
        raise typer.BadParameter(f"{', '.join(names)} reads the future and is replayed without hints, so "
                                 f"{' and '.join(given)} would change nothing (add an online policy)",
                                 param_hint="--policies")


def recorded_hint_budget(recordings) -> float | None:
    """The hint budget the recorded servers ran with (``--kv-hint-max-fraction``, in each ``recording.json``),
    for ``--hints trace`` without ``--hint-max-fraction``: the servers' hints replayed under their own bound.
    None (with a warning where they differ) when their starts ran with different ones or none."""
    budgets = {start.hint_max_fraction for recording in recordings for start in recording.starts}
    if len(budgets) > 1:
        shown = ", ".join("none" if b is None else f"{b:g}" for b in sorted(budgets, key=lambda b: (b is None, b)))
        warn(f"the recorded server starts ran with different hint budgets ({shown}); their hints are replayed "
             "without one unless --hint-max-fraction gives it")
        return None
    (budget,) = budgets
    if budget is not None:
        say(f"--hint-max-fraction {budget:g}: the recorded servers' (recording.json)")
    return budget


def warn_empty_budgets(max_fraction: float | None, capacities) -> None:
    """Warn of the capacities where ``--hint-max-fraction`` rounds down to no block: no tag retains anything there."""
    empty = [capacity for capacity in capacities if max_fraction is not None and int(max_fraction * capacity) == 0]
    if empty:
        warn(f"--hint-max-fraction {max_fraction:g} holds no whole block at capacity "
             f"{', '.join(f'{c:,}' for c in empty)}: no hint tag retains anything there")


def hinted(trace, hp, names, source, stop, max_fraction, ignore):
    """The evaluated trace with the hints to replay, the policies with their ``+hints`` twins (online
    policies only: an offline yardstick is told the future already), and what results.json records of
    the hints (None: none replayed)."""
    from kvprof.sim.hints import stop_hints, with_hints

    if ignore:
        return with_hints(trace, None), names, {"source": "ignored"}
    if source == "stop":
        try:
            trace = with_hints(trace, stop_hints(trace, hp, *stop))
        except SimulationError as exc:
            raise typer.BadParameter(str(exc), param_hint="--hints") from None
    if trace.hints is None or not trace.hints.n_hinted:
        if source == "stop":
            warn("--hints stop: no evaluated request ended in a tool call or an end of turn that gives a hint "
                 "(a retention fitted for its class, or a release), so nothing is replayed with them")
        elif max_fraction is not None:
            warn("--hint-max-fraction: no evaluated request carries a hint (none has retain_s or release), "
                 "so nothing is replayed with them")
        return trace, names, None
    with_twins = with_hinted_twins(names)
    facts = {"source": source, "hinted_requests": trace.hints.n_hinted, "max_fraction": max_fraction}
    if source == "stop":
        facts.update(zip(("share", "end_turn", "tool_call"), stop))
    return trace, with_twins, facts
