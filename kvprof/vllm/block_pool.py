"""GPU tier: vLLM's block pool with its cached blocks ordered by a kvprof eviction policy.

vLLM keeps every free block in one intrusive list, ``FreeKVCacheBlockQueue``, whose front is
evicted first (``vllm/v1/core/kv_cache_utils.py``). :class:`PolicyFreeQueue` is a drop-in
replacement with the same methods, split in three parts that are always consumed in this order:

1. **front** -- blocks that hold no cached content (never cached, or freed without a hash):
   handed out first, as vLLM does with ``prepend_n``. Initially every block by id
   (:class:`FrontBlocks`: a range of ids, no memory per block).
2. **policy** -- cached blocks (they have a block hash), ordered by the compiled twin of a
   kvprof policy (:class:`kvprof.core.twin.CompiledTwin`: the same compiled core the simulator
   runs, on block ids). They enter with ``append``/``append_n`` when a request frees them (vLLM
   passes them tail-first), leave with ``remove`` on a prefix hit (``BlockPool.touch``) or
   ``popleft``/``popleft_n`` when evicted.
3. **back** -- hash-less blocks appended as last-resort candidates (``BlockPool.unpin_blocks``).

The policy sees block ids only, never vLLM objects; per-block state (class of the last toucher,
depth, last access, hits since cached) lives in the compiled twin's tables, indexed by block id,
written by the compiled calls themselves (no numpy call per vLLM call for them).
All ordering logic is the policy's; this module only feeds it vLLM's events:

* ``access(hit=False)`` when :meth:`KvprofBlockPool.cache_full_blocks` caches newly computed blocks
  (the blocks' contents, depths and owning request are known only there),
* ``access(hit=True)`` for the blocks a request hits (:meth:`KvprofBlockPool.touch`); both as one
  compiled call per chain (``access_chain``),
* ``free`` when the request frees its blocks, ``remove`` on a hit of a free block, ``evict_n`` when
  blocks are needed, ``clear`` on ``reset_prefix_cache``;
* a finished request's client hint (its ``extra_args``) for the frees of its blocks: the queue's
  :class:`~kvprof.policy.hinted.HintLayer` over the policy keeps released and retained blocks out of
  its order, as the simulator's ``HintedPolicy`` does (docs/hints.md).

Invariants kept from vLLM: the null block (id 0) is popped once at construction and never enters
the queue; blocks owned by other pools go to their pools, as ``BlockPool.free_blocks`` sends them;
``get_all_free_blocks`` and ``iter_blocks_after`` walk the blocks in eviction order at the time of
the call; ``num_free_blocks`` counts all three parts (a plain int, as vLLM's is: the scheduler reads it
on every allocation). And one of this queue: a free block with a
block hash is in the policy part (hash-less blocks enter the front or the back, and a free block
gains no hash), so ``remove`` of such a block is a ``take`` of the policy, deferred to its next
call, without asking the core whether it holds it.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import deque
from collections.abc import Iterator

import numpy as np
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

from kvprof.cells import TIER_EDGES
from kvprof.core.handle import HITS_NOTED
from kvprof.core.twin import NO_NUMBERS
from kvprof.limits import usable_blocks
from kvprof.models.finish import UNKNOWN
from kvprof.models.hints import Hint, hint_of_args
from kvprof.policy.hinted import HintLayer
from kvprof.vllm.carry import Held, carry_over
from kvprof.vllm.native import NativeOrder
from kvprof.vllm.numbering import ContentNumbers
from kvprof.vllm.spec import PolicySpec, request_extra_args, shadow_thread

#: The suffix of group 0's cache keys (``make_block_hash_with_group_id(h, 0) == h + _GROUP0``).
_GROUP0 = make_block_hash_with_group_id(b"", 0)

#: Up to this many victims a list comprehension turns ids into blocks faster than numpy would.
_FEW = 64

#: From this many ints on, :func:`int64s` converts a list through ``array('q')``.
_LONG = 128

#: Below this many blocks, ``cache_full_blocks`` looks for the null block (id 0) in the Python list of ids
#: (decode caches one block a call); from it on, ``all()`` of the id array is faster.
_SEARCHED = 64

#: Whether vLLM's blocks keep the token count their hash covers (0.32 on; :func:`chain_depths`).
_HAS_TOKEN_COUNT = hasattr(KVCacheBlock, "_block_hash_num_tokens")

#: A block's hits since it was cached are carried over by a reload up to where the reuse tiers end: all
#: it replays of them (:func:`kvprof.vllm.carry.carry_over`); the policy notes them up to HITS_NOTED.
_HITS_KEPT = TIER_EDGES[-1]
if _HITS_KEPT > HITS_NOTED:
    raise ImportError(f"kvprof: the policy notes up to {HITS_NOTED} hits a block, but the tiers end at {_HITS_KEPT}")

#: Whether vLLM's ``BlockPool.touch`` is the plain loop (reference counts, the free queue's ``remove``, the
#: metrics collector) that :meth:`KvprofBlockPool._touch_plainly` does itself; else the pool calls it.
_PLAIN_TOUCH = (BlockPool.touch.__code__.co_argcount == 2 and BlockPool.touch.__code__.co_names
                == ("ref_cnt", "is_null", "free_block_queue", "remove", "metrics_collector", "on_block_accessed"))

#: Whether vLLM's ``BlockPool.free_blocks`` is the plain loop (reference counts down; hash-less blocks to the
#: front, cached ones to the back, in order; other pools' blocks to their pools) that
#: :meth:`KvprofBlockPool.free_blocks` does itself, handing the queue block ids without a second pass.
_PLAIN_FREE = (BlockPool.free_blocks.__code__.co_argcount == 2 and BlockPool.free_blocks.__code__.co_names
               == ("pool", "setdefault", "append", "ref_cnt", "is_null", "block_hash", "enable_caching",
                   "free_block_queue", "prepend_n", "append_n", "items", "free_blocks"))

if not hasattr(KVCacheBlock, "_block_hash"):  # read directly by PolicyFreeQueue.append_n
    raise ImportError("kvprof: this vLLM's KVCacheBlock has no _block_hash slot; the block pool cannot be installed")


class FrontBlocks:
    """The front of the free queue: hash-less free blocks, the first to be reused, in order.

    The pool's blocks start here, in id order, and most are never handed out for a long time: they
    are kept as a range of ids (``blocks[fresh:stop]``, no memory per block, where a deque of a
    500,000-block pool's blocks holds 8 bytes a block), between the blocks put before them
    (:meth:`prepend`) and after them (:meth:`extend`).

    Invariant: the order is ``[*left, *blocks[fresh:stop], *right]`` and holds each block at most
    once; ``size`` is its length (an attribute: the free queue's hot paths read it per call).
    """

    def __init__(self, blocks: list[KVCacheBlock], fresh: int = 0, stop: int | None = None) -> None:
        self._blocks = blocks
        self._fresh = fresh
        self._stop = len(blocks) if stop is None else stop
        self._left: deque[KVCacheBlock] = deque()
        self._right: deque[KVCacheBlock] = deque()
        self.size = self._stop - self._fresh

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self._left
        yield from self._blocks[self._fresh:self._stop]
        yield from self._right

    def popleft(self) -> KVCacheBlock:
        """The first block, taken out (``IndexError`` when empty)."""
        if self._left:
            block = self._left.popleft()
        elif self._fresh < self._stop:
            block = self._blocks[self._fresh]
            self._fresh += 1
        else:
            block = self._right.popleft()
        self.size -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first ``n`` blocks (at most ``len(self)``), taken out."""
        left = self._left
        out = [left.popleft() for _ in range(min(n, len(left)))]
        k = min(n - len(out), self._stop - self._fresh)
        if k > 0:
            out.extend(self._blocks[self._fresh:self._fresh + k])
            self._fresh += k
        right = self._right
        out.extend(right.popleft() for _ in range(min(n - len(out), len(right))))
        self.size -= len(out)
        return out

    def prepend(self, blocks) -> None:
        """Put ``blocks`` first, the first of them first."""
        blocks = list(blocks)
        self._left.extendleft(reversed(blocks))
        self.size += len(blocks)

    def extend(self, blocks) -> None:
        """Put ``blocks`` last, in order."""
        right = self._right
        before = len(right)
        right.extend(blocks)
        self.size += len(right) - before

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out wherever it is (rare: a hash-less free block taken back).

        Raises
        ------
        ValueError
            ``block`` is not here.
        """
        i = block.block_id
        if self._fresh <= i < self._stop and self._blocks[i] is block:
            if i == self._fresh:
                self._fresh += 1
            else:  # the blocks after it leave the range for the right part, in order
                self._right.extendleft(reversed(self._blocks[i + 1:self._stop]))
                self._stop = i
        else:
            try:
                self._left.remove(block)
            except ValueError:
                self._right.remove(block)
        self.size -= 1

    def clear(self) -> None:
        self._left.clear()
        self._right.clear()
        self._fresh = self._stop
        self.size = 0


class PolicyFreeQueue:
    """Drop-in for vLLM's ``FreeKVCacheBlockQueue`` whose cached part is ordered by ``policy``.

    Parameters
    ----------
    blocks : list of KVCacheBlock
        All blocks of the pool, ``blocks[i].block_id == i``; all start free, in id order.
    policy : CompiledTwin
        Orders the cached free blocks; must be empty.
    clock : callable
        Seconds, monotonic (the policy's ``now``).
    front : FrontBlocks, optional
        The hash-less free blocks, first out; default every block, in id order.
    hint_budget : int, optional
        Retained blocks each hint tag's alone and all tags' together may hold
        (:class:`~kvprof.policy.hinted.HintLayer`); None: no budget.

    Invariants: ``num_free_blocks`` is the length of the three parts together and ``_n_cached`` that of
    the policy's (blocks taken back but not yet applied to it excluded): both plain ints kept at
    each change, so that neither vLLM's reads nor the hot paths ask the policy for its length. Client
    hints: :attr:`hints` (a :class:`~kvprof.policy.hinted.HintLayer` over the policy) holds the
    released and retained cached blocks, the policy the others; ``_hinting`` is True whenever a hint
    is pending (:meth:`set_hint`) or the layer holds anything, and then every call goes through the
    layer (``_take`` is its ``take``); else each goes to the policy directly, as without hints.
    """

    def __init__(self, blocks: list[KVCacheBlock], policy, clock=time.monotonic,
                 front: FrontBlocks | None = None, hint_budget: int | None = None) -> None:
        self._blocks = blocks
        self._hint_budget = hint_budget
        #: The hint of the request whose blocks are being freed (None: none), until :meth:`set_hint` (None).
        self.hint: Hint | None = None
        # The same blocks as an object array: victims come back as an id array, and one gather
        # turns it into blocks three times faster than a list comprehension would.
        self._block_array = np.empty(len(blocks), dtype=object)
        self._block_array[:] = blocks
        self._n_cached = 0
        self.use(policy)
        self._clock = clock
        self._front = FrontBlocks(blocks) if front is None else front
        self._back: deque[KVCacheBlock] = deque()
        self.num_free_blocks = self._front.size + self._n_cached
        self._sentinels: tuple[KVCacheBlock, KVCacheBlock] | None = None  # vLLM's walk, once read

    def use(self, policy) -> None:
        """Order the cached blocks by ``policy`` from now on (it holds them already)."""
        self.policy = policy
        before = getattr(self, "hints", None)
        self.hints = HintLayer(policy, self._hint_budget, take=policy.take)
        if before is not None:
            self.hints.carry_from(before)
        self._n_cached = len(policy)
        self._hints_changed()

    # -- client hints ----------------------------------------------------------------------
    def set_hint(self, hint: Hint | None) -> None:
        """The blocks freed from now on are freed with ``hint`` (None: without one)."""
        self.hint = hint
        self._hints_changed()

    def _hints_changed(self) -> None:
        self._hinting = self.hint is not None or self.hints.active
        self._take = self.hints.take if self._hinting else self.policy.take

    @property
    def evictions(self) -> int:
        """Cached blocks evicted so far, reloads included: the horizon's count, which every eviction feeds."""
        return self.hints.horizon.evicted

    def hint_horizon(self) -> float:
        """The longest retention a hint is honoured for now, in seconds (the layer's
        :class:`~kvprof.policy.hinted.EvictionHorizon` over the evictable cached blocks)."""
        return self.hints.horizon.seconds(self._n_cached, self._clock())

    def _evict_hinted(self, n: int) -> list[int]:
        victims = self.hints.evict_n(n, self._clock())
        self._hints_changed()
        return victims

    def taken_back(self, n: int) -> None:
        """``n`` cached free blocks were taken back with :attr:`_take` (``policy.take``) directly."""
        self._n_cached -= n
        self.num_free_blocks -= n

    # -- taking blocks out -----------------------------------------------------------------
    def popleft(self) -> KVCacheBlock:
        if not self.num_free_blocks:
            raise ValueError("No free blocks available")
        self.num_free_blocks -= 1
        if self._front.size:
            return self._front.popleft()
        if self._n_cached:
            self._n_cached -= 1
            if self._hinting:
                return self._blocks[self._evict_hinted(1)[0]]
            now = self._clock()
            victim = self.policy.evict(now)
            self.hints.count_evicted(1, now, (victim,))  # the layer counts its own evictions
            return self._blocks[victim]
        return self._back.popleft()

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n <= 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} free blocks: only {self.num_free_blocks} are free")
        if n == 1:  # a decode step's block
            return [PolicyFreeQueue.popleft(self)]
        self.num_free_blocks -= n
        front = self._front
        if front.size >= n:  # the usual case until the pool first fills
            return front.popleft_n(n)
        out = front.popleft_n(n) if front.size else []
        n -= len(out)
        if n:
            m = min(n, self._n_cached)
            if m:
                self._n_cached -= m
                if self._hinting:
                    blocks = self._blocks
                    out.extend([blocks[i] for i in self._evict_hinted(m)])
                else:
                    now = self._clock()
                    if m <= _FEW:
                        victims = self.policy.evict_n(m, now)
                        blocks = self._blocks
                        out.extend([blocks[i] for i in victims])
                    else:
                        victims = self.policy.evict_n_array(m, now)
                        out.extend(self._block_array[victims].tolist())
                        victims = victims.tolist() if self.hints.tracks_sessions else ()
                    # the layer counts its own evictions (and, where it tracks sessions, whose they were)
                    self.hints.count_evicted(m, now, victims)
                n -= m
            if n:
                back = self._back
                out.extend([back.popleft() for _ in range(n)])
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block._block_hash is not None:  # the usual case: a prefix hit on a cached block
            self._take(block.block_id)
            self._n_cached -= 1
            self.num_free_blocks -= 1
            return
        try:
            self._front.remove(block)  # rare: a hash-less free block taken back
        except ValueError:
            try:
                self._back.remove(block)
            except ValueError:
                try:  # a cached block whose hash vLLM dropped while it was free (evict_blocks)
                    if self._hinting:
                        self._discard_hinted(block.block_id)
                    else:
                        self.policy.remove(block.block_id)
                except KeyError:
                    raise ValueError(f"block {block.block_id} is not free") from None
                self._n_cached -= 1
        self.num_free_blocks -= 1

    # -- putting blocks back ---------------------------------------------------------------
    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks) -> None:
        """Blocks freed in eviction order (tail first): cached ones go to the policy."""
        # ``_block_hash`` is the slot behind the ``block_hash`` property; reading it directly
        # costs a third as much on this per-block path (checked at import).
        cached = [block.block_id for block in blocks if block._block_hash is not None]
        if len(cached) < len(blocks):
            back = self._back
            before = len(back)
            back.extend(block for block in blocks if block._block_hash is None)
            self.num_free_blocks += len(back) - before
        self.append_cached(cached)

    def append_cached(self, block_ids: list[int]) -> None:
        """Cached blocks ``block_ids`` freed, in eviction order (tail first): to the policy, in one call."""
        if block_ids:
            n = len(block_ids)
            self.num_free_blocks += n
            self._n_cached += n
            if self._hinting:
                self.hints.free_hinted(block_ids, self._clock(), self.hint)
                self._hints_changed()
            else:
                self.policy.free(block_ids if n == 1 else int64s(block_ids), self._clock())

    def _discard_hinted(self, block_id: int) -> None:
        """Take out an evictable cached block, its retention forgotten (KeyError if not evictable)."""
        if block_id not in self.hints:
            raise KeyError(block_id)
        self.hints.discard(block_id)
        self._hints_changed()

    def prepend_n(self, blocks) -> None:
        """Blocks to reuse first, the first of ``blocks`` first."""
        before = self._front.size
        self._front.prepend(blocks)
        self.num_free_blocks += self._front.size - before

    # -- walking ---------------------------------------------------------------------------
    @property
    def fake_free_list_head(self) -> KVCacheBlock:
        """The head sentinel of vLLM's linked free list, for code that walks it (vLLM's own tests):
        ``next_free_block`` leads through the free blocks in eviction order to :attr:`fake_free_list_tail`.

        The links are written whenever either sentinel is read (a snapshot of the order then, a pass over
        the free blocks) and taken off a block when it leaves the queue, as vLLM's queue does; vLLM's
        serving path reads neither sentinel, so it never pays for them."""
        return self._link_free_blocks()[0]

    @property
    def fake_free_list_tail(self) -> KVCacheBlock:
        """The tail sentinel of vLLM's linked free list (:attr:`fake_free_list_head`)."""
        return self._link_free_blocks()[1]

    def _link_free_blocks(self) -> tuple[KVCacheBlock, KVCacheBlock]:
        if self._sentinels is None:
            self._sentinels = (KVCacheBlock(block_id=-1), KVCacheBlock(block_id=-1))
            self._unlink_what_leaves()
        head, tail = self._sentinels
        chain = [head, *self.get_all_free_blocks(), tail]
        for before, after in zip(chain, chain[1:]):
            before.next_free_block, after.prev_free_block = after, before
        return head, tail

    def _unlink_what_leaves(self) -> None:
        """From now on a block leaving the queue has its links taken off, as vLLM's queue does: this
        queue's taking methods wrapped on the instance once a walk is read (a queue never walked pays
        nothing for it)."""
        popleft, popleft_n, remove = self.popleft, self.popleft_n, self.remove

        def unlinked(block: KVCacheBlock) -> KVCacheBlock:
            block.prev_free_block = block.next_free_block = None
            return block

        self.popleft = lambda: unlinked(popleft())
        self.popleft_n = lambda n: [unlinked(block) for block in popleft_n(n)]
        self.remove = lambda block: remove(unlinked(block))

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        blocks = self._blocks
        return [*self._front, *(blocks[i] for i in self.hints.order(self._clock())), *self._back]

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order after ``cursor`` (from the front when None).

        A snapshot of the order at the time of the call; a cursor that is no longer free
        restarts from the front (vLLM's linked list would follow the stale pointer instead).
        """
        order = self.get_all_free_blocks()
        start = 0
        if cursor is not None:
            for i, block in enumerate(order):
                if block is cursor:
                    start = i + 1
                    break
        yield from order[start:]

    # -- reset -----------------------------------------------------------------------------
    def flush_policy_to_front(self) -> None:
        """After ``reset_prefix_cache``: every block is hash-less, so all go to the front, in order."""
        blocks = self._blocks
        order = self.hints.order(self._clock())
        self.hints.clear()  # the policy's too
        self._n_cached = 0
        self._hints_changed()
        self._front.extend(blocks[i] for i in order)
        self._front.extend(self._back)
        self._back.clear()


def front_of(blocks: list[KVCacheBlock], free: list[KVCacheBlock]) -> FrontBlocks:
    """vLLM's free queue at start, ``free``, as a front: a range of ids where it is one (the blocks after
    the null block, in id order), else its blocks one by one."""
    first = len(blocks) - len(free)
    if all(block is blocks[first + i] for i, block in enumerate(free)):
        return FrontBlocks(blocks, first)
    front = FrontBlocks(blocks, 0, 0)
    front.extend(free)
    return front


def _one(value) -> np.ndarray:
    """``value`` as a one-element object array (assigned to many entries without being unpacked)."""
    out = np.empty(1, dtype=object)
    out[0] = value
    return out


_NO_OWNER = _one(None)  # the owner of a block accessed outside any request


def request_hint(request) -> Hint | None:
    """The client hint in a vLLM request's ``extra_args`` (None: none). The API server refused a
    malformed one already (:mod:`kvprof.vllm.hints`); one that reaches the engine all the same (a server
    where vLLM takes no request check, docs/vllm.md) is logged and the request frees unhinted."""
    try:
        return hint_of_args(request_extra_args(request))
    except ValueError as err:
        logging.getLogger("vllm.kvprof").warning("kvprof: request %s: %s; freed without a hint", request.request_id, err)
        return None


def policy_has_shadows(policy) -> bool:
    """Whether compiled twin ``policy`` keeps shadows (``wa``'s safety net), which requests' chains feed."""
    return policy.safety_net() is not None


def int64s(values: list) -> np.ndarray:
    """``values`` (ints) as an int64 array; ``TypeError`` if one of them is None. A long list goes through
    ``array('q')`` (a fifth to a third faster than ``np.array`` from a few hundred ints on; slower below)."""
    if len(values) < _LONG:
        return np.array(values, dtype=np.int64)
    return np.frombuffer(array("q", values), dtype=np.int64)


def chain_depths(blocks, hash_block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Block ids and depths of the non-null blocks a request hits in one KV cache group.

    The depth is the block's position in the request, in hash blocks, read from the tokens its
    hash covers: a sliding-window group touches only the hit blocks inside its window (the
    chain's tail, after null blocks), so a block's index in ``blocks`` is not its depth. Where a
    group's blocks are hash-sized (all groups of the models vLLM's CPU build serves), this is the
    depth :meth:`KvprofBlockPool.cache_full_blocks` gave the block. A block cached without a
    token count (a vLLM that does not keep one, or a test) takes its index in ``blocks``.
    """
    if _HAS_TOKEN_COUNT and blocks:  # the usual case, two passes in C: no null block, every count known
        ids = int64s([block.block_id for block in blocks])
        try:
            tokens = int64s([block._block_hash_num_tokens for block in blocks])
        except TypeError:  # a count unknown
            tokens = None
        if tokens is not None and ids.all():  # the null block is id 0
            return ids, tokens // hash_block_size - 1
    real = [(index, block) for index, block in enumerate(blocks) if not block.is_null]
    ids = np.fromiter([block.block_id for _, block in real], dtype=np.int64, count=len(real))
    depths = np.fromiter([index if (tokens := getattr(block, "_block_hash_num_tokens", None)) is None  # absent before 0.32
                          else tokens // hash_block_size - 1 for index, block in real], dtype=np.int64, count=len(real))
    return ids, depths


class KvprofBlockPool(BlockPool):
    """vLLM's ``BlockPool`` with a :class:`PolicyFreeQueue` and the policy fed from vLLM's events.

    Built by vLLM's KV-cache coordinator in place of ``BlockPool`` (the plugin rebinds the name
    while the scheduler is constructed). ``kvprof_spec`` is the validated ``kv_policy``
    configuration; the request being scheduled is set in :attr:`current_request` by the plugin's
    wrapper around ``KVCacheManager.allocate_slots`` so that hits know their class.

    With ``native_first`` it serves vLLM's own order (:class:`~kvprof.vllm.native.NativeOrder`, no
    compiled code) until :meth:`replace_policy` hands over to the compiled policy (:mod:`kvprof.vllm.warmup`).

    For a reload (:meth:`replace_policy`) the pool remembers of every cached block what the new
    policy is told again: the tags and prompt length of the request that last accessed it
    (``_owner``); how often it was hit since it was cached, its depth and when it was last accessed
    or freed the policy keeps (:meth:`~kvprof.core.twin.CompiledTwin.hits_since_cached`,
    :meth:`~kvprof.core.twin.CompiledTwin.touches`).
    """

    def __init__(self, *args, kvprof_spec: PolicySpec, clock=time.monotonic, native_first: bool = False,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kvprof_spec = kvprof_spec
        if native_first:  # the compiled policy comes later (replace_policy), once its core is loaded
            policy = NativeOrder(self.num_gpu_blocks)
        else:
            policy = kvprof_spec.make_policy(capacity=self.num_gpu_blocks, n_blocks=self.num_gpu_blocks)
        self.current_request = None
        self._clock = clock
        n = len(self.blocks)
        self._owner = np.empty(n, dtype=object)  # (extra_args, prompt tokens) of the last request to access it
        self._none = np.full(64, -1, dtype=np.int64)  # the contents of a chain to a policy that reads none
        #: The content numbers every chain reaches the policy with (compiled lookups, the twin's rule).
        self.contents = ContentNumbers(policy.max_contents)
        #: Request id -> (content numbers of its chain, how many from the start are known): what
        #: its blocks were cached or hit with, so that admission and finish look up only the rest.
        self._chain_numbers: dict[str, tuple[np.ndarray, int]] = {}
        #: Request id -> (its owner, as :attr:`_owner` holds it, and its class index under the spec
        #: served): neither changes while it runs, and each cached or hit block would look them up.
        self._request_classes: dict[str, tuple[np.ndarray, int]] = {}
        # vLLM's queue has popped the null block already; keep its order for the rest.
        free = self.free_block_queue.get_all_free_blocks()
        for block in free:  # the links of vLLM's list, which this queue does not keep (they take part in ==)
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = PolicyFreeQueue(self.blocks, policy, clock, front_of(self.blocks, free),
                                                hint_budget=kvprof_spec.hint_budget(usable_blocks(self.num_gpu_blocks)))
        self._install(policy)

    def _install(self, policy) -> None:
        """Serve with compiled twin ``policy`` (which holds the cached blocks already) from now on.

        ``_shadowed``: whether it has shadows (``wa``), the only policies whose ``admit``/``finish``
        do anything, so for the others the pool neither tells them nor keeps requests' chains; the
        shadows are fed on a thread of their own, off the scheduler thread (unless turned off).
        """
        self.policy = policy
        self._shadowed = policy_has_shadows(policy)
        if shadow_thread():
            policy.feed_shadows_in_background()
        self.free_block_queue.use(policy)

    def touch(self, blocks, *args, **kwargs) -> None:
        if _PLAIN_TOUCH and not self.metrics_collector and not args and not kwargs:
            self._touch_plainly(blocks)
        else:
            super().touch(blocks, *args, **kwargs)  # takes free hit blocks out of the queue (policy.take)
        ids, depths = chain_depths(blocks, self.hash_block_size)
        if len(ids):
            request = self.current_request
            if not self.policy.reads_contents:
                self._access_numbered(ids, depths, self._no_contents(len(ids)), request, hit=True)
                return
            numbers = self.policy.remembered(ids)
            if numbers is None:  # a block no access told the policy about (cannot happen; kept exact)
                numbers = self.contents.numbers([self.blocks[i]._block_hash for i in ids.tolist()])
            self._access_numbered(ids, depths, numbers, request, hit=True)
            self._note_chain(request, depths, numbers, self.blocks[int(ids[0])]._block_hash)

    def _touch_plainly(self, blocks) -> None:
        """vLLM's ``BlockPool.touch`` without a metrics collector, in one loop: each block's reference
        count up by one, a free one taken out of the queue as :meth:`PolicyFreeQueue.remove` would
        (a cached one is a list append), without a method call per block (a 128k-token hit is
        8,000 blocks)."""
        queue = self.free_block_queue
        take, remove = queue._take, queue.remove
        taken = 0
        for block in blocks:
            if block.ref_cnt == 0:
                if block._block_hash is not None:
                    take(block.block_id)
                    taken += 1
                elif not block.is_null:
                    remove(block)
            block.ref_cnt += 1
        if taken:
            queue.taken_back(taken)

    def free_blocks(self, ordered_blocks) -> None:
        """vLLM's ``BlockPool.free_blocks`` in one pass that also collects the freed cached blocks' ids,
        where vLLM's collects the blocks and the free queue's ``append_n`` reads their ids in a second
        pass over the same objects (a 128k-token request frees 8,000)."""
        if not _PLAIN_FREE or not self.enable_caching:
            super().free_blocks(ordered_blocks)
            return
        first: list[KVCacheBlock] = []
        cached: list[int] = []
        other_pools: dict[BlockPool, list[KVCacheBlock]] = {}
        for block in ordered_blocks:
            pool = block.pool
            if pool is not None and pool is not self:
                other_pools.setdefault(pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if block._block_hash is None:
                    first.append(block)  # matches no prefix: reused first, as vLLM does
                else:
                    cached.append(block.block_id)
        queue = self.free_block_queue
        if first:
            queue.prepend_n(first)
        queue.append_cached(cached)
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks)

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs) -> None:
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
        if num_cached_blocks >= num_full_blocks:
            return
        new = blocks[num_cached_blocks:num_full_blocks]
        block_ids = [block.block_id for block in new]
        if self.free_block_queue.hints.tracks_sessions:  # new contents: no session held them yet
            self.free_block_queue.hints.recached_all(block_ids)
        if self.policy.reads_contents:
            keys = [block._block_hash for block in new]
            uncached = None in keys
        else:  # no key looked at: vLLM leaves a block uncached only where it is null (id 0) or masked out
            keys = None
            mask = kwargs.get("block_mask", args[2] if len(args) > 2 else None)
            uncached = mask is not None and not all(mask)
        if len(new) == 1 and block_ids[0] and not uncached:  # decode: a block at a time, no array
            number = -1 if keys is None else self.contents.number(keys[0])
            self._access_one(block_ids[0], num_cached_blocks, number, request)
            if keys is not None:
                self._note_one(request, num_cached_blocks, number, keys[0])
            return
        ids = int64s(block_ids)
        depths = np.arange(num_cached_blocks, num_full_blocks, dtype=np.int64)
        # rare: null blocks (id 0, a sliding window's) or blocks left uncached
        if uncached or (0 in block_ids if len(block_ids) < _SEARCHED else not ids.all()):
            kept = [i for i, block in enumerate(new) if not block.is_null and block._block_hash is not None]
            ids, depths = ids[kept], depths[kept]
            keys = None if keys is None else [keys[i] for i in kept]
        if len(ids):
            numbers = self._no_contents(len(ids)) if keys is None else self.contents.numbers(keys)
            self._access_numbered(ids, depths, numbers, request, hit=False)
            if keys is not None:
                self._note_chain(request, depths, numbers, keys[0])

    def _no_contents(self, n: int) -> np.ndarray:
        """``n`` contents of none (-1), for a policy that reads no contents (a view; not to be written)."""
        if n > len(self._none):
            self._none = np.full(max(n, 2 * len(self._none)), -1, dtype=np.int64)
        return self._none[:n]

    def _request_facts(self, request) -> tuple[np.ndarray, int]:
        """``request``'s owner (as :attr:`_owner` holds it) and class index, looked up once per request."""
        if request is None:
            return _NO_OWNER, self.kvprof_spec.default_index
        known = self._request_classes.get(request.request_id)
        if known is None:
            tags = (request_extra_args(request), request.num_prompt_tokens)
            known = self._request_classes[request.request_id] = (_one(tags), self.kvprof_spec.class_index(*tags))
        return known

    def _access_one(self, block_id: int, depth: int, number: int, request) -> None:
        """:meth:`_access_numbered` of one block a request cached (not a hit), without arrays."""
        owner, cls = self._request_facts(request)
        self._owner[block_id] = owner[0]
        self.policy.access_one(block_id, depth, number, self._clock(), cls)

    def _access_numbered(self, ids: np.ndarray, depths: np.ndarray, numbers: np.ndarray, request, hit: bool) -> None:
        """The policy accesses blocks ``ids`` at ``depths`` with contents ``numbers`` for ``request``
        (one compiled call), and the pool notes what a reload would tell a new policy of them."""
        owner, cls = self._request_facts(request)
        self._owner[ids] = owner
        self.policy.access_numbered(ids, depths, numbers, self._clock(), cls, hit=hit)

    def _note_chain(self, request, depths: np.ndarray | list[int], numbers: np.ndarray | list[int], first_key) -> None:
        """Remember ``numbers`` at chain positions ``depths`` of ``request`` (group 0's keys only)."""
        if request is None or not self._shadowed or not first_key.endswith(_GROUP0):
            return
        known_numbers, known = self._chain_numbers.get(request.request_id, (None, 0))
        end = int(depths[-1]) + 1
        if known_numbers is None or len(known_numbers) < end:
            grown = np.full(max(end, 2 * known, 64), -1, dtype=np.int64)
            if known_numbers is not None:
                grown[: len(known_numbers)] = known_numbers
            known_numbers = grown
        known_numbers[depths] = numbers
        if int(depths[0]) <= known and end - int(depths[0]) == len(depths):  # contiguous with what is known
            known = max(known, end)
        self._chain_numbers[request.request_id] = (known_numbers, known)

    def _note_one(self, request, depth: int, number: int, key) -> None:
        """:meth:`_note_chain` of one block (decode caches one a step), without arrays where the request's
        numbers are long enough already."""
        if request is None or not self._shadowed or not key.endswith(_GROUP0):
            return
        known_numbers, known = self._chain_numbers.get(request.request_id, (None, 0))
        if known_numbers is None or len(known_numbers) <= depth:
            self._note_chain(request, [depth], [number], key)
            return
        known_numbers[depth] = number
        if depth == known:  # contiguous with what is known
            self._chain_numbers[request.request_id] = (known_numbers, known + 1)

    def admit_request(self, request) -> None:
        """``request`` got its first blocks: its prompt's full blocks reach the policy as one chain.

        ``wa``'s shadows live on it (:meth:`~kvprof.policy.base.EvictionPolicy.admit`); the contents
        are the cached blocks' keys (group 0's), as the accesses pass them. A policy without
        shadows ignores both, so it is told neither.
        """
        if not self._shadowed:
            return
        size = self.hash_block_size
        prompt = request.num_prompt_tokens
        numbers = self._chain_of(request, prompt)
        n_full = len(numbers)
        cls = self.kvprof_spec.class_index(request_extra_args(request), prompt)
        self.policy.admit_numbered(request.request_id, numbers, self._clock(), cls,
                                   n_lookup=min(max(request.num_tokens - 1, 0) // size, n_full),
                                   n_blocks=-(-prompt // size))

    def finish_request(self, request, n_blocks: int, code: int = UNKNOWN, held=()) -> None:
        """``request``, holding ``n_blocks`` blocks, is about to be freed: its whole chain of computed
        full blocks (the output's too) reaches the policy, which caches what the output filled, how
        many tokens it generated (``wa``'s long-output candidate sorts its blocks by that) and how it
        ended, finish ``code`` (:mod:`kvprof.vllm.finish`; the finish-reason candidate reads it).
        A policy without shadows hears only the code, where one is known. The request's client hint
        (:func:`~kvprof.models.hints.hint_of_args` of its ``extra_args``, checked by the API server
        already) applies to the frees until :meth:`request_freed`; ``held``, the request's blocks (a list
        per KV-cache group), tells the hint layer who held them (a release naming a session demotes only
        that session's own blocks: :meth:`~kvprof.policy.hinted.HintLayer.note_held`)."""
        hint = request_hint(request)
        if hint is not None:
            self.free_block_queue.set_hint(hint)
        session, layer = None if hint is None else hint.session, self.free_block_queue.hints
        if layer.tracks(session):
            layer.note_held([block.block_id for group in held for block in group], session, self._clock())
        self._request_classes.pop(request.request_id, None)
        if not self._shadowed:
            self._chain_numbers.pop(request.request_id, None)  # kept under a policy served before a reload
            if code != UNKNOWN:
                self.policy.finish_numbered(request.request_id, self._clock(), NO_NUMBERS, n_blocks=n_blocks,
                                            n_output=request.num_output_tokens, finish=code)
            return
        numbers = self._chain_of(request, request.num_computed_tokens)
        self._chain_numbers.pop(request.request_id, None)
        self.policy.finish_numbered(request.request_id, self._clock(), numbers, n_blocks=max(n_blocks, len(numbers)),
                                    n_output=request.num_output_tokens, finish=code)

    def request_freed(self) -> None:
        """vLLM freed the finished request's blocks: what it frees until the next finish (a preempted
        request's blocks, a sliding window's) is no finished request's, so the policy hears of no output
        and no finish code."""
        if self._shadowed or self.kvprof_spec.tool_call_tokens:
            self.policy.tell_output(None)
        if self.free_block_queue.hint is not None:
            self.free_block_queue.set_hint(None)

    def _chain_of(self, request, n_tokens: int) -> np.ndarray:
        """The content numbers of the full blocks among ``request``'s first ``n_tokens`` tokens (their
        group-0 keys): those its accesses told the policy, the rest looked up (and kept)."""
        n_full = min(n_tokens // self.hash_block_size, len(request.block_hashes))
        known_numbers, known = self._chain_numbers.get(request.request_id, (None, 0))
        known = min(known, n_full)
        if known == n_full:
            return known_numbers[:n_full].copy() if n_full else np.empty(0, dtype=np.int64)
        rest = self.contents.numbers([h + _GROUP0 for h in request.block_hashes[known:n_full]])
        numbers = rest if not known else np.concatenate([known_numbers[:known], rest])
        self._chain_numbers[request.request_id] = (numbers, n_full)
        if self.policy.shadow_feed is None:  # the policy is done with it when the call returns
            return numbers
        return numbers.copy()  # the policy's (its shadow feed reads it later); the kept one grows in place

    @property
    def serves_natively(self) -> bool:
        """Whether vLLM's own order serves, the compiled policy not handed over yet."""
        return isinstance(self.policy, NativeOrder)

    def replace_policy(self, spec: PolicySpec, policy) -> None:
        """Serve with ``policy`` (a fresh compiled twin built from ``spec``) from now on: a reload, or the
        hand-over from vLLM's own order.

        The cached blocks carry over by :func:`kvprof.vllm.carry.carry_over`'s rule, each with its
        depth, classified by the new hp file from the tags of the request that accessed it last;
        client hints' retentions and releases do not (the new policy orders every cached block).
        """
        cached = [block for block in self.blocks if block._block_hash is not None and not block.is_null]
        ids = np.array([block.block_id for block in cached], dtype=np.int64)
        stamps, depths = self.policy.touches(ids)
        hits = np.minimum(self.policy.hits_since_cached(ids), _HITS_KEPT).tolist()
        held = []
        for block, stamp, depth, hit_count in zip(cached, stamps.tolist(), depths.tolist(), hits):
            i = block.block_id
            owner = self._owner[i]
            held.append(Held(i, depth, block.block_hash, stamp,
                             spec.default_index if owner is None else spec.class_index(*owner),
                             hit_count, block.ref_cnt == 0))
        number = self.contents.numbers
        carry_over(held,
                   lambda item, hit: policy.access_numbered(np.array([item.id]), np.array([item.depth]),
                                                            number([item.content]), item.stamp, item.workload, hit=hit),
                   lambda item: policy.free([item.id], item.stamp))
        self.policy.close()
        self.kvprof_spec = spec
        self._request_classes.clear()  # classes under the old hp file
        self._install(policy)

    def close(self) -> None:
        """Stop the policy's thread, if any (the scheduler shuts down)."""
        self.policy.close()

    def reset_prefix_cache(self) -> bool:
        ok = super().reset_prefix_cache()
        if ok:
            self.free_block_queue.flush_policy_to_front()
        return ok
