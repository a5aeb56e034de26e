"""kvprof's policy-backed free queue and block pool against vLLM's own, in one process.

With kvprof's ``lru`` policy the pool must hand out, keep and walk blocks exactly as vLLM's
``FreeKVCacheBlockQueue`` / ``BlockPool`` do, over a random sequence of the operations vLLM
performs (allocate, cache, hit, free tail-first, reset). Runs inside the vLLM venv (the test
re-runs itself there when this interpreter has no vLLM).
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm


def _pools(num_blocks: int, policy: str = "lru", native_first: bool = False):
    from vllm.v1.core.block_pool import BlockPool

    from kvprof.vllm.block_pool import KvprofBlockPool
    from kvprof.vllm.spec import PolicySpec

    spec = _wa_spec() if policy == "wa" else PolicySpec.from_additional_config({"kv_policy": {"policy": policy}})
    native = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)
    ours = KvprofBlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16, kvprof_spec=spec,
                           native_first=native_first)
    return native, ours


def _wa_spec():
    """The spec of ``wa`` from the tests' hp file."""
    import json
    import tempfile

    from vllm_support import HP_TEST

    from kvprof.vllm.spec import PolicySpec

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(HP_TEST, fh)
    return PolicySpec.from_additional_config({"kv_policy": {"config": fh.name}})


def _wa_pool(num_blocks: int, native_first: bool = False):
    """kvprof's pool running ``wa`` from the tests' hp file (vLLM's own order first, with ``native_first``),
    and its spec."""
    from kvprof.vllm.block_pool import KvprofBlockPool

    spec = _wa_spec()
    return KvprofBlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16, kvprof_spec=spec,
                           native_first=native_first), spec


def _ids(blocks):
    return [b.block_id for b in blocks]


def _cache(pool, block, key):
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool._insert_block_hash(make_block_hash_with_group_id(key, 0), block, num_tokens=16)


