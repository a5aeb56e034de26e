"""Free-queue cost: kvprof's policy-backed queue against vLLM's own FreeKVCacheBlockQueue.

Run with the vLLM venv's python (one process, no server)::

    .venv-vllm/bin/python benchmarks/bench_free_queue.py [--repeat 5]

For n in 512, 2048, 8192 blocks and 4 / 20 workload classes it times, per block:

* ``cycle`` -- ``popleft_n(n)`` then ``append_n`` of the same blocks (every block cached, so with
  kvprof every pop is a policy eviction and every append a policy free);
* ``remove`` -- taking blocks back on a prefix hit (``remove`` of every free block, then re-append);

for vLLM's native queue, kvprof's ``PolicyFreeQueue`` with ``lru`` and with ``wa`` (the compiled
twins the plugin serves with, :class:`kvprof.core.twin.CompiledTwin`), and a reference queue built
the published way: per-class LRU lists, every pop scans all class heads and computes an
exponential per head. Prints ns/block and the ratio to native.

Then, per call, ``popleft_n(n)`` + ``append_n`` for small n (1, 16, 64, 256) in a pool freed
request by request, as a serving vLLM sees it (:func:`bench_calls`): the shape of decode (one
block) and of prefill chunks, where fixed costs per call matter more than cost per block.

``--chain K`` instead times ``wa``'s twin alone (no queue) on a long prefix chain, per phase, in
ns/block: a pool of ``--pool`` blocks (the rest freed in chains of 64), a chain of ``K`` blocks in
random order freed tail first, each block taken back (``take``), the takes applied (the next call:
``remove_n``), and accessed again as hits; every third round the whole pool is evicted (``evict``)
and the chain allocated again (``access_miss``: ghost recalls). Min over ``--repeat`` rounds (x3).

``--through-pool N`` instead times what vLLM calls, the block pool: ``get_new_blocks(N)`` (evicting cached
blocks) + ``free_blocks`` of a request's ``N`` blocks, vLLM's ``BlockPool`` against kvprof's pool under
``lru`` and ``wa``, in a pool of ``--pool`` cached blocks; ns per block, the best of ``--repeat`` rounds.
Beside the queue's own figures it counts vLLM's loops over the blocks, which kvprof's pool shares
(its ``free_blocks`` collects the ids the policy needs in vLLM's own pass).

``--caching`` instead times the pool's ``cache_full_blocks`` of one block, as each decode step calls
it for every request that filled a block: vLLM's ``BlockPool`` against kvprof's pool under ``lru``
and ``wa`` (64 requests of 64 blocks in a pool of ``--pool`` blocks, each caching its next block in
turn; median us per call over ``--repeat`` rounds, and what kvprof adds to it).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import time
from collections import OrderedDict

import numpy as np
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, make_block_hash_with_group_id

from kvprof.core.twin import CompiledTwin
from kvprof.policy import make_policy
from kvprof.vllm.block_pool import FrontBlocks, KvprofBlockPool, PolicyFreeQueue


class PublishedQueue:
    """Per-class LRU lists; each pop scores every class head with an exp (PR #22236's way)."""

    def __init__(self, p, lam, life=5.0):
        self.p, self.lam, self.life = list(p), list(lam), life
        self.queues = [OrderedDict() for _ in p]
        self.cls, self.stamp = {}, {}

    def append_n(self, blocks, now):
        for b in blocks:
            self.queues[self.cls.get(b.block_id, 0)][b.block_id] = b
            self.stamp[b.block_id] = now

    def popleft_n(self, n, now):
        out = []
        for _ in range(n):
            best, best_c = None, -1
            for c, q in enumerate(self.queues):
                if q:
                    bid = next(iter(q))
                    lam = self.lam[c]
                    s = self.p[c] * math.exp(-lam * (now - self.stamp[bid])) * (1 - math.exp(-lam * self.life))
                    if best is None or s < best:
                        best, best_c = s, c
            out.append(self.queues[best_c].popitem(last=False)[1])
        return out

    def remove(self, b):
        del self.queues[self.cls.get(b.block_id, 0)][b.block_id]


def _hp(k, rng):
    """A real hp file with ``k`` classes of random parameters."""
    from kvprof.models.hp import HpFile

    p = rng.uniform(0.05, 0.95, k + 1)
    lam = rng.uniform(0.001, 0.5, k + 1)
    return HpFile.from_dict({
        "schema": "kvprof.hp/1", "horizon_s": 60.0, "min_gap_s": 0.3,
        "class_rule": {"key": "type_turn", "turn_cap": 5},
        "classes": {f"c{i}_1": {"p": float(p[i]), "lambda": float(lam[i])} for i in range(k)},
        "default": {"p": float(p[k]), "lambda": float(lam[k])},
    })


def _blocks(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    for b in blocks:
        b.set_block_hash(make_block_hash_with_group_id(b.block_id.to_bytes(8, "little"), 0))
    return blocks


def _time(fn, repeat):
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter_ns()
        fn()
        best = min(best, time.perf_counter_ns() - t)
    return best


def bench(n, k, repeat):
    rng = np.random.default_rng(0)
    hp = _hp(k, rng)
    _, hp_p, hp_lam = hp.table()
    blocks = _blocks(n)
    classes = rng.integers(0, k + 1, n).tolist()
    rows = {}

    native = FreeKVCacheBlockQueue(list(blocks))
    rows["native"] = (_time(lambda: native.append_n(native.popleft_n(n)), repeat),
                      _time(lambda: ([native.remove(b) for b in blocks], native.append_n(blocks)), repeat))

    for name in ("lru", "wa"):
        policy = CompiledTwin(make_policy(name, hp=hp), n)
        q = PolicyFreeQueue(blocks, policy, front=FrontBlocks(blocks, 0, 0))
        for b, c in zip(blocks, classes):
            policy.access(b.block_id, time.monotonic(), c, 0)
        q.append_n(blocks)
        rows[name] = (_time(lambda: q.append_n(q.popleft_n(n)), repeat),
                      _time(lambda: ([q.remove(b) for b in blocks], q.append_n(blocks)), repeat))

    pub = PublishedQueue(hp_p, hp_lam)
    pub.cls = dict(enumerate(classes))
    pub.append_n(blocks, time.monotonic())
    rows["published"] = (_time(lambda: pub.append_n(pub.popleft_n(n, time.monotonic()), time.monotonic()), repeat),
                         _time(lambda: ([pub.remove(b) for b in blocks], pub.append_n(blocks, time.monotonic())), repeat))
    return {name: (c / n, r / n) for name, (c, r) in rows.items()}


def bench_calls(k, pool, sizes, repeat):
    """Microseconds per ``popleft_n(n)`` + ``append_n`` in a served-looking pool.

    ``pool`` cached blocks freed one request (64 blocks, one class, tail first, depths 63..0) at a
    time, each at its own clock tick, and a tenth of them taken back by hits and freed again (dead
    entries in kvprof's lists); every append is another tick. This is vLLM's usual shape: decode
    takes one block, a prefill chunk a few dozen.
    """
    rng = np.random.default_rng(1)
    hp = _hp(k, rng)
    blocks = _blocks(pool)
    requests = [blocks[i:i + 64] for i in range(0, pool, 64)]
    classes = rng.integers(0, k + 1, len(requests)).tolist()
    hits = rng.choice(pool, pool // 10, replace=False).tolist()
    out = {}

    native = FreeKVCacheBlockQueue(list(blocks))
    for i in hits:
        native.remove(blocks[i])
    native.append_n([blocks[i] for i in hits])
    out["native"] = {n: _time(lambda n=n: native.append_n(native.popleft_n(n)), repeat) / 1e3 for n in sizes}

    for name in ("lru", "wa"):
        tick = [0.0]

        def clock():
            tick[0] += 0.01
            return tick[0]

        policy = CompiledTwin(make_policy(name, hp=hp), pool)
        q = PolicyFreeQueue(blocks, policy, clock=clock, front=FrontBlocks(blocks, 0, 0))
        for request, c in zip(requests, classes):
            for depth, b in enumerate(request):
                policy.access(b.block_id, clock(), c, depth)
            q.append_n(request[::-1])
        for i in hits:
            q.remove(blocks[i])
        q.append_n([blocks[i] for i in hits])
        out[name] = {n: _time(lambda n=n: q.append_n(q.popleft_n(n)), repeat) / 1e3 for n in sizes}
    return out


def bench_chain(pool, k, repeat):
    """ns/block of each phase of ``wa``'s twin on a chain of ``k`` blocks in a pool of ``pool`` (min)."""
    rng = np.random.default_rng(2)
    twin = CompiledTwin(make_policy("wa", hp=_hp(20, rng)), pool)
    tick = itertools.count(1.0, 0.01)  # the clock: a step per call
    others = np.arange(k, pool, dtype=np.int64)
    other_numbers = twin.numbers([("other", int(b)) for b in others])
    for i in range(0, len(others), 64):
        twin.access_numbered(others[i:i + 64], np.arange(len(others[i:i + 64])), other_numbers[i:i + 64], next(tick), 6,
                             hit=False)
        twin.free(others[i:i + 64][::-1], next(tick))
    chain, depths = rng.permutation(k).astype(np.int64), np.arange(k, dtype=np.int64)
    numbers, tail_first = twin.numbers([("chain", i) for i in range(k)]), chain[::-1].copy()
    twin.access_numbered(chain, depths, numbers, next(tick), 6, hit=False)
    phases = {name: [] for name in ("free", "take", "apply_taken", "access_hit", "evict", "access_miss")}

    def timed(name, fn, per=k):
        start = time.perf_counter_ns()
        fn()
        phases[name].append((time.perf_counter_ns() - start) / per)

    def take_back():
        take = twin.take
        for b in chain.tolist():
            take(b)

    for r in range(3 * repeat):
        timed("free", lambda: twin.free(tail_first, next(tick)))
        timed("take", take_back)
        timed("apply_taken", twin._apply_taken)
        timed("access_hit", lambda: twin.access_numbered(chain, depths, numbers, next(tick), 6, hit=True))
        if r % 3 == 2:  # the chain evicted with the whole pool, then allocated again
            twin.free(tail_first, next(tick))
            timed("evict", lambda: twin.evict_n_array(len(twin), next(tick)), pool)
            twin.access_numbered(others, np.zeros(len(others), np.int64), other_numbers, next(tick), 6, hit=False)
            twin.free(others[::-1], next(tick))
            timed("access_miss", lambda: twin.access_numbered(chain, depths, numbers, next(tick), 6, hit=False))
    return {name: min(times) for name, times in phases.items()}


def bench_caching(pool: int, repeat: int) -> dict[str, float]:
    """Median us per ``cache_full_blocks`` call of one block, by pool (see the module's docstring)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    specs = _specs()

    def make(kind):
        if kind == "native":
            return BlockPool(num_gpu_blocks=pool, enable_caching=True, hash_block_size=16)
        return KvprofBlockPool(num_gpu_blocks=pool, enable_caching=True, hash_block_size=16, kvprof_spec=specs[kind])

    medians: dict[str, list[float]] = {"native": [], "lru": [], "wa": []}
    for r in range(repeat):
        for kind in medians:  # alternating, each round on fresh pools and prompts
            blocks_pool, rng = make(kind), np.random.default_rng(r)
            requests = [Request(f"r{i}", rng.integers(100, 30000, 16 * 64).tolist(),
                                SamplingParams(max_tokens=1, extra_args={"type": "c0", "turn": 1}), None,
                                block_hasher=hasher) for i in range(64)]
            held = [blocks_pool.get_new_blocks(64) for _ in requests]
            times = []
            for k in range(64):
                for request, blocks in zip(requests, held):
                    start = time.perf_counter_ns()
                    blocks_pool.cache_full_blocks(request, blocks, k, k + 1, 16, 0)
                    times.append(time.perf_counter_ns() - start)
            medians[kind].append(float(np.median(times)) / 1e3)
            if kind != "native":
                blocks_pool.close()
    return {kind: min(values) for kind, values in medians.items()}


def bench_through_pool(pool: int, n: int, rounds: int) -> dict[str, float]:
    """ns per block of ``get_new_blocks(n)`` + ``free_blocks`` through the block pool vLLM calls, by pool.

    A pool of ``pool`` blocks is filled with cached requests of ``n`` blocks (16 tokens each, real block
    hashes), then each timed cycle allocates a new request's ``n`` blocks (evicting cached ones, as
    ``get_new_blocks`` does in vLLM), caches them (not timed: ``--caching`` times it) and frees them
    tail first. The pools alternate per round; the best round counts (the first pays numba's loading).
    """
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    specs = _specs()
    rng = np.random.default_rng(3)
    fill, cycles = pool // n, 64
    requests = [Request(f"r{i}", rng.integers(100, 30000, 16 * n).tolist(), SamplingParams(max_tokens=1), None,
                        block_hasher=hasher) for i in range(fill + cycles)]
    gc.collect()
    gc.freeze()  # the prompts are set-up, as vLLM's engine core freezes its start-up heap
    best = {"native": math.inf, "lru": math.inf, "wa": math.inf}
    for _ in range(rounds):
        for kind in best:
            blocks_pool = (BlockPool(num_gpu_blocks=pool + 1, enable_caching=True, hash_block_size=16)
                           if kind == "native" else
                           KvprofBlockPool(num_gpu_blocks=pool + 1, enable_caching=True, hash_block_size=16,
                                           kvprof_spec=specs[kind]))
            spent = 0
            for i, request in enumerate(requests):
                start = time.perf_counter_ns()
                held = blocks_pool.get_new_blocks(n)
                middle = time.perf_counter_ns()
                blocks_pool.cache_full_blocks(request, held, 0, n, 16, 0)
                resume = time.perf_counter_ns()
                blocks_pool.free_blocks(reversed(held))
                if i >= fill:  # the pool is full of cached blocks: every block allocated is an eviction
                    spent += middle - start + time.perf_counter_ns() - resume
            best[kind] = min(best[kind], spent / (cycles * n))
            if kind != "native":
                blocks_pool.close()
    return best


def _specs() -> dict:
    """The plugin's specs of ``lru`` and of ``wa`` (over a random hp file of 4 classes)."""
    import tempfile

    from kvprof.vllm.spec import PolicySpec

    with tempfile.TemporaryDirectory() as tmp:  # the hp file is read when a spec is made, here
        hp_path = f"{tmp}/hp.json"
        _hp(4, np.random.default_rng(0)).save(hp_path)
        return {kind: PolicySpec.from_additional_config({"kv_policy": {"policy": kind, **(
            {"config": hp_path} if kind == "wa" else {})}}) for kind in ("lru", "wa")}


def report(args) -> dict:
    """The mode's figures as one object: ``caching``, ``chain``, or ``per_block`` and ``per_call``
    (the shapes benchmarks/render_results.py documents)."""
    if args.caching:
        pool = max(args.pool, 4096 + 1)
        return {"caching": {"pool": pool, "us_per_call": bench_caching(pool, args.repeat)}}
    if args.through_pool:
        return {"through_pool": {"pool": args.pool, "blocks": args.through_pool,
                                 "ns_per_block": bench_through_pool(args.pool, args.through_pool, args.repeat)}}
    if args.chain:
        return {"chain": {"blocks": args.chain, "pool": args.pool,
                          "ns_per_block": bench_chain(args.pool, args.chain, args.repeat)}}
    return {"per_block": {str(k): {str(n): {name: list(pair) for name, pair in bench(n, k, args.repeat).items()}
                                   for n in args.sizes} for k in args.classes},
            "per_call": {str(k): {name: {str(n): us for n, us in row.items()}
                                  for name, row in bench_calls(k, args.pool, args.calls, 200 * args.repeat).items()}
                         for k in args.classes}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--classes", type=int, nargs="+", default=[4, 20])
    ap.add_argument("--pool", type=int, default=8192, help="pool size of the per-call part")
    ap.add_argument("--calls", type=int, nargs="+", default=[1, 16, 64, 256], help="n of the per-call part")
    ap.add_argument("--chain", type=int, default=0, help="time wa's twin on a chain of this many blocks instead")
    ap.add_argument("--caching", action="store_true", help="time cache_full_blocks of one block instead")
    ap.add_argument("--through-pool", type=int, default=0, metavar="N",
                    help="time get_new_blocks(N) + free_blocks through the block pool instead")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object instead of tables (benchmarks/render_results.py reads it)")
    args = ap.parse_args()
    if args.json:
        print(json.dumps(report(args)))
        return
    if args.caching:
        res = bench_caching(max(args.pool, 4096 + 1), args.repeat)
        print("cache_full_blocks of one block (decode), us per call (median; the best of --repeat rounds):")
        print("  ".join(f"{name} {us:.2f} (adds {us - res['native']:.2f})" for name, us in res.items()))
        return
    if args.through_pool:
        res = bench_through_pool(args.pool, args.through_pool, args.repeat)
        print(f"get_new_blocks({args.through_pool}) + free_blocks through the block pool, {args.pool} blocks, "
              "ns per block (x native):")
        print("  ".join(f"{name} {ns:.1f} ({ns / res['native']:.2f}x)" for name, ns in res.items()))
        return
    if args.chain:
        res = bench_chain(args.pool, args.chain, args.repeat)
        print(f"wa's twin, a chain of {args.chain} blocks in a pool of {args.pool}, ns/block "
              "(evict: per block of the pool):")
        print("  ".join(f"{name} {ns:.1f}" for name, ns in res.items()))
        return
    print(f"{'blocks':>6} {'classes':>7} {'queue':>10} {'cycle ns/blk':>13} {'x native':>9} {'remove ns/blk':>14} "
          f"{'x native':>9}")
    for k in args.classes:
        for n in args.sizes:
            res = bench(n, k, args.repeat)
            nc, nr = res["native"]
            for name, (c, r) in res.items():
                print(f"{n:>6} {k:>7} {name:>10} {c:>13.0f} {c / nc:>9.2f} {r:>14.0f} {r / nr:>9.2f}")
    print()
    print(f"per call in a pool of {args.pool} blocks freed request by request (us; x native):")
    print(f"{'classes':>7} {'queue':>7} " + " ".join(f"{f'n={n}':>17}" for n in args.calls))
    for k in args.classes:
        res = bench_calls(k, args.pool, args.calls, 200 * args.repeat)
        for name, row in res.items():
            cells = " ".join(f"{row[n]:>8.1f} ({row[n] / res['native'][n]:>5.1f}x)" for n in args.calls)
            print(f"{k:>7} {name:>7} {cells}")


if __name__ == "__main__":
    main()
