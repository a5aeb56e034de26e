"""The hint layer over the compiled twin (what vLLM's pool runs) decides as the simulator's
:class:`~kvprof.policy.hinted.HintedPolicy` over the reference policy, on the same operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.twin import CompiledTwin
from kvprof.models.hints import Hint
from kvprof.policy.hinted import HintedPolicy, HintLayer
from tests.test_hinted_policy import hints
from tests.test_policies import build

N_BLOCKS = 16
N_CLASSES = 4

operations = st.lists(st.one_of(
    st.tuples(st.just("request"), st.lists(st.integers(0, N_BLOCKS - 1), min_size=1, max_size=5, unique=True),
              st.integers(0, N_CLASSES - 1), hints),
    st.tuples(st.just("hit"), st.integers(0, N_BLOCKS - 1), st.integers(0, N_CLASSES - 1)),
    st.tuples(st.just("evict"), st.integers(1, 4)),
    st.tuples(st.just("wait"), st.sampled_from([0.25, 1.0, 4.0])),
), max_size=60)


class Side:
    """One side of the comparison: a policy driven as vLLM's pool drives its free queue."""

    def __init__(self, hinted, base):
        self.hinted, self.base = hinted, base
        self.victims: list[int] = []


class Pair:
    """The reference side (``HintedPolicy`` over the reference policy, told hints at ``finish``) and
    the pool's side (``HintLayer`` over the compiled twin, hits taken with the twin's deferred
    ``take``, hints given at the free), with the blocks held, evictable or empty (never cached)."""

    def __init__(self, name: str, budget: int | None):
        reference = HintedPolicy(build(name), budget_blocks=budget)
        twin = CompiledTwin(build(name), n_blocks=N_BLOCKS)
        self.reference = Side(reference, reference.base)
        self.pool = Side(HintLayer(twin, budget_blocks=budget, take=twin.take), twin)
        self.now = 0.0
        self.held: set[int] = set()
        self.evictable: set[int] = set()
        self.contents = dict.fromkeys(range(N_BLOCKS), 0)
        self.requests = 0

    def access(self, block: int, cls: int, depth: int, hit: bool) -> None:
        if not hit:
            self.contents[block] += 1  # new content in the slot
        content = (block, self.contents[block])
        self.reference.hinted.access(block, self.now, cls, depth, hit=hit, content=content)
        self.pool.base.access(block, self.now, cls, depth, hit=hit, content=content)
        if not hit and self.pool.hinted.tracks_sessions:  # as the pool's cache_full_blocks tells it
            self.pool.hinted.recached(block)

    def take(self, block: int, cls: int) -> None:
        self.reference.hinted.remove(block)
        self.pool.hinted.take(block)
        self.access(block, cls, 0, hit=True)
        self.evictable.discard(block)
        self.held.add(block)

    def step(self, op) -> None:
        kind, *args = op
        if kind == "request":
            blocks, cls, hint = args
            for depth, block in enumerate(blocks):
                if block in self.evictable:
                    self.take(block, cls)
                elif block not in self.held:
                    self.access(block, cls, depth, hit=False)
                    self.held.add(block)
            self.requests += 1
            self.reference.hinted.finish(self.requests, self.now, hint=hint, held=blocks)
            self.pool.base.finish(self.requests, self.now)
            session = None if hint is None else hint.session
            if session is not None or self.pool.hinted.tracks_sessions:  # as the pool's finish_request tells it
                self.pool.hinted.note_held(blocks, session, self.now)
            tail_first = blocks[::-1]
            self.reference.hinted.free(tail_first, self.now)
            self.pool.hinted.free_hinted(tail_first, self.now, hint)
            self.held -= set(blocks)
            self.evictable |= set(blocks)
        elif kind == "hit" and args[0] in self.evictable:
            self.take(*args)
            self.reference.hinted.free([args[0]], self.now)  # freed again, without a hint
            self.pool.hinted.free_hinted([args[0]], self.now, None)
            self.held.discard(args[0])
            self.evictable.add(args[0])
        elif kind == "evict" and self.evictable:
            n = min(args[0], len(self.evictable))
            for side in (self.reference, self.pool):
                side.victims.extend(side.hinted.evict_n(n, self.now))
            self.evictable -= set(self.reference.victims[-n:])
        elif kind == "wait":
            self.now += args[0]


@pytest.mark.parametrize("name", ["lru", "sieve", "s3fifo", "arc", "lfu", "wa", "wa+shadows"])
@settings(max_examples=40, deadline=None)
@given(ops=operations, budget=st.sampled_from([None, 0, 1, 3]))
def test_the_pools_hint_layer_decides_as_the_simulators(name, ops, budget):
    pair = Pair(name, budget)
    reference, pool = pair.reference.hinted, pair.pool.hinted
    for op in ops:
        pair.step(op)
        assert pair.pool.victims == pair.reference.victims
        assert len(pool) == len(reference) == len(pair.evictable)
        assert (pool.n_released, pool.n_retained, pool.active, pool._holders) == (
            reference.n_released, reference.n_retained, reference.active, reference._holders)
    assert pool.counters == reference.counters
    for record in ("released_record", "evicted_record"):  # the releases judged alike
        pool_side, reference_side = getattr(pool, record), getattr(reference, record)
        assert (pool_side.returned, pool_side.stayed_away) == (reference_side.returned, reference_side.stayed_away)
    assert pool.order(pair.now + 1) == reference.order(pair.now + 1)
    assert pool.evict_n(len(pool), pair.now + 1) == reference.evict_n(len(reference), pair.now + 1)


