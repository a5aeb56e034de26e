"""Eviction policies: vLLM's LRU order, the protocol every policy keeps, and each policy's rule."""

from __future__ import annotations

import copy
import math
import random
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprof.models.hp import ClassParams, HpFile
from kvprof.models.score import published_score, reuse_probability
from kvprof.policy.orders import N_TIERS
from kvprof.policy import classed
from kvprof.policy import (
    POLICIES,
    BeladyPolicy,
    LFUPolicy,
    LRUPolicy,
    PublishedWorkloadAwarePolicy,
    S3FIFOPolicy,
    WorkloadAwarePolicy,
    make_policy,
)
from kvprof.classes import ClassRule

# Three classes plus the default (last): short, medium and long reuse gaps.
P = [0.6, 0.4, 0.2, 0.3]
LAM = [0.5, 0.05, 0.01, 0.02]
WA_ORDERS = ("s3fifo", "model", "lru", "segmented", "frequency", "strict-frequency")  # the followed structure leads


def wa_policy(p, lam, horizon=30.0, tiers=N_TIERS, **kwargs):
    """``wa`` with one cure exponential per cell for every tier; the model order alone unless told."""
    p, lam = np.asarray(p, dtype=float), np.asarray(lam, dtype=float)
    kwargs = {"orders": ("model",), "safety_net": False, **kwargs}
    return WorkloadAwarePolicy(np.repeat(p[:, None], tiers, 1), np.ones((p.size, tiers, 1)),
                               np.repeat(lam[:, None, None], tiers, 1), horizon, **kwargs)


def build(name: str):
    """A fresh policy of each kind, wa and wa-paper over the four classes above; "wa+shadows" is
    ``wa`` with every candidate order and its safety net."""
    if name == "wa":
        return wa_policy(P, LAM)
    if name == "wa+shadows":
        return wa_policy(P, LAM, orders=WA_ORDERS, safety_net=True)
    if name == "wa-paper":
        return PublishedWorkloadAwarePolicy(P, LAM)
    return POLICIES[name]()


# --- a faithful replica of vLLM's free queue and block pool rules ---------------------------


class ReplicaBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int | None):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash = None
        self.prev = self.next = None


class ReplicaFreeQueue:
    """vLLM's FreeKVCacheBlockQueue: a doubly linked list between two sentinels, front evicted first."""

    def __init__(self, blocks):
        self.head, self.tail = ReplicaBlock(None), ReplicaBlock(None)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def _link_after(self, prev, block):
        block.prev, block.next = prev, prev.next
        prev.next.prev = block
        prev.next = block
        self.size += 1

    def append(self, block):
        self._link_after(self.tail.prev, block)

    def prepend_n(self, blocks):
        """Blocks go to the front in the given order (vLLM's prepend_n)."""
        prev = self.head
        for block in blocks:
            self._link_after(prev, block)
            prev = block

    def remove(self, block):
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self):
        block = self.head.next
        assert block is not self.tail, "popleft on an empty free queue"
        self.remove(block)
        return block


class ReplicaBlockPool:
    """vLLM's BlockPool rules: lazy eviction on reuse, touch, free_blocks' prepend/append split."""

    def __init__(self, num_blocks: int):
        self.blocks = [ReplicaBlock(i) for i in range(num_blocks)]
        self.queue = ReplicaFreeQueue(self.blocks)
        self.cached: dict[int, ReplicaBlock] = {}
        self.evicted: list[int] = []

    def num_free(self) -> int:
        return self.queue.size

    def get_new_blocks(self, n: int, now: float) -> list[int]:
        out = [self.queue.popleft() for _ in range(n)]
        for block in out:
            if block.block_hash is not None:  # _maybe_evict_cached_block
                self.evicted.append(block.block_id)
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt += 1
        return [block.block_id for block in out]

    def touch(self, block_ids):
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.queue.remove(block)
            block.ref_cnt += 1

    def note_access(self, *access):
        """vLLM has no policy to tell."""

    def admit(self, *request):
        """Nor whole requests."""

    def finish(self, *request):
        pass

    def cache(self, block_id: int, content: int):
        self.blocks[block_id].block_hash = content
        self.cached[content] = self.blocks[block_id]

    def lookup(self, content: int) -> int:
        return self.cached[content].block_id

    def free_blocks(self, ordered_ids, now: float):
        without_hash, with_hash = [], []
        for block_id in ordered_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (without_hash if block.block_hash is None else with_hash).append(block)
        self.queue.prepend_n(without_hash)
        for block in with_hash:
            self.queue.append(block)


