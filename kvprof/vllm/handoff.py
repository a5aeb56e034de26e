"""Items handed from vLLM's scheduler thread to a kvprof background thread, without waking it.

A ``queue.Queue`` wakes its consumer on every ``put``: the consumer then takes the GIL while the
scheduler still wants it, and each request paid tens of microseconds for it
(``benchmarks/bench_live.py``). :class:`Handoff` is a bounded deque instead: ``put`` is one append
(atomic in CPython), and the background thread drains it on its own schedule, a few times a second,
mostly while the scheduler waits for the model.
"""

from __future__ import annotations

from collections import deque


class Handoff:
    """A bounded FIFO between one producing and one consuming thread.

    Invariant: :meth:`put` never blocks and never raises; with ``limit`` items waiting it refuses
    the item (returns False) and the caller counts it as dropped. Items come out in the order
    they went in.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: deque = deque()

    def put(self, item) -> bool:
        if len(self._items) >= self.limit:
            return False
        self._items.append(item)
        return True

    def take(self):
        """The oldest item, or None when there is none."""
        try:
            return self._items.popleft()
        except IndexError:
            return None

    def __len__(self) -> int:
        return len(self._items)
