"""A replay acting as the router in front of several live servers (``kvprof replay --url A --url B --router R``).

Each request goes, when it is due, to the server the router picks; the routers are the
simulator's (:mod:`kvprof.sim.fleet`), so a live fleet and ``kvprof fleet`` route alike:

* ``round-robin``, ``session`` and ``prefix-approx --load-weight 0`` read only the trace: the
  whole routing is :func:`kvprof.sim.fleet.route`'s, decided before the first request (the very
  replicas ``kvprof fleet`` gives each request).
* ``least-loaded`` and load-weighing ``prefix-approx`` read the servers' loads: here the requests
  each server has in flight (sent, not yet answered), as the simulator's are its waiting and
  running requests.
* ``prefix-precise`` reads each server's real cache contents from its KV events
  (:class:`KvEventIndex`: vLLM's ``--kv-events-config`` publisher, over ZMQ), as llm-d's precise
  scorer and Dynamo's router do.

Outputs: each server's part of the replay in ``DIR/replica-K/`` exactly as a replay against that
server alone writes it, and the fleet in ``DIR`` (every request, with the ``replica`` it went to;
results.json with one run, the fleet's, labelled and laid out as ``kvprof fleet``'s rows).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path


from kvprof.errors import KvprofError
from kvprof.profiler.trace import Trace
from kvprof.replay.prompts import requests_of
from kvprof.replay.run import ReplayOutcome, ReplaySettings, _capacity, write_measured
from kvprof.replay.runner import Progress, send_all
from kvprof.replay.server import Server
from kvprof.sim.config import CostModel, SimConfig
from kvprof.sim.fleet import LeastLoaded, PrefixApprox, PrefixPrecise, RouterSpec, label, route
from kvprof.sim.workload import prepare_workload

#: What replica K's outputs are written in, under the fleet's output directory.
REPLICA_DIR = "replica-{}"
#: ZMQ's subscription takes a moment to reach a publisher that (re)connects: wait so long before the first request.
SUBSCRIBE_S = 1.0
_EVENTS_NEEDS = "prefix-precise reads the servers' KV events over ZMQ: it needs pyzmq and msgspec (or msgpack)"


def replica_dir(out: Path, replica: int) -> Path:
    return out / REPLICA_DIR.format(replica)


class KvEventIndex:
    """One server's cache contents as its KV events tell them (vLLM's ``BlockStored`` / ``BlockRemoved``
    / ``AllBlocksCleared``, decoded batches given to :meth:`apply`).

    Invariant: ``blocks`` counts, per content key (:func:`chain_keys` of the block's tokens and
    its prefix), the GPU blocks the server announced storing and has not announced removing.
    Applied from one thread and read from another, under its lock.
    """

    def __init__(self):
        self.blocks: Counter = Counter()
        self._key_of: dict = {}  # vLLM's block hash -> content key (content never changes under a hash)
        self._lock = threading.Lock()
        self.n_events = 0

    def depth(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` (a prompt's blocks, in order) are cached, leading ones only."""
        with self._lock:
            n = 0
            for key in keys:
                if not self.blocks[key]:
                    break
                n += 1
            return n

    def apply(self, batch) -> None:
        """Apply one decoded ``KVEventBatch`` (``[ts, events, rank]``, each event a map with its ``type``)."""
        with self._lock:
            for event in batch[1]:
                self.n_events += 1
                kind = event.get("type")
                if kind == "AllBlocksCleared":
                    self.blocks.clear()
                elif event.get("medium") not in (None, "GPU"):
                    continue  # another tier's blocks: not what a request hits first
                elif kind == "BlockStored":
                    parent_hash = event["parent_block_hash"]
                    parent = ROOT if parent_hash is None else self._key_of.get(_hashable(parent_hash))
                    if parent is None:
                        continue  # its prefix was announced before the router listened: no key to chain from
                    keys = chain_keys(event["token_ids"], event["block_size"], parent)
                    for block_hash, key in zip(event["block_hashes"], keys):
                        self._key_of[_hashable(block_hash)] = key
                        self.blocks[key] += 1
                elif kind == "BlockRemoved":
                    for block_hash in event["block_hashes"]:
                        key = self._key_of.get(_hashable(block_hash))
                        if key is not None and self.blocks[key] > 0:
                            self.blocks[key] -= 1


