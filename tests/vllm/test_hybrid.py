"""kvprof's pool serving a hybrid model: a full-attention and a sliding-window KV cache group in one pool.

vLLM's CPU build serves such a model (a tiny Gemma-3, see docs/vllm.md, "Hybrid models"), but what
each group's blocks go through is checked here, in process, as vLLM's own prefix-caching tests do:
vLLM's real ``KVCacheManager`` (its ``HybridKVCacheCoordinator``, ``FullAttentionManager`` and
``SlidingWindowManager``) is given a ``KVCacheConfig`` with the two groups and driven through the
calls its scheduler makes (:mod:`kv_cache_driver`; KV events and residency metrics of the hybrid
pool: test_kv_events.py).

* Sliding-window blocks no future request can hit are handed out before any cached block, under
  vLLM's pool and under kvprof's ``wa``, and nothing cached is given up for them.
* A sliding-window hit tells the policy each block's depth in the request.
* A Mamba state group is refused with a message that says why and what to do instead.

Runs inside the vLLM venv (the test re-runs itself there when this interpreter has no vLLM).
"""

from __future__ import annotations

import pytest

from kv_cache_driver import BLOCK, WINDOW, drive, kv_cache_config, kv_cache_manager, policy_spec

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("policy", [None, "wa"])
def test_blocks_no_request_can_hit_go_first(policy, monkeypatch, in_vllm):
    """With vLLM's default retention the sliding-window group caches only the blocks ending a
    reachable prefix; the others (left behind by the window, or masked) are hash-less when freed
    and are handed out before any cached block of either group, under vLLM's pool and kvprof's."""
    if not in_vllm:
        return
    manager = kv_cache_manager(monkeypatch, 40, policy)
    pool = manager.block_pool
    prompt = list(range(100, 100 + 10 * BLOCK + 5))  # 10 full blocks, then decode past the next boundary
    run = drive(manager, [(prompt, BLOCK, 0)])
    assert run.hits == [0]
    cached = {b.block_id for b in pool.blocks if b.block_hash is not None}
    full, swa = run.blocks[0]
    assert set(full[:10]) <= cached  # full attention: every full block
    swa_cached = [i for i in swa if i in cached]
    assert 0 < len(swa_cached) < 5, "the sliding-window group keeps only the blocks a later hit needs"
    free = pool.free_block_queue.get_all_free_blocks()
    n_plain = sum(b.block_hash is None for b in free)
    assert n_plain > 5 and all(b.block_hash is None for b in free[:n_plain]), "hash-less blocks come first"
    handed = pool.get_new_blocks(n_plain)
    assert all(b.block_hash is None for b in handed)
    pool.free_blocks(handed)
    assert {b.block_id for b in pool.blocks if b.block_hash is not None} == cached  # nothing cached was given up
    again = drive(manager, [(prompt[: 10 * BLOCK + 1], 1, 0)])
    assert again.hits == [10 * BLOCK]  # both groups still hit the whole prompt


