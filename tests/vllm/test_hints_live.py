"""Client hints through vLLM: the pool honours them as the simulator's hint layer does, and a server
takes them from ``vllm_xargs``, refuses a malformed one with a 400 naming the field, records them,
and caches what ``kvprof compare --hints trace`` of its own recording predicts."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm


def _cache(pool, block, key: bytes) -> None:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool._insert_block_hash(make_block_hash_with_group_id(key, 0), block, num_tokens=16)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_pool_evicts_as_the_hinted_reference(seed, in_vllm):
    """kvprof's pool serving ``lru``, its requests freed with random hints (retain, release, none) under
    a budget, hands out the blocks that ``HintedPolicy`` over the reference ``lru`` evicts, on the same
    operations and clock; prefix hits on released and retained blocks go through the layer."""
    if not in_vllm:
        return
    from kvprof.models.hints import Hint
    from kvprof.policy import make_policy
    from kvprof.policy.hinted import HintedPolicy
    from kvprof.vllm.block_pool import KvprofBlockPool
    from kvprof.vllm.spec import PolicySpec

    rng = random.Random(seed)
    n = 48
    now = [0.0]
    spec = PolicySpec.from_additional_config({"kv_policy": {"policy": "lru", "hint_max_fraction": 0.125}})
    pool = KvprofBlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=16, kvprof_spec=spec,
                           clock=lambda: now[0])
    reference = HintedPolicy(make_policy("lru"), budget_blocks=spec.hint_budget(n))
    queue = pool.free_block_queue
    cached: set[int] = set()  # blocks with a hash the reference holds (held or evictable)
    evictable: set[int] = set()
    running: list[list] = []
    choices = [None, None, Hint(retain_s=2.0, tag=1), Hint(retain_s=6.0, priority=10), Hint(release=True)]
    key = 0
    for step in range(500):
        now[0] += rng.choice([0.0, 0.1, 0.5, 1.5])
        if rng.random() < 0.5 and pool.get_num_free_blocks() > 6:
            hits = rng.sample(sorted(evictable), min(len(evictable), rng.randint(0, 3)))
            pool.touch([pool.blocks[i] for i in hits])
            for block in hits:
                reference.remove(block)
                reference.access(block, now[0], hit=True)
            evictable -= set(hits)
            k = min(rng.randint(1, 5), pool.get_num_free_blocks())
            expected = reference.evict_n(min(k - pool.free_block_queue._front.size, len(reference)), now[0]) \
                if k > pool.free_block_queue._front.size else []
            fresh = pool.get_new_blocks(k)
            victims = [b.block_id for b in fresh if b.block_id in cached]
            assert victims == expected, f"step {step}"
            cached -= set(victims)
            evictable -= set(victims)
            for block in fresh[: rng.randint(0, k)]:
                key += 1
                _cache(pool, block, key.to_bytes(8, "little"))
                pool.policy.access(block.block_id, now[0], hit=False)
                reference.access(block.block_id, now[0], hit=False)
                cached.add(block.block_id)
            running.append([pool.blocks[i] for i in hits] + fresh)
        elif running:
            blocks = running.pop(rng.randrange(len(running)))
            hint = rng.choice(choices)
            queue.set_hint(hint)
            pool.free_blocks(reversed(blocks))
            queue.set_hint(None)
            freed = [b.block_id for b in reversed(blocks) if b.block_id in cached and b.ref_cnt == 0]
            reference.finish(step, now[0], hint=hint)
            if freed:  # a free of no cached block does not reach the policy
                reference.free(freed, now[0])
            evictable |= set(freed)
        assert len(queue.hints) == len(reference)
        assert (queue.hints.n_released, queue.hints.n_retained) == (reference.n_released, reference.n_retained)
    assert queue.hints.counters == reference.counters
    assert reference.counters.honoured and reference.counters.released_evicted and reference.counters.over_budget
    order = [b.block_id for b in queue.get_all_free_blocks() if b.block_id in cached]
    assert order == reference.order(now[0])
