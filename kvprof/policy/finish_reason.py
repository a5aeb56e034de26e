"""A finish-reason candidate for ``wa``: LRU, save that the blocks of turns that ended the agent's answer go first.

When a request ends, the client knows why (:mod:`kvprof.models.finish`): a response that is a tool
call is followed by the tool's result as the session's next request, usually within seconds; a
response that ends the turn waits for a person, or never comes back. On weka-agents-dev, 98.6 % of
the requests ending in a tool call are followed by their session's next request (median 18 s),
against 82.6 % of those ending a turn (median 156 s, 21 % within a minute). Evicting the blocks of
turn ends first therefore keeps those of sessions about to return.

Only an end of turn demotes. A tool call, a code not known (no ``stop`` recorded, a preemption, a
server that cannot tell a tool call from an end of turn) and any other ending (``length``,
``max_tokens``, ``stop_sequence``: a cut response is usually continued by its session at once, and
a stop sequence means what the application made it mean) keep their blocks in LRU order; so without
finish codes the order is exactly LRU. Whether it helps depends on the capacity (it trades the
blocks of returning turn ends for those of tool calls), so it is a candidate ``wa`` follows only
while its shadow hits most.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvprof.models.finish import END_OF_TURN
from kvprof.policy.demoting import DemotingLRU


class FinishReasonLRU(DemotingLRU):
    """Two LRU lists: blocks freed after a request whose response ended its turn are evicted first,
    oldest-freed first, then the others in free order.

    A block's list is set when it is freed, by the :meth:`finish` that came before the free (the
    driver finishes a request, then frees its blocks): demoted after an end of turn
    (:data:`~kvprof.models.finish.END_OF_TURN`), kept after any other code, an unknown one, or no
    finish. Invariant: :class:`~kvprof.policy.demoting.DemotingLRU`'s, ``_demoted`` holding the
    blocks of turn ends.
    """

    name = "finish-reason"

    def finish(self, request: Hashable, now: float, contents: Sequence[Hashable] | None = None, *,
               n_blocks: int | None = None, n_output: int | None = None, finish: int | None = None) -> None:
        self._demoting = finish == END_OF_TURN
