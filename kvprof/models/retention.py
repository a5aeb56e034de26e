"""The retention a client should ask for: per workload class and per hint kind, the wait after a request
within which its session's next request came, as the share of those returns a retention would catch.

A client that holds a session's cache for a while after a response (a retention hint, a cache TTL)
wants the shortest time that still catches most of the session's returns. ``kvprof fit`` measures it on
the fit window (:func:`fit_retention`), per class and, where the trace says how each response ended
(:mod:`kvprof.models.finish`), separately after a tool call (the runtime resumes as soon as the tool
is done) and after an end of turn (the next request waits for a person), and over every request.

The wait of a request is from its end where the trace records it (``finished``, as a vLLM recording
does) and from its arrival otherwise (then it holds the request's own service time too); the session's
next request is its earliest child (``parent_chat_id``). Returns are censored at the window's end: a
request whose session has not come back by then counts as not returned, and one near the end counts as
not returned only for the time the window could see (Kaplan-Meier). ``share_returned`` is the estimated
share of requests whose session comes back (within the longest wait seen); the retention for share ``q``
is the shortest wait that catches ``q`` of those returns. The file keeps them as ``retention``
(schema ``kvprof.hp/6``, ``docs/hp-schema.md``); ``docs/hints.md`` says how a runtime uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvprof.jsonfile import JsonChecks, member
from kvprof.limits import SECONDS, Bound
from kvprof.models.finish import END_OF_TURN, TOOL_CALL
from kvprof.models.hp_loader import class_name
from kvprof.models.sessions import next_request_rows

#: Shares of a session's returns the file gives a retention for (``fit --retention-shares``).
RETENTION_SHARES = (0.5, 0.9, 0.99)
#: What one share may be.
SHARE = Bound(0.0, 1.0, low_open=True)
#: Hint kinds, each the finish code of the requests it is taken over (None: every request).
HINT_KINDS = {"tool_call": TOOL_CALL, "end_turn": END_OF_TURN, "any": None}
#: What a wait is counted from.
FROM_ARRIVAL, FROM_END = "arrival", "end"
#: The trace field holding a request's end on the arrivals' clock (what ``vllm serve --kv-record`` writes).
END_FIELD = "finished"


@dataclass(frozen=True)
class RetentionRow:
    """The requests of one class and hint kind, and their sessions' returns.

    Invariant: ``0 <= returned <= requests``; ``share_returned`` in ``[0, 1]``, 0 exactly when nothing
    returned; ``seconds`` holds one wait per share of the file, all None exactly when nothing returned,
    otherwise non-decreasing.
    """

    requests: int
    returned: int
    share_returned: float
    seconds: tuple[float | None, ...]

    def __post_init__(self):
        if (not 0 <= self.returned <= self.requests or not 0.0 <= self.share_returned <= 1.0
                or (self.share_returned > 0) != (self.returned > 0)):
            raise ValueError(f"returned must be within 0 .. requests and its share within [0, 1], 0 exactly when "
                             f"none returned, got {self}")
        known = [s for s in self.seconds if s is not None]
        if (not known) != (not self.returned) or (known and len(known) != len(self.seconds)) or known != sorted(known):
            raise ValueError(f"retention times must be all null (nothing returned) or all set and non-decreasing, "
                             f"got {self}")

    def to_dict(self) -> dict:
        return {"requests": self.requests, "returned": self.returned, "share_returned": self.share_returned,
                "retention_s": list(self.seconds)}


@dataclass(frozen=True)
class Retention:
    """Per class (and pooled over every class: ``default``) and per hint kind, a :class:`RetentionRow`.

    Invariant: ``shares`` rise strictly within ``(0, 1]``; every row has one wait per share; a kind is
    present only where the window had requests of it.
    """

    basis: str
    shares: tuple[float, ...]
    classes: dict[str, dict[str, RetentionRow]]
    default: dict[str, RetentionRow]

    def row(self, class_name: str, kind: str = "any") -> RetentionRow | None:
        """The row of ``class_name`` and ``kind``, the pooled one where the class had no request of that kind
        (or the file has no entry for the class); None where no request of the window was of that kind."""
        return self.classes.get(class_name, {}).get(kind) or self.default.get(kind)

    def to_dict(self) -> dict:
        def kinds(rows: dict[str, RetentionRow]) -> dict:
            return {kind: row.to_dict() for kind, row in rows.items()}

        return {"from": self.basis, "shares": list(self.shares),
                "classes": {name: kinds(rows) for name, rows in sorted(self.classes.items())},
                "default": kinds(self.default)}

    @classmethod
    def read(cls, checks: JsonChecks, data, where: str) -> Retention:
        """From an hp file's ``retention`` object, strictly."""
        checks.fields(data, where, required=("from", "shares", "classes", "default"))
        basis = checks.one_of(data["from"], member(where, "from"), (FROM_ARRIVAL, FROM_END))
        at = member(where, "shares")
        shares = tuple(float(checks.number(share, f"{at}[{i}]", high=1.0))
                       for i, share in enumerate(checks.sequence(data["shares"], at, empty=False)))
        if shares[0] <= 0 or any(a >= b for a, b in zip(shares, shares[1:])):
            checks.fail(at, f"must rise strictly within (0, 1], got {list(shares)}")

        def kinds(value, place: str) -> dict[str, RetentionRow]:
            rows = checks.fields(value, place, optional=tuple(HINT_KINDS))
            return {kind: _read_row(checks, row, member(place, kind), len(shares)) for kind, row in rows.items()}

        classes = {class_name(checks, name, member(where, "classes")): kinds(rows, member(member(where, "classes"), name))
                   for name, rows in checks.mapping(data["classes"], member(where, "classes")).items()}
        return cls(basis, shares, classes, kinds(data["default"], member(where, "default")))


