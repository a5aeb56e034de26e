"""CPU offload tier: a ``CachePolicy`` for vLLM's OffloadingConnector ordered by a kvprof policy.

vLLM's CPU offloading manager (``vllm/v1/kv_offload/cpu/manager.py``) keeps offloaded chunks in a
pluggable ``CachePolicy`` (``vllm/v1/kv_offload/cpu/policies/``; LRU and ARC in-tree). This one hands
the ordering to the same kvprof policy the GPU tier uses, with the same scores. Select it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 4000000000,
            "eviction_policy": "KvprofCachePolicy", "cache_policy_module_path": "kvprof.vllm.offload"}}'

together with ``--kv-policy-config hp.json`` (the plugin makes that spec the active one in the engine
core). vLLM constructs the policy with ``cache_capacity`` only, so the spec comes from the plugin or,
without it, from ``$KVPROF_KV_POLICY_CONFIG`` (and ``$KVPROF_KV_POLICY``); with neither, construction
fails (no silent LRU).

Workload hints: the manager sees a ``ReqContext`` (request id and ``kv_transfer_params``), not the
sampling parameters, so requests name their class in ``kv_transfer_params`` (``{"workload": "text_2"}``
or ``{"type": "text", "turn": 2}``) or with a ``workload=<class>`` token in the request id.

Client hints come the same way, in ``kv_transfer_params`` (``retain_s``, ``retain_priority``,
``release``, ``hint_tag``, ``hint_session``: :func:`kvprof.models.hints.hint_of_args`; a malformed one is logged and
ignored here, the API server refuses it where vLLM checks requests). A request's hint applies at its
finish (``on_request_finished``; 0.30 reports none, so it honours no hint): the request's chunks that
are evictable then, those it stored and those it reused, are freed again with the hint into the
:class:`~kvprof.policy.hinted.HintLayer` over the policy, as the GPU pool and the simulator's
``HintedPolicy`` do (released chunks evicted first, retained ones last, a retention lapsing when its
time passes; retained chunks at most ``hint_max_fraction`` of the tier's chunks, per tag and in all); those
not evictable then (a store still in flight, another request's load) take it when they become
evictable. A request without a hint is ordered exactly as without the layer. Every chunk a finished
request holds tells the layer its session (a release naming one demotes only the chunks that session
alone held); a session alone places nothing.

Mapping of vLLM's calls onto the kvprof protocol (chunk keys are mapped to ints), as 0.33's
``CachePolicy`` (``vllm/v1/kv_offload/cpu/policies/base.py``) defines them:

* ``insert(key, chunk, req_context)`` -> ``access(hit=False)`` with the storing request's class: the
  store is that request's one access of the chunk; evictable at once only if its ref count is 0
  (0.33 inserts at -1, "not ready", and marks it evictable when the store completes),
* ``mark_evictable`` -> ``free`` (with the hint pending for the chunk, if any); ``mark_non_evictable``
  -> ``remove`` (a load: the layer's ``take``, a hit on a hinted chunk),
* ``on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)`` -> one
  ``access(hit=True)`` of each chunk the request reused, head to tail (vLLM records a request's
  accesses once, when it finishes: vLLM #51787); its insertion-only chunks are not accessed again,
  their store was the access. An evictable chunk is taken out of the order (``remove``), accessed
  and freed again (tail first), so it is re-ordered by its new score; with a client hint, that free
  is the hinted one, and the request's evictable insertion-only chunks are taken and freed with it,
* ``touch(keys, req_context)`` (0.30's connector; later ones never call it) -> the same, a hit for
  chunks another request stored; ``on_request_access`` (0.33: keys seen before the request
  finishes) records nothing: the access comes once, at the finish,
* ``evict(n, protected)`` -> the first ``n`` unprotected blocks of the layer's order (released,
  ``policy.order``, retained; atomic: nothing changes when ``n`` cannot be met but the lazy lapse
  of retentions whose time has passed; the victims counted and judged as ``evict_n``'s own:
  ``HintLayer.evict_chosen``), ``remove`` -> ``discard``, ``clear`` -> ``clear``.

Depth is the chunk's 0-based place in the request's chain, as in the GPU tier: from the end-token
position the connector records for each key (``ReqContext.get_offload_key_position``, 0.31 on),
divided by the tokens per chunk of the key's KV-cache group. That unit is not passed to the policy;
every position is a multiple of it and a request's first chunk ends at it, so it is the greatest
common divisor of the positions seen (until a group's first two chunks were seen, a deeper chunk
may be placed shallower). Without positions (0.30), the key's place in the keys given.

Which request stores a chunk reaches the policy differently across vLLM releases; the policy takes
it from whichever call carries it, so no version is branched on:

* 0.33: ``insert(key, chunk, req_context)``;
* 0.31-0.32: ``insert(key, chunk)``, right after ``on_store_miss(keys, req_context)`` for those keys;
* 0.30: ``insert(key, chunk)`` and no ``on_store_miss`` or ``on_request_finished``; the connector
  calls ``touch(all of the request's keys, req_context)`` right after each store, so the first
  touch of a chunk stored without a request names the request that stored it.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

try:  # 0.31 on: a key packs its KV-cache group's index
    from vllm.v1.kv_offload.base import get_offload_group_idx
except ImportError:  # 0.30: one group
    def get_offload_group_idx(key) -> int:
        return 0

from kvprof.models.hints import Hint, hint_of_args
from kvprof.policy import make_policy
from kvprof.policy.hinted import HintLayer
from kvprof.policy.lru import LRUPolicy
from kvprof.vllm.carry import Held, carry_over
from kvprof.vllm.spec import CONFIG_KEY, KvPolicyConfigError, PolicySpec

#: Set by the plugin in the engine core when ``kv_policy`` is configured.
ACTIVE_SPEC: PolicySpec | None = None
#: Set by the plugin with it: tiers built while the engine core starts order their chunks by LRU (the
#: reference policy, no compiled code) until the live loop hands the compiled policy over (:func:`hand_over`).
NATIVE_FIRST = False
#: Every tier of this process, for :func:`replace_policies` (a reload of the hp file).
TIERS: weakref.WeakSet[KvprofCachePolicy] = weakref.WeakSet()
_REQ_ID_TAG = re.compile(r"(?:^|[^A-Za-z0-9])workload=([A-Za-z0-9_.+\-]+)")


def _spec_from_env() -> PolicySpec | None:
    path = os.environ.get("KVPROF_KV_POLICY_CONFIG")
    if not path:
        return None
    return PolicySpec.from_additional_config(
        {CONFIG_KEY: {"config": path, "policy": os.environ.get("KVPROF_KV_POLICY") or "wa"}}
    )


class KvprofCachePolicy(CachePolicy):
    """Offloaded chunks ordered by a kvprof eviction policy (see the module docstring).

    Invariant: every evictable chunk is in exactly one place of :attr:`hints` (a
    :class:`~kvprof.policy.hinted.HintLayer` over :attr:`policy`): its released pool, its retained pool
    or the policy's order; ``_pending_hints`` holds the hint of a finished request for each of its
    chunks that was not evictable at its finish, until the chunk becomes evictable or leaves.
    """

    def __init__(self, cache_capacity: int, spec: PolicySpec | None = None, clock=time.monotonic) -> None:
        super().__init__(cache_capacity)
        spec = spec or ACTIVE_SPEC or _spec_from_env()
        if spec is None:
            raise KvPolicyConfigError(
                "KvprofCachePolicy needs a policy: serve with --kv-policy-config PATH "
                "(or set KVPROF_KV_POLICY_CONFIG)"
            )
        self.spec = spec
        self.policy = make_policy("lru") if NATIVE_FIRST else self.build_policy(spec)
        self.hints = HintLayer(self.policy, spec.hint_budget(cache_capacity))
        self._pending_hints: dict[Any, Hint] = {}
        self._clock = clock
        self.chunks: dict[Any, Any] = {}
        self._id: dict[Any, int] = {}
        self._key: dict[int, Any] = {}
        self._next_id = 0
        self._spare_ids: list[int] = []  # ids of chunks gone: the policy's tables stay as large as the tier
        self._store_ctx = None
        #: Request id that stored each chunk; None until named (vLLM 0.30: by the first ``touch``).
        self._stored_by: dict[Any, str | None] = {}
        #: Per chunk, for a reload (:meth:`replace_policy`): the tags its class came from at its last
        #: access, its depth then, its hits since it was stored and when it was last accessed or freed.
        self._history: dict[Any, list] = {}
        #: Per KV-cache group, the gcd of the key positions seen: its tokens per chunk (module docstring).
        self._chunk_tokens: dict[int, int] = {}
        TIERS.add(self)

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _tags_of(req_context) -> dict | None:
        """The tags a request names its class with (module docstring); None for an untagged one."""
        params = getattr(req_context, "kv_transfer_params", None)
        if isinstance(params, dict) and any(k in params for k in ("workload", "type", "turn")):
            return params
        match = _REQ_ID_TAG.search(str(getattr(req_context, "req_id", "")))
        return {"workload": match.group(1)} if match else None

    @staticmethod
    def _hint_of(req_context) -> Hint | None:
        """The client hint in a request's ``kv_transfer_params`` (None: none). A malformed one is logged
        (once: a request finishes once) and ignored; refusing it is the API server's business."""
        params = getattr(req_context, "kv_transfer_params", None)
        try:
            return hint_of_args(params if isinstance(params, dict) else None)
        except ValueError as err:
            logging.getLogger("vllm.kvprof").warning(
                "kvprof: request %s: %s in kv_transfer_params; its offloaded chunks keep no hint",
                getattr(req_context, "req_id", None), err)
            return None

    def _class_of(self, tags: dict | None) -> int:
        return self.spec.default_index if tags is None else self.spec.class_index(tags)

    def _id_of(self, key) -> int:
        block = self._id.get(key)
        if block is None:
            if self._spare_ids:
                block = self._spare_ids.pop()
            else:
                block = self._next_id
                self._next_id += 1
            self._id[key] = block
            self._key[block] = key
        return block

    def _forget(self, key, block: int) -> None:
        """A chunk left the tier: drop its mappings and keep its id for the next chunk."""
        del self._id[key]
        del self._key[block]
        del self._stored_by[key]
        del self._history[key]
        self._pending_hints.pop(key, None)
        self._spare_ids.append(block)

    def _depth(self, key, req_context, fallback: int) -> int:
        """The chunk's 0-based place in the request's chain (module docstring)."""
        getter = getattr(req_context, "get_offload_key_position", None)
        end = getter(key) if getter is not None else None
        if not end:
            return fallback
        group = get_offload_group_idx(key)
        unit = self._chunk_tokens[group] = math.gcd(self._chunk_tokens.get(group, 0), int(end))
        return int(end) // unit - 1

    # -- CachePolicy -----------------------------------------------------------------------
    def get(self, key):
        return self.chunks.get(key)

    def insert(self, key, chunk, req_context=None) -> None:
        if req_context is None:
            req_context = self._store_ctx
        self.chunks[key] = chunk
        self._stored_by[key] = getattr(req_context, "req_id", None)
        block = self._id_of(key)
        now = self._clock()
        tags, depth = self._tags_of(req_context), self._depth(key, req_context, 0)
        self._history[key] = [tags, depth, 0, now]
        self.hints.recached(block)  # a retention of the id's last chunk is not this one's
        self.policy.access(block, now, self._class_of(tags), depth, hit=False, content=key)
        if chunk.ref_cnt == 0:
            self.hints.free_hinted((block,), now, None)

    def remove(self, key) -> None:
        del self.chunks[key]
        block = self._id[key]
        self.hints.discard(block)
        self._forget(key, block)

    def touch(self, keys: Iterable, req_context) -> None:
        # A request's own chunks are not hits; vLLM 0.30 names the storer only here (module docstring).
        keys = list(keys)
        req_id = getattr(req_context, "req_id", None)
        stored_by = self._stored_by
        reused = set()
        for key in keys:
            if key not in stored_by:
                continue
            if stored_by[key] is None:
                stored_by[key] = req_id
            elif stored_by[key] != req_id:
                reused.add(key)
        self._access(keys, req_context, reused=reused)

    def on_store_miss(self, keys: Iterable, req_context) -> None:
        # Not an access of a cached chunk. vLLM 0.31-0.32 call this just before inserting the missed
        # keys, without passing the request to ``insert``: remember it for those inserts.
        self._store_ctx = req_context

    def on_request_finished(self, key_groups: Sequence[Sequence], insertion_only_keys: set, reused_keys: set, req_context) -> None:
        # Each group comes head to tail. The insertion-only chunks had their access at ``insert``;
        # with a client hint they are freed again with it (module docstring).
        hint = self._hint_of(req_context)
        session = None if hint is None else hint.session
        if self.hints.tracks(session):  # who held them (a release demotes one session's own)
            self.hints.note_held([self._id[key] for group in key_groups for key in group if key in self._id], session,
                                 self._clock())
        if hint is not None and not (hint.retains or hint.release):
            hint = None  # a session alone places nothing
        own = insertion_only_keys if hint is not None else ()
        for group in key_groups:
            self._access(group, req_context, reused=reused_keys, only_reused=True, hint=hint, own=own)

    def _access(self, keys: Sequence, req_context, reused, only_reused: bool = False, hint: Hint | None = None,
                own=()) -> None:
        """One access of each of ``keys`` (head to tail) that is held, a hit for those in ``reused``;
        the evictable ones of these and of ``own`` freed again with ``hint``, the others of them
        given it for when they become evictable (a hint is a request's free: module docstring)."""
        tags = self._tags_of(req_context)
        cls = self._class_of(tags)
        now = self._clock()
        policy, hints, history = self.policy, self.hints, self._history
        refree = []  # evictable ones: out of the order while accessed, freed again tail first
        for i, key in enumerate(keys):
            block = self._id.get(key)
            hit = key in reused
            accessed = hit or not only_reused
            if block is None or key not in self.chunks or not (accessed or key in own):
                continue
            if block in hints:
                hints.take(block, hit=False)  # the load that read it was the hit, counted at mark_non_evictable
                refree.append(block)
            elif hint is not None:
                self._pending_hints[key] = hint
            if not accessed:
                continue
            depth = self._depth(key, req_context, i)
            policy.access(block, now, cls, depth, hit=hit, content=key)
            past = history[key]
            past[0], past[1], past[3] = tags, depth, now
            past[2] += hit
        if refree:
            hints.free_hinted(refree[::-1], now, hint)

    def evict(self, n: int, protected: set):
        hints = self.hints
        if n == 0:
            return []
        if n > len(hints):
            return None
        now = self._clock()
        chosen = []
        # Protected chunks can only push the n victims that many places down the order (the layer's:
        # released, the policy's, retained).
        for block in hints.order(now, n + len(protected)):
            key = self._key[block]
            if key in protected:
                continue
            chosen.append(block)
            if len(chosen) == n:
                break
        if len(chosen) < n:
            return None
        hints.evict_chosen(chosen, now)  # counted and judged as the simulator's evictions are
        out = []
        for block in chosen:
            key = self._key[block]
            self._forget(key, block)
            chunk = self.chunks.pop(key)
            assert chunk.ref_cnt == 0
            out.append((key, chunk))
        return out

    def clear(self) -> None:
        self.hints.clear()  # the policy's too
        self._pending_hints.clear()
        self.chunks.clear()
        self._stored_by.clear()
        self._history.clear()
        self._id.clear()
        self._key.clear()
        self._spare_ids.clear()
        self._next_id = 0

    def mark_evictable(self, key) -> None:
        now = self._clock()
        self.hints.free_hinted((self._id_of(key),), now, self._pending_hints.pop(key, None))
        if key in self._history:
            self._history[key][3] = now

    def mark_non_evictable(self, key) -> None:
        self.hints.take(self._id[key])  # a load: a hit, on a hinted chunk counted as one

    def replace_policy(self, spec: PolicySpec, policy=None) -> None:
        """Order the tier by ``policy``, built from ``spec`` (a reloaded hp file), from now on.

        The chunks carry over as the GPU pool's blocks do (:func:`kvprof.vllm.carry.carry_over`),
        each with its depth, classified by the new file from the tags it was last accessed with;
        client hints' retentions and releases do not (the new policy orders every evictable chunk, as
        the GPU pool's reload does), hints still pending do, and the hint counters go on. ``policy``
        is built here when not given (:func:`build_policies` builds it off the scheduler thread).
        """
        if policy is None:
            policy = self.build_policy(spec)
        self.spec = spec
        held = [Held(self._id[key], depth, key, stamp, self._class_of(tags), hits, self.chunks[key].ref_cnt == 0)
                for key, (tags, depth, hits, stamp) in ((key, self._history[key]) for key in self.chunks)]
        carry_over(held,
                   lambda item, hit: policy.access(item.id, item.stamp, item.workload, item.depth, hit=hit,
                                                   content=item.content),
                   lambda item: policy.free((item.id,), item.stamp))
        self.policy = policy
        before = self.hints
        self.hints = HintLayer(policy, spec.hint_budget(self.cache_capacity))
        self.hints.carry_from(before)

    def build_policy(self, spec: PolicySpec):
        """A fresh policy of ``spec`` for this tier's capacity."""
        return spec.make_policy(capacity=self.cache_capacity, n_blocks=self.cache_capacity)

    @property
    def serves_natively(self) -> bool:
        """Whether LRU orders the tier until the compiled policy is handed over (:data:`NATIVE_FIRST`)."""
        return isinstance(self.policy, LRUPolicy)


def build_policies(spec: PolicySpec) -> list:
    """A fresh policy of ``spec`` for every CPU offload tier of this process (:data:`TIERS`): built on
    the reload thread, handed to :func:`replace_policies` on the scheduler thread."""
    return [(tier, tier.build_policy(spec)) for tier in list(TIERS)]


def native_tiers_policies(spec: PolicySpec) -> list:
    """:func:`build_policies` for the tiers that wait for the compiled policy (built off the scheduler thread)."""
    return [(tier, tier.build_policy(spec)) for tier in list(TIERS) if tier.serves_natively]


def hand_over(spec: PolicySpec, built: list) -> None:
    """Each tier of ``built`` (:func:`native_tiers_policies`) is ordered by its compiled policy from now on, its
    chunks carried over as by a reload."""
    for tier, policy in built:
        tier.replace_policy(spec, policy)


def replace_policies(spec: PolicySpec, built: list | None = None) -> None:
    """A reloaded hp file reaches every CPU offload tier of this process (:data:`TIERS`), with the
    policies :func:`build_policies` built for them where given (a tier made since builds its own)."""
    prebuilt = dict(built or ())
    for tier in list(TIERS):
        tier.replace_policy(spec, prebuilt.get(tier))
