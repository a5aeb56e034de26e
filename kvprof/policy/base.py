"""The one interface every eviction policy implements.

It mirrors what vLLM's free block queue does (``vllm/v1/core/kv_cache_utils.py``): blocks become
evictable when a request frees them (tail-first), stop being evictable when a prefix hit takes
them back, and a victim is chosen only when a new block is needed. The simulator and the vLLM
adaptor both drive policies through these methods and nothing else, so the same class runs in
both. A policy never imports the simulator or vLLM.

Blocks are plain ints (vLLM's ``block_id``; the simulator's slot numbers). Per-block state lives
in the policy's own side tables, because vLLM's ``KVCacheBlock`` has ``__slots__``.

A policy holds only *evictable* blocks: cached content that no running request holds. The driver
keeps never-cached (empty) free blocks itself and hands them out before it asks the policy for a
victim. That is vLLM's order too: ``BlockPool.free_blocks`` prepends never-cached blocks to the
free queue and appends cached ones, so the front of the queue is reused before any cached block
is evicted.

Call protocol (the driver keeps it):

* ``access(block, now, workload, depth, hit=..., next_use=..., content=...)`` whenever a request
  allocates a block for new content (``hit=False``) or hits a cached block (``hit=True``). This
  is where a block learns the class of the request that touched it last, its depth in the chain
  and, for Belady, when it will next be used. A hit on an evictable block also calls ``remove``;
  the two may come in either order, but both before the next ``evict``.
* ``free(blocks, now)`` when a request finishes: its cached blocks become evictable, given in
  the order vLLM frees them (the chain's tail first).
* ``remove(block)`` when a hit takes an evictable block back (vLLM's ``touch``).
* ``evict(now)`` / ``evict_n(n, now)`` when blocks are needed: returns victims in order and
  forgets them.
* ``discard(block)`` drops an evictable block without counting it as a decision (e.g. a block
  whose hash was overwritten), ``clear()`` forgets everything (``reset_prefix_cache``).

Two calls per request tell a policy about whole requests; a policy that orders blocks only needs
none of them (the default ignores them), ``wa``'s shadows live on them:

* ``admit(request, contents, now, workload, n_lookup=, n_blocks=)`` when the scheduler first
  admits a request (and again after a preemption), after the ``remove``/``access`` calls of the
  blocks it was given then: its id, the contents of its full prompt blocks shallowest first
  (vLLM's ``request.block_hashes``), how many of them a prefix hit may cover and how many blocks
  it holds.
* ``finish(request, now, contents=, n_blocks=, n_output=, finish=)`` when it finishes or is
  preempted, before the ``free`` of its blocks; with its chain then (output blocks included) if it
  grew since, how many tokens it generated (``wa``'s long-output candidate reads it) and how its
  response ended, where the driver knows (the finish-reason candidate reads it).
"""

from __future__ import annotations

import copy
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence

import numpy as np


def request_sizes(contents: Sequence, n_lookup: int | None, n_blocks: int | None) -> tuple[int, int]:
    """``admit``'s ``n_lookup`` and ``n_blocks``, defaults filled in (``len(contents)``) and checked.

    Raises ValueError unless ``0 <= n_lookup <= len(contents) <= n_blocks``.
    """
    n_full = len(contents)
    n_lookup = n_full if n_lookup is None else n_lookup
    n_blocks = n_full if n_blocks is None else n_blocks
    if not 0 <= n_lookup <= n_full <= n_blocks:
        raise ValueError(f"a request needs 0 <= n_lookup <= len(contents) <= n_blocks; got n_lookup={n_lookup}, "
                         f"{n_full} contents, n_blocks={n_blocks}")
    return n_lookup, n_blocks


def finish_takes(policy: EvictionPolicy, keyword: str) -> bool:
    """Whether ``policy.finish`` takes ``keyword`` (``finish``, the code; ``hint``) by name: one whose
    ``finish`` predates the keyword (written before it, or a wrapper passing on what it is told) is
    not told it and runs as before."""
    return keyword in inspect.signature(policy.finish).parameters


def finished_size(contents: Sequence | None, n_blocks: int | None) -> int:
    """``finish``'s ``n_blocks``: as given, else ``len(contents)`` (0 without contents), checked.

    Raises ValueError if it is fewer than the contents.
    """
    n_full = 0 if contents is None else len(contents)
    if n_blocks is None:
        return n_full
    if n_blocks < n_full:
        raise ValueError(f"a finishing request holds at least its {n_full} full blocks; got n_blocks={n_blocks}")
    return n_blocks


