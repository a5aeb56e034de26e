"""kvprof's Prometheus metrics, counted in vLLM's engine core and served on vLLM's own ``/metrics``.

vLLM serves ``/metrics`` from its API server process, while the scheduler (and so kvprof's
policy, recorder and counterfactual) lives in the engine core, another process. The engine core
keeps plain counters (:class:`Metrics`) and writes a snapshot of them once a second, atomically,
into a directory the API server chose when it validated the configuration
(``$KVPROF_METRICS_DIR``); a collector registered in the API server's default registry
(:class:`SnapshotCollector`) reads the snapshots at every scrape. So the metrics appear beside
vLLM's own, at most a second old, whatever vLLM release and without prometheus_client's
multiprocess mode (which vLLM turns on only for several API servers, and which would hide the
API server's own metrics if switched on late). With ``--api-server-count`` above 1 vLLM serves a
registry of its own making: kvprof's metrics are then not on ``/metrics`` (docs/vllm.md).

Names follow Prometheus conventions: ``kvprof_`` prefix, ``_total`` for counters, ``_info`` for
the labels of what runs. Each snapshot's samples carry an ``engine`` label (the engine core's
index in ``$KVPROF_METRICS_DIR``).
"""

from __future__ import annotations

import json
import os
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
    "kvprof_reloads_total": ("counter", "Reloads of a changed hp file, by result (ok, error)."),
    "kvprof_records_total": ("counter", "Requests the recorder wrote (result=written) or dropped (result=queue_full, "
                                        "disk, error)."),
    "kvprof_unclassified_requests_total": ("counter", "Requests whose tags matched no class of the hp file and went "
                                                      "to the default class, by reason."),
    "kvprof_events_dropped_total": ("counter", "Scheduler events kvprof's background thread could not take (its "
                                               "queue was full): the counterfactual and the class counts miss them."),
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

    def write(self, directory: str | Path, engine: str) -> None:
        """The snapshot, atomically, as ``directory/engine-<engine>.json``."""
        document = {"engine": engine, "samples": [[n, l, v] for n, l, v in self.samples()]}
        atomic_write_text(Path(directory) / f"engine-{engine}.json", json.dumps(document))


def read_snapshots(directory: str | Path) -> list[tuple[str, dict, float]]:
    """Every engine's samples in ``directory``, each with its ``engine`` label; unreadable files are skipped."""
    out = []
    for path in sorted(Path(directory).glob("engine-*.json")):
        try:
            document = json.loads(path.read_text())
            for name, labels, value in document["samples"]:
                if name in FAMILIES:
                    out.append((name, {**labels, "engine": str(document["engine"])}, float(value)))
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
    """In the API server: a fresh snapshot directory, named in the environment the engine cores
    inherit, and its collector in prometheus_client's default registry (the one vLLM's
    ``/metrics`` serves with a single API server). Idempotent."""
    directory = os.environ.get(METRICS_DIR_ENV)
    if directory and Path(directory).is_dir():
        return Path(directory)
    import atexit
    import shutil
    import tempfile

    from prometheus_client import REGISTRY

    directory = tempfile.mkdtemp(prefix="kvprof-metrics-")
    os.environ[METRICS_DIR_ENV] = directory
    REGISTRY.register(SnapshotCollector(directory))
    atexit.register(shutil.rmtree, directory, True)
    return Path(directory)
