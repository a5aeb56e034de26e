"""wa's safety net: shadow caches, the followed S3-FIFO, and a deliberately wrong profile."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.models.hp import ReuseRow
from kvprof.policy import LRUPolicy, make_policy
from kvprof.core.wa import mixed as compiled_mixed
from kvprof.policy.prefix_cache import NO_BLOCK
from kvprof.policy.shadow import ChainSample, ShadowCache, chain_memory, mixed
from kvprof.policy.wa import DEFAULT_ORDERS, SHADOW_SAMPLE, SHADOW_SAMPLE_MIN_BLOCKS, default_sample
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload
from tests.test_policies import OPS, WA_ORDERS, PolicyPool, Scenario, wa_policy


def test_a_shadow_counts_the_hits_a_prefix_cache_would_find():
    shadow = ShadowCache(LRUPolicy(), capacity=4)
    assert shadow.admit("r1", "abc", 0.0, 0, 3, 4) == 0  # a request computes a, b, c and a partial tail
    assert shadow.held["r1"] == [0, 1, 2, 3] and len(shadow.block_slot) == 3
    shadow.finish("r1", 1.0)  # freed tail first; the tail, never cached, goes back empty
    assert shadow.admit("r2", "axc", 2.0, 0, 3, 3) == 1, "c sits behind a miss: a prefix cache would not find it"
    assert set(shadow.block_slot) == {"a", "b", "c", "x"}  # the copy of c behind the miss stays uncached
    shadow.finish("r2", 3.0)
    assert shadow.admit("r3", "ab", 4.0, 0, 1, 3) == 1, "only n_lookup blocks may hit (vLLM recomputes the last token)"
    assert shadow.hits == 2


def test_a_shadow_caches_the_blocks_a_request_filled_when_it_finishes():
    shadow = ShadowCache(LRUPolicy(), capacity=8)
    shadow.admit("r1", "ab", 0.0, 0, 2, 3)  # a, b and a partial tail the output fills
    shadow.finish("r1", 1.0, "abcd", 5)  # c filled the tail in place, d and a partial block came after
    assert set(shadow.block_slot) == {"a", "b", "c", "d"} and shadow.block_slot["c"] == shadow.block_slot["b"] + 1
    shadow.check()
    assert shadow.admit("r2", "abcde", 2.0, 0, 4, 5) == 4, "the next turn finds the previous one's output"
    shadow.finish("r2", 3.0)
    shadow.check()


def test_a_hole_in_a_finished_chain_is_cached_nowhere():
    """A replay on recorded timing finishes a request with NO_BLOCK at its partial prompt block's
    depth (kvprof.sim.timed.RecordedTiming): that slot stays without content, as in the real tier."""
    shadow = ShadowCache(LRUPolicy(), capacity=8)
    shadow.admit("r1", "ab", 0.0, 0, 2, 3)  # a, b and a partial tail
    shadow.finish("r1", 1.0, ["a", "b", NO_BLOCK, "c"], 4)
    assert set(shadow.block_slot) == {"a", "b", "c"} and shadow.block_slot["c"] == shadow.block_slot["b"] + 2
    shadow.check()


def test_a_shadow_admits_what_the_real_cache_admitted_and_shrinks_back():
    shadow = ShadowCache(LRUPolicy(), capacity=4)
    shadow.admit(0, [0, 1, 2, 3], 0.0, 0, 4, 4)
    shadow.admit(1, [9], 1.0, 0, 1, 2)  # every slot pinned: the shadow grows past its size
    assert shadow.n_live == 6
    shadow.check()
    shadow.finish(0, 2.0)
    shadow.finish(1, 2.0)
    assert shadow.n_live == 4 and set(shadow.block_slot) == {0, 1, 9}  # back to its size, the chain's tail dropped
    shadow.check()
    assert shadow.admit(2, [9], 3.0, 0, 1, 1) == 1


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.lists(st.integers(0, 12), max_size=6)), max_size=60),
       capacity=st.integers(0, 10))
def test_a_shadow_keeps_the_prefix_cache_invariant(ops, capacity):
    """Whatever requests come, every slot is in one place and hits never exceed the lookups."""
    shadow = ShadowCache(LRUPolicy(), capacity)
    running, lookups, request = [], 0, 0
    for start, extra, chain in ops:
        if start or not running:
            chain = list(dict.fromkeys(chain))  # a chain names each prefix once
            n_lookup = max(len(chain) - extra % 2, 0)
            shadow.admit(request, chain, float(request), 0, n_lookup, len(chain) + extra % 3)
            running.append((request, chain))
            lookups += n_lookup
            request += 1
        else:  # some finish with output blocks: contents 100 + ... are new to every chain
            done, chain = running.pop(extra % len(running))
            grown = chain + [100 + 10 * done + k for k in range(extra % 3)]
            shadow.finish(done, float(request), grown, len(grown) + extra // 3) if extra % 2 else \
                shadow.finish(done, float(request))
        shadow.check()
        assert shadow.hits <= lookups
    for request, _ in running:
        shadow.finish(request, 1e9)
    assert shadow.n_live == capacity
    shadow.check()


@settings(max_examples=60, deadline=None)
@given(ops=OPS, num_blocks=st.integers(4, 24))
def test_the_followed_s3fifo_holds_exactly_the_evictable_blocks(ops, num_blocks):
    pool = PolicyPool(num_blocks, wa_policy([0.6, 0.4, 0.2, 0.3], [0.5, 0.05, 0.01, 0.02], orders=WA_ORDERS,
                                            safety_net=True))
    scenario = Scenario([pool])
    for op in ops:
        scenario.step(*op)
        followed = pool.policy._followed[0]
        assert sorted(b for b in range(num_blocks) if b in followed) == sorted(pool.evictable())


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory):
    """Six minutes of synthetic bailian-a, fitted on the first three."""
    path = tmp_path_factory.mktemp("short") / "trace.jsonl"
    write_jsonl(path, generate("bailian-a", 0.1, 7))
    trace, _ = read_trace(path)
    hp = fit_trace(trace.time_window(0, 180), max_cells=4)
    return prepare_workload(trace.time_window(180, None), hp, 128), hp


@pytest.mark.parametrize("candidate", DEFAULT_ORDERS)
@pytest.mark.parametrize("capacity", [48, 400])
def test_the_shadow_of_the_candidate_in_force_counts_the_real_hits(short_trace, candidate, capacity):
    """Faithful shadows: fed whole requests, the leader's shadow is the real cache, hit for hit."""
    workload, hp = short_trace
    orders = (candidate, *(name for name in DEFAULT_ORDERS if name != candidate))
    engines = ("compiled", "python") if capacity == 48 else ("compiled",)
    for engine in engines:
        policy = make_policy("wa", hp, capacity, orders=orders, switch_margin=math.inf)
        metrics = simulate(workload, policy, capacity, SimConfig(), engine=engine)
        assert policy.order_name == candidate
        assert policy.shadow_hits()[candidate] == metrics.hits_device > 0


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory):
    """A synthetic bailian-a trace and an hp file fitted on its first 15 minutes, then turned
    upside down: rows that come back look never reused, and their fast components slow."""
    path = tmp_path_factory.mktemp("adversarial") / "trace.jsonl"
    write_jsonl(path, generate("bailian-a", 0.5, 3))
    trace, _ = read_trace(path)
    bad = upside_down(fit_trace(trace.time_window(0, 900), max_cells=0))
    return prepare_workload(trace.time_window(900, None), bad, 128), bad


