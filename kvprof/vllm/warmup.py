"""Compile kvprof's core off the serving path, and load it before the policy needs it.

numba compiles a function the first time it is called with given argument types, or loads it from
its on-disk cache (``kvprof/core/__pycache__``, ``NUMBA_CACHE_DIR``, or numba's per-user cache
directory when the package directory cannot be written). Either way it happens at the first call:
without a warm-up the first request after an install waited 12 s and the first one that evicted
6.6 s. :func:`warm_up` drives throw-away copies of what the engine will call -- the pool's compiled
twin through every call the free queue makes, and the live counterfactual through an admission, blocks
taken while decoding, a finish and a recycled content.

With an empty cache that is minutes of CPU, so a server does not wait for it:
:func:`compile_in_child` runs :func:`warm_up` in a child process (``python -m kvprof.vllm.warmup``),
which fills the cache on another core while vLLM's own order serves (:mod:`kvprof.vllm.native`);
then :func:`warm_up` in the engine loads what the child compiled (about a second) and the policy
takes over (:class:`kvprof.vllm.live.LiveLoop`). ``kvprof warm`` fills a cache ahead, for an image.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from kvprof.policy import make_policy
from kvprof.vllm.numbering import ContentNumbers
from kvprof.vllm.observe import Counterfactual
from kvprof.vllm.spec import CONFIG_KEY, PolicySpec

_BLOCKS = 32


#: What :func:`warm_up` has run in this process (:func:`_key`): compiled or loaded, nothing left to compile.
_WARMED: set[tuple] = set()


def _key(spec: PolicySpec, pool, block_size: int) -> tuple:
    return spec.policy, spec.mode, spec.counterfactual_replays_policy, pool is not None, block_size


def warmed(spec: PolicySpec, pool, block_size: int) -> bool:
    """Whether this process ran :func:`warm_up` of the same paths already (a second engine's loop, a test)."""
    return _key(spec, pool, block_size) in _WARMED


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
    _WARMED.add(_key(spec, pool, block_size))
    return time.perf_counter() - started


def compile_in_child(spec: PolicySpec, pool: bool, block_size: int, started=None) -> tuple[int, float]:
    """Run :func:`warm_up` of ``spec`` in a child process, which compiles into the cache this process
    reads (the same interpreter, environment and package); returns its exit status and CPU seconds.

    The child reads the hp file in force from a copy (the file may be a pipe, or change meanwhile).
    ``started``, when given, is called with the child (:class:`subprocess.Popen`) once it runs, so that
    a caller can end it early.
    """
    with tempfile.TemporaryDirectory(prefix="kvprof-warm-") as directory:
        config = {"policy": spec.policy or "lru", "mode": spec.mode, "hint_counterfactual": spec.hint_counterfactual}
        if spec.hp is not None:
            config["config"] = os.path.join(directory, "hp.json")
            spec.hp.save(config["config"])
        command = [sys.executable, "-m", "kvprof.vllm.warmup", json.dumps({k: v for k, v in config.items() if v}),
                   "--block-size", str(block_size), *(["--pool"] if pool else [])]
        before = os.times()
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        if started is not None:
            started(child)
        _, errors = child.communicate()
        after = os.times()
        if child.returncode:
            logging.getLogger("vllm.kvprof").warning("kvprof: compiling in a child process failed (exit %d): %s",
                                                     child.returncode, errors.strip()[-2000:])
    return child.returncode, (after.children_user - before.children_user) + (after.children_system -
                                                                              before.children_system)


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
        counterfactual.admit(key, hashes[shift:shift + 4], 4 * block_size + 1, (0, 0), 1.0, n_first=5)
    counterfactual.grow([1, 2], 1.5)  # blocks running requests took while decoding, whoever took them
    counterfactual.grow([2], 1.6)  # taken again before a free claimed it: its old slot goes back first
    counterfactual.finish("a", hashes[:6], 4 * block_size + 1, 2 * block_size, 2.0, grown=[1, 2])
    counterfactual.finish("b", hashes[6:12], 4 * block_size + 1, 2 * block_size, 2.0)  # its decoded blocks not told
    counterfactual.admit("c", hashes[:2], 2 * block_size, (0, 0), 3.0)
    counterfactual.forget_request("c", 3.0)
    for name in counterfactual.tiers:
        counterfactual.safety_net(name)


def main(argv: list[str] | None = None) -> None:
    """The child of :func:`compile_in_child`: :func:`warm_up` of a ``kv_policy`` configuration (JSON)."""
    parser = argparse.ArgumentParser(prog="python -m kvprof.vllm.warmup", description=main.__doc__)
    parser.add_argument("config", help="the kv_policy configuration, as JSON")
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--pool", action="store_true", help="warm the GPU pool's calls too (enforce mode)")
    args = parser.parse_args(argv)
    os.nice(10)  # behind the server it compiles for: its start-up and its scheduler come first
    spec = PolicySpec.from_additional_config({CONFIG_KEY: json.loads(args.config)})
    warm_up(spec, object() if args.pool else None, args.block_size)


if __name__ == "__main__":
    main()
