"""A whole replay: the server checked, the trace sent, and its outputs written.

The run's capacity is the server's GPU KV-cache size in blocks, so the live point sits on
``compare``'s capacity axis: ``capacity``, or else ``num_gpu_blocks`` of vLLM's
``vllm:cache_config_info`` gauge (per engine, the null block included, as vLLM's
``--num-gpu-blocks-override`` counts). Without either, or without a server, the replay stops
before its first request: a replay runs as long as its trace, and a mistake is cheapest before
it starts. So does a test request the server refuses (:meth:`Server.probe`).

Outputs, each atomic, into the output directory: ``requests.jsonl`` (one line per request),
``cost.json`` (the fitted server, :mod:`kvprof.replay.calibrate`, when one can be fitted) and, last,
``results.json`` (``kvprof.results/1``, one measured run). An earlier ``results.json`` stays
until the new one replaces it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvprof import results
from kvprof.atomic import atomic_open
from kvprof.errors import KvprofError
from kvprof.profiler.trace import Trace
from kvprof.replay.calibrate import Calibration, calibrate
from kvprof.replay.prompts import requests_of
from kvprof.replay.runner import Pacing, Progress, RequestRecord, send_all
from kvprof.replay.server import Server, ServerUnreachable
from kvprof.sim.config import CostModel

COST_FILE = "cost.json"


@dataclass(frozen=True)
class ReplaySettings:
    """The server and how to drive it.

    ``policy`` and ``hp_path`` say what the server runs (they label the run; replay cannot see
    inside the server); ``capacity`` (blocks) overrides what the server reports.
    """

    url: str
    model: str
    pacing: Pacing = Pacing()
    timeout_s: float = 120.0
    capacity: int | None = None
    policy: str = "lru"
    hp_path: str | None = None


@dataclass(frozen=True)
class ReplayOutcome:
    """The results document, the fitted server (or why there is none) and every request's record."""

    document: dict
    calibration: Calibration | str
    records: list[RequestRecord]

    @property
    def commonest_error(self) -> tuple[str, int] | None:
        errors = Counter(r.error for r in self.records if r.error is not None)
        return errors.most_common(1)[0] if errors else None


def run_replay(trace: Trace, settings: ReplaySettings, out: Path, *, inputs: dict | None = None,
               progress: Progress | None = None) -> ReplayOutcome:
    """Replay ``trace`` (already windowed and limited) against the server; write the outputs into ``out``.

    Raises
    ------
    ServerUnreachable
        Nothing answers at the URL.
    KvprofError
        No capacity, or the server refused the test request.
    """
    pacing = settings.pacing
    requests = requests_of(trace)
    with Server(settings.url, settings.model, timeout_s=settings.timeout_s,
                max_connections=pacing.max_concurrency) as server:
        capacity, cache = _capacity(server, settings.capacity)
        server.probe(pacing.vocab_size)
        started = time.monotonic()
        records = send_all(server, requests, pacing, progress)
        wall = time.monotonic() - started
    calibration = calibrate(records)
    config = {"mode": "replay", "engine_block_size": cache["block_size"], "rate_scale": pacing.rate_scale,
              "max_concurrency": pacing.max_concurrency, "trace_block_tokens": trace.block_size,
              "vocab_size": pacing.vocab_size, "max_output_tokens": pacing.max_output_tokens,
              "timeout_s": settings.timeout_s, "policies": [settings.policy], "capacities": [capacity],
              "calibration": asdict(calibration) if isinstance(calibration, Calibration) else None}
    facts = {"source": trace.source, "sha256": trace.sha256, "format": trace.format, "block_size": trace.block_size,
             "window": [trace.window[0], trace.censor_time], "n_requests": trace.n_requests}
    document = results.build(
        inputs={**(inputs or {}), "hp": None if settings.hp_path is None else {"path": settings.hp_path},
                "server": {"url": settings.url, "model": settings.model, **cache}, "trace": facts},
        config=config, runs=[_measured_run(records, settings.policy, capacity, pacing.rate_scale)], wall_s=wall)
    _write_outputs(out, records, calibration, document)
    return ReplayOutcome(document, calibration, records)


def _capacity(server: Server, capacity: int | None) -> tuple[int, dict]:
    """The run's capacity (``capacity``, else the server's) and what the server reports of its cache."""
    try:
        cache = server.cache_info()
    except ServerUnreachable:
        raise
    except KvprofError as err:
        if capacity is None:
            raise KvprofError(f"{err}; pass --capacity BLOCKS, the server's GPU KV-cache size") from None
        cache = {"num_gpu_blocks": None, "block_size": None}
    return (cache["num_gpu_blocks"] if capacity is None else capacity), cache


def _measured_run(records: list[RequestRecord], policy: str, capacity: int, rate_scale: float) -> dict:
    """The results run of a replay: ``compare``'s fields that a server reports, measured."""
    ok = [r for r in records if r.error is None]
    qttft = [r.qttft_s for r in ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    p50, p90, p99 = (float(v) for v in np.percentile(qttft, [50, 90, 99])) if qttft else (None,) * 3
    return {
        "policy": policy,
        "capacity": capacity,
        "n_requests": len(records), "n_rejected": 0,
        "n_errors": len(records) - len(ok),
        "n_timeouts": sum(r.error == "timeout" for r in records),
        "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "token_hit_ratio": (cached / prompt_tokens) if prompt_tokens else None,
        "qttft_mean_s": float(np.mean(qttft)) if qttft else None,
        "qttft_p50_s": p50, "qttft_p90_s": p90, "qttft_p99_s": p99,
        "ttft_mean_s": float(np.mean([r.ttft_s for r in ok])) if ok else None,
        "makespan_s": max((r.arrival_s / rate_scale + r.qttft_s for r in ok), default=None),
        "measured": True,
    }


def _write_outputs(out: Path, records: list[RequestRecord], calibration: Calibration | str, document: dict) -> None:
    """requests.jsonl, cost.json (when fitted), then results.json, each atomically."""
    with atomic_open(out / "requests.jsonl") as handle:
        for record in records:
            handle.write(json.dumps(asdict(record)) + "\n")
    if isinstance(calibration, Calibration):
        fitted = CostModel(prefill_tokens_per_s=calibration.prefill_tokens_per_s,
                           step_overhead_s=calibration.step_overhead_s)
        fitted.write(out / COST_FILE, {"fitted_by": "kvprof replay", "server": document["inputs"]["server"],
                                       "n_requests": calibration.n_requests, "created": document["created"]},
                     keys=("prefill_tokens_per_s", "step_overhead_s"))
    results.write(out / results.FILE, document)