def upside_down(hp):
    """``hp`` with every row turned upside down: rows that come back look never reused, and their fast
    components slow."""

    def wrong(row: ReuseRow) -> ReuseRow:
        return ReuseRow(1.0 - row.p, row.weights, tuple(rate / 1000 for rate in row.rates), row.source)

    return dataclasses.replace(hp, cells={name: tuple(map(wrong, tiers)) for name, tiers in hp.cells.items()},
                               default_cell=tuple(map(wrong, hp.default_cell)))


@pytest.mark.slow
def test_with_a_wrong_profile_the_safety_net_ends_no_worse_than_lru(adversarial):
    """The issue's adversarial test: the model alone loses to LRU by far; wa does not."""
    workload, bad = adversarial
    capacity = 256
    lru = simulate(workload, LRUPolicy(), capacity, SimConfig()).token_hit_ratio
    model = simulate(workload, make_policy("wa", bad, orders=("model",), safety_net=False), capacity, SimConfig())
    wa_policy_ = make_policy("wa", bad, capacity)
    wa = simulate(workload, wa_policy_, capacity, SimConfig()).token_hit_ratio
    assert model.token_hit_ratio < 0.8 * lru, "the profile is not wrong enough to test anything"
    assert wa >= 0.99 * lru
    assert wa_policy_.order_name != "model"


def test_a_conversation_is_one_chain_and_a_shared_system_prompt_is_not():
    sample = ChainSample(0.5)
    chains = []
    for contents in (["s1", "s2", "a1"],                # conversation a under system prompt s
                     ["s1", "s2", "b1", "b2"],          # b branches off the prompt a continued: a new chain
                     ["s1", "s2", "a1", "a2", "a3"],    # a's next turn continues a1, which no one else did
                     ["s1", "s2", "b1", "b2", "b3"],    # b's next turn
                     ["s1", "s2", "a1"],                # a preempted turn admitted again: nothing new
                     ["s1", "s2", "a1", "c1"],          # c branches off a1, which a's second turn continued
                     [], ["x1"]):                       # no contents, and one never seen: new chains
        before = dict(sample.chain)
        sample.admits(contents, 1000)
        new = [sample.chain[c] for c in contents if c not in before]
        chains.append(new[0] if new else sample.chain[contents[-1]] if contents else sample.n_chains - 1)
    assert chains == [0, 1, 0, 1, 0, 2, 3, 4]


