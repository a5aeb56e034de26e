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
  and the running policy stays. The file on disk is compared with what is in force, so the newest
  valid file wins even when an earlier reload still waits for the scheduler; the metrics say what
  is in force.

Every engine core (a data-parallel rank) runs a loop of its own: its own policy, counterfactual,
metrics (labelled with its ``rank``) and reloads of the same hp file.

The recorder (:class:`kvprof.vllm.record.Recorder`) has a thread of its own, so that a slow disk
delays nothing else.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from kvprof.models.finish import UNKNOWN
from kvprof.policy import make_policy
from kvprof.recording import PROBE_TAG
from kvprof.vllm.handoff import Handoff
from kvprof.vllm.metrics import METRICS_DIR_ENV, Metrics, note_hints, offload_hint_layers
from kvprof.vllm.observe import Counterfactual
from kvprof.vllm.spec import KvPolicyConfigError, PolicySpec, load_spec_hp, request_extra_args
from kvprof.vllm.warmup import compile_in_child, warm_up, warmed

logger = logging.getLogger("vllm.kvprof")

#: Events the background thread may have waiting; past it they are dropped and counted.
EVENT_QUEUE = 1 << 16
#: Seconds between metric snapshots (what /metrics lags behind at most).
SNAPSHOT_S = 1.0
#: Seconds the background thread sleeps when no event waits.
POLL_S = 0.05
#: Distinct tag values logged (once each) as unclassified, and type values used as metric labels.
_DISTINCT_KEPT = 256
#: Why a request goes to the default class (``kvprof_unclassified_requests_total``'s reasons).
UNCLASSIFIED_REASONS = ("untagged", "unknown_workload", "unknown_class", "bad_turn")
#: What becomes of a request the recorder is given (``kvprof_records_total``'s results).
RECORD_RESULTS = ("written", "queue_full", "disk", "error")


