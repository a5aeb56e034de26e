"""Client hints made from a trace's true future, right or wrong by a chosen amount.

To measure what a hint is worth as it degrades, the hints are computed from what the generator
knows (whether and when each session's next request comes) and then spoiled:

* ``future``: a request whose session goes on asks to retain its blocks for the time to the next
  request times ``time_factor`` (1: exactly until it arrives); one whose session ends releases them.
  A share ``1 - accuracy`` of the requests, drawn at random, get the other hint (a "resume soon"
  that does not come, a release of a session that does), a wrong retention lasting the median true
  gap times ``time_factor``;
* ``retain-all``: every request asks to retain for ``retain_s`` (the adversarial client);
* ``random``: each request retains or releases by a fair coin, retaining for a time drawn uniformly
  up to twice the median true gap.

Each hint is charged to a tag: the request's type (a tenant per type), so a budget bounds each, and
names the request's session (its first request's ``chat_id``), so a release demotes only the blocks
that session alone held, not a system prompt other sessions share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvprof.models.hints import MAX_RETAIN_S, RELEASE_FIELD, RETAIN_FIELD, SESSION_FIELD, TAG_FIELD, HintColumns

HINT_MODES = ("future", "retain-all", "random")
#: The shortest retention a hint asks for (a next request in the same instant still needs one).
MIN_RETAIN_S = 0.001


@dataclass(frozen=True)
class HintSpec:
    """How hints are made. Invariant: ``mode`` in :data:`HINT_MODES`, ``0 <= accuracy <= 1``,
    ``time_factor > 0``, ``0 < retain_s <= MAX_RETAIN_S``."""

    mode: str = "future"
    accuracy: float = 1.0
    time_factor: float = 1.0
    retain_s: float = 600.0

    def __post_init__(self):
        if self.mode not in HINT_MODES:
            raise ValueError(f"hint mode must be one of {', '.join(HINT_MODES)}, got {self.mode!r}")
        if not (0.0 <= self.accuracy <= 1.0 and self.time_factor > 0 and 0 < self.retain_s <= MAX_RETAIN_S):
            raise ValueError(f"hint accuracy must be within [0, 1], the time factor > 0 and the retention within "
                             f"(0, {MAX_RETAIN_S:g}], got {self}")


def future_hints(gap: np.ndarray, tag: np.ndarray, spec: HintSpec, rng: np.random.Generator,
                 session: np.ndarray | None = None) -> HintColumns:
    """Each request's hint from ``gap`` (seconds from its arrival to its session's next request;
    ``inf`` where the session ends), charged to ``tag``, naming ``session`` (ints >= 0; None: none)."""
    n = gap.shape[0]
    columns = HintColumns.empty(n)
    columns.tag[:] = tag
    if session is not None:
        columns.session[:] = np.asarray(session).tolist()
    if spec.mode == "retain-all":
        columns.retain_s[:] = spec.retain_s
        return columns
    continues = np.isfinite(gap)
    typical = float(np.median(gap[continues])) if continues.any() else spec.retain_s
    if spec.mode == "random":
        says_continue = rng.random(n) < 0.5
        retain = rng.uniform(0.0, 2.0 * typical, n)
    else:
        says_continue = continues ^ (rng.random(n) >= spec.accuracy)
        retain = np.where(continues, gap, typical) * spec.time_factor
    chosen = np.clip(retain[says_continue], MIN_RETAIN_S, MAX_RETAIN_S)
    columns.retain_s[says_continue] = chosen
    columns.release[~says_continue] = True
    return columns


def hint_fields(columns: HintColumns, row: int) -> dict:
    """The trace fields of request ``row``'s hint (none where it has none; defaults left out)."""
    session = columns.session[row]
    fields = {} if session is None else {SESSION_FIELD: session}
    if columns.release[row]:
        fields[RELEASE_FIELD] = True
    elif columns.retain_s[row] > 0:
        fields[RETAIN_FIELD] = float(columns.retain_s[row])
    else:
        return fields
    if columns.tag[row]:
        fields[TAG_FIELD] = int(columns.tag[row])
    return fields