@pytest.mark.parametrize("served", ["lru", "wa-native-first"])
@pytest.mark.parametrize("own_free", [True, False], ids=["one-pass-free", "vllms-free"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lru_pool_matches_vllm_block_pool(seed, own_free, served, in_vllm, monkeypatch):
    """Both ways a request's blocks are freed: the pool's own ``free_blocks`` (one pass that hands the
    queue the cached blocks' ids, where vLLM's is the plain loop it replaces) and vLLM's. Under kvprof's
    ``lru``, and under ``wa`` before the compiled policy takes over (vLLM's own order serves)."""
    if not in_vllm:
        return
    import kvprof.vllm.block_pool as block_pool

    if own_free and not block_pool._PLAIN_FREE:
        pytest.skip("this vLLM's free_blocks is not the loop the pool's own replaces: vLLM's runs")
    monkeypatch.setattr(block_pool, "_PLAIN_FREE", own_free)
    rng = random.Random(seed)
    n = 64
    native, ours = _pools(n, "wa", native_first=True) if served == "wa-native-first" else _pools(n)
    assert ours.serves_natively == (served == "wa-native-first")
    running: list[tuple[list, list]] = []  # (native blocks, our blocks) per request, in allocation order
    key = 0
    for step in range(600):
        op = rng.random()
        assert native.get_num_free_blocks() == ours.get_num_free_blocks()
        if op < 0.45 and native.get_num_free_blocks() > 8:
            # a new request: maybe hit cached blocks of a free chain, then allocate and cache
            k = rng.randint(1, 6)
            cached = [b for b in native.free_block_queue.get_all_free_blocks() if b.block_hash is not None]
            hits = rng.sample(cached, min(len(cached), rng.randint(0, 2))) if cached else []
            hit_ids = [b.block_id for b in hits]
            native.touch(hits)
            ours.touch([ours.blocks[i] for i in hit_ids])
            a, b = native.get_new_blocks(k), ours.get_new_blocks(k)
            assert _ids(a) == _ids(b), f"step {step}: allocation differs"
            assert a == b, f"step {step}: blocks in use differ (their free-list links included)"
            for x, y in zip(a[: rng.randint(0, k)], b):  # full blocks get a hash
                key += 1
                _cache(native, x, key.to_bytes(8, "little"))
                _cache(ours, ours.blocks[x.block_id], key.to_bytes(8, "little"))
            running.append((hits + a, [ours.blocks[i] for i in hit_ids] + b))
        elif running:
            a, b = running.pop(rng.randrange(len(running)))
            native.free_blocks(reversed(a))
            ours.free_blocks(reversed(b))
        if step % 50 == 0:
            assert _ids(native.free_block_queue.get_all_free_blocks()) == _ids(ours.free_block_queue.get_all_free_blocks())
            assert (_ids(native.free_block_queue.iter_blocks_after(None))
                    == _ids(ours.free_block_queue.iter_blocks_after(None)))
    while running:
        a, b = running.pop()
        native.free_blocks(reversed(a))
        ours.free_blocks(reversed(b))
    assert _ids(native.free_block_queue.get_all_free_blocks()) == _ids(ours.free_block_queue.get_all_free_blocks())
    # drain: the whole eviction order, cached blocks included, is the same
    m = native.get_num_free_blocks()
    assert _ids(native.get_new_blocks(m)) == _ids(ours.get_new_blocks(m))


def test_lru_queue_matches_vllm_queue_and_reset(in_vllm):
    if not in_vllm:
        return
    native, ours = _pools(32)
    _cache_and_free(native, ours, 10)
    assert native.reset_prefix_cache() and ours.reset_prefix_cache()
    assert ours.free_block_queue.policy.__len__() == 0  # all hash-less now: nothing left to order
    assert native.get_num_free_blocks() == ours.get_num_free_blocks() == 31
    # null block is never handed out
    assert 0 not in _ids(ours.get_new_blocks(31))


def _cache_and_free(native, ours, n: int) -> None:
    """``n`` blocks taken from both pools, cached under the same keys, freed tail first."""
    a, b = native.get_new_blocks(n), ours.get_new_blocks(n)
    for i, (x, y) in enumerate(zip(a, b)):
        _cache(native, x, bytes([i + 1]))
        _cache(ours, y, bytes([i + 1]))
    native.free_blocks(reversed(a))
    ours.free_blocks(reversed(b))


def _walk(queue) -> list[int]:
    """The block ids from ``fake_free_list_head`` to ``fake_free_list_tail``, as vLLM's tests walk them."""
    ids, block = [], queue.fake_free_list_head.next_free_block
    while block is not queue.fake_free_list_tail:
        ids.append(block.block_id)
        block = block.next_free_block
    return ids


@pytest.mark.parametrize("policy", ["lru", "wa"])
def test_the_sentinel_walk_of_vllms_tests_goes_in_eviction_order(in_vllm, policy):
    if not in_vllm:
        return
    native, ours = _pools(32, policy)
    _cache_and_free(native, ours, 10)
    queue = ours.free_block_queue
    assert _walk(queue) == _ids(queue.get_all_free_blocks())
    if policy == "lru":
        assert _walk(queue) == _walk(native.free_block_queue)  # vLLM's own order, block for block
    taken = ours.get_new_blocks(25)  # blocks leaving the queue lose their links, as vLLM's do
    assert all(block.prev_free_block is None and block.next_free_block is None for block in taken)
    assert _walk(queue) == _ids(queue.get_all_free_blocks())
    ours.get_new_blocks(queue.num_free_blocks)
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head


def test_touch_does_vllms_work_in_its_own_loop_or_leaves_it_to_vllm(in_vllm):
    """On this vLLM the pool's touch does ``BlockPool.touch``'s work itself (no call per block); with a
    metrics collector, which vLLM's own touch tells of every block, it leaves the work to vLLM. Either
    way the blocks end as vLLM's do: reference counts up, the free ones out of the queue."""
    if not in_vllm:
        return
    from kvprof.vllm import block_pool

    assert block_pool._PLAIN_TOUCH  # else the test above compares vLLM's touch with itself

    class Collector:
        def __init__(self):
            self.accessed = []

        def on_block_accessed(self, block):
            self.accessed.append(block.block_id)

    for collector in (None, Collector()):
        native, ours = _pools(16)
        a, b = native.get_new_blocks(6), ours.get_new_blocks(6)
        for i, (x, y) in enumerate(zip(a, b)):
            _cache(native, x, bytes([i + 1]))
            _cache(ours, y, bytes([i + 1]))
        native.free_blocks(reversed(a[:4]))  # four free cached blocks, two still held
        ours.free_blocks(reversed(b[:4]))
        ours.metrics_collector = collector
        hit = [1, 2, 5, 6, 3]
        native.touch([native.blocks[i] for i in hit])
        ours.touch([ours.blocks[i] for i in hit])
        assert [blk.ref_cnt for blk in native.blocks] == [blk.ref_cnt for blk in ours.blocks]
        assert _ids(native.free_block_queue.get_all_free_blocks()) == _ids(ours.free_block_queue.get_all_free_blocks())
        if collector is not None:
            assert collector.accessed == hit

def test_wa_pool_prefers_cold_class(in_vllm):
    """With ``wa`` the pool evicts the cold request's blocks before the older hot ones."""
    if not in_vllm:
        return
    pool, spec = _wa_pool(9)

    class FakeReq:  # only what the pool reads: sampling_params.extra_args and the prompt's length
        def __init__(self, xargs):
            self.sampling_params = type("SP", (), {"extra_args": xargs})()
            self.num_prompt_tokens = 128

    hot, cold = pool.get_new_blocks(4), pool.get_new_blocks(4)
    for reqx, blocks, base in ((FakeReq({"type": "hot", "turn": 1}), hot, 0), (FakeReq({"workload": "cold_1"}), cold, 10)):
        for i, blk in enumerate(blocks):
            _cache(pool, blk, bytes([base + i + 1]))
        pool.current_request = reqx
        pool.touch([])  # no hits
        # the class is recorded when blocks are cached; call the policy as cache_full_blocks does
        for depth, blk in enumerate(blocks):
            pool.policy.access(blk.block_id, 0.0, spec.class_index(reqx.sampling_params.extra_args), depth)
    pool.free_blocks(reversed(hot))
    pool.free_blocks(reversed(cold))
    victims = _ids(pool.get_new_blocks(4))
    assert victims == _ids(reversed(cold))


def test_wa_pool_tells_its_shadows_whole_requests(in_vllm):
    """The pool's admit/finish give each of ``wa``'s shadows a request's whole chain: a second request
    with the first one's prompt hits all its full blocks in every shadow."""
    if not in_vllm:
        return
    from types import SimpleNamespace

    pool, _ = _wa_pool(9)
    chain = [bytes([k]) * 32 for k in range(1, 5)]  # three prompt blocks and one the output filled

    def request(rid):
        return SimpleNamespace(request_id=rid, num_prompt_tokens=3 * 16 + 5, num_tokens=3 * 16 + 5,
                               num_computed_tokens=4 * 16 + 2, num_output_tokens=20, block_hashes=chain,
                               sampling_params=SimpleNamespace(extra_args={"type": "hot", "turn": 1}))

    first, second = request("a"), request("b")
    pool.admit_request(first)
    pool.finish_request(first, n_blocks=5)
    pool.admit_request(second)
    _, hits = pool.policy.safety_net()
    assert len(hits) > 1 and list(hits) == [3] * len(hits)


def test_wa_pool_tells_the_long_output_candidate_each_requests_output(in_vllm):
    """A file tuned to start ``wa`` on its long-output candidate (limit 10 tokens): the pool tells it each
    finishing request's ``num_output_tokens``, so the blocks of the request that generated 50 tokens
    go before the older ones of the request that generated 5 (LRU would take those first); blocks freed
    after the finished request's frees (a preempted request's, 80 tokens so far) are kept as LRU keeps them."""
    if not in_vllm:
        return
    import json
    import tempfile
    from types import SimpleNamespace

    from vllm_support import HP_TEST

    from kvprof.vllm.block_pool import KvprofBlockPool
    from kvprof.vllm.spec import PolicySpec

    tuned = {**HP_TEST, "schema": "kvprof.hp/4",
             "tuning": [{"capacity": 8, "horizon_s": 60.0, "start": "long-output", "long_output_tokens": 10}]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(tuned, fh)
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": fh.name}})
    pool = KvprofBlockPool(num_gpu_blocks=9, enable_caching=True, hash_block_size=16, kvprof_spec=spec)
    assert pool.policy.reference.order_names[pool.policy.safety_net()[0]] == "long-output"
    held = {}
    for rid, output, base in (("short", 5, 0), ("long", 50, 10), ("preempted", 80, 20)):
        chain = [bytes([base + k + 1]) * 32 for k in range(2)]
        request = SimpleNamespace(request_id=rid, num_prompt_tokens=2 * 16, num_tokens=2 * 16 + output,
                                  num_computed_tokens=2 * 16, num_output_tokens=output, block_hashes=chain,
                                  sampling_params=SimpleNamespace(extra_args={"type": "hot", "turn": 1}))
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(request, blocks, 0, 2, 16, 0)
        pool.admit_request(request)
        held[rid] = (request, blocks)
    for rid in ("short", "long"):  # the short one is freed first: LRU's first victims
        request, blocks = held[rid]
        pool.finish_request(request, n_blocks=2)
        pool.free_blocks(reversed(blocks))
        pool.request_freed()
    pool.free_blocks(reversed(held["preempted"][1]))  # vLLM's preemption frees without a finish
    taken = _ids(pool.get_new_blocks(6))  # the two blocks never cached first, then the victims
    assert taken[2:] == _ids(reversed(held["long"][1])) + _ids(reversed(held["short"][1]))
    pool.close()


def test_wa_pool_runs_over_first_turn_where_the_next_turn_counts_favour_it(in_vllm):
    """A file whose fit window's continued sessions came back soon six times as often as new ones: ``wa``
    runs over ``first-turn`` and LRU and follows the first. Request "c" continues "a" (its chain holds a's
    whole chain, here on blocks of its own), "b" begins a session: a's and b's blocks go first, c's last,
    though LRU would take c's before b's."""
    if not in_vllm:
        return
    import json
    import tempfile
    from types import SimpleNamespace

    from vllm_support import HP_TEST

    from kvprof.vllm.block_pool import KvprofBlockPool
    from kvprof.vllm.spec import PolicySpec

    favouring = {**HP_TEST, "schema": "kvprof.hp/5", "next_turn": {
        "horizon_s": 30.0, "began": 1000, "began_followed": 50, "continued": 100, "continued_followed": 30}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(favouring, fh)
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": fh.name}})
    pool = KvprofBlockPool(num_gpu_blocks=9, enable_caching=True, hash_block_size=16, kvprof_spec=spec)
    assert pool.policy.reference.order_names == ("first-turn", "lru")
    held = {}
    for rid, contents in (("a", (1, 2)), ("c", (1, 2, 3)), ("b", (7, 8))):
        chain = [bytes([k]) * 32 for k in contents]
        request = SimpleNamespace(request_id=rid, num_prompt_tokens=len(chain) * 16, num_tokens=len(chain) * 16 + 4,
                                  num_computed_tokens=len(chain) * 16, num_output_tokens=4, block_hashes=chain,
                                  sampling_params=SimpleNamespace(extra_args={"type": "hot", "turn": 1}))
        blocks = pool.get_new_blocks(len(chain))
        pool.cache_full_blocks(request, blocks, 0, len(chain), 16, 0)
        pool.admit_request(request)
        pool.finish_request(request, n_blocks=len(chain))
        pool.free_blocks(reversed(blocks))
        pool.request_freed()
        held[rid] = blocks
    taken = _ids(pool.get_new_blocks(8))  # the one block never cached first, then the victims
    assert taken[1:] == _ids(reversed(held["a"])) + _ids(reversed(held["b"])) + _ids(reversed(held["c"]))
    pool.close()


def test_a_policy_without_shadows_is_told_no_requests(in_vllm):
    """Under ``lru`` (no shadows: its admit/finish do nothing) the pool numbers no request's chain
    and keeps none, while ``wa``'s pool keeps a running request's chain until it finishes."""
    if not in_vllm:
        return
    from types import SimpleNamespace

    chain = [bytes([k]) * 32 for k in range(1, 5)]
    request = SimpleNamespace(request_id="a", num_prompt_tokens=3 * 16 + 5, num_tokens=3 * 16 + 5,
                              num_computed_tokens=4 * 16 + 2, num_output_tokens=20, block_hashes=chain,
                              sampling_params=SimpleNamespace(extra_args={"type": "hot", "turn": 1}))
    _, lru = _pools(9)
    wa, _ = _wa_pool(9)
    for pool, kept in ((lru, False), (wa, True)):
        pool.admit_request(request)
        assert ("a" in pool._chain_numbers) is kept
        assert len(pool.contents) == 3 * kept  # the prompt's three full blocks, numbered for wa only
        pool.finish_request(request, n_blocks=5)
        assert "a" not in pool._chain_numbers


def test_shadow_thread_can_be_turned_off(in_vllm, monkeypatch):
    """KVPROF_SHADOW_THREAD=0 keeps wa's shadows on the scheduler thread (no feed thread), with the same
    shadow hits as the thread gives; any value but 0 or 1 is refused with the variable's name."""
    if not in_vllm:
        return
    from types import SimpleNamespace

    from kvprof.vllm.spec import SHADOW_THREAD_ENV, KvPolicyConfigError

    chain = [bytes([k]) * 32 for k in range(1, 5)]

    def hits_after_two_requests():
        pool, _ = _wa_pool(9)
        for rid in ("a", "b"):
            request = SimpleNamespace(request_id=rid, num_prompt_tokens=3 * 16 + 5, num_tokens=3 * 16 + 5,
                                      num_computed_tokens=4 * 16 + 2, num_output_tokens=20, block_hashes=chain,
                                      sampling_params=SimpleNamespace(extra_args={"type": "hot", "turn": 1}))
            pool.admit_request(request)
            pool.finish_request(request, n_blocks=5)
        threaded = pool.policy.shadow_feed is not None
        hits = list(pool.policy.safety_net()[1])
        pool.close()
        return threaded, hits

    monkeypatch.setenv(SHADOW_THREAD_ENV, "0")
    synchronous = hits_after_two_requests()
    monkeypatch.setenv(SHADOW_THREAD_ENV, "1")
    threaded = hits_after_two_requests()
    assert synchronous[0] is False and threaded[0] is True
    assert synchronous[1] == threaded[1] and synchronous[1][0] == 3
    monkeypatch.setenv(SHADOW_THREAD_ENV, "yes")
    with pytest.raises(KvPolicyConfigError, match="KVPROF_SHADOW_THREAD='yes'"):
        _wa_pool(9)


def test_front_blocks_keep_a_deques_order(in_vllm):
    """FrontBlocks (a range of never-used ids between two deques) hands out, lists and removes blocks
    exactly as one deque of them would, over random operations (hypothesis)."""
    if not in_vllm:
        return
    from collections import deque
    from types import SimpleNamespace

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvprof.vllm.block_pool import front_of

    n = 24
    operations = st.lists(st.tuples(st.sampled_from(["pop", "prepend", "extend", "remove"]), st.integers(0, 6)),
                          max_size=40)

    @settings(max_examples=200, deadline=None)
    @given(first=st.integers(0, n), operations=operations)
    def check(first, operations):
        blocks = [SimpleNamespace(block_id=i) for i in range(n)]
        front, model = front_of(blocks, blocks[first:]), deque(blocks[first:])
        taken = list(blocks[:first])
        for name, k in operations:
            if name == "pop":
                k = min(k, len(model))
                out = front.popleft_n(k) if k != 1 else [front.popleft()]
                assert out == [model.popleft() for _ in range(k)]
                taken.extend(out)
            elif name in ("prepend", "extend"):
                put, taken[:] = taken[:k], taken[k:]
                (front.prepend if name == "prepend" else front.extend)(put)
                model.extendleft(reversed(put)) if name == "prepend" else model.extend(put)
            elif model:
                block = model[k % len(model)]
                front.remove(block)
                model.remove(block)
                taken.append(block)
            assert list(front) == list(model) and len(front) == len(model)
        with pytest.raises(ValueError):
            front.remove(SimpleNamespace(block_id=n + 1))

    check()
    scattered = [SimpleNamespace(block_id=i) for i in range(4)]
    assert list(front_of(scattered, [scattered[3], scattered[1]])) == [scattered[3], scattered[1]]


class _Traffic:
    """Random vLLM-like traffic on a pool, and what a reload must tell a new policy of each cached block.

    Requests hit the cached prefix of one of a few chains, cache their new full blocks and are freed
    tail-first, under a clock that advances once per operation. Invariant: ``touched[b]`` is the
    clock reading of block ``b``'s last access or free and its depth then, ``hits[b]`` its hits since
    it was cached, ``owner[b]`` the (tags, prompt tokens) of its last accessor.
    """

    TAGS = ({"type": "hot", "turn": 1}, {"workload": "cold_1"}, None)

    def __init__(self, pool, seed: int) -> None:
        self.pool, self.rng, self.now = pool, random.Random(seed), [0.0]
        self.chains = [[bytes([c, k]) * 16 for k in range(8)] for c in range(10)]  # more than the pool holds
        self.running: list[list] = []
        self.touched: dict[int, tuple[float, int]] = {}
        self.hits: dict[int, int] = {}
        self.owner: dict[int, tuple] = {}
        self.served = 0

    def run(self, steps: int) -> None:
        from types import SimpleNamespace

        pool, rng = self.pool, self.rng
        for _ in range(steps):
            self.now[0] += rng.choice([0.5, 1.0, 7.0])
            t = self.now[0]
            if rng.random() < 0.5 and len(self.running) < 4 and pool.get_num_free_blocks() > 8:
                k = rng.randint(1, 8)
                hashes = rng.choice(self.chains)[:k]
                self.served += 1
                request = SimpleNamespace(request_id=f"r{self.served}", num_prompt_tokens=16 * k, block_hashes=hashes,
                                          sampling_params=SimpleNamespace(extra_args=rng.choice(self.TAGS)))
                owner = (request.sampling_params.extra_args, request.num_prompt_tokens)
                hit = []
                for h in hashes:
                    found = pool.get_cached_block(h, [0])
                    if found is None:
                        break
                    hit.append(found[0])
                pool.current_request = request
                pool.touch(hit)
                new = pool.get_new_blocks(k - len(hit))
                n_full = k - rng.randint(0, 1)  # the last block may stay partial (uncached)
                pool.cache_full_blocks(request, hit + new, len(hit), n_full, 16, 0)
                for depth, block in enumerate(hit + new[:max(n_full - len(hit), 0)]):
                    i = block.block_id
                    self.touched[i] = (t, depth)
                    self.hits[i] = min(self.hits.get(i, 0) + 1, 4) if depth < len(hit) else 0
                    self.owner[i] = owner
                self.running.append(hit + new)
            elif self.running:
                blocks = self.running.pop(rng.randrange(len(self.running)))
                pool.free_blocks(reversed(blocks))
                for block in blocks:
                    if block.ref_cnt == 0 and block.block_hash is not None:
                        self.touched[block.block_id] = (t, self.touched[block.block_id][1])

    def cached(self) -> list:
        return [block for block in self.pool.blocks if block.block_hash is not None and not block.is_null]

    def carried_into(self, spec, policy) -> None:
        """What a reload under ``spec`` tells ``policy`` of the cached blocks, from this record (carry_over's rule)."""
        from kvprof.vllm.carry import Held, carry_over

        held = []
        for block in self.cached():
            i = block.block_id
            owner = self.owner[i]
            held.append(Held(i, self.touched[i][1], block.block_hash, self.touched[i][0],
                             spec.default_index if owner is None else spec.class_index(*owner),
                             self.hits[i], block.ref_cnt == 0))
        carry_over(held,
                   lambda item, hit: policy.access_chain([item.id], [item.depth], [item.content], item.stamp,
                                                         item.workload, hit=hit),
                   lambda item: policy.free([item.id], item.stamp))


@pytest.mark.parametrize("seed", [0, 1])
def test_wa_core_keeps_each_blocks_last_touch_and_depth(seed, in_vllm):
    """Under ``wa`` the twin's core stamps a block with the clock reading of its last access or free and
    keeps the depth of its last access: exactly what a reload tells a new policy of it."""
    if not in_vllm:
        return
    import numpy as np

    pool, _ = _wa_pool(48)
    assert pool.policy.keeps_touches
    traffic = _Traffic(pool, seed)
    pool._clock = pool.free_block_queue._clock = lambda: traffic.now[0]
    traffic.run(300)
    ids = np.array([block.block_id for block in traffic.cached()], dtype=np.int64)
    assert len(ids) > 10
    stamps, depths = pool.policy.touches(ids)
    assert list(zip(stamps.tolist(), depths.tolist())) == [traffic.touched[i] for i in ids.tolist()]
    pool.close()


@pytest.mark.parametrize("native_first", [False, True], ids=["compiled", "native-first"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_reload_tells_the_new_policy_what_the_pool_served(seed, native_first, in_vllm):
    """A reload (``replace_policy``) in the middle of random traffic, ``wa`` -> ``lru`` -> ``wa`` -> ``wa``:
    each new policy orders the free cached blocks as one told the traffic's record by carry_over's rule,
    and the pool serves on (its last touches and depths kept by the pool or by the core, as the policy has them).
    Started with vLLM's own order (``native_first``), the first replacement is the hand-over to the compiled
    policy, under the same rule."""
    if not in_vllm:
        return
    pool, wa_spec = _wa_pool(48, native_first)
    assert pool.serves_natively == native_first
    lru_spec = _pools(4)[1].kvprof_spec
    traffic = _Traffic(pool, seed)
    pool._clock = pool.free_block_queue._clock = lambda: traffic.now[0]
    traffic.run(200)
    for spec in (lru_spec, wa_spec, wa_spec):
        policy, expected = (spec.make_policy(capacity=pool.num_gpu_blocks, n_blocks=pool.num_gpu_blocks)
                            for _ in range(2))
        pool.replace_policy(spec, policy)
        assert not pool.serves_natively
        traffic.carried_into(spec, expected)
        now = traffic.now[0]
        assert len(policy) == len(expected) > 5
        assert policy.order(now) == expected.order(now)
        expected.close()
        evicted = pool.free_block_queue.evictions
        traffic.run(200)
        assert pool.free_block_queue.evictions > evicted
    pool.close()


def test_a_running_requests_class_follows_a_reload(in_vllm):
    """The pool keeps each running request's class rather than look it up per cached block; a reload to an
    hp file that numbers the classes otherwise reaches the blocks the request caches after it."""
    if not in_vllm:
        return
    import json
    import tempfile
    from types import SimpleNamespace

    from vllm_support import HP_TEST

    from kvprof.vllm.spec import PolicySpec

    pool, old_spec = _wa_pool(32)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:  # one class more: hot_1's index moves
        json.dump({**HP_TEST, "classes": {**HP_TEST["classes"], "api_1": {"p": 0.5, "lambda": 0.1}}}, fh)
    new_spec = PolicySpec.from_additional_config({"kv_policy": {"config": fh.name}})
    tags = {"type": "hot", "turn": 1}
    assert old_spec.class_index(tags) != new_spec.class_index(tags)
    told = []

    def record(policy):  # a call's class, whether it passes a chain or one block
        access, access_one = policy.access_numbered, policy.access_one

        def recorded(ids, depths, numbers, now, workload, *, hit):
            told.append(workload)
            return access(ids, depths, numbers, now, workload, hit=hit)

        def recorded_one(block, depth, number, now, workload, **kwargs):
            told.append(workload)
            return access_one(block, depth, number, now, workload, **kwargs)

        policy.access_numbered, policy.access_one = recorded, recorded_one

    request = SimpleNamespace(request_id="r", num_prompt_tokens=4 * 16, num_computed_tokens=4 * 16,
                              num_output_tokens=1, block_hashes=[bytes([k]) * 16 for k in range(4)],
                              sampling_params=SimpleNamespace(extra_args=tags))
    blocks = pool.get_new_blocks(4)
    record(pool.policy)
    pool.cache_full_blocks(request, blocks, 0, 2, 16, 0)
    pool.cache_full_blocks(request, blocks, 2, 3, 16, 0)
    policy = new_spec.make_policy(capacity=pool.num_gpu_blocks, n_blocks=pool.num_gpu_blocks)
    pool.replace_policy(new_spec, policy)
    record(pool.policy)
    pool.cache_full_blocks(request, blocks, 3, 4, 16, 0)
    assert told == [old_spec.class_index(tags)] * 2 + [new_spec.class_index(tags)]
    pool.finish_request(request, n_blocks=4)
    assert not pool._request_classes  # forgotten with the request
    pool.close()