# --- the driver side of the protocol, as the simulator keeps it ----------------------------


class PolicyPool:
    """A block pool whose cached evictable blocks are ordered by an EvictionPolicy.

    Never-cached free blocks stay here, in a deque whose front is reused first (vLLM prepends
    them), and are handed out before the policy is asked for a victim. The pool also keeps what
    the policies are told, so tests can check their choices: per block its class (last
    toucher), depth, stamp (last access or free), access count and next use.
    """

    def __init__(self, num_blocks: int, policy):
        self.policy = policy
        self.empty = deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.content: dict[int, int] = {}  # cached block -> content
        self.cached: dict[int, int] = {}  # content -> cached block
        self.evicted: list[int] = []
        self.workload, self.depth, self.stamp, self.count, self.next_use = {}, {}, {}, {}, {}

    def num_free(self) -> int:
        return len(self.empty) + len(self.policy)

    def evictable(self) -> set[int]:
        return {block for block in self.content if self.refs[block] == 0}

    def _forget(self, victims):
        for block in victims:
            assert block in self.content and self.refs[block] == 0, f"policy evicted non-evictable block {block}"
            del self.cached[self.content.pop(block)]
        self.evicted += victims

    def get_new_blocks(self, n: int, now: float) -> list[int]:
        take = min(n, len(self.empty))
        blocks = [self.empty.popleft() for _ in range(take)]
        if n > take:
            victims = self.policy.evict_n(n - take, now)
            self._forget(victims)
            blocks += victims
        for block in blocks:
            self.refs[block] += 1
        return blocks

    def evict(self, k: int, now: float) -> list[int]:
        """Evict k cached blocks outright (memory pressure from elsewhere, e.g. an offload tier)."""
        victims = self.policy.evict_n(k, now)
        self._forget(victims)
        return victims

    def touch(self, block_ids):
        for block in block_ids:
            if self.refs[block] == 0:
                self.policy.remove(block)
            self.refs[block] += 1

    def admit(self, request, contents, now, workload, n_lookup, n_blocks):
        self.policy.admit(request, contents, now, workload, n_lookup=n_lookup, n_blocks=n_blocks)

    def finish(self, request, now, contents=None, n_blocks=None, n_output=None, finish=None):
        self.policy.finish(request, now, contents, n_blocks=n_blocks, n_output=n_output, finish=finish)

    def note_access(self, block, now, workload, depth, hit, next_use, content):
        self.policy.access(block, now, workload, depth, hit=hit, next_use=next_use, content=content)
        self.workload[block] = workload
        self.depth[block] = depth
        self.stamp[block] = now
        self.count[block] = self.count.get(block, 0) + 1 if hit else 1
        self.next_use[block] = next_use

    def cache(self, block: int, content: int):
        self.content[block] = content
        self.cached[content] = block

    def lookup(self, content: int) -> int:
        return self.cached[content]

    def free_blocks(self, ordered_ids, now: float):
        cached = []
        for block in ordered_ids:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.content:
                    cached.append(block)
                    self.stamp[block] = now
                else:
                    self.empty.appendleft(block)
        self.policy.free(cached, now)


