"""The compiled twins against the reference policies: same operations, same victims, same order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.twin import CompiledTwin
from kvprof.models.learned import N_LOG_BINS, LearnedModel
from kvprof.policy import POLICIES, make_policy
from kvprof.policy.learned import LearnedPolicy
from kvprof.policy.long_output import LongOutputLRU
from kvprof.policy.wa import DEFAULT_ORDERS, ORDER_NAMES
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from tests.test_policies import LAM, OPS, P, PolicyPool, Scenario, build, wa_policy

#: A predictor over the four test cells whose buckets (three edges) all fill: the weights vary
#: with every feature (the chain's turn, its gap and a block's fan-out too), so blocks of one free call land in different buckets; a credit of a few
#: steps of the scenarios' clock, so the buckets interleave.
LEARNED = LearnedModel(0.1, cell=(0.8, -0.6, 0.3, -0.2), tier=(-1.0, 0.4, 1.1, 2.0),
                       depth=tuple(np.linspace(1.5, -1.5, N_LOG_BINS)), tail=tuple(np.linspace(-1.0, 1.0, N_LOG_BINS)),
                       turn=tuple(np.linspace(-0.8, 1.2, N_LOG_BINS)), gap=tuple(np.linspace(0.9, -0.9, N_LOG_BINS)),
                       fanout=tuple(np.linspace(-0.5, 1.5, N_LOG_BINS)), edges=(0.3, 0.5, 0.7), credit_s=2.5)

#: The long-output candidate's limit: about half the scenarios' finishes pass it (their outputs are 0-99 tokens).
OUTPUT_LIMIT = 50.0

#: wa in each configuration the twin must follow: every candidate order alone (adaptive
#: frequency learning from its own ghost), the followed S3-FIFO or learned candidate leading, and
#: the safety net (with the learned candidate too).
WA_VARIANTS = {
    "wa model": lambda: wa_policy(P, LAM),
    "wa lru": lambda: wa_policy(P, LAM, orders=("lru",)),
    "wa segmented": lambda: wa_policy(P, LAM, orders=("segmented",)),
    "wa frequency": lambda: wa_policy(P, LAM, orders=("frequency",)),
    "wa strict-frequency": lambda: wa_policy(P, LAM, orders=("strict-frequency",)),
    "wa s3fifo leads": lambda: wa_policy(P, LAM, orders=("s3fifo", "model")),
    "wa+shadows": lambda: build("wa+shadows"),
    "wa default orders": lambda: wa_policy(P, LAM, safety_net=True, orders=DEFAULT_ORDERS),
    "wa learned leads": lambda: wa_policy(P, LAM, orders=("learned", "model"), learned=LEARNED),
    "wa long-output leads": lambda: wa_policy(P, LAM, orders=("long-output", "model"), output_limit=OUTPUT_LIMIT),
    "wa every order": lambda: wa_policy(P, LAM, safety_net=True, orders=ORDER_NAMES, learned=LEARNED,
                                        output_limit=OUTPUT_LIMIT),
    "wa sampled shadows": lambda: wa_policy(P, LAM, safety_net=True, orders=DEFAULT_ORDERS, shadow_sample=0.5),
    "wa margin alone": lambda: wa_policy(P, LAM, safety_net=True, orders=DEFAULT_ORDERS, switch_errors=0.0),
}
BUILDERS = {**{name: (lambda name=name: build(name)) for name in sorted(POLICIES) if name != "wa"}, **WA_VARIANTS,
            "learned": lambda: LearnedPolicy(LEARNED), "long-output": lambda: LongOutputLRU(OUTPUT_LIMIT)}


def run_side_by_side(reference, twin, ops, num_blocks, n_classes=4):
    """Drive both through the same requests; the scenario asserts they hand out the same blocks."""
    ref_pool, twin_pool = PolicyPool(num_blocks, reference), PolicyPool(num_blocks, twin)
    scenario = Scenario([ref_pool, twin_pool], n_classes=n_classes)
    for op in ops:
        scenario.step(*op)
        assert twin_pool.evicted == ref_pool.evicted
        assert len(twin) == len(reference)
        assert [b in twin for b in range(-1, num_blocks + 1)] == [b in reference for b in range(-1, num_blocks + 1)]
    # Whatever is left leaves in the same order, which both can tell without evicting.
    assert twin.order(scenario.now + 1) == reference.order(scenario.now + 1)
    assert twin.order(scenario.now + 1, 3) == reference.order(scenario.now + 1, 3)
    assert twin.evict_n(len(twin), scenario.now + 1) == reference.evict_n(len(reference), scenario.now + 1)
    return ref_pool


@pytest.mark.parametrize("name", sorted(BUILDERS))
@settings(max_examples=40, deadline=None)
@given(ops=OPS, num_blocks=st.integers(4, 24))
def test_the_twin_evicts_what_the_reference_evicts(name, ops, num_blocks):
    run_side_by_side(BUILDERS[name](), CompiledTwin(BUILDERS[name]()), ops, num_blocks)


@pytest.fixture(scope="module")
def fitted():
    """wa's parameters as the profiler fits them: cells, reuse tiers, mixtures of exponentials."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        write_jsonl(path, generate("bailian-a", 0.25, 5))
        trace, _ = read_trace(path)
    return fit_trace(trace)


