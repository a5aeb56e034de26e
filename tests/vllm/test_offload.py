"""The CPU offload tier: kvprof's CachePolicy inside vLLM's real CPU offloading manager.

Full offloading needs a GPU (the connector refuses to start on CPU), so the scheduler-side manager
(``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``) is driven directly, loading the policy the
way the connector does: ``cache_policy="KvprofCachePolicy"``, ``cache_policy_module_path="kvprof.vllm.offload"``.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.vllm


def _manager(policy: str, spec=None, chunks: int = 8):
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvprof.vllm import offload

    offload.ACTIVE_SPEC = spec
    if policy == "lru":
        return CPUOffloadingManager(num_chunks=chunks, cache_policy="lru")
    return CPUOffloadingManager(num_chunks=chunks, cache_policy="KvprofCachePolicy",
                                cache_policy_module_path="kvprof.vllm.offload")


def _spec(tmp_path):
    from vllm_support import HP_TEST

    from kvprof.vllm.spec import PolicySpec

    path = tmp_path / "hp.json"
    path.write_text(json.dumps(HP_TEST))
    return PolicySpec.from_additional_config({"kv_policy": {"config": str(path)}})


def _store(manager, keys, ctx):
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * 32)
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    return out


def _scenario(manager):
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    hot = [make_offload_key(bytes([1, i]) * 8, 0) for i in range(4)]
    cold = [make_offload_key(bytes([2, i]) * 8, 0) for i in range(4)]
    new = [make_offload_key(bytes([3, i]) * 8, 0) for i in range(4)]
    _store(manager, hot, ReqContext("hot-req", kv_transfer_params={"type": "hot", "turn": 1}))
    _store(manager, cold, ReqContext("req-7 workload=cold_1"))  # class named in the request id
    out = _store(manager, new, ReqContext("new-req", kv_transfer_params={"workload": "cold_1"}))
    return hot, cold, out


def test_kvprof_cache_policy_evicts_cold_chunks_lru_evicts_oldest(tmp_path, in_vllm):
    if not in_vllm:
        return
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    hot, cold, out = _scenario(_manager("kvprof", _spec(tmp_path)))
    assert sorted(out.evicted_keys) == sorted(cold)
    _, _, out_lru = _scenario(_manager("lru"))
    assert sorted(out_lru.evicted_keys) == sorted(hot)

    manager = _manager("kvprof", _spec(tmp_path))
    hot, cold, _ = _scenario(manager)
    ctx = ReqContext("again", kv_transfer_params={"type": "hot", "turn": 1})
    assert all(manager.lookup(k, ctx) == LookupResult.HIT for k in hot)
    manager.prepare_load(hot, ctx)  # pinned while loading: never a victim
    assert manager.prepare_store([b"x" * 36, b"y" * 36, b"z" * 36, b"w" * 36, b"v" * 36], ctx) is None
    manager.complete_load(hot, ctx)
    manager.on_request_finished(ctx)
    manager.reset_cache()
    assert all(manager.lookup(k, ctx) == LookupResult.MISS for k in hot)


def test_kvprof_cache_policy_refuses_without_spec(monkeypatch, in_vllm):
    if not in_vllm:
        return
    from kvprof.vllm.spec import KvPolicyConfigError

    monkeypatch.delenv("KVPROF_KV_POLICY_CONFIG", raising=False)
    with pytest.raises(KvPolicyConfigError, match="needs a policy"):
        _manager("kvprof", None)