class LiveLoop:
    """Everything kvprof does beside (or, in enforce mode, inside) one vLLM scheduler.

    Invariants: the scheduler thread only enqueues events and swaps references; a request's
    counterfactual admission comes before its finish (one queue, in the scheduler's order);
    ``spec`` is the configuration in force (replaced whole on a reload); at most one reload waits
    for the scheduler thread (``_pending``, taken and replaced under ``_swap``), and it is never
    of the file in force; the hand-over from vLLM's own order to the compiled policy waits beside it
    (``_handover``, set once, taken first). Every series the loop will report exists from its start, at 0.

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
    rank : int
        The engine core's data-parallel rank (the ``rank`` label of its metrics).
    """

    def __init__(self, spec: PolicySpec, *, num_gpu_blocks: int, block_size: int, start: dict, pool=None,
                 rank: int = 0, clock=time.time) -> None:
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
        self._counterfactual: Counterfactual | None = None  # built once the compiled core is loaded
        self._ready = threading.Event()
        self._child = None  # the process compiling the core, while it runs
        self._events = Handoff(EVENT_QUEUE)
        self._pending = None  # (spec, compiled twin, offloaded) of a reload, for the scheduler thread to swap in
        self._handover = None  # the same of the spec in force, once its compiled core is loaded
        self._swap = threading.Lock()
        self._shown = None  # the spec kvprof_info describes
        self._stop = threading.Event()
        self._seen: set = set()  # tag values already logged as unclassified
        self._types: set = set()
        self._file_state = _file_state(spec.config)
        self._next_reload = self._next_log = self._next_snapshot = 0.0
        self._interval = {"start": clock(), "lookups": 0, "cached": 0, "requests": 0, "cf_lookups": 0, "cf": {}}
        self._leader = None
        self._labels = {"engine": str(os.getpid()), "rank": str(rank)}
        self._metrics_dir = os.environ.get(METRICS_DIR_ENV)
        self._declare()
        self._show_in_force()
        self._thread = threading.Thread(target=self._run, name="kvprof-live", daemon=True)
        self._warming = threading.Thread(target=self._get_ready, name="kvprof-warm-up", daemon=True)

    def begin(self) -> LiveLoop:
        now = self._clock()
        self._next_reload = now + self.spec.reload_interval_s
        self._next_log = now + self.spec.log_interval_s
        self._interval["start"] = now
        if self.recorder is not None:
            self.recorder.begin()
        self._warming.start()
        self._thread.start()
        return self

    def close(self) -> None:
        """Take the events still waiting, write the last snapshot, close the recording."""
        self._stop.set()
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()  # the server stops before the core was compiled
        self._thread.join(10)
        if self.recorder is not None:
            self.recorder.close()
        self._snapshot()

    # -- scheduler thread -----------------------------------------------------------------
    def scheduled(self, request, now: float, n_first: int | None = None) -> None:
        """``request`` got its first blocks at ``now`` (seconds since the epoch), ``n_first`` of them
        (None: its prompt's)."""
        self._put(("admit", now, request, n_first))

    def grew(self, block_ids: list[int], now: float) -> None:
        """Running requests took the blocks ``block_ids`` at ``now`` (which request learns at its free)."""
        self._put(("grow", now, block_ids))

    def finished(self, request, scheduled: float | None, hit_tokens: int, now: float, code: int = UNKNOWN,
                 grown: list[int] = (), grown_at: list[float] = ()) -> None:
        """vLLM freed ``request`` at ``now``; ``scheduled`` is when it got its first blocks (None:
        never), with ``hit_tokens`` of its prompt found in the prefix cache; it ended as finish
        ``code`` says (:mod:`kvprof.vllm.finish`); ``grown`` are the blocks it took after its first
        ones (:meth:`grew`), in depth order, taken at the times ``grown_at``."""
        if self.recorder is not None:
            self.recorder.submit(request, scheduled, hit_tokens, now, code, grown_at)
        self._put(("finish", now, request, scheduled is not None, hit_tokens, code, grown))

    def poll(self) -> None:
        """Swap in the compiled policy or a reloaded one, if one is ready (the scheduler thread, between its
        calls to the pool)."""
        if self._pending is None and self._handover is None:
            return
        with self._swap:
            handover, self._handover = self._handover, None
            pending, self._pending = self._pending, None
            if handover is not None:
                started = time.perf_counter()
                spec, twin, offloaded = handover
                self.pool.replace_policy(spec, twin)
                if offloaded:
                    sys.modules["kvprof.vllm.offload"].hand_over(spec, offloaded)
                self.metrics.inc("kvprof_handovers_total")
                logger.info("kvprof: %s is in force from this step on; vLLM's own order served until now "
                            "(%d cached free blocks handed over in %.3f s)", handover[0].policy, len(handover[1]),
                            time.perf_counter() - started)
            if pending is not None:
                self._swap_in(*pending)
                self._put_in_force(pending[0])

    def _swap_in(self, spec: PolicySpec, twin, offloaded) -> None:
        self.pool.replace_policy(spec, twin)
        offload = sys.modules.get("kvprof.vllm.offload")  # imported only where vLLM offloads to CPU
        if offload is not None and offloaded is not None:
            offload.replace_policies(spec, offloaded)

    def _put_in_force(self, spec: PolicySpec) -> None:
        """``spec``, a reloaded hp file's, is in force from now on (the recording lists it)."""
        self.spec = spec
        if self.recorder is not None:
            self.recorder.reloaded(spec.hp_sha256, spec.config)

    def _put(self, event) -> None:
        if not self._events.put(event):
            self.metrics.inc("kvprof_events_dropped_total")

    # -- background thread ----------------------------------------------------------------
    def _get_ready(self) -> None:
        """Compile the core in a child process (nothing to compile when the cache holds it), load it here,
        build the counterfactual, and in enforce mode the policy for the scheduler thread to take over
        with (:meth:`poll`); until then events wait and vLLM's own order serves."""
        spec, pool = self.spec, self.pool
        try:
            started = time.perf_counter()
            child = "none: this process has it already"
            if not warmed(spec, pool, self.block_size):
                status, cpu = compile_in_child(spec, pool is not None, self.block_size, self._started_child)
                child = f"exit {status}, {cpu:.1f} s of CPU"
                self._child = None
            if self._stop.is_set():
                return
            loaded = warm_up(spec, pool, self.block_size)  # loads what the child compiled; compiles if it failed
            counterfactual = self._new_counterfactual()
            handing_over = getattr(pool, "serves_natively", False)
            if handing_over:
                twin = spec.make_policy(capacity=pool.num_gpu_blocks, n_blocks=pool.num_gpu_blocks)
                offload = sys.modules.get("kvprof.vllm.offload")  # imported only where vLLM offloads to CPU
                offloaded = offload.native_tiers_policies(spec) if offload is not None else []
                with self._swap:
                    self._handover = (spec, twin, offloaded)
            self._counterfactual = counterfactual
            self._ready.set()
            self.metrics.set("kvprof_core_ready", 1)
            logger.info("kvprof: compiled core ready in %.1f s (compiled in a child process: %s; loaded here in "
                        "%.1f s)%s", time.perf_counter() - started, child, loaded,
                        "; the policy takes over at the scheduler's next step" if handing_over else "")
        except Exception:  # noqa: BLE001 - kvprof must never stop serving
            logger.exception("kvprof: the compiled core could not be loaded; vLLM's own order goes on serving")

    @property
    def counterfactual(self) -> Counterfactual:
        """The replays beside the server: built by a begun loop once its core is loaded (:meth:`_get_ready`),
        on first use by one not begun (handed its events directly)."""
        if self._counterfactual is None:
            self._counterfactual = self._new_counterfactual()
        return self._counterfactual

    def _replayed(self) -> tuple[str, ...]:
        """What the counterfactual replays: lru, and the policy in force where it runs without its hints or
        only beside vLLM's eviction (the counterfactual takes no hints)."""
        return ("lru", self.spec.policy) if self.spec.counterfactual_replays_policy else ("lru",)

    def _new_counterfactual(self) -> Counterfactual:
        policies = {name: make_policy(name) if name == "lru" else self.spec.reference_policy(self.capacity)
                    for name in self._replayed()}
        return Counterfactual(policies, self.capacity, self.block_size)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the compiled core is loaded and the counterfactual runs (:meth:`_get_ready`)."""
        return self._ready.wait(timeout)

    def _started_child(self, child) -> None:
        self._child = child
        if self._stop.is_set():
            child.kill()

    def _run(self) -> None:
        while True:
            event = self._events.take() if self._ready.is_set() else None  # events wait for the counterfactual
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
        if kind == "grow":
            self.counterfactual.grow(request, now)  # the blocks taken, whoever took them
            return
        key = request.request_id
        if kind == "admit":
            index = self._class_index(request)
            self.counterfactual.admit(key, request.block_hashes, request.num_prompt_tokens, (index, index), now,
                                      n_first=event[3])
            return
        admitted, hit_tokens, code, grown = event[3:]
        lookups = self.counterfactual.finish(key, request.block_hashes, request.num_prompt_tokens,
                                             request.num_output_tokens, now, code, grown=grown)
        if not admitted or lookups is None:
            return
        if PROBE_TAG in (request_extra_args(request) or {}):
            return  # kvprof replay's test request (no full block): no class, no warning, not one of the traffic's
        # the same requests and prompt blocks the counterfactual counted: a window compares like with like
        cached = min(hit_tokens // self.block_size, lookups)
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
        if self.spec is not self._shown:  # (a reload's: none before the compiled core is loaded)
            self._show_in_force()
        if now >= self._next_snapshot:
            self._next_snapshot = now + SNAPSHOT_S
            self._snapshot()
        if not self._ready.is_set():
            return  # interval lines and reloads wait for the compiled core
        if self.spec.log_interval_s and now >= self._next_log:
            self._next_log = now + self.spec.log_interval_s
            self._log_interval(now)
        if self.spec.reload_interval_s and self.spec.config and now >= self._next_reload:
            self._next_reload = now + self.spec.reload_interval_s
            self._maybe_reload()

    def _snapshot(self) -> None:
        metrics = self.metrics
        for name, hits in (self._counterfactual.hits.items() if self._counterfactual is not None else ()):
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
            note_hints(metrics, [self.pool.free_block_queue.hints], "gpu")
            metrics.set("kvprof_hint_horizon_seconds", self.pool.free_block_queue.hint_horizon())
        offloaded = offload_hint_layers()
        if offloaded:
            note_hints(metrics, offloaded, "cpu")
        if self.recorder is not None:
            metrics.set("kvprof_records_total", self.recorder.written, result="written")
            for reason, count in self.recorder.dropped.items():
                metrics.set("kvprof_records_total", count, result=reason)
        if self._metrics_dir:
            try:
                metrics.write(self._metrics_dir, self._labels)
            except OSError:
                pass  # the API server is gone (shutting down)

    def _safety_net(self):
        """``(leader, candidate names, shadow hits)`` of the ``wa`` that runs, or None."""
        if self.spec.policy is None:
            return None
        if self.pool is not None:
            twin = self.pool.policy
            net = twin.safety_net(wait=False)  # metrics: never wait for (or race with) the shadows' thread
            if net is None:
                return None
            leader, hits = net
            return twin.reference.order_names[leader], twin.reference.order_names, hits.tolist()
        counterfactual = self._counterfactual
        if counterfactual is None or self.spec.policy not in counterfactual.tiers:
            return None
        net = counterfactual.safety_net(self.spec.policy)
        if net is None:
            return None
        names = counterfactual.tiers[self.spec.policy].reference.order_names
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
        if not lookups or not cf_n:  # (both count the same finished requests: both are 0 or neither)
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
            if spec.policy in cf_delta and spec.policy != "lru":  # the hint counterfactual
                unhinted = cf_delta[spec.policy] / cf_n
                line += (f"; without the clients' hints it would have hit {100 * unhinted:.1f} % "
                         f"(the hints {_relative(real, unhinted)})")
        logger.info(line)

    def _declare(self) -> None:
        """Every series this loop reports, at 0 until it counts (Prometheus shows a series from the start)."""
        metrics, spec = self.metrics, self.spec
        for name in ("kvprof_events_dropped_total",) + (("kvprof_evictions_total",) if self.pool is not None else ()):
            metrics.inc(name, 0)
        if self.pool is not None:
            note_hints(metrics, [self.pool.free_block_queue.hints], "gpu")
            metrics.set("kvprof_hint_horizon_seconds", self.pool.free_block_queue.hint_horizon())
        for name in self._replayed():
            metrics.inc("kvprof_counterfactual_cached_blocks_total", 0, policy=name)
        metrics.set("kvprof_core_ready", 0)
        if self.pool is not None:
            metrics.inc("kvprof_handovers_total", 0)
        if self.recorder is not None:
            for result in RECORD_RESULTS:
                metrics.inc("kvprof_records_total", 0, result=result)
        if spec.config:
            for result in ("ok", "error"):
                metrics.inc("kvprof_reloads_total", 0, result=result)
        if spec.hp is not None:
            for reason in UNCLASSIFIED_REASONS:
                metrics.inc("kvprof_unclassified_requests_total", 0, reason=reason)
        if spec.policy is not None and getattr(spec.reference_policy(self.capacity), "_shadows", None):  # wa's net
            metrics.inc("kvprof_leader_changes_total", 0)

    def _show_in_force(self) -> None:
        """``kvprof_info`` (and each class's counters, at 0 until used) of the spec in force now."""
        spec = self.spec
        if self._shown is not None and spec.hp_sha256 != self._shown.hp_sha256:
            logger.info("kvprof: %s (sha256 %s) is in force", spec.config, spec.hp_sha256[:12])
        self._shown = spec
        hp = spec.hp
        self.metrics.clear("kvprof_info")
        self.metrics.set("kvprof_info", 1, policy=spec.policy or "none",
                         mode="record" if spec.policy is None else spec.mode, hp=spec.config or "",
                         hp_sha256=spec.hp_sha256 or "", recording=spec.record or "",
                         classes=len(spec.class_names) - 1 if hp is not None else 0,
                         cells=len(hp.cell_names()) - 1 if hp is not None else 0)
        labels = spec.class_names if hp is not None else ()
        for label in labels:
            for name in ("kvprof_prompt_blocks_total", "kvprof_cached_blocks_total"):
                self.metrics.inc(name, 0, **{"class": label})

    # -- reloads (background thread) ----------------------------------------------------------
    def _maybe_reload(self) -> None:
        """Take the hp file on disk if it differs from the newest one taken (in force or waiting for
        the scheduler thread); when it is the one in force again, the waiting one is dropped."""
        state = _file_state(self.spec.config)
        if state == self._file_state:
            return
        self._file_state = state
        try:
            hp, sha256 = load_spec_hp(self.spec.config)
            with self._swap:
                newest = (self._pending[0] if self._pending is not None else self.spec).hp_sha256
            if sha256 == newest:  # touched, or rewritten with the same bytes
                return
            spec = self.spec.with_hp(hp, sha256)
            spec.check_block_size(self.block_size)
            twin = offloaded = None
            if self.pool is not None and sha256 != self.spec.hp_sha256:  # built here, swapped in by poll
                twin = spec.make_policy(capacity=self.pool.num_gpu_blocks, n_blocks=self.pool.num_gpu_blocks)
                offload = sys.modules.get("kvprof.vllm.offload")
                offloaded = offload.build_policies(spec) if offload is not None else None
        except KvPolicyConfigError as err:
            self.metrics.inc("kvprof_reloads_total", result="error")
            logger.error("kvprof: not reloading %s, the running policy stays: %s", self.spec.config, err)
            return
        with self._swap:
            if sha256 == self.spec.hp_sha256:  # back to the file in force
                dropped, self._pending = self._pending, None
                message = "the reload waiting for the scheduler is dropped" if dropped else "nothing to swap"
            elif self.pool is not None:  # the scheduler thread swaps it in (poll)
                if spec.hint_counterfactual and spec.policy in self.counterfactual.tiers:
                    self.counterfactual.replace(spec.policy, spec.reference_policy(self.capacity))
                self._pending = (spec, twin, offloaded)
                message = "in force from the scheduler's next step"
            else:
                if spec.policy in self.counterfactual.tiers:
                    self.counterfactual.replace(spec.policy, spec.reference_policy(self.capacity))
                self._put_in_force(spec)
                message = "in force now"
        self.metrics.inc("kvprof_reloads_total", result="ok")
        logger.info("kvprof: reloaded %s (sha256 %s), %s: %s", spec.config, sha256[:12], message,
                    spec.describe(self.capacity + 1))


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