@settings(max_examples=25, deadline=None)
@given(ops=OPS, num_blocks=st.integers(4, 40), capacity=st.sampled_from([None, 64, 4096]))
def test_the_twin_of_a_fitted_wa_evicts_what_it_evicts(fitted, ops, num_blocks, capacity):
    n_cells = len(fitted.cell_names())
    reference = make_policy("wa", fitted, capacity)
    run_side_by_side(reference, CompiledTwin(make_policy("wa", fitted, capacity)), ops, num_blocks, n_classes=n_cells)


def test_the_twin_refuses_what_the_reference_refuses():
    twin = CompiledTwin(build("lru"))
    with pytest.raises(KeyError):
        twin.remove(3)
    with pytest.raises(IndexError):
        twin.evict(0.0)
    twin.access(0, 0.0)
    twin.free([0], 0.0)
    with pytest.raises(IndexError):
        twin.evict_n(2, 1.0)
    assert twin.evict_n_array(1, 1.0).tolist() == [0]
    with pytest.raises(ValueError, match="fresh"):
        reference = build("lru")
        reference.free([1], 0.0)
        CompiledTwin(reference)


def test_the_twin_grows_past_the_blocks_and_contents_it_was_sized_for():
    reference, twin = build("wa+shadows"), CompiledTwin(build("wa+shadows"))
    rng = np.random.default_rng(0)
    for step in range(300):
        blocks = [int(b) for b in rng.choice(5000, size=3, replace=False) if b not in reference]
        for depth, block in enumerate(blocks):
            for policy in (reference, twin):
                policy.access(block, float(step), depth % 4, depth, content=f"c{block % 997}")
        for policy in (reference, twin):
            policy.free(reversed(blocks), float(step))
        k = min(2, len(reference))
        assert twin.evict_n(k, float(step)) == reference.evict_n(k, float(step))


@pytest.mark.parametrize("name", ["lru", "wa+shadows"])
def test_taken_blocks_reach_the_core_before_anything_else(name):
    """``take`` is ``remove`` deferred: the same victims, sizes and orders as removing at once."""
    reference, twin = build(name), CompiledTwin(build(name), n_blocks=64)
    rng = np.random.default_rng(1)
    for step in range(200):
        blocks = [int(b) for b in rng.choice(64, size=3, replace=False) if b not in reference]
        for policy in (reference, twin):
            for depth, block in enumerate(blocks):
                policy.access(block, float(step), depth % 4, depth, hit=step % 2 == 0, content=block % 13)
            policy.free(blocks[::-1], float(step))
        for block in rng.choice(reference.order(float(step)), size=min(2, len(reference)), replace=False).tolist():
            reference.remove(block)
            twin.take(block)
            assert len(twin) == len(reference)
        if step % 3 == 0:
            assert twin.order(float(step)) == reference.order(float(step))
        k = min(step % 4, len(reference))
        assert twin.evict_n(k, float(step)) == reference.evict_n(k, float(step))
    twin.take(-5)  # never a block
    with pytest.raises(KeyError, match="not evictable"):
        twin.order(1e9)


