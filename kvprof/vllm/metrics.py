"""kvprof's Prometheus metrics, counted in vLLM's engine cores and served on vLLM's own ``/metrics``.

vLLM serves ``/metrics`` from its API server process(es), while the scheduler (and so kvprof's
policy, recorder and counterfactual) lives in an engine core, another process, one per
data-parallel rank. Each engine core keeps plain counters (:class:`Metrics`) and writes a
snapshot of them once a second, atomically, into a directory the first process that validated
the configuration chose (``$KVPROF_METRICS_DIR``, inherited by every process vLLM starts after);
a collector (:class:`SnapshotCollector`) reads the snapshots at every scrape. It is registered
in the registry each API server serves: prometheus_client's default registry with one API
server; with ``--api-server-count`` above 1 vLLM switches prometheus_client to its multiprocess
mode and each API server serves a registry of its own holding a ``MultiProcessCollector``
(``vllm.v1.metrics.prometheus.get_prometheus_registry``), so kvprof's collector joins every
such registry when it is made (:func:`serve_on_vllm_metrics`). The snapshots are not written in
prometheus_client's multiprocess format: their gauges (``kvprof_info``) and counters set from a
count (the counterfactual's hits) would need per-metric aggregation modes, and whichever API
server answers a scrape reads the same files anyway.

Names follow Prometheus conventions: ``kvprof_`` prefix, ``_total`` for counters, ``_info`` for
the labels of what runs. Each snapshot's samples carry an ``engine`` label (the engine core's
process id) and a ``rank`` label (its data-parallel rank).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

from kvprof.atomic import atomic_write_text

#: Where the engine core writes its snapshot; set by the plugin in the API server process.
METRICS_DIR_ENV = "KVPROF_METRICS_DIR"

#: name -> (type, help); every metric kvprof reports.
FAMILIES = {
    "kvprof_info": ("gauge", "What kvprof runs in this engine: policy, mode (enforce, shadow, record), hp file, its "
                             "sha256, its classes and cells; value 1."),
    "kvprof_prompt_blocks_total": ("counter", "Prompt blocks that could have been prefix-cache hits "
                                              "((prompt tokens - 1) // block size), by workload class."),
    "kvprof_cached_blocks_total": ("counter", "Prompt blocks the server found in its prefix cache, by workload class."),
    "kvprof_evictions_total": ("counter", "Cached blocks kvprof's policy evicted (enforce mode)."),
    "kvprof_counterfactual_cached_blocks_total": (
        "counter", "Prompt blocks a policy run beside the server, on its own traffic and timing, would have found "
                   "cached (lru always; the configured policy in shadow mode)."),
    "kvprof_shadow_cached_blocks_total": ("counter", "Blocks the safety-net shadow of each candidate order of wa "
                                                     "would have hit."),
    "kvprof_leader_info": ("gauge", "The candidate order wa follows now; value 1."),
    "kvprof_leader_changes_total": ("counter", "Changes of wa's leading candidate order, observed once a second."),
    "kvprof_core_ready": ("gauge", "1 once kvprof's compiled core is loaded (compiled in a child process where "
                                   "its cache was empty): the counterfactual runs from then on and, in enforce "
                                   "mode, the policy takes over at the scheduler's next step; 0 before, while "
                                   "vLLM's own order serves."),
    "kvprof_handovers_total": ("counter", "Hand-overs from vLLM's own order, which serves while the compiled core "
                                          "loads, to kvprof's policy (enforce mode; one per engine start)."),
    "kvprof_reloads_total": ("counter", "Reloads of a changed hp file, by result (ok, error)."),
    "kvprof_records_total": ("counter", "Requests the recorder wrote (result=written) or dropped (result=queue_full, "
                                        "disk, error)."),
    "kvprof_unclassified_requests_total": ("counter", "Requests whose tags matched no class of the hp file and went "
                                                      "to the default class, by reason."),
    "kvprof_events_dropped_total": ("counter", "Scheduler events kvprof's background thread could not take (its "
                                               "queue was full): the counterfactual and the class counts miss them."),
    "kvprof_hint_blocks_total": ("counter", "What client hints did, in blocks (CPU tier: chunks), by tier (gpu, cpu) "
                                            "and outcome: retained_hits (retained blocks "
                                            "hit before they lapsed), lapsed (retentions that ran out of time), "
                                            "over_budget (retentions lapsed by --kv-hint-max-fraction), "
                                            "released_evicted, hinted_hits (hits on released or retained blocks), "
                                            "beyond_horizon (blocks whose retention, or its time left, was longer "
                                            "than an unhinted block lives in the cache: not retained, or lapsed), "
                                            "release_declined (blocks of "
                                            "releases not honoured: released sessions came back more often than "
                                            "those the policy evicted)."),
    "kvprof_hint_sessions_judged_total": ("counter", "Sessions chosen as victims and judged so far, by tier (gpu, "
                                                     "cpu), chosen (released: by a client's release naming it; "
                                                     "evicted: by the policy evicting its own blocks) and outcome "
                                                     "(returned within the horizon, stayed_away): a release is "
                                                     "honoured while the released return no more often than the "
                                                     "evicted."),
    "kvprof_hint_horizon_seconds": ("gauge", "How long an unhinted cached block lives in the GPU pool now (its "
                                             "evictable blocks over the eviction rate since the first eviction): "
                                             "the longest retention a client hint is honoured for; +Inf until the "
                                             "pool first evicts."),
    "kvprof_hinted_blocks": ("gauge", "Cached free blocks (CPU tier: chunks) held by client hints now, by tier "
                                      "(gpu, cpu) and pool (released: evicted first; retained: evicted last)."),
}


class Metrics:
    """Counters and gauges by (name, labels), written as a JSON snapshot.

    Invariant: every name is a key of :data:`FAMILIES`; counters only grow. Thread-safe: the
    background thread counts, and the scheduler thread may too.
    """

    def __init__(self) -> None:
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()

    def inc(self, name: str, amount: float = 1.0, **labels) -> None:
        key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels) -> None:
        key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
        with self._lock:
            self._values[key] = float(value)

    def clear(self, name: str) -> None:
        """Drop every sample of gauge ``name`` (before setting the one that holds now)."""
        with self._lock:
            for key in [k for k in self._values if k[0] == name]:
                del self._values[key]

    def get(self, name: str, **labels) -> float:
        return self._values.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), 0.0)

    def samples(self) -> list[tuple[str, dict, float]]:
        with self._lock:
            return [(name, dict(labels), value) for (name, labels), value in sorted(self._values.items())]

    def write(self, directory: str | Path, engine_labels: dict[str, str]) -> None:
        """The snapshot, atomically, as ``directory/engine-<engine>.json``; ``engine_labels``
        (``engine``, ``rank``) go on every sample."""
        document = {"labels": engine_labels, "samples": [[n, l, v] for n, l, v in self.samples()]}
        atomic_write_text(Path(directory) / f"engine-{engine_labels['engine']}.json", json.dumps(document))


def note_hints(metrics: Metrics, layers: Iterable, tier: str) -> None:
    """The counts of a tier's hint layers (:class:`~kvprof.policy.hinted.HintLayer`: their
    :class:`~kvprof.policy.hinted.HintCounters` summed, each field an ``outcome``), the sessions their
    releases and their policies' evictions chose, judged, and their hinted blocks now, labelled ``tier`` (``gpu``: the pool's layer; ``cpu``: the offload tiers'); at least one layer."""
    layers = list(layers)
    for field in dataclasses.fields(layers[0].counters):
        metrics.set("kvprof_hint_blocks_total", sum(getattr(layer.counters, field.name) for layer in layers),
                    outcome=field.name, tier=tier)
    for chosen in ("released", "evicted"):
        records = [getattr(layer, f"{chosen}_record") for layer in layers]
        for outcome in ("returned", "stayed_away"):
            metrics.set("kvprof_hint_sessions_judged_total", sum(getattr(record, outcome) for record in records),
                        chosen=chosen, outcome=outcome, tier=tier)
    metrics.set("kvprof_hinted_blocks", sum(layer.n_released for layer in layers), pool="released", tier=tier)
    metrics.set("kvprof_hinted_blocks", sum(layer.n_retained for layer in layers), pool="retained", tier=tier)


