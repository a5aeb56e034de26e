"""How soon a session's next request follows, after a request that began the session and after one that
continued it: the evidence for ``wa``'s ``first-turn`` candidate (:class:`kvprof.policy.first_turn.FirstTurnLRU`).

The profiler counts it on the fit window (:func:`kvprof.profiler.turns.next_turn_rates`) and the hp file
keeps the counts (``next_turn``, schema ``kvprof.hp/5``). Where a continued session comes back within
:data:`NEXT_TURN_HORIZON_S` at least :data:`FIRST_TURN_RATIO` times as often as a new one, ``wa`` runs
over the first-turn order and LRU instead of its default candidates (:meth:`NextTurnRates.favours_first_turn`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvprof.jsonfile import JsonChecks, member
from kvprof.limits import POSITIVE_SECONDS

#: Seconds within which a session's next request counts as following soon.
NEXT_TURN_HORIZON_S = 30.0
#: The least ratio of the two rates (continued over began) at which ``wa`` follows ``first-turn``. On the
#: fit windows of the traces measured (docs/results.md, "Online facts: the output length and the session's
#: turn") Mooncake's ratios are 4.9-17.2, weka's 1.1, bailian-a's 1.0-1.2 and bailian-b's 0: any value
#: between 1.2 and 4.9 splits them alike. The evidence is four traces.
FIRST_TURN_RATIO = 3.0
#: Fewest requests of each kind (began, continued) that the ratio is taken on. Mooncake's shortest fit
#: window (200 s) has 22 continued requests whose next turn could be seen.
MIN_REQUESTS = 20
#: Fewest followed requests of each kind the ratio is taken on: a rate of one event, or none (a ratio of
#: inf), says nothing of how often either kind is followed. Mooncake's shortest fit window (200 s) has 5
#: and 3 (of 598 began and 22 continued requests), so every fit window measured decides as before.
MIN_FOLLOWED = 3


@dataclass(frozen=True)
class NextTurnRates:
    """Requests of the fit window whose session's next request could be seen within the horizon (they
    arrived at least ``horizon_s`` before the window's last arrival), by whether they began their session,
    and how many of each were followed within it."""

    horizon_s: float
    began: int
    began_followed: int
    continued: int
    continued_followed: int

    def __post_init__(self):
        if not (0 <= self.began_followed <= self.began and 0 <= self.continued_followed <= self.continued):
            raise ValueError(f"followed requests must be within 0 .. requests, got {self}")

    @property
    def ratio(self) -> float:
        """The continued requests' rate over the began ones' (inf where none of those was followed; nan
        without requests of either kind)."""
        if not (self.began and self.continued):
            return math.nan
        if not self.began_followed:
            return math.inf if self.continued_followed else math.nan
        return self.continued_followed * self.began / (self.continued * self.began_followed)  # (one rounding)

    def enough(self) -> bool:
        """Whether the counts can give a ratio: :data:`MIN_REQUESTS` requests and :data:`MIN_FOLLOWED`
        followed requests of each kind."""
        return (min(self.began, self.continued) >= MIN_REQUESTS
                and min(self.began_followed, self.continued_followed) >= MIN_FOLLOWED)

    def favours_first_turn(self) -> bool:
        """Whether ``wa`` should run over ``first-turn`` and LRU: enough counts of each kind (:meth:`enough`)
        and a ratio of at least :data:`FIRST_TURN_RATIO`."""
        return self.enough() and self.ratio >= FIRST_TURN_RATIO

    def to_dict(self) -> dict:
        return {"horizon_s": self.horizon_s, "began": self.began, "began_followed": self.began_followed,
                "continued": self.continued, "continued_followed": self.continued_followed}

    @classmethod
    def read(cls, checks: JsonChecks, data, where: str) -> NextTurnRates:
        """From an hp file's ``next_turn`` object, strictly (each count an int, followed within its requests)."""
        keys = ("horizon_s", "began", "began_followed", "continued", "continued_followed")
        checks.fields(data, where, required=keys)
        horizon = float(checks.bounded(data["horizon_s"], member(where, "horizon_s"), POSITIVE_SECONDS))
        counts = {key: checks.integer(data[key], member(where, key)) for key in keys[1:]}
        for kind in ("began", "continued"):
            if counts[f"{kind}_followed"] > counts[kind]:
                checks.fail(member(where, f"{kind}_followed"), f"must be at most {kind} ({counts[kind]}), "
                                                               f"got {counts[f'{kind}_followed']}")
        return cls(horizon, **counts)
