"""Compile kvprof's core before vLLM reports ready, not inside the first requests.

numba compiles a function the first time it is called with given argument types, or loads it from
its on-disk cache (``kvprof/core/__pycache__``, or numba's per-user cache directory when the package
directory cannot be written). Either way it happens at the first call: without this, the first
request after an install waited 12 s and the first one that evicted 6.6 s. :func:`warm_up` drives
throw-away copies of what the engine will call -- the pool's compiled twin through every call the
free queue makes, and the live counterfactual through an admission, a finish and a recycled content --
while the scheduler is being built, which vLLM does before it answers ``/health``.
"""

from __future__ import annotations

import time

from kvprof.policy import make_policy
from kvprof.vllm.numbering import ContentNumbers
from kvprof.vllm.observe import Counterfactual
from kvprof.vllm.spec import PolicySpec

_BLOCKS = 32


def warm_up(spec: PolicySpec, pool, block_size: int) -> float:
    """Run every compiled path once on throw-away objects; returns the seconds it took."""
    started = time.perf_counter()
    if pool is not None:
        twin = spec.make_policy(capacity=_BLOCKS, n_blocks=_BLOCKS)
        twin.feed_shadows_in_background()  # as the pool runs it
        _drive_twin(twin, spec.default_index)
        twin.close()
        _drive_numbering()
    policies = {"lru": make_policy("lru")}
    if spec.counterfactual_replays_policy:  # the counterfactual takes no hints
        policies[spec.policy] = spec.reference_policy(_BLOCKS)
    _drive_counterfactual(Counterfactual(policies, _BLOCKS // 2, block_size, max_contents=8), block_size)
    return time.perf_counter() - started


def _drive_twin(twin, workload: int) -> None:
    """Every call :class:`kvprof.vllm.block_pool.PolicyFreeQueue` and its pool make, as they make them."""
    now = 1.0
    for hit in (False, True):
        twin.access_chain([1, 2, 3], [0, 1, 2], [b"a", b"b", b"c"], now, workload, hit=hit)
    twin.access_chain(list(range(4, 20)), list(range(16)), [bytes([i]) for i in range(16)], now, workload, hit=False)
    twin.free([3], now)  # one block: free_one
    twin.free(list(range(19, 3, -1)), now)
    twin.take(4)
    twin.remove(5)
    assert 6 in twin and len(twin)
    twin.order(now + 1)
    twin.evict(now + 1)
    twin.evict_n(2, now + 1)
    twin.evict_n_array(2, now + 1)
    twin.admit_numbered("warm-up", twin.numbers([b"a", b"b"]), now, workload, n_lookup=2, n_blocks=2)
    twin.finish_numbered("warm-up", now, twin.numbers([b"a", b"b", b"c"]), n_blocks=3)
    twin.safety_net()
    twin.free([1, 2], now + 2)


def _drive_numbering() -> None:
    """The pool's content numbering: lookups, a table that grows, recycled numbers (40 keys past 33)."""
    numbers = ContentNumbers(max_contents=33)
    numbers.numbers([bytes([i]) for i in range(40)])
    numbers.numbers([bytes([i]) for i in range(10, 20)])
    numbers.number(b"one")  # a decode's one block


def _drive_counterfactual(counterfactual: Counterfactual, block_size: int) -> None:
    hashes = [bytes([i]) for i in range(12)]
    for key, shift in (("a", 0), ("b", 6)):  # the second recycles content numbers (max_contents=8)
        counterfactual.admit(key, hashes[shift:shift + 4], 4 * block_size + 1, (0, 0), 1.0)
    for key, shift in (("a", 0), ("b", 6)):
        counterfactual.finish(key, hashes[shift:shift + 6], 4 * block_size + 1, 2 * block_size, 2.0)
    counterfactual.admit("c", hashes[:2], 2 * block_size, (0, 0), 3.0)
    counterfactual.forget_request("c", 3.0)
    for name in counterfactual.tiers:
        counterfactual.safety_net(name)