@pytest.mark.parametrize("name", ["lru", "s3fifo", "wa+shadows"])
def test_touches_are_each_blocks_last_access_or_free_under_every_policy(name):
    """What a reload reads back (:meth:`CompiledTwin.touches`, :meth:`CompiledTwin.hits_since_cached`):
    the ``now`` of each block's last access or free, the depth of its last access and its hits since
    its last miss, whether the core keeps the first two (``wa``) or the twin's tables do (``lru``,
    ``s3fifo``); one-block accesses and chains, takes and evictions between them."""
    twin = CompiledTwin(build(name), n_blocks=64)
    rng = np.random.default_rng(3)
    stamp, depth, hits = np.full(64, -np.inf), np.zeros(64, np.int64), np.zeros(64, np.int64)
    evictable: set[int] = set()
    for step in range(300):
        now = float(step)
        held = [b for b in rng.permutation(64).tolist() if b not in evictable][:4]
        hit = step % 3 == 1  # on both kinds of access
        if step % 2:
            for d, block in enumerate(held):
                twin.access_one(block, d + step % 5, block % 7, now, step % 3, hit=hit)
        else:
            twin.access_chain(held, [d + step % 5 for d in range(len(held))], [b % 7 for b in held], now, step % 3,
                              hit=hit)
        stamp[held], depth[held] = now, [d + step % 5 for d in range(len(held))]
        hits[held] = hits[held] + 1 if hit else 0
        twin.free(held[::-1], now + 0.5)
        stamp[held] = now + 0.5
        evictable.update(held)
        for block in rng.choice(sorted(evictable), size=min(2, len(evictable)), replace=False).tolist():
            twin.take(block)
            evictable.discard(block)
        if len(evictable) > 40:
            evictable.difference_update(twin.evict_n(8, now + 0.7))
        if step % 25 == 0:
            stamps, depths = twin.touches(np.arange(64, dtype=np.int64))
            assert stamps.tolist() == stamp.tolist() and depths.tolist() == depth.tolist()
            assert twin.hits_since_cached(np.arange(64, dtype=np.int64)).tolist() == hits.tolist()
            assert len(twin) == len(evictable)


def test_a_cleared_twin_starts_over():
    twin = CompiledTwin(build("lru"))
    twin.access(0, 0.0, content="x")
    twin.free([0], 0.0)
    twin.clear()
    assert len(twin) == 0 and 0 not in twin and twin.order(1.0) == []
    twin.access(1, 1.0)
    twin.free([1], 1.0)
    assert twin.evict_n(1, 2.0) == [1]


@pytest.mark.parametrize("name", ["lru", "wa+shadows"])
def test_content_numbers_stay_bounded_in_a_long_run(name):
    """A server sees new block hashes forever: the twin recycles the oldest content numbers past
    ``max_contents``, and still hands out only evictable blocks, each once, within the pool."""
    twin = CompiledTwin(build(name), n_blocks=16, max_contents=40)
    for step in range(3000):  # 3 new contents a step: 9,000 in all
        if len(twin) > 8:
            victims = twin.evict_n(len(twin) - 8, float(step))
            assert len(set(victims)) == len(victims) and all(0 <= b < 16 for b in victims)
            assert len(twin) == 8 and not any(b in twin for b in victims)
        blocks = [b for b in range(16) if b not in twin][:3]
        for depth, block in enumerate(blocks):
            twin.access(block, float(step), depth, depth, content=f"hash{step}-{depth}")
        twin.free(blocks[::-1], float(step))
    assert len(twin._content_id) == 40 and sorted(twin._content_id.values()) == list(range(40))
