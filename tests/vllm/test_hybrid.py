"""kvprof's pool serving a hybrid model: a full-attention and a sliding-window KV cache group in one pool.

vLLM's CPU build serves no such model here (see docs/vllm.md, "Hybrid models"), so these tests run
in process, as vLLM's own prefix-caching tests do: vLLM's real ``KVCacheManager`` (its
``HybridKVCacheCoordinator``, ``FullAttentionManager`` and ``SlidingWindowManager``) is given a
``KVCacheConfig`` with the two groups and driven through the calls its scheduler makes for each
request (look-up, prefill allocation, decode steps, which free the blocks that leave the window,
free). kvprof's pool is put in at the seam the plugin uses (``kv_cache_coordinator.BlockPool``).

* Under kvprof's ``lru`` every request hits, is given and frees exactly what it is under vLLM's
  own pool, and vLLM's KV events (BlockStored / BlockRemoved, with their group) and residency
  metrics (``--kv-cache-metrics``) come out identical.
* Under ``wa`` every block the policy evicts is announced with a BlockRemoved (a router that
  indexes the events holds exactly the pool's cached keys), the residency metrics stay populated,
  sliding-window blocks no future request can hit are handed out before any cached block, and a
  sliding-window hit tells the policy the blocks' depths in the request.
* A Mamba state group is refused with a message that says why and what to do instead.

Runs inside the vLLM venv (the test re-runs itself there when this interpreter has no vLLM).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.vllm

BLOCK = 16
WINDOW = 2 * BLOCK


def _spec(policy: str, mode: str = "enforce"):
    """The validated ``kv_policy`` spec of ``policy`` (``wa`` from the tests' hp file)."""
    import json
    import tempfile

    from vllm_support import HP_TEST

    from kvprof.vllm.spec import PolicySpec

    if policy == "wa":
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(HP_TEST, fh)
        return PolicySpec.from_additional_config({"kv_policy": {"config": fh.name, "mode": mode}})
    return PolicySpec.from_additional_config({"kv_policy": {"policy": policy, "mode": mode}})


def _hybrid_config(num_blocks: int, retention: int | None = 0, third=None):
    """A full-attention group and a sliding-window group (``WINDOW`` tokens) sharing ``num_blocks`` blocks.

    ``retention`` is vLLM's resolved ``prefix_cache_retention_interval``: 0, the serving default,
    caches of the sliding-window group only the blocks a later request can hit.
    """
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    groups = [
        KVCacheGroupSpec(["layers.0.full"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                              dtype=torch.float32)),
        KVCacheGroupSpec(["layers.1.swa"], SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                             dtype=torch.float32, sliding_window=WINDOW)),
    ]
    if third is not None:
        groups.append(third)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                         prefix_cache_retention_interval=retention)


def _manager(monkeypatch, num_blocks: int, policy: str | None, retention: int | None = 0):
    """vLLM's KV cache manager for the hybrid config, with vLLM's pool (``policy`` None) or kvprof's,
    KV events on and a residency-metrics collector that samples every block."""
    import functools

    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    from kvprof.vllm.block_pool import KvprofBlockPool

    if policy is not None:  # the plugin's seam (kvprof.vllm.plugin.install_into_scheduler)
        monkeypatch.setattr(kv_cache_coordinator, "BlockPool",
                            functools.partial(KvprofBlockPool, kvprof_spec=_spec(policy)))
    manager = KVCacheManager(_hybrid_config(num_blocks, retention), max_model_len=4096, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, enable_caching=True, enable_kv_cache_events=True,
                             metrics_collector=KVCacheMetricsCollector(sample_rate=1.0))
    monkeypatch.undo()
    return manager


def _request(request_id: str, prompt: list[int], xargs: dict | None = None):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id, prompt, SamplingParams(max_tokens=64, extra_args=xargs), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


@dataclass
class Run:
    """What one manager did on a workload: per request its hit tokens and blocks, the KV events,
    the residency metrics' eviction events."""

    hits: list[int] = field(default_factory=list)
    blocks: list[list[list[int]]] = field(default_factory=list)
    events: list = field(default_factory=list)
    evictions: list = field(default_factory=list)
    refused: int = 0


