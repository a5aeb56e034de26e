"""Client hints in the CPU offload tier: kvprof's CachePolicy inside vLLM's real CPU offloading manager.

Requests carry a hint in ``kv_transfer_params`` (``retain_s``, ``retain_priority``, ``release``,
``hint_tag``); the tier's :class:`~kvprof.policy.hinted.HintLayer` puts the request's chunks where the
simulator's :class:`~kvprof.policy.hinted.HintedPolicy` puts them. The differential tests drive the
manager (as tests/vllm/test_offload.py does, on a clock the test moves) and, beside it, a model fed
the operations the module docstring of :mod:`kvprof.vllm.offload` maps vLLM's calls to: a
``HintedPolicy`` over the same reference policy; the victims of every store and the whole eviction
order after every step must agree.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random

import pytest

from test_offload import needs_request_scoped_access

# A hint applies at the request's finish, which vLLM reports to the tier from 0.31 on.
pytestmark = [pytest.mark.vllm, needs_request_scoped_access]

CAPACITY = 12


def _spec(tmp_path, hint_max_fraction=None):
    from vllm_support import HP_TEST

    from kvprof.vllm.spec import PolicySpec

    path = tmp_path / "hp.json"
    path.write_text(json.dumps(HP_TEST))
    config = {"config": str(path)}
    if hint_max_fraction is not None:
        config["hint_max_fraction"] = hint_max_fraction
    return PolicySpec.from_additional_config({"kv_policy": config})


def _key(chain: int, i: int):
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(bytes([chain % 256, chain // 256, i]) * 8, 0)


class Mirror:
    """vLLM's CPU offloading manager with kvprof's tier, and beside it ``model`` told the policy calls
    that the tier's mapping makes of the same requests, on one clock the test moves.

    Invariant: after each step the tier's chunks are the model's blocks (by the tier's ids) and the
    layer's eviction order is the model's.
    """

    def __init__(self, spec, model_of, capacity: int = CAPACITY):
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        from kvprof.vllm import offload

        offload.ACTIVE_SPEC = spec
        self.manager = CPUOffloadingManager(num_chunks=capacity, cache_policy="KvprofCachePolicy",
                                            cache_policy_module_path="kvprof.vllm.offload")
        self.tier = self.manager._policy
        self.now = 1000.0
        self.tier._clock = lambda: self.now
        self.spec = spec
        self.model = model_of(spec.reference_policy(capacity), spec.hint_budget(capacity))
        self.capacity = capacity
        self.chains: dict[int, list] = {}
        self.n_requests = 0

    def _context(self, keys, params):
        from vllm.v1.kv_offload.base import ReqContext

        self.n_requests += 1
        ctx = ReqContext(f"req-{self.n_requests}", kv_transfer_params=params)
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * 32)
        return ctx

    def _class_of(self, params) -> int:
        tagged = isinstance(params, dict) and any(k in params for k in ("workload", "type", "turn"))
        return self.spec.class_index(params) if tagged else self.spec.default_index

    def _finish(self, hint):
        from kvprof.policy.hinted import HintedPolicy

        if isinstance(self.model, HintedPolicy):
            self.model.finish(None, self.now, hint=hint)

    def _held(self, ids, hint):
        """The tier's finish tells its layer who held the request's chunks (once any session was named)."""
        from kvprof.policy.hinted import HintedPolicy

        session = None if hint is None else hint.session
        if isinstance(self.model, HintedPolicy) and self.model.tracks(session):
            self.model.note_held(ids, session, self.now)

    def store(self, chain: int, length: int, params, hint, late: bool = False) -> tuple[list, list, list]:
        """A request stores a new chain (``late``: its stores complete after it finishes): the model's
        victims, the manager's and the chain's keys."""
        keys = [_key(chain, i) for i in range(length)]
        ctx = self._context(keys, params)
        need = max(0, length - (self.capacity - len(self.tier.chunks)))
        predicted = [self.tier._key[block] for block in (self.model.evict_n(need, self.now) if need else [])]
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and out.keys_to_store == keys
        ids = [self.tier._id[key] for key in keys]
        for i, (key, block) in enumerate(zip(keys, ids)):
            self.model.access(block, self.now, self._class_of(params), i, hit=False, content=key)
        if not late:
            self.manager.complete_store(keys, ctx)
            for block in ids:
                self.model.free([block], self.now)
        self.manager.on_request_finished(ctx)
        self._held(ids, hint)
        hint = _placing(hint)
        if not late and hint is not None:  # its stored chunks, evictable, freed again with its hint
            for block in ids:
                self.model.remove(block)
            self._finish(hint)
            self.model.free(ids[::-1], self.now)
        if late:
            self.now += 0.5
            self.manager.complete_store(keys, ctx)
            for block in ids:  # each takes the hint when its store completes
                self._finish(hint)
                self.model.free([block], self.now)
        self.chains[chain] = keys
        return predicted, list(out.evicted_keys), keys

    def load(self, keys: list, params, hint) -> None:
        """A request loads resident ``keys`` (a chain's head) and finishes."""
        from vllm.v1.kv_offload.base import LookupResult

        ctx = self._context(keys, params)
        assert all(self.manager.lookup(key, ctx) == LookupResult.HIT for key in keys)
        ids = [self.tier._id[key] for key in keys]
        self.manager.prepare_load(keys, ctx)
        for block in ids:
            self.model.remove(block)  # a hit
        self.manager.complete_load(keys, ctx)
        for block in ids:
            self.model.free([block], self.now)
        self.manager.on_request_finished(ctx)
        self._held(ids, hint)
        hint = _placing(hint)
        for i, block in enumerate(ids):  # the request's access, head to tail, when it finishes
            self.model.remove(block)
            self.model.access(block, self.now, self._class_of(params), i, hit=True, content=keys[i])
        self._finish(hint)
        self.model.free(ids[::-1], self.now)

    def resident_head(self, chain: int) -> list:
        keys = []
        for key in self.chains[chain]:
            if key not in self.tier.chunks:
                break
            keys.append(key)
        return keys

    def check(self) -> None:
        tier = self.tier
        assert sorted(tier._id.values()) == sorted(tier._key) and set(tier._id) == set(tier.chunks)
        assert len(tier.hints) == len(self.model) == len(tier.chunks)
        assert tier.hints.order(self.now) == self.model.order(self.now)


def _placing(hint):
    """The hint that places the request's chunks (a session alone places nothing)."""
    return hint if hint is not None and (hint.retains or hint.release) else None


def _random_request(rng: random.Random, sessions: int = 0):
    """A request's ``kv_transfer_params`` and the hint they carry: a class or none, and a release, a
    retention (of one of two tags) or no hint; now and then a malformed hint (ignored: no hint). With
    ``sessions``, most requests name one of that many (a session alone is a hint that places nothing)."""
    from kvprof.models.hints import Hint

    params = {}
    session = rng.randrange(sessions) if sessions and rng.random() < 0.8 else None
    tag = rng.choice(["hot_1", "cold_1", None])
    if tag is not None:
        params["workload"] = tag
    kind = rng.random()
    hint = None
    if kind < 0.25:
        params["release"] = True
        hint = Hint(release=True)
    elif kind < 0.6:
        retain_s, priority, hint_tag = rng.choice([2.0, 5.0, 30.0]), rng.randrange(100), rng.randrange(2)
        params.update(retain_s=retain_s, retain_priority=priority, hint_tag=hint_tag)
        hint = Hint(retain_s, priority, False, hint_tag)
    elif kind < 0.65:
        params.update(retain_s=5.0, retain_priority=500)  # malformed: out of range
    if session is not None:
        if kind < 0.65 and hint is None:  # the malformed hint is ignored, its session too
            return params, None
        params["hint_session"] = session
        hint = Hint(session=session) if hint is None else dataclasses.replace(hint, session=session)
    return (params or None), hint


def _run(mirror: Mirror, rng: random.Random, steps: int, hinted: bool = True, sessions: int = 0) -> int:
    """``steps`` random stores and loads through both; the number of victims compared."""
    compared = 0
    for step in range(steps):
        mirror.now += rng.choice([0.0, 0.5, 1.0, 3.0])
        params, hint = _random_request(rng, sessions) if hinted else ({"workload": rng.choice(["hot_1", "cold_1"])}, None)
        heads = [head for chain in mirror.chains if (head := mirror.resident_head(chain))]
        if heads and rng.random() < 0.4:
            mirror.load(rng.choice(heads), params, hint)
        else:
            late = hinted and rng.random() < 0.2
            predicted, evicted, _ = mirror.store(step, rng.randint(1, 4), params, hint, late=late)
            assert evicted == predicted, f"step {step}"
            compared += len(evicted)
        mirror.check()
        assert hinted or not mirror.tier.hints.active
    return compared


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fraction", [None, 0.25])
def test_hints_order_the_tier_as_the_hinted_policy_over_the_same_reference(tmp_path, in_vllm, seed, fraction, caplog):
    """Random requests with release and retain hints (and none, and malformed ones): every store's
    victims and the order after every step are the simulator's ``HintedPolicy``'s over the same
    reference policy, budget included; the lapses, the budget's lapses and the released victims
    are counted alike."""
    if not in_vllm:
        return
    from kvprof.policy.hinted import HintedPolicy

    mirror = Mirror(_spec(tmp_path, fraction), HintedPolicy)
    with caplog.at_level(logging.WARNING, logger="vllm.kvprof"):
        compared = _run(mirror, random.Random(seed), 150)
    assert compared > 50  # the tier filled and evicted many times
    tier, model = mirror.tier.hints.counters, mirror.model.counters
    for field in ("lapsed", "over_budget", "released_evicted", "beyond_horizon"):
        assert getattr(tier, field) == getattr(model, field), field
    assert tier.released_evicted > 0 and tier.lapsed > 0 and tier.retained_hits > 0
    assert (tier.over_budget > 0) == (fraction is not None)
    # /metrics reads every CPU tier of the process, labelled tier="cpu", beside the GPU pool's
    from kvprof.vllm.metrics import Metrics, note_hints, offload_hint_layers

    assert any(layer is mirror.tier.hints for layer in offload_hint_layers())
    metrics = Metrics()
    note_hints(metrics, [mirror.tier.hints], "cpu")
    assert metrics.get("kvprof_hint_blocks_total", outcome="lapsed", tier="cpu") == model.lapsed
    assert metrics.get("kvprof_hinted_blocks", pool="released", tier="cpu") == mirror.model.n_released
    malformed = [r for r in caplog.records if "retain_priority" in r.getMessage()]
    assert malformed and all("kv_transfer_params" in r.getMessage() for r in malformed)


@pytest.mark.parametrize("seed", range(3))
def test_sessions_are_judged_in_the_tier_as_in_the_hinted_policy(tmp_path, in_vllm, seed):
    """Random requests naming one of a few sessions: the tier's victims and order are the simulator's,
    and its releases and the policy's victims are judged alike (the same deadlines: the horizon read
    as the simulator reads it, with the victims gone), so the same releases are declined."""
    if not in_vllm:
        return
    from kvprof.policy.hinted import HintedPolicy

    mirror = Mirror(_spec(tmp_path), HintedPolicy)
    compared = _run(mirror, random.Random(seed), 200, sessions=4)
    assert compared > 50
    tier, model = mirror.tier.hints, mirror.model
    assert tier.tracks_sessions and model.tracks_sessions
    for record in ("released_record", "evicted_record"):
        ours, theirs = getattr(tier, record), getattr(model, record)
        assert (ours.returned, ours.stayed_away, ours._deadline) == (theirs.returned, theirs.stayed_away, theirs._deadline)
    assert tier.evicted_record.returned + tier.evicted_record.stayed_away > 0
    # (hits are not compared: the model takes a chunk back as a hit where the tier re-orders it)
    for field in ("lapsed", "over_budget", "released_evicted", "beyond_horizon", "release_declined"):
        assert getattr(tier.counters, field) == getattr(model.counters, field), field


def test_unhinted_traffic_evicts_as_the_plain_policy(tmp_path, in_vllm):
    """Requests without hints: the layer stays empty and the victims are the reference policy's,
    as without hints (the same operations, no ``HintedPolicy``)."""
    if not in_vllm:
        return
    mirror = Mirror(_spec(tmp_path, 0.25), lambda reference, budget: reference)
    assert _run(mirror, random.Random(7), 150, hinted=False) > 50
    assert mirror.tier.hints.counters == type(mirror.tier.hints.counters)()


def test_a_client_retaining_everything_holds_at_most_its_budget(tmp_path, in_vllm):
    """One tenant retains every chunk it stores for an hour; with ``hint_max_fraction`` 0.25 of 12
    chunks it holds at most 3 retained, its oldest retention lapsing past that, and another tenant's
    chunks, stored later and unhinted, are not pushed out by its retentions: without the budget they are.
    A second after the first evictions the tier's horizon is a few seconds, and the hour-long retentions
    lapse as beyond it."""
    if not in_vllm:
        return
    from kvprof.models.hints import Hint
    from kvprof.policy.hinted import HintedPolicy

    def run(fraction):
        mirror = Mirror(_spec(tmp_path, fraction), HintedPolicy)
        greedy = {"workload": "cold_1", "retain_s": 3600.0, "hint_tag": 1}
        for chain in range(4):  # 12 chunks, all retained
            mirror.now += 1
            mirror.store(chain, 3, greedy, Hint(3600.0, tag=1))
            assert mirror.tier.hints.retained_of(1) <= (3 if fraction else 12)
        mirror.now += 1
        _, evicted, other = mirror.store(10, 3, {"workload": "cold_1"}, None)
        # in the same instant as the first evictions: no time since them, the horizon still unbounded
        _, evicted_next, _ = mirror.store(11, 3, {"workload": "cold_1"}, None)
        mirror.check()
        return mirror, other, evicted_next

    mirror, other, evicted = run(0.25)
    tier = mirror.tier
    assert tier.hints.retained_of(1) == 3 and tier.hints.counters.over_budget == 9
    assert not set(other) & set(evicted)  # the greedy tenant's unretained chunks went instead
    mirror.now += 1
    mirror.check()  # the order, the model's too, a second later
    assert tier.hints.retained_of(1) == 0 and tier.hints.counters.beyond_horizon == 3
    mirror, other, evicted = run(None)
    assert mirror.tier.hints.retained_of(1) == 9 and set(other) == set(evicted)  # retained last: the other's go


def test_clear_discard_and_reload_keep_every_evictable_chunk_in_one_place(tmp_path, in_vllm):
    """A failed store's chunks, an eviction (atomic: all or nothing, protected chunks skipped), a
    reload of the hp file and a reset leave the layer whole: every evictable chunk in exactly one of
    the released pool, the retained pool and the policy's order; a reload carries the chunks into the
    new policy's order and the counts on."""
    if not in_vllm:
        return
    from vllm.v1.kv_offload.base import ReqContext

    from kvprof.models.hints import Hint
    from kvprof.policy.hinted import HintedPolicy
    from kvprof.vllm import offload
    from kvprof.vllm.spec import load_spec_hp

    spec = _spec(tmp_path, 0.5)
    mirror = Mirror(spec, HintedPolicy)
    tier, manager = mirror.tier, mirror.manager
    mirror.store(0, 3, {"workload": "hot_1", "release": True}, Hint(release=True))
    mirror.store(1, 3, {"workload": "hot_1", "retain_s": 60.0}, Hint(60.0))
    mirror.store(2, 2, None, None)
    mirror.check()
    assert (tier.hints.n_released, tier.hints.n_retained, len(tier.policy)) == (3, 3, 2)

    failed = [_key(3, i) for i in range(2)]
    ctx = ReqContext("failed", kv_transfer_params={"retain_s": 60.0})
    out = manager.prepare_store(failed, ctx)
    manager.on_request_finished(ctx)  # the hint waits for the store to complete
    assert set(tier._pending_hints) == set(failed)
    manager.complete_store(out.keys_to_store, ctx, success=False)
    assert not tier._pending_hints and len(tier.hints) == len(tier.chunks) == 8

    order = [tier._key[block] for block in tier.hints.order(mirror.now)]
    released = mirror.chains[0][::-1]  # freed tail first, evicted in the order freed
    assert order[:3] == released and set(order[3:5]) == set(mirror.chains[2])
    assert set(order[5:]) == set(mirror.chains[1])
    def state():
        return tier.hints.order(mirror.now), dict(tier.chunks), (tier.hints.n_released, tier.hints.n_retained)

    before = state()
    assert tier.evict(8, protected={released[1]}) is None and tier.evict(9, set()) is None  # atomic
    assert state() == before
    evicted = tier.evict(4, protected={released[1]})
    assert [key for key, _ in evicted] == [released[0], released[2], *order[3:5]]
    assert tier.hints.counters.released_evicted == 2 and len(tier.hints) == len(tier.chunks) == 4

    offload.replace_policies(spec.with_hp(*load_spec_hp(str(tmp_path / "hp.json"))))
    assert not tier.hints.active and len(tier.policy) == len(tier.chunks) == 4
    assert tier.hints.base is tier.policy and tier.hints.counters.released_evicted == 2

    mirror.store(4, 2, {"release": True}, Hint(release=True))
    assert tier.hints.n_released == 2
    manager.reset_cache()
    assert not tier.hints.active and len(tier.hints) == len(tier.policy) == 0 and not tier.chunks


def test_shared_chunks_take_the_last_finishing_requests_hint_and_a_load_counts_once(tmp_path, in_vllm):
    """Chunks one request stored and another reused: the hint of the request that finishes last
    places them (as the simulator's last free of a shared block), and a release does not cancel a
    live retention. A load of a retained chunk is one honoured retention (the load), not two (its
    finish orders the chunk again, no second hit)."""
    if not in_vllm:
        return
    from vllm.v1.kv_offload.base import ReqContext

    mirror = Mirror(_spec(tmp_path), lambda reference, budget: reference)
    tier, manager = mirror.tier, mirror.manager
    keys = [_key(0, i) for i in range(3)]

    def load_and_finish(ctx):
        manager.prepare_load(keys, ctx)
        manager.complete_load(keys, ctx)
        manager.on_request_finished(ctx)

    storer = ReqContext("storer", kv_transfer_params={"retain_s": 60.0})
    manager.complete_store(manager.prepare_store(keys, storer).keys_to_store, storer)
    load_and_finish(ReqContext("reuser", kv_transfer_params={"release": 1}))
    assert (tier.hints.n_retained, tier.hints.n_released) == (0, 3)
    manager.on_request_finished(storer)
    assert (tier.hints.n_retained, tier.hints.n_released) == (3, 0)
    load_and_finish(ReqContext("done", kv_transfer_params={"release": True}))
    assert (tier.hints.n_retained, tier.hints.n_released) == (3, 0)
    assert tier.hints.counters.retained_hits == 3
    load_and_finish(ReqContext("later"))
    counters = tier.hints.counters
    assert tier.hints.n_retained == 3 and (counters.retained_hits, counters.hinted_hits) == (6, 6)


def test_a_release_naming_a_session_demotes_only_that_sessions_own_chunks(tmp_path, in_vllm):
    """Sessions A and B read one document (two chunks), each with a chunk of its own after it; A's
    release then demotes its own chunk only, the document stays in the policy's order. A's return
    judges its release, C's return the policy's eviction of C's own chunks."""
    if not in_vllm:
        return
    from vllm.v1.kv_offload.base import ReqContext

    mirror = Mirror(_spec(tmp_path), lambda reference, budget: reference)
    tier, manager = mirror.tier, mirror.manager
    document, own = [_key(0, 0), _key(0, 1)], {"A": _key(1, 2), "B": _key(2, 2)}

    def request(name, params, loads, stores):
        ctx = ReqContext(name, kv_transfer_params=params)
        if loads:
            manager.prepare_load(loads, ctx)
            manager.complete_load(loads, ctx)
        if stores:
            manager.complete_store(manager.prepare_store(stores, ctx).keys_to_store, ctx)
        manager.on_request_finished(ctx)

    request("first", {"hint_session": "warm-up"}, [], [_key(3, 0)])  # sessions are tracked from its finish
    request("a1", {"hint_session": "A"}, [], [*document, own["A"]])
    request("b1", {"hint_session": "B"}, document, [own["B"]])
    assert tier.hints.n_released == 0
    request("a2", {"hint_session": "A", "release": True}, [*document, own["A"]], [])
    assert [tier._key[block] for block in tier.hints._released] == [own["A"]]
    assert all(tier._id[key] in tier.policy for key in document)
    request("b2", {"release": True}, [*document, own["B"]], [])  # naming no session: every chunk
    assert {tier._key[block] for block in tier.hints._released} == {own["A"], own["B"], *document}
    # the releases and the policy's victims are judged by their sessions' returns, as in the simulator
    request("a3", {"hint_session": "A"}, [own["A"]], [])  # A came back after its release
    assert (tier.hints.released_record.returned, tier.hints.released_record.stayed_away) == (1, 0)
    request("c1", {"hint_session": "C"}, [], [_key(4, i) for i in range(7)])  # the tier is full
    # six victims: the three chunks still released, then the policy's first three: the warm-up chunk
    # (cached before sessions were tracked: shared) and two of C's own, victims of a session it chose
    victims = [tier._key[block] for block in tier.hints.order(mirror.now, 6)]
    assert victims[3:] == [_key(3, 0), _key(4, 0), _key(4, 1)]
    request("d1", {"hint_session": "D"}, [], [_key(5, i) for i in range(6)])
    assert not any(key in tier.chunks for key in victims)
    request("c2", {"hint_session": "C"}, [_key(4, 2)], [])
    assert (tier.hints.evicted_record.returned, tier.hints.evicted_record.stayed_away) == (1, 0)
    from kvprof.vllm.metrics import Metrics, note_hints

    metrics = Metrics()
    note_hints(metrics, [tier.hints], "cpu")  # on /metrics as the tier keeps it
    assert [metrics.get("kvprof_hint_sessions_judged_total", chosen=chosen, outcome="returned", tier="cpu")
            for chosen in ("released", "evicted")] == [1, 1]
