"""The CPU offload tier: kvprof's CachePolicy inside vLLM's real CPU offloading manager.

Full offloading needs a GPU (the connector refuses to start on CPU), so the scheduler-side manager
(``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``) is driven directly, loading the policy the
way the connector does: ``cache_policy="KvprofCachePolicy"``, ``cache_policy_module_path="kvprof.vllm.offload"``,
and calling it as the installed release's connector does: 0.30's connector touches a request's keys after
each lookup and store and never reports the request finished to the policy (its ``CachePolicy`` has no
``on_request_finished``); later ones do not touch, and record key positions in the ``ReqContext``.
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


def _connector_touches() -> bool:
    """Whether this release's connector reports accesses with ``touch`` (0.30) rather than per request."""
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

    return not hasattr(CachePolicy, "on_request_finished")


def _store(manager, keys, ctx):
    if hasattr(ctx, "set_offload_key_position"):
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * 32)
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    if _connector_touches() and out.keys_to_store:
        manager.touch(keys, ctx)
    manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    return out


def _load(manager, keys, ctx):
    from vllm.v1.kv_offload.base import LookupResult

    assert all(manager.lookup(k, ctx) == LookupResult.HIT for k in keys)
    if _connector_touches():
        manager.touch(keys, ctx)
    manager.prepare_load(keys, ctx)
    manager.complete_load(keys, ctx)
    manager.on_request_finished(ctx)


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


def test_chunks_take_the_storing_requests_class_and_hits_the_loaders(tmp_path, in_vllm):
    """Each release names the storing request its own way (see kvprof.vllm.offload): whichever it is,
    a stored chunk's last access has that request's class and is no hit; a later load is a hit."""
    if not in_vllm:
        return
    from vllm.v1.kv_offload.base import ReqContext

    manager = _manager("kvprof", _spec(tmp_path))
    cache_policy = manager._policy
    last = {}  # block -> (class index, hit) of its last access
    access = cache_policy.policy.access

    def spy(block, now, workload=0, depth=0, *, hit=False, **kwargs):
        last[block] = (workload, hit)
        return access(block, now, workload, depth, hit=hit, **kwargs)

    cache_policy.policy.access = spy
    hot, _, out = _scenario(manager)
    spec = cache_policy.spec
    hot_class, cold_class = spec.class_index({"workload": "hot_1"}), spec.class_index({"workload": "cold_1"})
    assert {last[cache_policy._id[k]] for k in hot} == {(hot_class, False)}
    assert {last[cache_policy._id[k]] for k in out.keys_to_store} == {(cold_class, False)}
    _load(manager, hot, ReqContext("later", kv_transfer_params={"workload": "cold_1"}))
    assert {last[cache_policy._id[k]] for k in hot} == {(cold_class, True)}


def test_chunk_ids_are_reused_so_the_policy_stays_the_size_of_the_tier(tmp_path, in_vllm):
    """A long-running server stores ever new chunks: ids of chunks gone are given to new ones."""
    if not in_vllm:
        return
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    manager = _manager("kvprof", _spec(tmp_path))
    cache_policy = manager._policy
    for batch in range(50):
        keys = [make_offload_key(bytes([batch, i]) * 8, 0) for i in range(4)]
        out = _store(manager, keys, ReqContext(f"req-{batch}", kv_transfer_params={"workload": "cold_1"}))
        assert len(out.keys_to_store) == 4
        assert len(cache_policy.chunks) == min(8, 4 * (batch + 1))
    assert cache_policy._next_id <= 8 + 4  # not 200
    assert sorted(cache_policy._id.values()) == sorted(cache_policy._key) and len(cache_policy._id) == 8


def test_kvprof_cache_policy_refuses_without_spec(monkeypatch, in_vllm):
    if not in_vllm:
        return
    from kvprof.vllm.spec import KvPolicyConfigError

    monkeypatch.delenv("KVPROF_KV_POLICY_CONFIG", raising=False)
    with pytest.raises(KvPolicyConfigError, match="needs a policy"):
        _manager("kvprof", None)


def test_a_reload_reorders_the_tier_and_keeps_its_chunks(tmp_path, in_vllm):
    """A reloaded hp file reaches the CPU tier (kvprof.vllm.offload.replace_policies, called by the
    live loop with the GPU pool's swap): the chunks stay, each with its class tags, hits and age, and
    the new file's scores decide the next victims."""
    if not in_vllm:
        return
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm_support import HP_TEST

    from kvprof.vllm import offload
    from kvprof.vllm.spec import load_spec_hp

    spec = _spec(tmp_path)
    manager = _manager("kvprof", spec)
    tier = manager._policy
    hot, cold, _ = _scenario(manager)  # the tier holds hot's and the new request's chunks
    _load(manager, hot, ReqContext("again", kv_transfer_params={"type": "hot", "turn": 1}))
    held = dict(tier.chunks)
    assert all(tier._history[k][2] == 1 for k in hot)

    swapped = dict(HP_TEST, classes={"hot_1": HP_TEST["classes"]["cold_1"], "cold_1": HP_TEST["classes"]["hot_1"]})
    (tmp_path / "hp.json").write_text(json.dumps(swapped))
    old_policy = tier.policy
    offload.replace_policies(spec.with_hp(*load_spec_hp(str(tmp_path / "hp.json"))))
    assert tier.policy is not old_policy and tier.chunks == held and len(tier.policy) == len(held)
    assert tier.spec.hp.table()[1][0] != spec.hp.table()[1][0]  # the new file's scores serve

    newer = [make_offload_key(bytes([4, i]) * 8, 0) for i in range(4)]
    out = _store(manager, newer, ReqContext("newest", kv_transfer_params={"workload": "cold_1"}))
    assert sorted(out.evicted_keys) == sorted(hot)  # hot_1 now scores as never reused: its chunks go first
