"""Drive vLLM's real ``KVCacheManager`` as its scheduler does, with vLLM's block pool or kvprof's.

vLLM's own prefix-caching tests (tests/v1/core/) build the manager from a ``KVCacheConfig`` without a
model; so do these helpers, for one full-attention group ("plain") or a full-attention and a
sliding-window group sharing the pool ("hybrid"). kvprof's pool goes in at the seam the plugin
uses (``kv_cache_coordinator.BlockPool``, :func:`kvprof.vllm.plugin.install_into_scheduler`). KV
events and a residency-metrics collector that samples every block are on. Import vLLM only
inside the functions: the test modules are collected outside the vLLM venv too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

BLOCK = 16
WINDOW = 2 * BLOCK


def policy_spec(policy: str, mode: str = "enforce"):
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


def kv_cache_config(num_blocks: int, groups: str = "hybrid", retention: int | None = 0, extra=None):
    """``num_blocks`` blocks for a full-attention group and, for ``groups="hybrid"``, a sliding-window
    group (``WINDOW`` tokens) sharing them; ``extra``: one more group.

    ``retention`` is vLLM's resolved ``prefix_cache_retention_interval``: 0, the serving default,
    caches of the sliding-window group only the blocks a later request can hit.
    """
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    specs = [KVCacheGroupSpec(["layers.0.full"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                                   dtype=torch.float32))]
    if groups == "hybrid":
        specs.append(KVCacheGroupSpec(["layers.1.swa"], SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=WINDOW)))
    if extra is not None:
        specs.append(extra)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs,
                         prefix_cache_retention_interval=retention)


def kv_cache_manager(monkeypatch, num_blocks: int, policy: str | None, groups: str = "hybrid",
                     retention: int | None = 0):
    """vLLM's KV cache manager for :func:`kv_cache_config`, with vLLM's pool (``policy`` None) or kvprof's,
    KV events on and a residency-metrics collector that samples every block."""
    import functools

    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    from kvprof.vllm.block_pool import KvprofBlockPool

    if policy is not None:  # the plugin's seam (kvprof.vllm.plugin.install_into_scheduler)
        monkeypatch.setattr(kv_cache_coordinator, "BlockPool",
                            functools.partial(KvprofBlockPool, kvprof_spec=policy_spec(policy)))
    manager = KVCacheManager(kv_cache_config(num_blocks, groups, retention), max_model_len=4096, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, enable_caching=True, enable_kv_cache_events=True,
                             metrics_collector=KVCacheMetricsCollector(sample_rate=1.0))
    monkeypatch.undo()
    return manager


def make_request(request_id: str, prompt: list[int], xargs: dict | None = None):
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


def workload(seed: int, n: int = 60) -> list[tuple[list[int], int, int]]:
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


def drive(manager, requests, xargs=None) -> Run:
    """Serve ``requests`` (as :func:`workload` makes them) as vLLM's scheduler would, one step at a time: a request is looked up and
    prefilled, then decodes one token a step (each step frees the blocks that left the window)
    while at most its number of requests are open; the oldest finishes first."""
    pool = manager.block_pool
    run = Run()
    running: list = []

    def allocate(request, *args):
        """``allocate_slots``, with the request made known to kvprof's pool as the plugin's wrapper does."""
        if hasattr(pool, "current_request"):
            pool.current_request = request
        try:
            return manager.allocate_slots(request, *args)
        finally:
            if hasattr(pool, "current_request"):
                pool.current_request = None

    def step(request) -> bool:
        """One decode step: a token is computed and the next sampled."""
        if allocate(request, 1) is None:
            return False
        request.num_computed_tokens += 1
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
                if entry[1] < 0 or not step(entry[0]):
                    entry[1] = -1
            for entry in [e for e in running if e[1] < 0]:
                running.remove(entry)
                run.blocks.append([[b.block_id for b in group]
                                   for group in manager.coordinator.get_blocks(entry[0].request_id)])
                finish(entry[0])

    for i, (prompt, steps, open_limit) in enumerate(requests):
        request = make_request(f"r{i}", prompt, xargs)
        for _ in range(2):  # when the open requests leave too few blocks, vLLM waits for them to finish
            computed, hit_tokens, _ = manager.get_computed_blocks(request)
            if allocate(request, len(prompt) - hit_tokens, hit_tokens, computed) is not None:
                break
            run.refused += 1
            decode_until(0)
        else:
            raise AssertionError(f"request {i} does not fit in the pool alone")
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


def router_index(events):
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


def pool_index(pool):
    """The pool's cached keys, as :func:`router_index` counts them."""
    from collections import Counter

    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

    return Counter({(maybe_convert_block_hash(get_block_hash(key)), get_group_id(key)): 1 if hasattr(held, "block_id")
                    else len(held) for key, held in pool.cached_block_hash_to_block._cache.items()})