class EvictionPolicy(ABC):
    """Orders the evictable blocks of one cache tier.

    Invariant: a block is in the policy (``block in policy``) exactly when the driver has freed it
    and neither removed nor evicted it since; ``evict`` only ever returns such blocks, so a block
    pinned by a running request can never be chosen.
    """

    #: Name used on the command line and in results.
    name: str = ""
    #: What ``access``'s ``workload`` indexes: the hp file's classes (``"class"``,
    #: ``HpFile.table()`` order) or its cells (``"cell"``, ``HpFile.cell_names()`` order).
    keyed_by: str = "class"
    #: Whether the policy needs the future (``access``'s ``next_use``): a simulator's yardstick that
    #: no live server can run.
    offline: bool = False

    @abstractmethod
    def access(
        self,
        block: int,
        now: float,
        workload: int = 0,
        depth: int = 0,
        *,
        hit: bool = False,
        next_use: float = math.inf,
        content: Hashable | None = None,
    ) -> None:
        """Record an access by a running request.

        Parameters
        ----------
        block : int
        now : float
            Seconds (trace time in the simulator, monotonic time in vLLM).
        workload : int
            Index of the accessing request's class, or its cell for a policy whose ``keyed_by``
            is ``"cell"``. Policies with classes map an index outside their table (e.g. -1) to
            their default one.
        depth : int
            0-based position of the block in the request's chain.
        hit : bool
            True for a prefix-cache hit, False for a newly allocated block.
        next_use : float
            Time of the block's next access, ``inf`` if none; only Belady reads it.
        content : hashable or None
            Identity of the block's content (its prefix hash), or None if the driver does not
            track it; only S3-FIFO's ghost queue reads it, to recognise recomputed content.
        """

    @abstractmethod
    def free(self, blocks: Iterable[int], now: float) -> None:
        """Blocks become evictable, in the order given (tail-first)."""

    @abstractmethod
    def remove(self, block: int) -> None:
        """An evictable block is taken back by a hit; it is no longer evictable.

        Raises KeyError, changing nothing, if ``block`` is not evictable (the vLLM queue relies
        on it to tell cached blocks from hash-less ones in one lookup).
        """

    @abstractmethod
    def evict(self, now: float) -> int:
        """Remove and return the block to evict now. Raises IndexError when empty."""

    def evict_n(self, n: int, now: float) -> list[int]:
        """Remove and return ``n`` victims, first victim first (vLLM's ``popleft_n``).

        The same blocks, in the same order, as ``n`` calls of ``evict(now)``. Raises IndexError,
        changing nothing, when fewer than ``n`` blocks are evictable.
        """
        if n > len(self):
            raise IndexError(f"{n} victims asked for, {len(self)} evictable")
        return [self.evict(now) for _ in range(n)]

    def evict_n_array(self, n: int, now: float) -> np.ndarray:
        """:meth:`evict_n` as an int64 array (the vLLM queue gathers its blocks with it)."""
        return np.array(self.evict_n(n, now), dtype=np.int64)

    def discard(self, block: int) -> None:
        """Forget an evictable block without choosing it (no-op if it is not evictable)."""
        if block in self:
            self.remove(block)

    def admit(
        self,
        request: Hashable,
        contents: Sequence[Hashable],
        now: float,
        workload: int = 0,
        *,
        n_lookup: int | None = None,
        n_blocks: int | None = None,
    ) -> None:
        """A request is admitted with its whole chain; the default ignores it.

        Parameters
        ----------
        request : hashable
            Its id, unique among running requests; :meth:`finish` names it again.
        contents : sequence of hashable
            The content of each of its full prompt blocks, shallowest first (prefix hashes).
        now : float
        workload : int
            As in :meth:`access`.
        n_lookup : int, optional
            How many leading blocks a prefix hit may cover, at most ``len(contents)`` (the
            default): vLLM recomputes a prompt's last token, so ``(prompt_tokens - 1) // block_size``.
        n_blocks : int, optional
            Blocks the request holds while it runs, at least ``len(contents)`` (the default): a
            partial last block is allocated but never cached.
        """

    def finish(self, request: Hashable, now: float, contents: Sequence[Hashable] | None = None, *,
               n_blocks: int | None = None, n_output: int | None = None, finish: int | None = None) -> None:
        """The request admitted as ``request`` finished or was preempted; the default ignores it.

        Parameters
        ----------
        contents : sequence of hashable, optional
            Its chain now, when it grew since :meth:`admit`: the content of every full block,
            prompt and output, shallowest first (vLLM's ``request.block_hashes`` at the end).
            Blocks filled since admission were cached as they filled; a shadow caches them now.
        n_blocks : int, optional
            Blocks it holds now, at least ``len(contents)`` (the default: as many as it held,
            or ``len(contents)`` if more).
        n_output : int, optional
            Tokens it generated so far (vLLM's ``num_output_tokens``); None when the driver does
            not know.
        finish : int, optional
            How its response ended, a code of :mod:`kvprof.models.finish` (a tool call, an end of
            turn, other); None or 0 when the driver does not know (a preemption, a server that
            cannot tell).
        """

    @abstractmethod
    def clear(self) -> None:
        """Forget every block and all per-block state."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable blocks."""

    @abstractmethod
    def __contains__(self, block: int) -> bool:
        """Whether ``block`` is evictable now."""

    def order(self, now: float, limit: int | None = None) -> list[int]:
        """Evictable blocks in eviction order at time ``now`` (first victim first), unchanged;
        only the first ``limit`` when given.

        Used where vLLM walks its free list (``get_all_free_blocks``, ``iter_blocks_after``) and
        where its offload tier picks victims past protected blocks. The default evicts from a
        copy; policies with a cheaper walk override it.
        """
        shadow = copy.deepcopy(self)
        return shadow.evict_n(len(shadow) if limit is None else min(limit, len(shadow)), now)
