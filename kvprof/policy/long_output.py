"""``wa``'s long-output candidate: LRU, save that the blocks of requests with long outputs go first.

The oracle and rule benchmarks (docs/results.md, "Where the headroom to Belady is" and "Online facts: the
output length and the session's turn") found one thing a server knows when a request ends that says whether
its chain comes back: how much it generated. On weka's agent sessions and on Mooncake, the blocks of
requests whose output was longer than the fit window's median (or a quartile) are reused less, and evicting
them first closes part of the best-baseline-to-Belady gap where LRU or a simple order leads. The limit is
tuned per capacity (:mod:`kvprof.sim.tune`); ``wa`` follows this order only while its shadow hits most.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from kvprof.policy.demoting import DemotingLRU


class LongOutputLRU(DemotingLRU):
    """Two LRU lists: blocks freed after a request that generated more than ``limit`` tokens are evicted
    first, oldest-freed first, then the others in free order.

    A block's list is set when it is freed, by the :meth:`finish` that came before the free (the
    driver finishes a request, then frees its blocks); a free with no output length known, or
    after no finish, keeps its blocks. Invariant: :class:`~kvprof.policy.demoting.DemotingLRU`'s,
    ``_demoted`` holding the blocks of the long outputs.

    Parameters
    ----------
    limit : float
        Output tokens above which a finished request's blocks are evicted first (>= 0).
    """

    name = "long-output"

    def __init__(self, limit: float) -> None:
        if not limit >= 0 or not math.isfinite(limit):
            raise ValueError(f"limit must be a finite number of tokens >= 0, got {limit}")
        super().__init__()
        self.limit = float(limit)

    def finish(self, request: Hashable, now: float, contents: Sequence[Hashable] | None = None, *,
               n_blocks: int | None = None, n_output: int | None = None, finish: int | None = None) -> None:
        self._demoting = n_output is not None and n_output > self.limit