class Scenario:
    """Turns hypothesis-drawn integers into requests: prefix hits, new blocks, finishes.

    Each op is ``(kind, a, b)``: kinds 0-1 start a request, 2 finishes one, 3 evicts under
    pressure (only with ``pressure=True``, else it finishes one too). New contents are fresh, or
    evicted contents being recomputed. Every pool given sees the same requests in the same order,
    each request announced whole after its blocks (``admit``, its hit and new contents as its
    chain, some of them not hittable) and ``finish`` before its free (mostly with its chain grown
    by output blocks, which only shadows cache), with its output's length in tokens or none and its
    finish code or none.
    """

    def __init__(self, pools, n_classes: int = 4, pressure: bool = True):
        self.pools = pools
        self.n_classes = n_classes
        self.pressure = pressure
        self.running: list[tuple[int, list[int]]] = []  # (request, its blocks)
        self.requests = 0
        self.depth_of: dict[int, int] = {}  # content -> its fixed position in the chain
        self.gone: set[int] = set()  # contents evicted at least once
        self.fresh = 0
        self.now = 0.0

    def step(self, kind: int, a: int, b: int):
        self.now += 0.25 + (a % 7)
        if kind <= 1:
            self.start(a, b)
        elif kind == 2 or not self.pressure:
            self.finish(a)
        else:
            self.evict(a % 4)

    def start(self, a: int, b: int):
        rng = random.Random(a * 1009 + b)
        lead = self.pools[0]
        workload = a % (self.n_classes + 1) - 1  # -1: a class the policy does not know
        hits = rng.sample(sorted(lead.cached), min(b % 4, len(lead.cached)))
        n_new = min(b // 4 % 5 + 1, lead.num_free() - sum(lead.lookup(c) in lead.policy for c in hits))
        contents = []
        for _ in range(n_new):
            recomputable = sorted(self.gone - set(lead.cached) - set(contents))
            if recomputable and rng.random() < 0.3:
                contents.append(rng.choice(recomputable))
            else:
                contents.append(self.fresh)
                self.fresh += 1
        for content in contents:
            self.depth_of.setdefault(content, len(hits) + len(self.depth_of) % 3)
        next_uses = [math.inf if rng.random() < 0.2 else self.now + rng.uniform(0, 50) for _ in hits + contents]
        cache_last = b // 20 % 2 == 0  # a partial last block is never cached
        chain = hits + (contents if cache_last else contents[:-1])
        n_lookup = max(len(chain) - b // 40 % 2, 0)  # the last block may not be hittable (vLLM's last token)
        request = self.requests
        self.requests += 1

        chains = []
        for pool in self.pools:
            hit_blocks = [pool.lookup(c) for c in hits]
            pool.touch(hit_blocks)
            before = set(pool.cached)
            new = pool.get_new_blocks(n_new, self.now)
            self.gone |= before - set(pool.cached)
            for i, (block, content) in enumerate(zip(hit_blocks + new, hits + contents)):
                hit = i < len(hits)
                pool.note_access(block, self.now, workload, self.depth_of[content], hit, next_uses[i], content)
                if not hit and (i < len(hits) + n_new - 1 or cache_last):
                    pool.cache(block, content)
            pool.admit(request, chain, self.now, workload, n_lookup, len(hits) + n_new)
            chains.append(hit_blocks + new)
        assert all(chain == chains[0] for chain in chains), "pools handed out different blocks"
        self.running.append((request, chains[0], chain))

    def finish(self, a: int):
        if self.running:
            request, blocks, chain = self.running.pop(a % len(self.running))
            contents, n_blocks = None, None
            if a % 3:  # its output filled blocks: the whole chain now (the partial last one included)
                contents = chain + list(range(self.fresh, self.fresh + a // 3 % 3))
                self.fresh += a // 3 % 3
                n_blocks = max(len(blocks), len(contents)) + a // 9 % 2
            n_output = None if a % 5 == 0 else a // 5 % 100  # the long-output candidate's limit is 50
            finish = a // 500 % 4 or None  # how it ended (kvprof.models.finish), or not known
            for pool in self.pools:
                pool.finish(request, self.now, contents, n_blocks, n_output, finish)
                pool.free_blocks(reversed(blocks), self.now)  # vLLM frees a chain tail-first

    def evict(self, k: int):
        for pool in self.pools:
            before = set(pool.cached)
            pool.evict(min(k, len(pool.policy)), self.now)
            self.gone |= before - set(pool.cached)


OPS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6), st.integers(0, 10**6)), max_size=120)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, num_blocks=st.integers(4, 24))
def test_lru_evicts_exactly_as_vllm_free_queue(ops, num_blocks):
    replica, pool = ReplicaBlockPool(num_blocks), PolicyPool(num_blocks, LRUPolicy())
    scenario = Scenario([pool, replica], pressure=False)
    for op in ops:
        scenario.step(*op)
        assert pool.num_free() == replica.num_free()
        assert set(pool.cached) == set(replica.cached)
    assert pool.evicted == replica.evicted


