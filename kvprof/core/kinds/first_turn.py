"""The twin of wa's first-turn candidate (:class:`kvprof.policy.first_turn.FirstTurnLRU`): list 0 of
the queue holds the blocks freed by a request that began its session, list 1 the others, each in free
order; eviction takes list 0's front first (``long_output``'s lists). Ghost list 0 holds the open
tails' contents, oldest first.

State: the common ``content`` and ``depth`` of each block (set at each access, a content only when one
is given) and ``first_turn_memory`` (open tails remembered at most).
"""

from __future__ import annotations

from numba import njit, types

from kvprof.core.kinds.long_output import evict  # noqa: F401 (the same two lists: dispatched from here)
from kvprof.core.structs import NONE, holds, pop_front, push_back, unlink

FIELDS = [("first_turn_memory", types.int64)]
COMMON = ("q", "content", "depth")


def lists(policy) -> tuple[int, int]:
    return 2, 1


def configure(core, policy) -> None:
    """The open-tail memory of the reference instance."""
    set_memory(core, policy.memory)


@njit(cache=True)
def set_memory(core, memory):
    core.first_turn_memory = memory


@njit(cache=True)
def init(core):
    core.first_turn_memory = 1


@njit(cache=True, inline="always")
def access(core, block, depth, content):
    core.depth[block] = depth
    if content >= 0:
        core.content[block] = content


@njit(cache=True)
def access_n(core, blocks, depths, contents, n):
    """``access`` of ``blocks[i]`` at ``depths[i]`` with ``contents[i]`` for ``i < n``, the tables read once
    (a 128k-token prompt is 8,000 blocks: a dispatched call each cost a quarter of a millisecond)."""
    depth, content_of = core.depth, core.content
    for i in range(n):
        depth[blocks[i]] = depths[i]
        if contents[i] >= 0:
            content_of[blocks[i]] = contents[i]


@njit(cache=True)
def free_n(core, blocks, n):
    """Free ``blocks[:n]``: to list 0 unless one holds an open tail (the deepest such is closed); the
    deepest block's content is opened as a tail. Depth ties go to the earlier block, as the reference's
    stable sort."""
    if n == 0:
        return
    depth, content_of, g = core.depth, core.content, core.g
    deepest, continued = 0, NONE
    for i in range(n):
        block = blocks[i]
        if depth[block] > depth[blocks[deepest]]:
            deepest = i
        if holds(g, content_of[block]) and (continued == NONE or depth[block] > depth[blocks[continued]]):
            continued = i
    if continued != NONE:
        unlink(g, content_of[blocks[continued]])
    tail = content_of[blocks[deepest]]
    if tail >= 0 and not holds(g, tail):
        push_back(g, 0, tail)
        if g.count[0] > core.first_turn_memory:
            pop_front(g, 0)
    which = 0 if continued == NONE else 1
    for i in range(n):
        push_back(core.q, which, blocks[i])