def test_an_idle_layer_is_the_base():
    """Without hints nothing enters the layer: it stays inactive and every victim is the twin's."""
    twin = CompiledTwin(build("lru"), n_blocks=8)
    layer = HintLayer(twin, budget_blocks=2, take=twin.take)
    for block in range(4):
        twin.access(block, float(block), 0, 0, content=block)
    layer.free_hinted([3, 2, 1, 0], 5.0, None)
    layer.take(2)
    assert not layer.active and len(twin) == 3
    assert layer.evict_n(3, 6.0) == [3, 1, 0]


@pytest.mark.parametrize("args, field", [
    ({"retain_s": "soon"}, "retain_s"), ({"retain_s": -1}, "retain_s"), ({"retain_s": float("inf")}, "retain_s"),
    ({"retain_s": 5, "retain_priority": 100}, "retain_priority"), ({"release": 2}, "release"),
    ({"release": "true"}, "release"), ({"retain_s": 5, "hint_tag": 1.5}, "hint_tag"),
    ({"retain_s": 5, "release": 1}, "release"),
])
def test_a_requests_malformed_hint_is_refused_naming_the_field(args, field):
    from kvprof.models.hints import hint_of_args

    with pytest.raises(ValueError, match=f"'{field}'"):
        hint_of_args(args)


def test_a_requests_hint_from_vllm_xargs():
    """vllm_xargs makes a JSON true 1: release takes 1 and 0 as well as booleans; no hint field, or
    neither a retention nor a release, is no hint."""
    from kvprof.models.hints import hint_of_args

    assert hint_of_args({"retain_s": 69, "retain_priority": 60, "hint_tag": 3, "workload": "x"}) == Hint(69.0, 60, False, 3)
    assert hint_of_args({"release": 1}) == hint_of_args({"release": True}) == Hint(release=True)
    assert hint_of_args({"release": 0, "retain_s": 0}) is None
    assert hint_of_args({"workload": "text_2"}) is None and hint_of_args(None) is None


@pytest.mark.parametrize("value", [0, "0", 1.5, "x", -0.1, True, "nan"])
def test_the_served_budget_is_a_share_refused_naming_the_flag(value):
    from kvprof.vllm.spec import KvPolicyConfigError, PolicySpec

    with pytest.raises(KvPolicyConfigError, match="--kv-hint-max-fraction"):
        PolicySpec.from_additional_config({"kv_policy": {"policy": "lru", "hint_max_fraction": value}})


@pytest.mark.parametrize("config", [{"record": "rec"}, {"policy": "lru", "mode": "shadow"}])
def test_a_budget_where_no_policy_evicts_is_refused(config):
    from kvprof.vllm.spec import KvPolicyConfigError, PolicySpec

    with pytest.raises(KvPolicyConfigError, match="--kv-hint-max-fraction.*enforce"):
        PolicySpec.from_additional_config({"kv_policy": {**config, "hint_max_fraction": 0.5}})


def test_the_served_budget_counts_blocks_as_compare_does():
    from kvprof.vllm.spec import PolicySpec

    assert PolicySpec.from_additional_config({"kv_policy": {"policy": "lru"}}).hint_budget(1000) is None
    spec = PolicySpec.from_additional_config({"kv_policy": {"policy": "lru", "hint_max_fraction": "0.25"}})
    assert spec.hint_budget(1001) == 250


def test_a_recorded_timing_replay_tells_each_request_its_hint():
    """On a recording's timing (as ``kvprof compare`` replays a vLLM recording) the hinted policy hears each
    request's hint: request 0 retains its blocks, so when request 2 needs room request 1's go first and
    request 3 finds all of request 0's; LRU evicts request 0's oldest ones instead; without hints it is LRU."""
    import dataclasses

    import numpy as np

    from kvprof.models.hints import HintColumns
    from kvprof.sim.config import SimConfig
    from kvprof.sim.engine import simulate
    from kvprof.sim.hints import make_hinted_policy, with_hints
    from kvprof.sim.workload import prepare_workload
    from tests.helpers import make_trace

    rows = [(0.0, "a", 1, [1, 2, 3, 9]), (1.0, "a", 1, [10, 11]), (2.0, "a", 1, [4, 5, 6, 8]),
            (3.0, "a", 1, [1, 2, 3, 7])]
    trace = make_trace(rows, block_size=16)
    trace = dataclasses.replace(trace, output_length=np.ones(4, dtype=np.int64), extra={
        "scheduled": np.array([0.0, 1.0, 2.0, 3.0], dtype=object), "finished": np.array([0.5, 1.5, 2.5, 3.5])})
    hints = HintColumns.empty(4)
    hints.retain_s[0] = 60.0
    hinted = with_hints(trace, hints)

    def hits(trace, policy):
        workload = prepare_workload(trace, engine_block_size=16)
        config = SimConfig(engine_block_size=16, timing="recorded")
        return simulate(workload, make_hinted_policy(policy, None, 8), 8, config).hits_device

    assert hits(hinted, "lru+hints") == 3  # the lookup's cap: (64 - 1) // 16 blocks
    assert hits(hinted, "lru") == hits(with_hints(trace, None), "lru+hints") == 2


def test_an_argument_that_looks_like_a_misspelt_hint_field_is_named_and_other_tags_are_not():
    from kvprof.models.hints import HINT_FIELDS, lookalike_field

    assert {name: lookalike_field(name) for name in ("retian_s", "Retain_S", "retain", "Release", "hint_tags")} == {
        "retian_s": "retain_s", "Retain_S": "retain_s", "retain": "retain_s", "Release": "release",
        "hint_tags": "hint_tag"}
    assert "retain_s" in lookalike_field("hint_foo")
    tags = ("session", "type", "turn", "workload", "tenant", "stop", "release_version", "priority", "kvprof_probe")
    assert [lookalike_field(name) for name in HINT_FIELDS + tags] == [None] * (len(HINT_FIELDS) + len(tags))