@pytest.fixture(params=["one by one", "in bulk"])
def bulk(request):
    """Run a test with frees pushed one block at a time in Python, then always in numpy."""
    saved = classed.ONE_BY_ONE_FREE
    if request.param == "in bulk":
        classed.ONE_BY_ONE_FREE = 0
    yield request.param
    classed.ONE_BY_ONE_FREE = saved


# --- the protocol, for every policy ----------------------------------------------------------


def default_class(workload: int) -> int:
    return workload if 0 <= workload < len(P) else len(P) - 1


def victim_keys(name: str, pool: PolicyPool, victims, now: float):
    """What each victim was chosen by, for the policies whose whole order a rule fixes."""
    if name == "wa":
        classes = [default_class(pool.workload[b]) for b in victims]
        ages = [now - pool.stamp[b] for b in victims]
        return reuse_probability(np.take(P, classes), np.take(LAM, classes), ages, 30.0)
    if name == "lfu":
        return [pool.count[b] for b in victims]
    if name == "belady":
        return [-pool.next_use[b] for b in victims]
    return None


def check_eviction_order(name: str, pool: PolicyPool, now: float):
    """order(now) == repeated evict(now) == evict_n; all evictable blocks, in the policy's rule."""
    policy = pool.policy
    twin = copy.deepcopy(policy)
    singles = [twin.evict(now) for _ in range(len(twin))]
    with pytest.raises(IndexError):
        twin.evict(now)
    assert sorted(singles) == sorted(pool.evictable())
    assert policy.order(now) == singles
    assert policy.order(now, len(singles) // 3) == singles[: len(singles) // 3]
    twin = copy.deepcopy(policy)
    half = len(singles) // 2
    assert twin.evict_n(half, now) == singles[:half]
    assert twin.order(now) == singles[half:]
    with pytest.raises(IndexError):
        twin.evict_n(len(twin) + 1, now)
    assert twin.order(now) == singles[half:], "a refused evict_n changed the policy"
    keys = victim_keys(name, pool, singles, now)
    if keys is not None:  # each victim is the lowest of those left: the keys never decrease
        assert all(a <= b + 1e-12 for a, b in zip(keys, keys[1:])), keys


@pytest.mark.parametrize("name", [*sorted(POLICIES), "wa+shadows"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, num_blocks=st.integers(4, 24))
def test_policy_keeps_the_protocol(name, ops, num_blocks, bulk):
    pool = PolicyPool(num_blocks, build(name))
    scenario = Scenario([pool])
    for op in ops:
        if op[0] == 3:
            check_eviction_order(name, pool, scenario.now)
        scenario.step(*op)
        evictable = pool.evictable()
        assert len(pool.policy) == len(evictable)
        assert all(block in pool.policy for block in evictable)
        assert not any(pool.refs[block] and block in pool.policy for block in range(num_blocks))
    check_eviction_order(name, pool, scenario.now)
    pool.policy.clear()
    assert len(pool.policy) == 0 and pool.policy.order(scenario.now) == []
    with pytest.raises(IndexError):
        pool.policy.evict(scenario.now)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, num_blocks=st.integers(4, 24))
def test_wa_with_one_cell_and_one_tier_is_lru(ops, num_blocks):
    lru, wa = PolicyPool(num_blocks, LRUPolicy()), PolicyPool(num_blocks, wa_policy([0.4], [0.05], tiers=1))
    scenario = Scenario([lru, wa], n_classes=1)
    for op in ops:
        scenario.step(*op)  # asserts that both pools hand out the same blocks
        assert wa.policy.order(scenario.now) == lru.policy.order(scenario.now)
    assert wa.evicted == lru.evicted


# --- wa and wa-paper --------------------------------------------------------------------------


def freed(policy, now, *blocks):
    """Allocate (block, workload, depth) at ``now`` and free them in the order given."""
    for block, workload, depth in blocks:
        policy.access(block, now, workload, depth)
    policy.free([block for block, _, _ in blocks], now)


def row(cell: int, tier: int = 0) -> int:
    """The list (row) of a block of ``cell`` in reuse ``tier``."""
    return cell * N_TIERS + tier


@settings(max_examples=200, deadline=None)
@given(
    p=st.sampled_from([0.0, 1e-9, 0.3, 0.999, 1.0]) | st.floats(0, 1),
    lam=st.sampled_from([0.0, 1e-6, 2.0]) | st.floats(0, 10),
    age=st.sampled_from([0.0, 1e4, 1e9]) | st.floats(0, 1e6),
)
def test_scalar_scores_equal_the_vectorised_models(p, lam, age):
    model = wa_policy([p], [lam])._order
    paper = PublishedWorkloadAwarePolicy([p], [lam])
    assert model.score(0, age) == pytest.approx(float(reuse_probability(p, lam, age, 30.0)), rel=1e-9, abs=1e-300)
    assert paper.score(0, age) == pytest.approx(float(published_score(p, lam, age, 5.0)), rel=1e-12, abs=1e-300)
    assert paper.score(0, math.inf) == float(published_score(p, lam, math.inf, 5.0)) == 0.0


def test_wa_evicts_the_cell_with_the_lower_score_not_the_older_block():
    wa = wa_policy([0.9, 0.1, 0.3], [0.01, 0.01, 0.01])
    freed(wa, 0.0, (1, 0, 0))  # older, but its cell is usually reused
    freed(wa, 10.0, (2, 1, 0))
    assert wa._order.score(row(1), 0.0) < wa._order.score(row(0), 10.0)
    assert wa.order(10.0) == [2, 1]
    lru = LRUPolicy()
    lru.free([1, 2], 0.0)
    assert lru.order(10.0) == [1, 2]


def test_wa_ties_go_to_the_deeper_block_then_the_older_access_then_the_lower_row():
    wa = wa_policy([0.5, 0.5, 0.5], [0.1, 0.1, 0.1])
    freed(wa, 0.0, (1, 0, 2), (2, 1, 5))
    assert wa.order(0.0) == [2, 1]  # same score: depth 5 beats cell 0
    never = wa_policy([0.5, 0.5, 0.5], [0.0, 0.0, 0.0])  # lam 0: every score is 0
    freed(never, 1.0, (1, 0, 3))
    freed(never, 0.0, (2, 1, 3))
    freed(never, 1.0, (3, 2, 3))
    assert never.order(1.0) == [2, 1, 3]  # older access first, then cell 0 before cell 2


def test_wa_ages_blocks_from_their_free_while_wa_paper_scores_never_hit_blocks_zero():
    def run(policy):
        policy.access(1, 0.0, 0, 0)
        policy.access(1, 50.0, 0, 0, hit=True)
        policy.free([1], 60.0)
        policy.access(2, 0.0, 1, 0)  # computed and never hit
        policy.free([2], 100.0)
        return policy.order(100.0)

    p, lam = [0.5, 0.5, 0.5], [0.1, 0.1, 0.1]
    assert run(wa_policy(p, lam)) == [1, 2]  # 1 is idle since 60, 2 since 100
    paper = PublishedWorkloadAwarePolicy(p, lam)
    assert run(paper) == [2, 1]
    assert paper.score(1, 100.0 - paper._stamp[2]) == 0.0  # the stale stamp


def test_wa_moves_a_block_to_its_last_toucher_cell_wa_paper_keeps_the_allocator():
    def run(policy):
        policy.access(1, 10.0, 0, 0)  # allocated by class 0 (reused soon, p 0.6)
        policy.access(1, 10.0, 2, 0, hit=True)  # hit by class 2 (rarely reused, p 0.2)
        policy.access(2, 10.0, 1, 0)
        policy.access(2, 10.0, 1, 0, hit=True)
        policy.free([2, 1], 10.0)
        return policy.order(10.0)

    assert run(build("wa")) == [1, 2]  # 1 scores as cell 2, the lowest
    assert run(build("wa-paper")) == [2, 1]  # 1 still scores as class 0, the highest


def test_wa_paper_ties_go_to_the_first_queue_not_the_deeper_block():
    paper = build("wa-paper")
    freed(paper, 0.0, (1, 2, 9), (2, 0, 1))  # never hit: both score 0
    assert paper.order(0.0) == [2, 1]
    wa = wa_policy([0.5] * 4, [0.1] * 4)
    freed(wa, 0.0, (1, 2, 9), (2, 0, 1))  # equal scores: the deeper block goes first
    assert wa.order(0.0) == [1, 2]


def test_wa_evict_n_scores_each_head_once(monkeypatch):
    """A batched eviction scores each block once, when it becomes its list's head."""
    wa = wa_policy(np.linspace(0.1, 0.9, 20), np.full(20, 0.05))
    for t in range(100):
        freed(wa, float(t), *[(t * 20 + c, c, 0) for c in range(20)])
    calls = []
    score = wa._order.score
    monkeypatch.setattr(wa._order, "score", lambda r, age: calls.append(r) or score(r, age))
    victims = wa.evict_n(1000, 200.0)
    assert len(victims) == len(set(victims)) == 1000 and len(wa) == 1000
    assert len(calls) == 20 + 999  # the 20 first heads, then the head after each victim but the last


def test_hits_move_a_block_up_the_reuse_tiers_and_a_recomputed_content_keeps_its_count():
    # Cell 0: fresh blocks rarely reused, blocks hit before almost surely (tiers 1 and up).
    p = np.array([[0.1, 0.99, 0.99, 0.99], [0.5, 0.5, 0.5, 0.5]])
    wa = WorkloadAwarePolicy(p, np.ones((2, N_TIERS, 1)), np.full((2, N_TIERS, 1), 0.01), 10.0,
                             orders=("model",), safety_net=False)
    wa.access(7, 0.0, workload=0, content="a")  # fresh block of cell 0
    wa.access(8, 0.0, workload=0, content="b")
    wa.access(8, 0.5, workload=0, hit=True)  # hit: tier 1
    wa.free([8, 7], 1.0)
    assert wa._class[7] == row(0, 0) and wa._class[8] == row(0, 1)
    assert wa.evict_n(2, 1.0) == [7, 8]
    wa.access(3, 2.0, workload=0, content="b")  # b's content comes back: one more than its hit count
    assert wa._hits[3] == 2 and wa._class[3] == row(0, 2)


def test_frequency_order_moves_beta_as_arc_moves_its_target():
    from kvprof.policy.orders import FrequencyOrder

    order = FrequencyOrder(N_TIERS, beta=1.0, adaptive=True, step=0.1)
    order.ghost_hit(0, [10, 30, 0, 0])  # a never-hit content wanted again: recency counts more
    assert order.beta == pytest.approx(1.0 - 0.1 * 3)
    order.ghost_hit(2, [10, 5, 0, 0])  # a hit content wanted again: frequency counts more
    assert order.beta == pytest.approx(0.7 + 0.1 * 2)
    fixed = FrequencyOrder(N_TIERS, beta=4.0, adaptive=False)
    fixed.ghost_hit(0, [1, 1, 1, 1])
    assert fixed.beta == 4.0
    # Tier t ages e^(beta t) times slower: a tier-1 block idle 10 s outlasts a fresh one idle 2 s.
    assert fixed.key(row(0, 1), 0.0, 0, 10.0) > fixed.key(row(0, 0), 8.0, 0, 10.0)


# --- baselines ------------------------------------------------------------------------------


def test_belady_evicts_the_farthest_next_use_deeper_first_on_ties():
    belady = BeladyPolicy()
    for block, next_use, depth in [(1, 5.0, 0), (2, math.inf, 1), (3, 50.0, 0), (4, math.inf, 4), (5, 50.0, 2)]:
        belady.access(block, 0.0, 0, depth, next_use=next_use)
    belady.free([1, 2, 3, 4, 5], 0.0)
    belady.remove(4)  # a hit pins it: no longer a candidate
    assert belady.order(1.0) == [2, 5, 3, 1]
    assert belady.evict(1.0) == 2 and 4 not in belady


def test_lfu_evicts_the_lowest_count_and_counts_restart_with_new_content():
    lfu = LFUPolicy()
    for block, hits in [(1, 2), (2, 0), (3, 1), (4, 0)]:
        lfu.access(block, 0.0)
        for _ in range(hits):
            lfu.access(block, 1.0, hit=True)
    lfu.free([1, 2, 3, 4], 2.0)
    assert lfu.order(3.0) == [2, 4, 3, 1]  # ties by free order
    assert lfu.evict_n(4, 3.0) == [2, 4, 3, 1]
    lfu.access(1, 4.0)  # block 1 reused for new content: its 3 accesses are gone
    lfu.access(3, 4.0, hit=True)
    lfu.free([3, 1], 5.0)
    assert lfu.order(5.0) == [1, 3]


def test_s3fifo_evicts_one_hit_blocks_first_and_recomputed_content_goes_to_main():
    s3 = S3FIFOPolicy(small_ratio=0.1)
    for block in range(10):
        s3.access(block, 0.0, content=100 + block)
    for block in (0, 1):
        s3.access(block, 1.0, hit=True)
    s3.free(range(10), 2.0)
    assert s3.evict_n(8, 3.0) == [2, 3, 4, 5, 6, 7, 8, 9]  # hit blocks 0, 1 were promoted to main
    s3.access(2, 4.0, content=102)  # content of evicted block 2 comes back: straight to main
    s3.access(3, 4.0, content=999)
    s3.free([2, 3], 5.0)
    assert s3.order(5.0) == [3, 0, 1, 2]


# --- registry -------------------------------------------------------------------------------


def hp_file() -> HpFile:
    return HpFile(
        classes={"text_1": ClassParams(p=0.4, lam=0.02), "image_1": ClassParams(p=0.7, lam=0.3)},
        default=ClassParams(p=0.3, lam=0.05, source="pooled"),
        horizon=60.0,
        class_rule=ClassRule(),
    )


def test_make_policy_builds_every_registered_policy_and_wa_from_the_hp_file():
    hp = hp_file()
    for name, cls in POLICIES.items():
        policy = make_policy(name, hp)
        assert type(policy) is cls and policy.name == name
    wa, paper = make_policy("wa", hp), make_policy("wa-paper", hp)
    names, p, lam = hp.table()
    assert wa.n_cells == len(hp.cell_names()) and wa.horizon == 60.0 and wa.keyed_by == "cell"
    np.testing.assert_array_equal(wa.p[:, 0], p)
    assert paper.horizon == 5.0 and (paper.p[-1], paper.lam[-1]) == (1.0, 0.0)
    assert paper.score(hp.index_of("search_1"), 0.0) == 0.0
    assert make_policy("wa", hp, horizon=10.0).horizon == 10.0
    assert make_policy("s3fifo", small_ratio=0.2).small_ratio == 0.2


def test_make_policy_names_the_problem():
    with pytest.raises(ValueError, match=r"unknown policy 'clock'.*lru, wa, wa-paper, lfu, s3fifo, arc, belady"):
        make_policy("clock")
    with pytest.raises(ValueError, match="'wa' needs an hp file"):
        make_policy("wa")


# --- the batched merge of ClassedLRUPolicy against a one-head-at-a-time reference ------------


class GreedyReference:
    """Class lists in free order and the textbook greedy merge: evict the lowest head, repeat.

    Keys are taken from the policy's own score function and side tables, so only the lists and
    the merge are independent of the implementation under test.
    """

    def __init__(self, policy):
        self.policy = policy
        self.lists = [[] for _ in range(policy.n_classes)]

    def free(self, blocks):
        for block in blocks:
            self.lists[int(self.policy._class[block])].append(block)

    def remove(self, block):
        for blocks in self.lists:
            if block in blocks:
                blocks.remove(block)

    def key(self, cls, block, now):
        return self.policy._key(cls, block, self.policy._stamp.item(block), now)

    def evict_n(self, n, now):
        victims = []
        for _ in range(n):
            cls = min((c for c, blocks in enumerate(self.lists) if blocks), key=lambda c: self.key(c, self.lists[c][0], now))
            victims.append(self.lists[cls].pop(0))
        return victims

    def order(self, now):
        shadow = GreedyReference(self.policy)
        shadow.lists = [list(blocks) for blocks in self.lists]
        return shadow.evict_n(sum(map(len, self.lists)), now)


MERGE_OPS = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10**6), st.integers(0, 10**6)), min_size=40, max_size=200)