class KvEventListener:
    """A ZMQ SUB socket bound at ``endpoint``, where a server's KV events publisher connects (its
    ``--kv-events-config`` endpoint names this host), feeding ``index`` from a thread until :meth:`close`."""

    def __init__(self, endpoint: str):
        try:
            import zmq
        except ImportError:
            raise KvprofError(f"{_EVENTS_NEEDS} (pip install 'kvprof[replay]')") from None
        self.endpoint = endpoint
        self.index = KvEventIndex()
        self._decode = _msgpack_decoder()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise KvprofError(f"cannot listen for KV events at {endpoint}: {exc}") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name=f"kv-events {endpoint}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                frames = self._socket.recv_multipart()  # topic, sequence number, payload
                self.index.apply(self._decode(frames[-1]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)


#: The key chain_keys starts from: the empty prefix.
ROOT = 0


def chain_keys(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """A content key per full block of ``tokens``: the hash of its tokens and its prefix's key, as
    vLLM's block hashes chain (equal keys: equal prefixes), whatever vLLM's own hash function."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        keys.append(parent)
    return keys


def _hashable(block_hash):
    return bytes(block_hash) if isinstance(block_hash, (bytes, bytearray, memoryview)) else block_hash


def _msgpack_decoder() -> Callable[[bytes], object]:
    try:
        import msgspec

        return msgspec.msgpack.decode
    except ImportError:
        pass
    try:
        import msgpack
    except ImportError:
        raise KvprofError(f"{_EVENTS_NEEDS} (pip install 'kvprof[replay]')") from None
    return lambda data: msgpack.unpackb(data, raw=False, strict_map_key=False)


class _LivePrefixPrecise(PrefixPrecise):
    """The simulator's precise prefix router reading the live servers' KV event indexes: the overlap
    is the leading blocks of the prompt being sent that the server announced caching."""

    def __init__(self, n_replicas, workload, blocks, load_weight, indexes: Sequence[KvEventIndex]):
        super().__init__(n_replicas, workload, blocks, load_weight)
        self.indexes = indexes
        self.keys: list[int] = []  # the prompt being routed, its blocks' keys

    def overlap(self, j, r, caches):
        return self.indexes[j].depth(self.keys[: self.n_lookup[r]])


@dataclass(frozen=True)
class LiveRouter:
    """A simulator router in front of live servers: ``choose(index, prompt, loads)`` is the server of
    the request at ``index`` of the trace. Invariant: it picks exactly what :func:`kvprof.sim.fleet.route`
    picks when the router reads only the trace."""

    choose: Callable[[int, list[int], list[int]], int]
    listeners: tuple[KvEventListener, ...] = ()


def live_router(trace: Trace, spec: RouterSpec, replicas: int, capacity: int, block_size: int,
                rate_scale: float, events: Sequence[str] = ()) -> LiveRouter:
    """The router ``spec`` over ``replicas`` servers of ``capacity`` blocks of ``block_size`` tokens;
    ``events``: each server's KV events endpoint (for ``prefix-precise``, which reads them).

    Raises
    ------
    KvprofError
        ``prefix-precise`` without one KV events endpoint per server, or one that cannot be listened at.
    """
    workload = prepare_workload(trace, None, block_size, rate_scale)
    if not spec.reads_replicas:
        config = SimConfig(engine_block_size=block_size, cost=CostModel(), rate_scale=rate_scale, timing="model")
        chosen = route(trace, workload, None, spec, replicas, "lru", capacity, config).replica.tolist()
        return LiveRouter(lambda r, prompt, loads: chosen[r])
    if spec.name == "least-loaded":
        router = LeastLoaded(replicas)
        return LiveRouter(lambda r, prompt, loads: router.choose(r, loads, None))
    blocks = workload.block.tolist()
    if spec.name == "prefix-approx":
        approx = PrefixApprox(replicas, workload, blocks, spec.load_weight, spec.index_blocks or capacity)
        return LiveRouter(lambda r, prompt, loads: approx.choose(r, loads, None))
    if len(events) != replicas:
        raise KvprofError(f"prefix-precise reads each server's KV events: give one --kv-events endpoint per --url "
                          f"({replicas}), got {len(events)}")
    listeners: list[KvEventListener] = []
    try:
        for endpoint in events:
            listeners.append(KvEventListener(endpoint))
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    precise = _LivePrefixPrecise(replicas, workload, blocks, spec.load_weight, [one.index for one in listeners])

    def choose(r, prompt, loads):
        precise.keys = chain_keys(prompt, block_size)
        return precise.choose(r, loads, None)

    return LiveRouter(choose, tuple(listeners))


def run_fleet_replay(trace: Trace, settings: ReplaySettings, urls: Sequence[str], spec: RouterSpec, out: Path, *,
                     events: Sequence[str] = (), inputs: dict | None = None, progress: Progress | None = None,
                     plot=None) -> ReplayOutcome:
    """Replay ``trace`` through ``spec`` in front of the servers at ``urls`` (``settings.url`` is unused);
    write each server's outputs in ``DIR/replica-K`` and the fleet's in ``out``.

    Raises
    ------
    KvprofError
        A server unreachable, refusing the test request, without a capacity, or servers whose caches
        (blocks, block size) or models' context differ: before the first request, nothing written.
    """
    pacing = settings.pacing
    requests = requests_of(trace)
    with ExitStack() as stack:
        servers = [stack.enter_context(Server(url, settings.model, timeout_s=settings.timeout_s,
                                              max_connections=pacing.max_concurrency)) for url in urls]
        facts = []
        for url, server in zip(urls, servers):
            capacity, cache = _capacity(server, settings.capacity)
            facts.append({"url": url, "model": settings.model, **cache, "max_model_len": server.max_model_len(),
                          "capacity": capacity})
        _check_alike(facts)
        capacity, block_size = facts[0]["capacity"], facts[0]["block_size"] or pacing.block_tokens
        for server in servers:
            server.probe(pacing.vocab_size)
        router = live_router(trace, spec, len(urls), capacity, block_size, pacing.rate_scale, events)
        for listener in router.listeners:
            stack.callback(listener.close)
        if router.listeners:
            time.sleep(SUBSCRIBE_S)
        started = time.monotonic()
        sent = send_all(servers, requests, pacing, progress, max_model_len=facts[0]["max_model_len"],
                        classes=settings.classes, route=router.choose)
        wall = time.monotonic() - started
    complete = sent.stopped_by is None
    records = sent.records
    shares = [[r for r in records if r.replica == j] for j in range(len(urls))]
    per_replica = []
    for j, (share, fact) in enumerate(zip(shares, facts)):
        server_facts = {key: value for key, value in fact.items() if key != "capacity"}
        document, _, _ = write_measured(replica_dir(out, j), trace, share, replace(settings, url=fact["url"]),
                                        capacity, server_facts, wall, complete=complete, inputs=inputs)
        per_replica.append(document["runs"][0])
    fleet_facts = {"urls": list(urls), "model": settings.model, "num_gpu_blocks": facts[0]["num_gpu_blocks"],
                   "block_size": facts[0]["block_size"], "max_model_len": facts[0]["max_model_len"]}
    fields = fleet_fields(settings.policy, spec, per_replica)
    if router.listeners:  # what the router read: a server whose events never came was routed on load alone
        fields["replica_kv_events"] = [listener.index.n_events for listener in router.listeners]
    document, calibration, plots = write_measured(out, trace, records, settings, capacity, fleet_facts, wall,
                                                  complete=complete, inputs=inputs, plot=plot, run_fields=fields)
    if sent.stopped_by is not None and not isinstance(sent.stopped_by, KeyboardInterrupt):
        raise sent.stopped_by
    return ReplayOutcome(document, calibration, records, sent.stopped_by, plots)


def fleet_fields(policy: str, spec: RouterSpec, per_replica: list[dict]) -> dict:
    """The fields ``kvprof fleet`` gives a configuration's run, measured: its label as ``policy``, the
    fleet's token hit ratio, per replica requests, tokens and hit ratios, and the load imbalance (max /
    mean of the uncached prompt tokens each server computed). Each request's replica is in requests.jsonl."""
    prompt = [run["prompt_tokens"] for run in per_replica]
    cached = [run["cached_tokens"] for run in per_replica]
    work = [p - c for p, c in zip(prompt, cached)]
    mean = sum(work) / len(work)
    return {
        "policy": label(policy, spec.name, len(per_replica)),
        "fleet_policy": policy, "router": spec.name, "replicas": len(per_replica), "hp": "fleet",
        "load_weight": spec.load_weight, "index_blocks": spec.index_blocks,
        "fleet_token_hit_ratio": sum(cached) / sum(prompt) if sum(prompt) else None,
        "replica_requests": [run["n_requests"] for run in per_replica],
        "replica_prompt_tokens": prompt, "replica_cached_tokens": cached,
        "replica_token_hit_ratios": [run["token_hit_ratio"] for run in per_replica],
        "load_imbalance": max(work) / mean if mean else 1.0,
    }


def _check_alike(facts: list[dict]) -> None:
    """A fleet's servers must hold alike caches and serve alike models (the simulator's replicas do)."""
    for key in ("capacity", "block_size", "max_model_len"):
        values = {fact[key] for fact in facts}
        if len(values) > 1:
            seen = ", ".join(f"{fact['url']}: {fact[key]}" for fact in facts)
            raise KvprofError(f"the servers differ in {key} ({seen}); a fleet's replicas must be alike, as "
                              f"kvprof fleet simulates them")


__all__ = ["KvEventIndex", "KvEventListener", "LiveRouter", "chain_keys", "live_router", "run_fleet_replay"]