def _read_row(checks: JsonChecks, data, where: str, n_shares: int) -> RetentionRow:
    checks.fields(data, where, required=("requests", "returned", "share_returned", "retention_s"))
    requests = checks.integer(data["requests"], member(where, "requests"))
    returned = checks.integer(data["returned"], member(where, "returned"), high=requests)
    share = float(checks.number(data["share_returned"], member(where, "share_returned"), high=1.0))
    at = member(where, "retention_s")
    waits = checks.sequence(data["retention_s"], at)
    if len(waits) != n_shares:
        checks.fail(at, f"must hold one wait per share ({n_shares}), got {len(waits)}")
    seconds = tuple(checks.bounded(wait, f"{at}[{i}]", SECONDS, null=True) for i, wait in enumerate(waits))
    try:
        return RetentionRow(requests, returned, share, tuple(None if s is None else float(s) for s in seconds))
    except ValueError as exc:
        checks.fail(where, str(exc))


def fit_retention(trace, codes: np.ndarray, names, shares=RETENTION_SHARES) -> Retention | None:
    """The retention figures of a fit window (None where no request of it names a parent: the trace
    says nothing of sessions, as a Mooncake trace does).

    Parameters
    ----------
    trace : kvprof.profiler.trace.Trace
        The fit window's requests, in arrival order (their hash ids are not read).
    codes, names
        Each request's class and the class names.
    shares : sequence of float
        Shares of the returns to give a retention for, rising within ``(0, 1]``.
    """
    if not (trace.parent_chat_id >= 0).any():
        return None
    basis, start = _starts(trace)
    following = next_request_rows(trace.chat_id, trace.parent_chat_id)
    returned = following >= 0
    wait = np.where(returned, trace.timestamp[following] - start, trace.censor_time - start)
    wait = np.maximum(wait, 0.0)  # a child may arrive before its parent ends (a sub-agent), or the window ends first
    finish = trace.finish
    kind_masks = {kind: np.ones(trace.n_requests, bool) if code is None else finish == code
                  for kind, code in HINT_KINDS.items()}

    def rows(in_class: np.ndarray) -> dict[str, RetentionRow]:
        out = {}
        for kind, mask in kind_masks.items():
            chosen = in_class & mask
            if chosen.any():
                out[kind] = _row(wait[chosen], returned[chosen], shares)
        return out

    classes = {name: rows(codes == code) for code, name in enumerate(names) if (codes == code).any()}
    return Retention(basis, tuple(float(s) for s in shares), classes, rows(np.ones(trace.n_requests, bool)))


def _starts(trace) -> tuple[str, np.ndarray]:
    """What waits count from and each request's moment of it: its recorded end where every request has
    one, none before its arrival, else its arrival."""
    end = _ends(trace)
    if end is not None and (end >= trace.timestamp).all():
        return FROM_END, end
    return FROM_ARRIVAL, trace.timestamp


def _ends(trace) -> np.ndarray | None:
    """Each request's recorded end (float64), None unless every request has a finite one."""
    end = trace.extra.get(END_FIELD)
    if end is not None and end.dtype.kind in "if" and np.isfinite(end).all():
        return end.astype(np.float64)
    return None


def start_problems(trace) -> list[str]:
    """What a user should know of the waits :func:`fit_retention` measures on ``trace``: requests whose
    recorded end lies before their arrival (then waits count from arrivals), and returns that arrived
    before the request they follow ended (their wait from its end counts as 0 s). Empty where neither."""
    end = _ends(trace)
    if end is None or not (trace.parent_chat_id >= 0).any():
        return []
    early = np.flatnonzero(end < trace.timestamp)
    if early.size:
        i = int(early[0])
        return [f"{early.size:,} requests finish before they arrive (field '{END_FIELD}'; request "
                f"{int(trace.chat_id[i])}: arrived {float(trace.timestamp[i]):g} s, finished {float(end[i]):g} s): "
                f"retention is measured from arrivals"]
    following = next_request_rows(trace.chat_id, trace.parent_chat_id)
    returned = np.flatnonzero(following >= 0)
    overlapping = returned[trace.timestamp[following[returned]] < end[returned]]
    if not overlapping.size:
        return []
    return [f"{overlapping.size:,} of {returned.size:,} returns arrived before the request they follow ended "
            f"(sub-agents, or '{END_FIELD}' on another clock): their waits count as 0 s"]


def _row(wait: np.ndarray, returned: np.ndarray, shares) -> RetentionRow:
    """Kaplan-Meier over the waits (censored where not ``returned``): the share that returns, and the
    shortest wait that catches each share of those returns.

    Taken in wait order, returns before censorings at a tie, each return multiplies the survival by
    ``1 - 1 / at_risk``; over a tie of ``d`` returns among ``n`` at risk that telescopes to ``1 - d / n``,
    the estimator's own factor.
    """
    n = wait.size
    order = np.lexsort((~returned, wait))
    wait, returned = wait[order], returned[order]
    survival = np.cumprod(np.where(returned, 1.0 - 1.0 / (n - np.arange(n)), 1.0))
    caught = 1.0 - survival[returned]  # share returned by each return's wait
    if not caught.size:
        return RetentionRow(n, 0, 0.0, (None,) * len(shares))
    times = wait[returned]
    total = float(caught[-1])
    picks = np.minimum(np.searchsorted(caught, np.asarray(shares) * total * (1 - 1e-12)), caught.size - 1)
    return RetentionRow(n, int(returned.sum()), total, tuple(round(float(times[i]), 3) for i in picks))