@pytest.mark.parametrize("name", ["wa", "wa-paper"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=MERGE_OPS,
    params=st.lists(st.tuples(st.sampled_from([0.0, 0.3, 1.0]), st.sampled_from([0.0, 0.05, 800.0])), min_size=1, max_size=4),
)
def test_batched_merge_equals_the_greedy_reference(name, ops, params, bulk):
    """Cross-class score ties (p = 0, equal classes, underflow at lam = 800), clocks that step
    back, hits taking blocks out of the middle of lists: the order is the greedy merge's, with
    frees pushed one at a time and in bulk."""
    p, lam = [a for a, _ in params], [b for _, b in params]
    policy = wa_policy(p, lam) if name == "wa" else PublishedWorkloadAwarePolicy(p, lam)
    reference = GreedyReference(policy)
    held: set[int] = set(range(40))  # blocks a request holds: accessed, not evictable
    now = 0.0
    for kind, a, b in ops:
        now += (a % 5) - (1 if b % 11 == 0 else 0)  # mostly forward, sometimes back
        evictable = sorted(set(range(40)) - held)
        if kind <= 1 and held:  # a request finishes: some held blocks freed, tail first
            blocks = sorted(held)[a % len(held):][: b % 12 + 1]
            for i, block in enumerate(blocks):
                policy.access(block, now, (a + i) % (len(p) + 1) - 1, b % 4 + i, hit=bool(b & (1 << i)))
            blocks.reverse()
            policy.free(blocks, now)
            reference.free(blocks)
            held -= set(blocks)
        elif kind == 2 and evictable:  # a prefix hit takes an evictable block back
            block = evictable[a % len(evictable)]
            policy.remove(block)
            reference.remove(block)
            held.add(block)
        elif kind == 3 and evictable:
            k = a % len(evictable) + 1
            victims = policy.evict_n(k, now)
            assert victims == reference.evict_n(k, now)
            held |= set(victims)
        assert policy.order(now) == reference.order(now)
        assert len(policy) == 40 - len(held)


def test_class_fifos_compact_and_widen_under_churn():
    """A tiny buffer: pushes, hits in the middle of rows and merges force compaction and growth;
    runs of one stamp survive it, and a dry merge equals the taking one."""
    from kvprof.policy.fifos import ClassFifos

    rng = np.random.default_rng(3)
    fifos, model = ClassFifos(3, width=4), [[], [], []]
    fifos.reserve(200)
    free = list(range(200))
    rank = [2, 0, 1]  # row 1 first, then row 2, then row 0; one score per row: runs leave whole

    def key(cls, block, stamp, now):
        return (float(rank[cls]), cls)

    for step in range(3000):
        op = rng.integers(3)
        if op == 0 and free:
            blocks = np.array([free.pop(rng.integers(len(free))) for _ in range(min(len(free), rng.integers(1, 9)))])
            classes = rng.integers(0, 3, len(blocks))
            if step % 2:
                fifos.push(blocks, classes, float(step))
            else:
                for block, cls in zip(blocks.tolist(), classes.tolist()):
                    fifos.push_one(block, cls, float(step))
            for block, cls in zip(blocks.tolist(), classes.tolist()):
                model[cls].append(block)
        elif op == 1 and len(fifos):
            cls = rng.choice([c for c in range(3) if model[c]])
            block = model[cls].pop(rng.integers(len(model[cls])))
            fifos.remove(block)
            free.append(block)
        elif len(fifos):
            n = int(rng.integers(1, min(12, len(fifos)) + 1))
            expected = [b for c in (1, 2, 0) for b in model[c]][:n]
            assert list(fifos.merge(n, key, 0.0, take=False)) == expected
            assert list(fifos.merge(n, key, 0.0)) == expected
            for c in range(3):
                model[c] = [b for b in model[c] if b not in expected]
            free.extend(expected)
        assert len(fifos) == sum(map(len, model)) and fifos.live == [len(rows) for rows in model]
        assert all(d >= 0 for d in fifos.dead)
    with pytest.raises(KeyError):
        fifos.remove(free[0])