def _workload(seed: int, n: int = 60) -> list[tuple[list[int], int, int]]:
    """``n`` requests ``(prompt, decode steps, requests held open)``: prompts of a few documents with
    shared prefixes of several lengths, some long enough that the window slides off their start."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1000, 30000) for _ in range(8 * BLOCK)] for _ in range(5)]
    out = []
    for i in range(n):
        doc = docs[min(int(rng.expovariate(0.8)), len(docs) - 1)]
        prefix = doc[: rng.randint(1, 8) * BLOCK - rng.randint(0, BLOCK // 2)]
        prompt = prefix + [rng.randrange(30000, 32000) for _ in range(rng.randint(0, 2 * BLOCK))]
        out.append((prompt, rng.randint(1, 2 * BLOCK), rng.randint(1, 3)))
    return out


def _drive(manager, workload, xargs=None) -> Run:
    """Serve ``workload`` as vLLM's scheduler would, one step at a time: a request is looked up and
    prefilled, then decodes one token a step (each step frees the blocks that left the window)
    while at most its number of requests are open; the oldest finishes first."""
    pool = manager.block_pool
    run = Run()
    running: list = []

    def step(request, tokens: int) -> bool:
        if hasattr(pool, "current_request"):  # as the plugin's allocate_slots wrapper does
            pool.current_request = request
        blocks = manager.allocate_slots(request, tokens)
        if hasattr(pool, "current_request"):
            pool.current_request = None
        if blocks is None:
            return False
        request.num_computed_tokens += tokens
        request.append_output_token_ids(7 + len(request.output_token_ids))
        return True

    def finish(request) -> None:
        manager.free(request)
        run.events.extend(pool.take_events())

    def decode_until(limit: int) -> None:
        """Decode the open requests a step at a time until at most ``limit`` are open."""
        while len(running) > limit:
            for entry in running:
                entry[1] -= 1
                if entry[1] < 0 or not step(entry[0], 1):
                    entry[1] = -1
            for entry in [e for e in running if e[1] < 0]:
                running.remove(entry)
                run.blocks.append([[b.block_id for b in group]
                                   for group in manager.coordinator.get_blocks(entry[0].request_id)])
                finish(entry[0])

    for i, (prompt, steps, open_limit) in enumerate(workload):
        request = _request(f"r{i}", prompt, xargs)
        for _ in range(2):  # when the open requests leave too few blocks, vLLM waits for them to finish
            computed, hit_tokens, _ = manager.get_computed_blocks(request)
            if hasattr(pool, "current_request"):
                pool.current_request = request
            blocks = manager.allocate_slots(request, len(prompt) - hit_tokens, hit_tokens, computed)
            if hasattr(pool, "current_request"):
                pool.current_request = None
            if blocks is not None:
                break
            run.refused += 1
            decode_until(0)
        assert blocks is not None, f"request {i} does not fit in the pool alone"
        request.num_computed_tokens = len(prompt)
        request.append_output_token_ids(7)
        run.hits.append(hit_tokens)
        running.append([request, steps])
        decode_until(open_limit)
        run.events.extend(pool.take_events())
    decode_until(0)
    run.events.extend(pool.take_events())
    run.evictions = pool.metrics_collector.drain_events()
    return run


@pytest.mark.parametrize("seed", [0, 1])
def test_lru_serves_a_hybrid_model_as_vllm_does(seed, monkeypatch, in_vllm):
    """Same hits, same blocks, same KV events (both groups), same residency-metric evictions."""
    if not in_vllm:
        return
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    workload = _workload(seed)
    native_manager = _manager(monkeypatch, 64, None)
    native_pool = native_manager.block_pool
    native = _drive(native_manager, workload)
    ours = _drive(_manager(monkeypatch, 64, "lru"), workload)
    assert ours.hits == native.hits
    assert ours.blocks == native.blocks
    assert ours.events == native.events
    assert _router_index(native.events) == _pool_index(native_pool)
    removed = [e for e in native.events if isinstance(e, BlockRemoved)]
    assert removed and {e.group_idx for e in removed} == {0, 1}, "the workload must evict in both groups"
    assert {e.group_idx for e in native.events if isinstance(e, BlockStored)} == {0, 1}
    assert sum(h > 0 for h in native.hits) > 10, "the workload must hit"
    assert len(ours.evictions) == len(native.evictions) > 0
    assert [len(e.reuse_gaps_seconds) for e in ours.evictions] == [len(e.reuse_gaps_seconds) for e in native.evictions]


def _router_index(events):
    """What a router that indexes the KV events (llm-d's precise prefix scorer) believes is cached:
    for each (block hash, group), how many blocks hold it (vLLM caches a prefix computed twice at
    once in two blocks, announces both and removes them one at a time)."""
    from collections import Counter

    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    index: Counter = Counter()
    for event in events:
        if isinstance(event, BlockStored):
            index.update((h, event.group_idx) for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.subtract((h, event.group_idx) for h in event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            index.clear()
    return +index


def _pool_index(pool):
    """The pool's cached keys, as :func:`_router_index` counts them."""
    from collections import Counter

    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

    return Counter({(maybe_convert_block_hash(get_block_hash(key)), get_group_id(key)): 1 if hasattr(held, "block_id")
                    else len(held) for key, held in pool.cached_block_hash_to_block._cache.items()})


def test_wa_announces_every_eviction(monkeypatch, in_vllm):
    """Under ``wa`` each block the policy evicts has its BlockRemoved: the events' index is the pool's."""
    if not in_vllm:
        return
    from vllm.distributed.kv_events import BlockRemoved

    manager = _manager(monkeypatch, 64, "wa")
    pool = manager.block_pool
    run = _drive(manager, _workload(3), xargs={"type": "hot", "turn": 1})
    removed = sum(len(e.block_hashes) for e in run.events if isinstance(e, BlockRemoved))
    assert pool.free_block_queue.evictions > 20
    assert removed == pool.free_block_queue.evictions  # nothing else drops a hash in this workload
    assert _router_index(run.events) == _pool_index(pool)
    assert len(run.evictions) >= pool.free_block_queue.evictions  # sampled at rate 1: every block handed out
    assert all(e.lifetime_seconds > 0 and e.idle_seconds > 0 for e in run.evictions)
    assert any(e.reuse_gaps_seconds for e in run.evictions), "hit blocks must show their reuse gaps"


@pytest.mark.parametrize("policy", [None, "wa"])
def test_blocks_no_request_can_hit_go_first(policy, monkeypatch, in_vllm):
    """With vLLM's default retention the sliding-window group caches only the blocks ending a
    reachable prefix; the others (left behind by the window, or masked) are hash-less when freed
    and are handed out before any cached block of either group, under vLLM's pool and kvprof's."""
    if not in_vllm:
        return
    manager = _manager(monkeypatch, 40, policy)
    pool = manager.block_pool
    prompt = list(range(100, 100 + 10 * BLOCK + 5))  # 10 full blocks, then decode past the next boundary
    run = _drive(manager, [(prompt, BLOCK, 0)])
    assert run.hits == [0]
    cached = {b.block_id for b in pool.blocks if b.block_hash is not None}
    full, swa = run.blocks[0]
    assert set(full[:10]) <= cached  # full attention: every full block
    swa_cached = [i for i in swa if i in cached]
    assert 0 < len(swa_cached) < 5, "the sliding-window group keeps only the blocks a later hit needs"
    free = pool.free_block_queue.get_all_free_blocks()
    n_plain = sum(b.block_hash is None for b in free)
    assert n_plain > 5 and all(b.block_hash is None for b in free[:n_plain]), "hash-less blocks come first"
    handed = pool.get_new_blocks(n_plain)
    assert all(b.block_hash is None for b in handed)
    pool.free_blocks(handed)
    assert {b.block_id for b in pool.blocks if b.block_hash is not None} == cached  # nothing cached was given up
    again = _drive(manager, [(prompt[: 10 * BLOCK + 1], 1, 0)])
    assert again.hits == [10 * BLOCK]  # both groups still hit the whole prompt


def test_sliding_window_hits_reach_the_policy_at_their_depth(monkeypatch, in_vllm):
    """A sliding-window group touches only its window's blocks: the policy is told each block's
    position in the request (what ``wa``'s depth features and its safety net read), not its index
    among the touched blocks."""
    if not in_vllm:
        return
    manager = _manager(monkeypatch, 64, "wa", retention=None)  # dense: every sliding-window block cached
    pool = manager.block_pool
    prompt = list(range(500, 500 + 8 * BLOCK + 3))
    _drive(manager, [(prompt, 1, 0)])
    second = _drive(manager, [(prompt, 1, 0)])
    assert second.hits == [8 * BLOCK]
    full, swa = second.blocks[0]
    touched = [i for i in swa if i != 0][: WINDOW // BLOCK]  # the window's blocks the hit touched
    assert touched, "the sliding-window group must hit"
    assert [pool._depth[i] for i in touched] == [swa.index(i) for i in touched]
    assert [pool._depth[i] for i in full[:8]] == list(range(8))


def test_a_mamba_group_is_refused_with_a_clear_message(in_vllm):
    if not in_vllm:
        return
    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    from kvprof.vllm.plugin import check_kv_cache_groups
    from kvprof.vllm.spec import KvPolicyConfigError

    mamba = KVCacheGroupSpec(["layers.2.mamba"], MambaSpec(block_size=BLOCK, shapes=((4,),), dtypes=(torch.float32,)))
    config = _hybrid_config(32, third=mamba)
    with pytest.raises(KvPolicyConfigError, match=r"KV cache group 2 \(layers.2.mamba\) holds Mamba state") as err:
        check_kv_cache_groups(_spec("lru"), config)
    assert "--kv-policy-mode shadow" in str(err.value) and str(err.value).startswith("kvprof kv_policy:")
    check_kv_cache_groups(_spec("lru", mode="shadow"), config)  # vLLM's own eviction stays: nothing to refuse
    check_kv_cache_groups(_spec("lru"), _hybrid_config(32))  # full + sliding window is served