def offload_hint_layers() -> list:
    """The hint layers of this process's CPU offload tiers (:data:`kvprof.vllm.offload.TIERS`); none where
    vLLM offloads no KV cache to the CPU (the module is imported only where it does)."""
    offload = sys.modules.get("kvprof.vllm.offload")
    return [tier.hints for tier in list(offload.TIERS)] if offload is not None else []


def read_snapshots(directory: str | Path) -> list[tuple[str, dict, float]]:
    """Every engine's samples in ``directory``, each with its engine's labels; unreadable files are skipped."""
    out = []
    for path in sorted(Path(directory).glob("engine-*.json")):
        try:
            document = json.loads(path.read_text())
            engine_labels = {str(k): str(v) for k, v in document["labels"].items()}
            for name, labels, value in document["samples"]:
                if name in FAMILIES:
                    out.append((name, {**labels, **engine_labels}, float(value)))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not ours
    return out


class SnapshotCollector:
    """A prometheus_client collector of the engine cores' snapshots in ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def collect(self) -> Iterable:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        by_name: dict[str, list[tuple[dict, float]]] = {}
        for name, labels, value in read_snapshots(self.directory):
            by_name.setdefault(name, []).append((labels, value))
        for name, samples in by_name.items():
            kind, help_text = FAMILIES[name]
            label_names = sorted({k for labels, _ in samples for k in labels})
            if kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=label_names)
            else:
                family = GaugeMetricFamily(name, help_text, labels=label_names)
            for labels, value in samples:
                family.add_metric([labels.get(k, "") for k in label_names], value)
            yield family

    def describe(self) -> Iterable:
        return []  # unknown until scraped: prometheus_client then calls collect() only at scrape time


def serve_on_vllm_metrics() -> Path:
    """In an API server: the snapshot directory (made fresh and named in the environment the engine
    cores and other API servers inherit, unless an earlier process did), and its collector in the
    registry this process serves on ``/metrics``. Idempotent."""
    directory = os.environ.get(METRICS_DIR_ENV)
    if not (directory and Path(directory).is_dir()):
        import atexit
        import shutil
        import tempfile

        directory = tempfile.mkdtemp(prefix="kvprof-metrics-")
        os.environ[METRICS_DIR_ENV] = directory
        atexit.register(shutil.rmtree, directory, True)
    _register_collector(Path(directory))
    return Path(directory)


_registered: list[Path] = []  # the directory whose collector this process registered


def _register_collector(directory: Path) -> None:
    """One :class:`SnapshotCollector` of ``directory`` in the default registry, and in every registry
    that prometheus_client's multiprocess mode builds from now on (vLLM's, with several API servers)."""
    if _registered:
        return
    _registered.append(directory)
    from prometheus_client import REGISTRY, multiprocess

    REGISTRY.register(SnapshotCollector(directory))
    base = multiprocess.MultiProcessCollector

    class MultiProcessAndKvprofCollector(base):
        """prometheus_client's collector of its multiprocess files; registering it registers
        kvprof's snapshot collector beside it."""

        def __init__(self, registry, path=None):
            super().__init__(registry, path)
            if registry is not None and registry is not REGISTRY:
                registry.register(SnapshotCollector(directory))

    multiprocess.MultiProcessCollector = MultiProcessAndKvprofCollector
