"""What a reloaded policy is told of the blocks its tier already holds: one rule for every tier.

A reload of the hp file (:mod:`kvprof.vllm.live`) replaces the policy of the GPU pool
(:meth:`kvprof.vllm.block_pool.KvprofBlockPool.replace_policy`) and of each CPU offload tier
(:meth:`kvprof.vllm.offload.KvprofCachePolicy.replace_policy`) by a fresh one built from the new file.
The held blocks carry over the same way in both, so that the new policy orders them as if it had seen
them come: oldest first, each accessed as often as it was hit since it was cached (its reuse tier,
capped where the tiers end), at the time it was last accessed or freed; then the evictable ones are
freed in that order. What the old policy had learnt beyond that (ghosts, ``wa``'s shadows) starts afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from kvprof.cells import TIER_EDGES


class Held(NamedTuple):
    """A block (or offloaded chunk) a tier holds, as a new policy is told of it."""

    id: int
    depth: int
    content: object
    stamp: float  # when it was last accessed or freed (the policy's clock)
    workload: int  # its class under the new hp file
    hits: int  # hits since it was cached
    evictable: bool


def carry_over(held: Iterable[Held], access: Callable[[Held, bool], None], free: Callable[[Held], None]) -> None:
    """Replay ``held`` into a new policy: ``access(item, hit)`` per access, then ``free(item)``
    for the evictable ones, oldest first (the order they were last touched)."""
    items = sorted(held, key=lambda item: item.stamp)
    for item in items:
        for k in range(min(item.hits, TIER_EDGES[-1]) + 1):
            access(item, k > 0)
    for item in items:
        if item.evictable:
            free(item)
