"""kvprof beside one vLLM scheduler: recording, the live counterfactual, metrics, log lines, reloads.

:class:`LiveLoop` is built in the engine core with the scheduler (:mod:`kvprof.vllm.plugin`). The
scheduler thread calls only :meth:`LiveLoop.scheduled` (a request got its first blocks),
:meth:`LiveLoop.finished` (vLLM freed it) and :meth:`LiveLoop.poll` (take a reloaded policy); each
puts a reference on a bounded queue or swaps a reference, and never blocks. One background thread
does the rest:

* the counterfactual (:class:`kvprof.vllm.observe.Counterfactual`): LRU always, and in shadow
  mode the configured policy, each in a simulated tier of the server's size fed with the
  requests as the server scheduled and finished them;
* metrics (:mod:`kvprof.vllm.metrics`): per-class prompt and cached blocks, the counterfactual's
  and ``wa``'s shadows' hits, the leader, reloads, records, unclassified requests;
* a log line every ``log_interval_s``: the hit ratio of what serves and of LRU on the same traffic;
* reloads: every ``reload_interval_s`` it looks at the hp file; a changed, valid file becomes a new
  compiled policy that the scheduler thread swaps in at its next call (the pool keeps its cached
  blocks, their ages and reuse counts, and so does a CPU offload tier); an invalid one is logged with its location, counted,
  and the running policy stays.

The recorder (:class:`kvprof.vllm.record.Recorder`) has a thread of its own, so that a slow disk
delays nothing else.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from kvprof.policy import make_policy
from kvprof.recording import PROBE_TAG
from kvprof.vllm.handoff import Handoff
from kvprof.vllm.metrics import METRICS_DIR_ENV, Metrics
from kvprof.vllm.observe import Counterfactual
from kvprof.vllm.spec import ChangedWhileRead, KvPolicyConfigError, PolicySpec, load_spec_hp, request_extra_args

logger = logging.getLogger("vllm.kvprof")

#: Events the background thread may have waiting; past it they are dropped and counted.
EVENT_QUEUE = 1 << 16
#: Seconds between metric snapshots (what /metrics lags behind at most).
SNAPSHOT_S = 1.0
#: Seconds the background thread sleeps when no event waits.
POLL_S = 0.05
#: Distinct tag values logged (once each) as unclassified, and type values used as metric labels.
_DISTINCT_KEPT = 256


class LiveLoop:
    """Everything kvprof does beside (or, in enforce mode, inside) one vLLM scheduler.

    Invariants: the scheduler thread only enqueues events and swaps references; a request's
    counterfactual admission comes before its finish (one queue, in the scheduler's order);
    ``spec`` is the configuration in force (replaced whole on a reload).

    Parameters
    ----------
    spec : PolicySpec
    num_gpu_blocks : int
        vLLM's GPU KV-cache size in blocks, its null block included.
    block_size : int
        Tokens per block.
    start : dict
        The server's description for the recording (model, versions, policy).
    pool : KvprofBlockPool or None
        The pool kvprof's policy evicts in (enforce mode).
    """

    def __init__(self, spec: PolicySpec, *, num_gpu_blocks: int, block_size: int, start: dict, pool=None,
                 clock=time.time) -> None:
        self.spec = spec
        self.pool = pool
        self.block_size = block_size
        self.capacity = max(num_gpu_blocks - 1, 1)
        self._clock = clock
        self.metrics = Metrics()
        self.recorder = None
        if spec.record:
            from kvprof.vllm.record import Recorder

            self.recorder = Recorder(spec.record, block_size=block_size, rotate_s=spec.record_rotate_s,
                                     start={**start, "num_gpu_blocks": num_gpu_blocks, "hp_sha256": spec.hp_sha256})
        policies = {"lru": make_policy("lru")}
        if spec.policy is not None and spec.mode == "shadow" and spec.policy != "lru":
            policies[spec.policy] = spec.reference_policy(self.capacity)
        self.counterfactual = Counterfactual(policies, self.capacity, block_size)
        self._events = Handoff(EVENT_QUEUE)
        self._pending = None  # (spec, compiled twin) for the scheduler thread to swap in
        self._stop = threading.Event()
        self._seen: set = set()  # tag values already logged as unclassified
        self._types: set = set()
        self._file_state = _file_state(spec.config)
        self._next_reload = self._next_log = self._next_snapshot = 0.0
        self._interval = {"start": clock(), "lookups": 0, "cached": 0, "requests": 0, "cf_lookups": 0, "cf": {}}
        self._leader = None
        self._engine = str(os.getpid())
        self._metrics_dir = os.environ.get(METRICS_DIR_ENV)
        self._set_info(spec)
        self._thread = threading.Thread(target=self._run, name="kvprof-live", daemon=True)

    def begin(self) -> LiveLoop:
        now = self._clock()
        self._next_reload = now + self.spec.reload_interval_s
        self._next_log = now + self.spec.log_interval_s
        self._interval["start"] = now
        if self.recorder is not None:
            self.recorder.begin()
        self._thread.start()
        return self

    def close(self) -> None:
        """Take the events still waiting, write the last snapshot, close the recording."""
        self._stop.set()
        self._thread.join(10)
        if self.recorder is not None:
            self.recorder.close()
        self._snapshot()

    # -- scheduler thread -----------------------------------------------------------------
    def scheduled(self, request, now: float) -> None:
        """``request`` got its first blocks at ``now`` (seconds since the epoch)."""
        self._put(("admit", now, request))

    def finished(self, request, scheduled: float | None, hit_tokens: int, now: float) -> None:
        """vLLM freed ``request`` at ``now``; ``scheduled`` is when it got its first blocks (None:
        never), with ``hit_tokens`` of its prompt found in the prefix cache."""
        if self.recorder is not None:
            self.recorder.submit(request, scheduled, hit_tokens, now)
        self._put(("finish", now, request, scheduled is not None, hit_tokens))

    def poll(self) -> None:
        """Swap in a reloaded policy, if one is ready (the scheduler thread, between its calls to the pool)."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            spec, twin = pending
            self.pool.replace_policy(spec, twin)
            offload = sys.modules.get("kvprof.vllm.offload")  # imported only where vLLM offloads to CPU
            if offload is not None:
                offload.replace_policies(spec)
            self.spec = spec

    def _put(self, event) -> None:
        if not self._events.put(event):
            self.metrics.inc("kvprof_events_dropped_total")

    # -- background thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            event = self._events.take()
            if event is None:
                if self._stop.is_set():
                    break
                time.sleep(POLL_S)
            try:
                if event is not None:
                    self._handle(event)
                self._periodic()
            except Exception:  # noqa: BLE001 - kvprof must never stop serving
                logger.exception("kvprof: the background thread hit an error (serving goes on)")
            time.sleep(0)  # hand the GIL to the scheduler thread if it waits for it

    def _handle(self, event) -> None:
        kind, now, request = event[:3]
        key = request.request_id
        if kind == "admit":
            index = self._class_index(request)
            self.counterfactual.admit(key, request.block_hashes, request.num_prompt_tokens, (index, index), now)
            return
        admitted, hit_tokens = event[3:]
        self.counterfactual.finish(key, request.block_hashes, request.num_prompt_tokens,
                                   request.num_output_tokens, now)
        if not admitted:
            return
        size = self.block_size
        lookups = min(max(request.num_prompt_tokens - 1, 0) // size, len(request.block_hashes))
        cached = min(hit_tokens // size, lookups)
        label = self._class_label(request)
        self.metrics.inc("kvprof_prompt_blocks_total", lookups, **{"class": label})
        self.metrics.inc("kvprof_cached_blocks_total", cached, **{"class": label})
        interval = self._interval
        interval["lookups"] += lookups
        interval["cached"] += cached
        interval["requests"] += 1

    def _class_index(self, request) -> int:
        spec = self.spec
        if spec.hp is None:
            return 0
        return spec.class_index(request_extra_args(request), request.num_prompt_tokens)

    def _class_label(self, request) -> str:
        """The request's class for metric labels (a bounded set), counting unclassified requests."""
        tags = request_extra_args(request) or {}
        if PROBE_TAG in tags:  # kvprof replay's test request: no class, no warning
            return "<probe>"
        spec = self.spec
        if spec.hp is None:  # recording only: the type tag, while there are few of them
            kind = tags.get("type")
            if kind is None:
                return "<untagged>"
            kind = str(kind)
            if kind not in self._types and len(self._types) < _DISTINCT_KEPT:
                self._types.add(kind)
            return kind if kind in self._types else "<other>"
        name = spec.class_name(tags)
        reason = _unclassified(spec, tags, name)
        if reason is None:
            return name
        self.metrics.inc("kvprof_unclassified_requests_total", reason=reason)
        value = (reason, str(tags.get("workload", tags.get("type")))[:80], str(tags.get("turn"))[:20])
        if value not in self._seen and len(self._seen) < _DISTINCT_KEPT:
            self._seen.add(value)
            logger.warning("kvprof: a request tagged %s went to the default class (%s); logged once per value",
                           {k: tags[k] for k in ("workload", "type", "turn") if k in tags}, reason)
        return "<default>"

    def _periodic(self) -> None:
        now = self._clock()
        if now >= self._next_snapshot:
            self._next_snapshot = now + SNAPSHOT_S
            self._snapshot()
        if self.spec.log_interval_s and now >= self._next_log:
            self._next_log = now + self.spec.log_interval_s
            self._log_interval(now)
        if self.spec.reload_interval_s and self.spec.config and now >= self._next_reload:
            self._next_reload = now + self.spec.reload_interval_s
            self._maybe_reload()

    def _snapshot(self) -> None:
        metrics = self.metrics
        for name, hits in self.counterfactual.hits.items():
            metrics.set("kvprof_counterfactual_cached_blocks_total", hits, policy=name)
        net = self._safety_net()
        if net is not None:
            leader, names, hits = net
            for name, count in zip(names, hits):
                metrics.set("kvprof_shadow_cached_blocks_total", count, candidate=name)
            if self._leader is not None and leader != self._leader:
                metrics.inc("kvprof_leader_changes_total")
            self._leader = leader
            metrics.clear("kvprof_leader_info")
            metrics.set("kvprof_leader_info", 1, candidate=leader)
        if self.pool is not None:
            metrics.set("kvprof_evictions_total", self.pool.free_block_queue.evictions)
        if self.recorder is not None:
            metrics.set("kvprof_records_total", self.recorder.written, result="written")
            for reason, count in self.recorder.dropped.items():
                metrics.set("kvprof_records_total", count, result=reason)
        if self._metrics_dir:
            try:
                metrics.write(self._metrics_dir, self._engine)
            except OSError:
                pass  # the API server is gone (shutting down)

    def _safety_net(self):
        """``(leader, candidate names, shadow hits)`` of the ``wa`` that runs, or None."""
        if self.spec.policy is None:
            return None
        if self.pool is not None:
            twin = self.pool.policy
            net = twin.safety_net()
            if net is None:
                return None
            leader, hits = net
            return twin.reference.order_names[leader], twin.reference.order_names, hits.tolist()
        net = self.counterfactual.safety_net(self.spec.policy) if self.spec.policy in self.counterfactual.tiers else None
        if net is None:
            return None
        names = self.counterfactual.tiers[self.spec.policy].reference.order_names
        return names[net[0]], names, net[1].tolist()

    def _log_interval(self, now: float) -> None:
        interval = self._interval
        cf_hits = self.counterfactual.hits
        cf_lookups = self.counterfactual.lookups
        seconds = now - interval["start"]
        lookups = interval["lookups"]
        cf_delta = {name: hits - interval["cf"].get(name, 0) for name, hits in cf_hits.items()}
        cf_n = cf_lookups - interval["cf_lookups"]
        self._interval = {"start": now, "lookups": 0, "cached": 0, "requests": 0, "cf_lookups": cf_lookups,
                          "cf": dict(cf_hits)}
        if not lookups or not cf_n:
            return
        real = interval["cached"] / lookups
        lru = cf_delta["lru"] / cf_n
        spec = self.spec
        head = f"kvprof: last {seconds:.0f} s, {interval['requests']:,} requests, {lookups:,} prompt blocks: "
        if spec.policy is None or spec.mode == "shadow":
            line = head + f"vLLM's own eviction hit {100 * real:.1f} %"
            if spec.policy in cf_delta:
                wa = cf_delta[spec.policy] / cf_n
                line += (f"; {spec.policy} would have hit {100 * wa:.1f} % on the same traffic "
                         f"({_relative(wa, real)})")
            line += f" (lru replayed beside it: {100 * lru:.1f} %)"
        else:
            line = head + (f"{spec.policy} hit {100 * real:.1f} %; lru would have hit {100 * lru:.1f} % on the same "
                           f"traffic ({spec.policy} {_relative(real, lru)})")
        logger.info(line)

    def _set_info(self, spec: PolicySpec) -> None:
        hp = spec.hp
        self.metrics.clear("kvprof_info")
        self.metrics.set("kvprof_info", 1, policy=spec.policy or "none",
                         mode="record" if spec.policy is None else spec.mode, hp=spec.config or "",
                         hp_sha256=spec.hp_sha256 or "", recording=spec.record or "",
                         classes=len(spec.class_names) - 1 if hp is not None else 0,
                         cells=len(hp.cell_names()) - 1 if hp is not None else 0)

    # -- reloads (background thread) ----------------------------------------------------------
    def _maybe_reload(self) -> None:
        state = _file_state(self.spec.config)
        if state == self._file_state:
            return
        self._file_state = state
        try:
            hp, sha256 = load_spec_hp(self.spec.config)
            if sha256 == self.spec.hp_sha256:
                return
            spec = self.spec.with_hp(hp, sha256)
            if self.pool is not None:  # the scheduler thread swaps it in (poll)
                self._pending = (spec, spec.make_policy(capacity=self.pool.num_gpu_blocks,
                                                        n_blocks=self.pool.num_gpu_blocks))
            else:
                if spec.policy in self.counterfactual.tiers:
                    self.counterfactual.replace(spec.policy, spec.reference_policy(self.capacity))
                self.spec = spec
        except ChangedWhileRead:
            self._file_state = None  # read it again at the next look
            return
        except KvPolicyConfigError as err:
            self.metrics.inc("kvprof_reloads_total", result="error")
            logger.error("kvprof: not reloading %s, the running policy stays: %s", self.spec.config, err)
            return
        self.metrics.inc("kvprof_reloads_total", result="ok")
        self._set_info(spec)
        logger.info("kvprof: reloaded %s: %s", spec.config, spec.describe(self.capacity + 1))


def _file_state(path: str | None):
    """What tells that a file changed: inode, size and modification time (None: no such file)."""
    if not path:
        return None
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


def _unclassified(spec: PolicySpec, tags: dict, name: str | None) -> str | None:
    """Why a request with ``tags`` goes to the default class, or None when it has a class of its own."""
    if name is None:
        return "untagged"
    hp = spec.hp
    if "workload" in tags and tags["workload"] not in ("", None):
        known = name in hp.classes or name in hp.cell_names()[:-1]
        return None if known else "unknown_workload"
    turn = tags.get("turn")
    if turn is not None:
        try:
            int(turn)
        except (TypeError, ValueError):
            return "bad_turn"
    return None if name in hp.classes else "unknown_class"


def _relative(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.1f} %" if base > 0 else "n/a"


__all__ = ["LiveLoop"]
