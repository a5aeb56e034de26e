"""vLLM's own eviction order, served by kvprof's pool until its compiled core is loaded.

The compiled core (:mod:`kvprof.core`) is compiled on its first use and cached on disk; with an empty
cache (a new image, a fresh venv, a new kvprof release) that takes minutes of CPU. A server must not
wait for it before it answers ``/health``, so the pool starts with :class:`NativeOrder`, vLLM's own
order in plain Python, while the core is compiled in a child process (:mod:`kvprof.vllm.warmup`),
and hands over to the compiled policy once it is ready (:meth:`kvprof.vllm.block_pool.KvprofBlockPool.
replace_policy`, the rule a reload follows: every cached block carried over with its depth, age and hits).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import numpy as np

from kvprof.core.handle import HITS_NOTED
from kvprof.core.twin import CONTENTS_PER_BLOCK, MIN_CONTENTS
from kvprof.policy.lru import LRUPolicy


class NativeOrder(LRUPolicy):
    """vLLM's free-queue order (:class:`~kvprof.policy.lru.LRUPolicy`) behind the compiled twin's
    interface as the pool drives it, noting of each block what a hand-over tells the compiled policy.

    Invariants: the order is LRU's (freed blocks appended tail first, a hit takes its block out, the
    front evicted first), so a server serves exactly what vLLM would until the hand-over; for every
    block below ``n_blocks`` ``_notes`` holds when it was last accessed or freed, the depth of its last
    access and its hits since its last access that was not a hit (up to
    :data:`~kvprof.core.handle.HITS_NOTED`), as the twin keeps them (:meth:`touches`,
    :meth:`hits_since_cached`). It reads no contents and keeps no shadows: the pool tells it neither.
    """

    name = "vllm-native"
    reads_contents = False
    keeps_touches = True
    shadow_feed = None

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.max_contents = max(CONTENTS_PER_BLOCK * n_blocks, MIN_CONTENTS)
        self._notes = (np.full(n_blocks, -np.inf), np.zeros(n_blocks, np.int64), np.zeros(n_blocks, np.int8))
        self.take = self.remove  # the twin defers a take; here it is as cheap done at once

    # -- what the pool tells a policy ------------------------------------------------------
    def access(self, block: int, now: float, workload: int = 0, depth: int = 0, *, hit: bool = False,
               next_use: float = math.inf, content: Hashable | None = None) -> None:
        self.access_one(block, depth, -1, now, workload, hit=hit)

    def access_one(self, block: int, depth: int, number: int, now: float, workload: int, *, hit: bool = False,
                   next_use: float = math.inf) -> None:
        at, depths, hits = self._notes
        at[block], depths[block] = now, depth
        hits[block] = min(int(hits[block]) + 1, HITS_NOTED) if hit else 0

    def access_numbered(self, blocks: np.ndarray, depths: np.ndarray, numbers: np.ndarray, now: float,
                        workload: int, *, hit: bool) -> None:
        at, depth, hits = self._notes
        at[blocks], depth[blocks] = now, depths
        if hit:
            hits[blocks] = np.minimum(hits[blocks] + 1, HITS_NOTED)
        else:
            hits[blocks] = 0

    def free(self, blocks, now: float) -> None:
        if isinstance(blocks, np.ndarray):
            blocks = blocks.tolist()
        super().free(blocks, now)
        self._notes[0][blocks] = now

    def evict_n_array(self, n: int, now: float) -> np.ndarray:
        return np.array(self.evict_n(n, now), dtype=np.int64)

    def admit_numbered(self, request: Hashable, numbers: np.ndarray, now: float, workload: int, *, n_lookup: int,
                       n_blocks: int) -> None:
        """Nothing: vLLM's order keeps no shadows."""

    def finish_numbered(self, request: Hashable, now: float, numbers: np.ndarray, *, n_blocks: int,
                        n_output: int | None = None, finish: int | None = None) -> None:
        """Nothing: vLLM's order does not read how a request ended."""

    def tell_output(self, n_output: int | None) -> None:
        """Nothing: vLLM's order does not read outputs."""

    # -- what a hand-over reads ------------------------------------------------------------
    def touches(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """When each of ``blocks`` was last accessed or freed, and the depth of its last access."""
        return self._notes[0][blocks], self._notes[1][blocks]

    def hits_since_cached(self, blocks: np.ndarray) -> np.ndarray:
        return self._notes[2][blocks]

    def safety_net(self, wait: bool = True) -> None:
        """None: no candidates, no shadows."""
        return None

    def feed_shadows_in_background(self) -> None:
        """Nothing: there are no shadows."""

    def close(self) -> None:
        """Nothing to stop."""