def test_a_sample_remembers_only_the_latest_contents_of_a_few_caches():
    sample = ChainSample(0.5)
    size = 4  # a real cache of 4 blocks: chain_memory(4) contents remembered
    sample.admits(["s", "a1"], size)
    sample.admits(["s", "b1"], size)  # branches off s: chain 1
    for i in range(chain_memory(size)):  # other traffic, s admitted again and again
        sample.admits(["s", ("other", i)], size)
    remembered = {c for c, at in sample.admitted.items() if at >= sample.horizon}
    assert "s" in remembered and "a1" not in remembered and len(sample.chain) <= 2 * chain_memory(size)
    n_chains = sample.n_chains
    sample.admits(["s", "a1", "a2"], size)  # a comes back after a1 was forgotten: drawn again
    assert sample.chain["a1"] == sample.chain["a2"] == n_chains


@settings(max_examples=200, deadline=None)
@given(number=st.integers(0, 2**63 - 1))
def test_the_compiled_mix_of_a_chain_number_is_the_reference_one(number):
    assert int(compiled_mixed(number)) == mixed(number)


def test_a_sample_holds_about_its_share_of_chains():
    sample = ChainSample(0.1)
    kept = sum(sample.admits([("prompt", i), ("turn", i)], 1000) for i in range(20000))
    assert sample.n_chains == 20000 and abs(kept / 20000 - 0.1) < 0.01


def test_the_default_sample_keeps_every_shadow_above_its_minimum_size():
    assert default_sample(None) == default_sample(SHADOW_SAMPLE_MIN_BLOCKS) == 1.0
    assert default_sample(4 * SHADOW_SAMPLE_MIN_BLOCKS) == 0.25
    assert default_sample(10**9) == SHADOW_SAMPLE
    with pytest.raises(ValueError, match="sample rate"):
        ChainSample(0.0)


@pytest.mark.parametrize("engine", ["compiled", "python"])
def test_sampled_shadows_are_scaled_and_only_see_sampled_requests(short_trace, engine):
    workload, hp = short_trace
    full, half = (make_policy("wa", hp, 400, shadow_sample=rate, switch_margin=math.inf) for rate in (1.0, 0.5))
    simulate(workload, full, 400, SimConfig(), engine=engine)
    simulate(workload, half, 400, SimConfig(), engine=engine)
    assert [shadow.limit for shadow in half._shadows] == [200] * len(DEFAULT_ORDERS)
    for name, hits in half.shadow_hits().items():
        assert 0 < hits < full.shadow_hits()[name]


def weighed(hits_per_period, switch_errors=None):
    """``wa`` over LRU and segmented, its shadows told they hit ``(lru, segmented)`` blocks in each period of
    100 lookups in a cache of 100 blocks, the real cache as many as the leader's; the candidate followed
    after each period."""
    policy = wa_policy([0.5], [0.1], orders=("lru", "segmented"), safety_net=True, capacity=100,
                       switch_errors=switch_errors)
    followed = []
    for period in hits_per_period:
        for shadow, hits in zip(policy._shadows, period):
            shadow.hits += hits
        policy._real_hits += period[policy.leader]  # the real cache hit as the leader's shadow: calibrated 1
        policy._weigh(100, 100)
        followed.append(policy.order_name)
    return followed


def test_a_steady_lead_switches_within_a_few_periods():
    followed = weighed([(50, 55)] * 8)
    assert followed[0] == "lru" and followed[-1] == "segmented"  # one period is one error: not yet
    assert followed.index("segmented") <= 5  # z = n / sqrt(n) for n equal leads: past 2 at the fifth


def test_a_lead_made_of_one_lump_is_within_its_error():
    """Hits come in chains: a 10 % lead from one period's lump is noise to wa, not to the margin alone."""
    lump = [(50, 50)] * 3 + [(50, 150)] + [(50, 50)] * 4
    assert set(weighed(lump)) == {"lru"}
    assert weighed(lump, switch_errors=0.0)[3] == "segmented"


@pytest.mark.parametrize("switch_errors", [-1.0, math.nan])
def test_switch_errors_must_be_a_non_negative_number(switch_errors):
    with pytest.raises(ValueError, match="switch_errors"):
        wa_policy([0.5], [0.1], orders=("lru", "segmented"), safety_net=True, switch_errors=switch_errors)
