"""vLLM's KV events and KV cache residency metrics under kvprof's queue.

A router that indexes the engines' KV events (llm-d's precise prefix scorer, with
``--kv-events-config``) must see a BlockStored / BlockRemoved for every block kvprof's queue caches
and evicts, exactly as vLLM's own pool announces them; vLLM's residency metrics
(``--kv-cache-metrics``: block lifetime, idle time before eviction, reuse gaps) must stay
populated. Both are fed by vLLM's ``BlockPool`` itself (``cache_full_blocks``, and
``_maybe_evict_cached_block`` on every block ``get_new_blocks`` hands out), which kvprof's pool
keeps: these tests hold it to that, on one full-attention group ("plain") and on a hybrid model's
full-attention and sliding-window groups, driving vLLM's real ``KVCacheManager``
(:mod:`kv_cache_driver`). Runs inside the vLLM venv (re-run there when this interpreter has no vLLM).
"""

from __future__ import annotations

import pytest

from kv_cache_driver import drive, kv_cache_manager, pool_index, router_index, workload

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("groups", ["plain", "hybrid"])
@pytest.mark.parametrize("seed", [0, 1])
def test_lru_gives_vllms_event_stream_and_metrics(groups, seed, monkeypatch, in_vllm):
    """The same requests under vLLM's pool and kvprof's ``lru``: the same hits, blocks, KV events
    (every group's) and residency-metric evictions, and the events index what the pool caches."""
    if not in_vllm:
        return
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    requests = workload(seed)
    native_manager = kv_cache_manager(monkeypatch, 64, None, groups)
    native = drive(native_manager, requests)
    ours = drive(kv_cache_manager(monkeypatch, 64, "lru", groups), requests)
    assert ours.hits == native.hits
    assert ours.blocks == native.blocks
    assert ours.events == native.events
    assert router_index(native.events) == pool_index(native_manager.block_pool)
    expected_groups = {0, 1} if groups == "hybrid" else {0}
    removed = [e for e in native.events if isinstance(e, BlockRemoved)]
    assert removed and {e.group_idx for e in removed} == expected_groups, "the workload must evict in each group"
    assert {e.group_idx for e in native.events if isinstance(e, BlockStored)} == expected_groups
    assert sum(h > 0 for h in native.hits) > 10, "the workload must hit"
    assert len(ours.evictions) == len(native.evictions) > 0
    assert [len(e.reuse_gaps_seconds) for e in ours.evictions] == [len(e.reuse_gaps_seconds) for e in native.evictions]


@pytest.mark.parametrize("groups", ["plain", "hybrid"])
def test_wa_announces_every_eviction(groups, monkeypatch, in_vllm):
    """Under ``wa`` each block the policy evicts has its BlockRemoved (the events index exactly what
    the pool caches), and the residency metrics see every block handed out, hit blocks' reuse gaps too."""
    if not in_vllm:
        return
    from vllm.distributed.kv_events import BlockRemoved

    manager = kv_cache_manager(monkeypatch, 64, "wa", groups)
    pool = manager.block_pool
    run = drive(manager, workload(3), xargs={"type": "hot", "turn": 1})
    removed = sum(len(e.block_hashes) for e in run.events if isinstance(e, BlockRemoved))
    assert pool.free_block_queue.evictions > 20
    assert removed == pool.free_block_queue.evictions  # nothing else drops a hash in this workload
    assert router_index(run.events) == pool_index(pool)
    assert len(run.evictions) >= pool.free_block_queue.evictions  # sampled at rate 1: every block handed out
    assert all(e.lifetime_seconds > 0 and e.idle_seconds > 0 for e in run.evictions)
    assert any(e.reuse_gaps_seconds for e in run.evictions), "hit blocks must show their reuse gaps"
