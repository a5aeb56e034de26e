"""``wa``'s first-turn candidate: LRU, save that the blocks of requests that began a session go first.

The oracle table (docs/results.md, "Where the headroom to Belady is") puts a quarter to a half of Mooncake's
best-baseline-to-Belady gap in knowing whether a freed chain's session continues. A server can infer one
fact that predicts it from the block hashes alone: whether the request *continued* a session (an earlier
request's whole chain is a prefix of its own) or began one. On Mooncake a session's next request follows
within 30 s 5-17 times as often after a request that continued it as after one that began it; on weka and
bailian about as often (docs/results.md, "Online facts: the output length and the session's turn"). The
profiler measures that ratio on the fit window (:mod:`kvprof.profiler.turns`); ``wa`` follows this order
where it is high.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable

from kvprof.policy.demoting import DemotingLRU

#: Open tails remembered at most by default (contents; the oldest is forgotten first).
TAIL_MEMORY = 65536


class FirstTurnLRU(DemotingLRU):
    """Two LRU lists: the blocks of a request that began its session are evicted first, oldest-freed
    first, then the others in free order.

    A freed request *continued* a session when one of its blocks holds an *open tail*: the content of
    the deepest block of an earlier freed request that no request has continued since (the deepest
    such, which it closes). Each free then opens the deepest freed block's content as a tail (one
    already open keeps its place). Contents are compared, not blocks, so a session is followed across
    the eviction of its previous turn's tail. Only the past is read: on requests that run one at a time
    this is :func:`kvprof.sim.oracles.infer_sessions`' session start.

    Invariant: :class:`~kvprof.policy.demoting.DemotingLRU`'s, ``_demoted`` holding the first turns'
    blocks; at most ``memory`` open tails are remembered, the oldest forgotten first.

    Parameters
    ----------
    memory : int
        Open tails remembered at most (>= 1): bounds the state by the live sessions, not the trace.
    """

    name = "first-turn"

    def __init__(self, memory: int = TAIL_MEMORY) -> None:
        if not (isinstance(memory, int) and memory >= 1):
            raise ValueError(f"memory must be an int >= 1 (open tails), got {memory!r}")
        super().__init__()
        self.memory = memory
        self._depth: dict[int, int] = {}
        self._content: dict[int, Hashable] = {}
        self._open: OrderedDict[Hashable, None] = OrderedDict()

    def access(self, block: int, now: float, workload: int = 0, depth: int = 0, *, hit: bool = False,
               next_use: float = math.inf, content: Hashable | None = None) -> None:
        self._depth[block] = depth
        if content is not None:
            self._content[block] = content

    def free(self, blocks: Iterable[int], now: float) -> None:
        blocks = list(blocks)
        if not blocks:
            return
        deepest_first = sorted(blocks, key=lambda block: -self._depth.get(block, 0))
        contents = [self._content.get(block) for block in deepest_first]
        continued = next((content for content in contents if content is not None and content in self._open), None)
        if continued is not None:  # the session's previous turn: no other request continues it now
            del self._open[continued]
        if contents[0] is not None:
            self._open[contents[0]] = None
            if len(self._open) > self.memory:
                self._open.popitem(last=False)
        self._demoting = continued is None
        super().free(blocks, now)

    def clear(self) -> None:
        super().clear()
        for table in (self._depth, self._content, self._open):
            table.clear()
