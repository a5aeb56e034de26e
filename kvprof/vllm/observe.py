"""The live counterfactual: what other policies would have hit on the server's own traffic.

:class:`Counterfactual` keeps, per policy, a simulated GPU tier of the server's size
(:mod:`kvprof.core.tiers`, the simulator's) and feeds it the requests as the server scheduled and
finished them, content by content (vLLM's block hashes), with the steps of a replay on recorded
timing (:func:`kvprof.core.timed.admit` / :func:`~kvprof.core.timed.grow` for each block a running
request took, when the server took it / :func:`~kvprof.core.timed.finish`, admit and finish followed
or preceded by the policy's own ``admit`` / ``finish``, which ``wa``'s shadows live on, as
:func:`kvprof.core.timed.replay` does). So its hits are
what that policy would have hit with the server's own concurrency, and ``kvprof compare`` of a
recording of the same traffic computes the same numbers. It runs on the plugin's background
thread, never on the scheduler's.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np

from kvprof.core import tiers
from kvprof.core.build import compile_policy
from kvprof.core.prefix_cache import first_size
from kvprof.core.wa import outcome, policy_admit, policy_finish
from kvprof.core.structs import NONE
from kvprof.core.twin import Seats
from kvprof.core.timed import admit, blocks_at_finish, finish, forget, grow_each
from kvprof.models.finish import UNKNOWN
from kvprof.policy.base import EvictionPolicy
from kvprof.vllm.numbering import RecentContentNumbers

#: Content numbers per block of the tier (and at least :data:`MIN_CONTENTS`), as the pool's twin keeps.
CONTENTS_PER_BLOCK = 16
MIN_CONTENTS = 1 << 16


class _Tier:
    """One policy's simulated tier and the slots each running request holds in it.

    The tier's per-slot tables and its policy's per-block ones start at :func:`first_size` of the
    capacity and double as the traffic first uses slots: a server's counterfactual costs what its
    traffic filled, and about the capacity once that is full.
    """

    def __init__(self, reference: EvictionPolicy, capacity: int, n_contents: int) -> None:
        self.reference = reference
        self.keyed_by = reference.keyed_by
        self.compiled = compile_policy(reference, first_size(capacity))
        self.gpu = tiers.new_device(self.compiled, capacity, n_contents)
        # request -> (its slots, how many it holds, its class or cell, its prompt's contents, its hits)
        self.running: dict[Hashable, tuple[np.ndarray, int, int, np.ndarray, int]] = {}
        # per server block id, the slot taken here when a running request took it (-1: none; its request says at
        # its free); block ids run to the server's block count, one more than the capacity (vLLM's null block)
        self.grown = np.full(capacity + 1, -1, np.int64)
        self.hits = 0  # over finished requests


class Counterfactual:
    """Policies run beside the server on its block hashes, each in a tier of ``capacity`` blocks.

    Invariants: content numbers name at most ``max_contents`` distinct hashes, densely, in a
    compiled table (:class:`~kvprof.vllm.numbering.RecentContentNumbers`: past ``max_contents``
    the least recently seen hash gives its number up); when one is given to a new hash, the old
    hash is first made uncached in every tier (:func:`forget`), so a tier never takes one content
    for another (a ghost or shadow of ``wa`` may, as in the pool's twin: it only shifts the safety
    net's statistics), save two hashes with one 64-bit fingerprint (probability ``m / 2**64`` for
    a new one with ``m`` numbered). Every admitted request is in ``running``
    of every tier until it finishes. Hits and lookups are counted when a request finishes, over
    the requests the server counts (it knows a request's hits when it frees it), so that both
    count the same requests in any window.

    Parameters
    ----------
    policies : dict of str to EvictionPolicy
        Fresh reference instances, by the name metrics report them under.
    capacity : int
        Usable blocks of the server's GPU tier (vLLM's ``num_gpu_blocks`` less its null block).
    block_size : int
        Tokens per block.
    """

    def __init__(self, policies: dict[str, EvictionPolicy], capacity: int, block_size: int,
                 max_contents: int | None = None) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.max_contents = max_contents or max(CONTENTS_PER_BLOCK * capacity, MIN_CONTENTS)
        self._numbers = RecentContentNumbers(self.max_contents)
        # Contents the tiers' maps cover now: grown with the numbers handed out (to ``max_contents``),
        # so a tier costs what the traffic numbered, not 16 contents per block from the start.
        self._reserved = min(self.max_contents, MIN_CONTENTS)
        self.tiers = {name: _Tier(policy, capacity, self._reserved) for name, policy in policies.items()}
        self.lookups = 0  # prompt blocks that could have been hits, over finished requests
        self._lookups_of: dict[Hashable, int] = {}  # running request -> its prompt blocks that could hit
        self._no_use = np.full(0, math.inf)
        self._seats = Seats()  # running request -> its number for the policies' admit/finish

    def replace(self, name: str, policy: EvictionPolicy) -> None:
        """Run ``policy`` under ``name`` from now on, in a new (empty) tier."""
        self.tiers[name] = _Tier(policy, self.capacity, self._reserved)

    @property
    def hits(self) -> dict[str, int]:
        return {name: tier.hits for name, tier in self.tiers.items()}

    def safety_net(self, name: str) -> tuple[int, np.ndarray] | None:
        """``wa``'s leader and its shadows' hits in tier ``name``; None for another policy."""
        tier = self.tiers[name]
        if not hasattr(tier.reference, "order_names"):
            return None
        leader, hits = outcome(tier.compiled)
        return int(leader), hits

    # -- events ----------------------------------------------------------------------------
    def admit(self, key: Hashable, hashes: Sequence, prompt_tokens: int, classes: tuple[int, int], now: float,
              n_first: int | None = None) -> None:
        """Request ``key`` was scheduled at ``now``: it takes its first ``n_first`` blocks (None: its
        prompt's) in every tier.

        ``hashes`` are vLLM's block hashes of the request (its prompt's full blocks first);
        ``classes`` its class and its cell index (a tier's policy is told the one it is keyed by).
        """
        size = self.block_size
        n_full = min(prompt_tokens // size, len(hashes))
        n_prompt = -(-prompt_tokens // size)
        blocks = np.full(n_prompt, NONE, np.int64)
        blocks[:n_full] = self._contents(hashes[:n_full])
        n_lookup = min(max(prompt_tokens - 1, 0) // size, n_full)
        self._lookups_of[key] = n_lookup
        n_take = n_prompt if n_first is None else n_first
        next_use = self._next_use(max(n_prompt, n_take))
        seat = self._seats.take(key)
        for tier in self.tiers.values():
            slots = np.zeros(max(n_prompt, n_take), np.int64)
            workload = classes[tier.keyed_by == "cell"]
            n_hit, held = admit(tier.gpu, blocks, next_use, 0, n_full, n_lookup, n_take, now, workload, slots)
            policy_admit(tier.compiled, seat, blocks[:n_full], n_lookup, n_prompt, now, workload)
            tier.running[key] = (slots, int(held), workload, blocks, int(n_hit))

    def grow(self, block_ids: Sequence[int], now: float) -> None:
        """Running requests took the server's blocks ``block_ids`` at ``now`` (decode steps that started a
        block, later prefill chunks): every tier takes as many, empty ones first, evicting for the rest as
        the server did then; each request learns its own at its :meth:`finish`. A block id taken again
        before a finish claimed it (its request was preempted) gives the old slot back first."""
        ids = np.asarray(block_ids, np.int64)
        ids = ids[(ids >= 0) & (ids <= self.capacity)]  # the server's block ids (none other is tracked)
        none, no_use = np.zeros(1, np.int64), self._next_use(1)
        for tier in self.tiers.values():
            stale = tier.grown[ids]
            stale = stale[stale >= 0]
            if stale.size:
                tiers.release(tier.gpu, stale, stale.size, now)
            slots = np.zeros(ids.size, np.int64)
            taken = grow_each(tier.gpu, none, no_use, ids.size, now, slots)  # one at a time, as the replay takes them
            tier.grown[ids] = -1
            tier.grown[ids[:taken]] = slots[:taken]

    def finish(self, key: Hashable, hashes: Sequence, prompt_tokens: int, output_tokens: int, now: float,
               code: int = UNKNOWN, grown: Sequence[int] | None = None) -> int | None:
        """Request ``key`` finished at ``now``, ending as finish ``code`` says (:mod:`kvprof.models.finish`):
        the blocks its output filled are cached (their hashes follow the prompt's in ``hashes``), then
        all its blocks are freed. ``grown`` are the server's blocks it took after its first ones
        (:meth:`grow`), in depth order; None: not known, so the blocks it took while decoding are taken
        now, as vLLM's ``allocate_slots`` counts them. Its lookups and hits are counted now; returns its
        lookups (None: it was never admitted)."""
        size = self.block_size
        n_full = min(prompt_tokens // size, len(hashes))
        n_prompt = -(-prompt_tokens // size)
        n_new, n_filled = (int(n) for n in blocks_at_finish(prompt_tokens, output_tokens, n_full, n_prompt, size))
        n_filled = min(n_filled, len(hashes) - n_full)
        filled = self._contents(hashes[n_full:n_full + n_filled])
        next_use = self._next_use(max(n_full + n_filled, n_prompt))
        seat = self._seats.give(key)
        n_lookup = self._lookups_of.pop(key, None)
        self.lookups += n_lookup or 0
        for tier in self.tiers.values():
            entry = tier.running.pop(key, None)
            if entry is None:  # admitted before this tier was replaced
                continue
            slots, held, workload, prompt, n_hit = entry
            tier.hits += n_hit
            # the layout of RecordedTiming: the prompt's full blocks (a full tier may give some only now), those
            # its output filled (the prompt's partial last block first), a partial block left NONE
            blocks = np.concatenate([prompt[:n_full], filled, prompt[n_full + n_filled:]])
            first = held
            if grown is not None:
                ids = np.asarray(grown, np.int64)
                ids = ids[(ids >= 0) & (ids <= self.capacity)]
                ids = ids[np.sort(np.unique(ids, return_index=True)[1])]  # each once, in depth order
                taken = tier.grown[ids]
                taken = taken[taken >= 0]
                tier.grown[ids] = -1
                slots = np.concatenate([slots[:held], taken])
                held += taken.size
            n_last = n_new if grown is None else 0
            slots = np.concatenate([slots, np.zeros(n_last + max(len(blocks) - len(slots), 0), np.int64)])
            policy_finish(tier.compiled, seat, now, blocks, n_prompt + n_new, output_tokens, code)
            # from its prompt's full blocks on, or from the first block it took while running (a later prefill chunk)
            finish(tier.gpu, blocks, next_use, 0, held, min(n_full, first), len(blocks), n_last, now, workload, slots)
        return n_lookup

    def forget_request(self, key: Hashable, now: float) -> None:
        """Request ``key`` left without a finish the counterfactual heard of: free what it holds."""
        seat = self._seats.give(key)
        self._lookups_of.pop(key, None)
        for tier in self.tiers.values():
            entry = tier.running.pop(key, None)
            if entry is not None:
                policy_finish(tier.compiled, seat, now, entry[3][:0], 0, -1)
                tiers.release(tier.gpu, entry[0], entry[1], now)

    # -- contents --------------------------------------------------------------------------
    def _contents(self, hashes: Sequence) -> np.ndarray:
        numbers, recycled = self._numbers.renumber(hashes)
        reserved = self._reserved
        while reserved < len(self._numbers):
            reserved = min(2 * reserved, self.max_contents)
        for tier in self.tiers.values():
            if reserved > self._reserved:
                tiers.reserve_contents(tier.gpu, reserved)
            for number in recycled.tolist():  # its old content is not this one: uncached first
                forget(tier.gpu, number)
        self._reserved = reserved
        return numbers

    def _next_use(self, n: int) -> np.ndarray:
        if len(self._no_use) < n:
            self._no_use = np.full(max(n, 2 * len(self._no_use)), math.inf)
        return self._no_use