def test_sliding_window_hits_reach_the_policy_at_their_depth(monkeypatch, in_vllm):
    """A sliding-window group touches only its window's blocks: the policy is told each block's
    position in the request (what ``wa``'s depth features and its safety net read), not its index
    among the touched blocks."""
    if not in_vllm:
        return
    manager = kv_cache_manager(monkeypatch, 64, "wa", retention=None)  # dense: every sliding-window block cached
    pool = manager.block_pool
    prompt = list(range(500, 500 + 8 * BLOCK + 3))
    drive(manager, [(prompt, 1, 0)])
    second = drive(manager, [(prompt, 1, 0)])
    assert second.hits == [8 * BLOCK]
    full, swa = second.blocks[0]
    touched = [i for i in swa if i != 0][: WINDOW // BLOCK]  # the window's blocks the hit touched
    assert touched, "the sliding-window group must hit"
    def depths(ids):  # wa's core keeps each block's depth (the pool does not keep it too)
        import numpy as np

        return pool.policy.touches(np.array(ids, dtype=np.int64))[1].tolist()

    assert depths(touched) == [swa.index(i) for i in touched]
    assert depths(full[:8]) == list(range(8))


def test_a_mamba_group_is_refused_with_a_clear_message(in_vllm):
    if not in_vllm:
        return
    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    from kvprof.vllm.plugin import check_kv_cache_groups
    from kvprof.vllm.spec import KvPolicyConfigError

    mamba = KVCacheGroupSpec(["layers.2.mamba"], MambaSpec(block_size=BLOCK, shapes=((4,),), dtypes=(torch.float32,)))
    config = kv_cache_config(32, extra=mamba)
    with pytest.raises(KvPolicyConfigError, match=r"KV cache group 2 \(layers.2.mamba\) holds Mamba state") as err:
        check_kv_cache_groups(policy_spec("lru"), config)
    assert "--kv-policy-mode shadow" in str(err.value) and str(err.value).startswith("kvprof kv_policy:")
    check_kv_cache_groups(policy_spec("lru", mode="shadow"), config)  # vLLM's own eviction stays: nothing to refuse
    check_kv_cache_groups(policy_spec("lru"), kv_cache_config(32))  # full + sliding window is served


# --- served: a tiny Gemma-3 (sliding-window + full-attention layers) through `vllm serve` -----------

SERVED_BLOCKS = 24  # shared by both groups: the test sequence's prompts (4 blocks + 4 tokens) evict


@pytest.fixture(scope="module")
def hybrid_model(vllm_venv, tmp_path_factory):
    """The tiny Gemma-3, built as conftest's ``tiny_model`` builds the Llama."""
    import subprocess

    from vllm_support import HERE, serves_on_cpu, vllm_python

    if not serves_on_cpu(vllm_venv):
        pytest.skip(f"{vllm_venv} holds vLLM's upstream (CUDA) build, which cannot serve without a GPU")

    out = tmp_path_factory.mktemp("tiny-gemma3") / "model"
    subprocess.run([vllm_python(vllm_venv), str(HERE / "tiny_hybrid_model.py"), str(out)], check=True, timeout=600)
    return out


def _served(vllm_venv, model, tmp_path_factory, name: str, *extra: str, events: bool = False) -> dict:
    """The test sequence of test_serve.py served once, with its results, kvprof's metrics and the log;
    with ``events``, the server publishes its KV events over ZMQ (``--kv-events-config``) and they
    are collected as a router would."""
    import json
    import time
    import urllib.request

    from test_serve import run_sequence
    from vllm_support import free_port, vllm_server

    log = tmp_path_factory.mktemp(f"hybrid-{name}") / "vllm.log"
    subscriber = None
    if events:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        extra = (*extra, "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                           "endpoint": endpoint, "topic": "kv"}))
        subscriber = _EventSubscriber(endpoint)
    with vllm_server(vllm_venv, model, *extra, log=log, blocks=SERVED_BLOCKS) as url:
        time.sleep(1.0)  # ZMQ's slow joiner: the subscription reaches the publisher before the first event
        results = run_sequence(url)
        time.sleep(1.5)  # kvprof's metrics snapshot is at most a second old; the last events are published
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
    run = {"results": results, "metrics": metrics, "log": log.read_text(),
           "events": subscriber.close() if subscriber else None}
    (log.parent / "run.json").write_text(json.dumps({"results": results, "metrics": metrics}))  # for a look after
    return run


@pytest.fixture(scope="module")
def served(vllm_venv, hybrid_model, hp_file, tmp_path_factory) -> dict:
    """The sequence served by vLLM's own pool, by kvprof's ``lru`` and by ``wa``: one server at a time."""
    return {
        "vllm": _served(vllm_venv, hybrid_model, tmp_path_factory, "vllm"),
        "lru": _served(vllm_venv, hybrid_model, tmp_path_factory, "lru", "--kv-policy", "lru"),
        "wa": _served(vllm_venv, hybrid_model, tmp_path_factory, "wa", "--kv-policy-config", str(hp_file),
                      events=_HAS_ZMQ),
    }


try:
    import msgspec  # noqa: F401 - vLLM's dependencies: the vLLM venv has them
    import zmq  # noqa: F401

    _HAS_ZMQ = True
except ImportError:
    _HAS_ZMQ = False


class _EventSubscriber:
    """A ZMQ SUB socket bound to the endpoint vLLM's KV events publisher connects to, as a router's;
    read by a thread until :meth:`close`."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._socket.bind(endpoint)  # vLLM's publisher connects to an endpoint that names a host, binds "*"
        self._frames: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                _topic, _seq, payload = self._socket.recv_multipart()
                self._frames.append(payload)

    def close(self) -> list:
        """The events received, in order, decoded as vLLM's ``KVEventBatch``."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        return [event for frame in self._frames for event in decoder.decode(frame).events]


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.slow
def test_the_served_model_has_a_full_and_a_sliding_window_group(served):
    for run in served.values():
        assert "kv cache group sizes (32, 32)" in run["log"]
    assert "2 KV cache groups (FullAttentionSpec, SlidingWindowSpec)" in served["wa"]["log"] or \
        "2 KV cache groups (SlidingWindowSpec, FullAttentionSpec)" in served["wa"]["log"]


@pytest.mark.slow
def test_greedy_outputs_are_identical_with_and_without_the_policy(served):
    tokens = {name: [r["tokens"] for r in run["results"]] for name, run in served.items()}
    assert tokens["lru"] == tokens["vllm"]
    assert tokens["wa"] == tokens["vllm"]
    assert len({tuple(t) for t in tokens["vllm"]}) > 2, "the model must not answer every prompt alike"


@pytest.mark.slow
def test_lru_hits_what_vllms_pool_hits_and_wa_evicts(served):
    cached = {name: [r["cached"] for r in run["results"]] for name, run in served.items()}
    assert cached["lru"] == cached["vllm"]
    assert any(cached["vllm"])
    assert _metric(served["wa"]["metrics"], "kvprof_evictions_total") > 0
    assert _metric(served["lru"]["metrics"], "kvprof_cached_blocks_total") * 32 == sum(cached["lru"])


@pytest.mark.slow
def test_a_router_sees_every_eviction_of_the_served_pool(served):
    """``--kv-events-config`` under ``wa``: a BlockRemoved for each block kvprof evicted, every
    removal of a block announced before, both groups' blocks announced."""
    from collections import Counter

    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    events = served["wa"]["events"]
    if events is None:
        pytest.skip("no zmq/msgspec in this interpreter (run the vLLM tests with the vLLM venv's python)")
    index: Counter = Counter()
    removed = 0
    for event in events:
        if isinstance(event, BlockStored):
            index.update((h, event.group_idx) for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            for key in ((h, event.group_idx) for h in event.block_hashes):
                assert index[key] > 0, f"BlockRemoved of {key}, never stored"
                index[key] -= 1
                removed += 1
    assert {e.group_idx for e in events if isinstance(e, BlockStored)} == {0, 1}
    assert removed == _metric(served["wa"]["metrics"], "kvprof_evictions_total") > 0
