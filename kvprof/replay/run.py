"""A whole replay: the server checked, the trace sent, and whatever was measured written.

The run's capacity is the blocks the server's cache can hold, so the live point sits on
``compare``'s capacity axis (and a recording's compare, by default, at the same number):
``capacity``, or else ``num_gpu_blocks - 1`` from vLLM's ``vllm:cache_config_info`` gauge, which
counts per engine the null block too (as ``--num-gpu-blocks-override`` does), a block that never
holds KV. ``inputs.server.num_gpu_blocks`` keeps the gauge's number. Without either, or without a server, the replay stops
before its first request: a replay runs as long as its trace, and a mistake is cheapest before
it starts. So does a test request the server refuses (:meth:`Server.probe`). The model's
context (``max_model_len`` of ``/v1/models``) decides which prompts are too long to send.

Outputs, each atomic, into the output directory: ``requests.jsonl`` (one line per request),
``cost.json`` (the fitted server, :mod:`kvprof.replay.calibrate`, when one can be fitted) and, last,
``results.json`` (``kvprof.results/1``, one measured run). They are written on every way a
replay ends once it has sent a request: finished (``complete: true``), or stopped by an
interrupt or an error (``complete: false``, the requests answered until then). An earlier
``results.json`` stays until the new one replaces it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvprof import results
from kvprof.atomic import StagedFiles, atomic_open, staged
from kvprof.errors import KvprofError
from kvprof.limits import usable_blocks
from kvprof.profiler.trace import Trace
from kvprof.replay.calibrate import Calibration, calibrate
from kvprof.replay.prompts import ReplayRequest, requests_of
from kvprof.replay.runner import Pacing, Progress, RequestRecord, send_all
from kvprof.replay.server import Server, ServerUnreachable
from kvprof.sim.config import CostModel

COST_FILE = "cost.json"
REQUESTS_FILE = "requests.jsonl"
#: A request that left this long after its scheduled arrival waited for a concurrency slot: the server fell behind.
LATE_S = 1.0


@dataclass(frozen=True)
class ReplaySettings:
    """The server and how to drive it.

    ``policy`` and ``hp_path`` say what the server runs (they label the run; replay cannot see
    inside the server); ``capacity`` (blocks) overrides what the server reports; ``classes``,
    when given, names a request's workload class (the hp file's rule) in its record.
    """

    url: str
    model: str
    pacing: Pacing = Pacing()
    timeout_s: float = 120.0
    capacity: int | None = None
    policy: str = "lru"
    hp_path: str | None = None
    classes: Callable[[ReplayRequest], str | None] | None = None


@dataclass(frozen=True)
class ReplayOutcome:
    """The results document, the fitted server (or why there is none), every request's record, the
    interrupt that stopped the replay (None: it finished) and the plots written beside the results."""

    document: dict
    calibration: Calibration | str
    records: list[RequestRecord]
    interrupted: BaseException | None = None
    plots: list[Path] = field(default_factory=list)

    @property
    def errors_by_kind(self) -> list[tuple[str, int, str]]:
        """``(kind, count, an example message)`` of the failed requests, commonest kind first."""
        failed = [r for r in self.records if r.sent and r.error is not None]
        counts = Counter(r.error_kind or "error" for r in failed)
        example = {}
        for record in failed:
            example.setdefault(record.error_kind or "error", record.error)
        return [(kind, count, example[kind]) for kind, count in counts.most_common()]

    @property
    def late(self) -> int:
        """Requests that left more than :data:`LATE_S` after their scheduled arrival (all slots were taken)."""
        return sum(1 for r in self.records if r.wait_s is not None and r.wait_s > LATE_S)


def run_replay(trace: Trace, settings: ReplaySettings, out: Path, *, inputs: dict | None = None,
               progress: Progress | None = None,
               plot: Callable[[dict, Path, StagedFiles], list[Path]] | None = None) -> ReplayOutcome:
    """Replay ``trace`` (already windowed and limited) against the server; write the outputs into ``out``.

    ``requests.jsonl`` is written first (every measured request is on disk whatever happens later);
    ``cost.json``, ``results.json`` and what ``plot(document, out, staging)`` draws are then replaced
    together, or none of them (an interrupt while plotting leaves the earlier ones).

    Raises
    ------
    ServerUnreachable
        Nothing answers at the URL.
    KvprofError
        No capacity (or one the server reports that is not a number of blocks), or the server
        refused the test request: before the first trace request, nothing written.
    Exception
        An error while sending that is a bug: raised again once what was measured is written.
    """
    pacing = settings.pacing
    requests = requests_of(trace)
    with Server(settings.url, settings.model, timeout_s=settings.timeout_s,
                max_connections=pacing.max_concurrency) as server:
        capacity, cache = _capacity(server, settings.capacity)
        max_model_len = server.max_model_len()
        server.probe(pacing.vocab_size)
        started = time.monotonic()
        sent = send_all(server, requests, pacing, progress, max_model_len=max_model_len, classes=settings.classes)
        wall = time.monotonic() - started
    server_facts = {"url": settings.url, "model": settings.model, **cache, "max_model_len": max_model_len}
    document, calibration, plots = write_measured(out, trace, sent.records, settings, capacity, server_facts,
                                                  wall, complete=sent.stopped_by is None, inputs=inputs, plot=plot)
    if sent.stopped_by is not None and not isinstance(sent.stopped_by, KeyboardInterrupt):
        raise sent.stopped_by
    return ReplayOutcome(document, calibration, sent.records, sent.stopped_by, plots)


def write_measured(out: Path, trace: Trace, records: list[RequestRecord], settings: ReplaySettings, capacity: int,
                   server_facts: dict, wall: float, *, complete: bool, inputs: dict | None = None,
                   plot: Callable[[dict, Path, StagedFiles], list[Path]] | None = None,
                   run_fields: dict | None = None) -> tuple[dict, Calibration | str, list[Path]]:
    """Write what one server (or a fleet, pooled) measured into ``out``: ``requests.jsonl`` first, then
    ``cost.json``, ``results.json`` and the plots together. ``server_facts`` is ``inputs.server``;
    ``run_fields`` are added to the measured run (a fleet's). Returns the document, the calibration
    and the plots written."""
    pacing = settings.pacing
    _write_records(out, records)
    calibration = calibrate(records)
    config = {"mode": "replay", "engine_block_size": server_facts.get("block_size"), "rate_scale": pacing.rate_scale,
              "max_concurrency": pacing.max_concurrency, "trace_block_tokens": trace.block_size,
              "vocab_size": pacing.vocab_size, "max_output_tokens": pacing.max_output_tokens,
              "timeout_s": settings.timeout_s, "max_model_len": server_facts.get("max_model_len"),
              "too_long": pacing.too_long, "policies": [settings.policy], "capacities": [capacity],
              "calibration": asdict(calibration) if isinstance(calibration, Calibration) else None}
    facts = {"source": trace.source, "sha256": trace.sha256, "format": trace.format, "block_size": trace.block_size,
             "window": [trace.window[0], trace.censor_time], "n_requests": trace.n_requests}
    run = {**_measured_run(records, settings.policy, capacity, pacing.rate_scale, calibration,
                           (trace.censor_time - trace.window[0]) / pacing.rate_scale), **(run_fields or {})}
    if run_fields and "policy" in run_fields:
        config["policies"] = [run_fields["policy"]]
    document = results.build(
        inputs={**(inputs or {}), "hp": None if settings.hp_path is None else {"path": settings.hp_path},
                "server": server_facts, "trace": facts},
        config=config, runs=[run], wall_s=wall, complete=complete)
    with staged() as outputs:
        _write_results(out, calibration, document, outputs)
        plots = plot(document, out, outputs) if plot is not None else []
    return document, calibration, plots


def _capacity(server: Server, capacity: int | None) -> tuple[int, dict]:
    """The run's capacity (``capacity``, else the server's usable blocks) and what the server reports of its cache."""
    try:
        cache = server.cache_info()
    except ServerUnreachable:
        raise
    except KvprofError as err:
        if capacity is None:
            raise KvprofError(f"{err}; pass --capacity BLOCKS, the blocks the server's cache holds "
                              f"(its num_gpu_blocks - 1)") from None
        cache = {"num_gpu_blocks": None, "block_size": None}
    if capacity is None and usable_blocks(cache["num_gpu_blocks"]) == 0:
        raise KvprofError("the server's cache is one block, vLLM's null block, which holds no KV (num_gpu_blocks 1 "
                          "in its /metrics); pass --capacity BLOCKS")
    return (usable_blocks(cache["num_gpu_blocks"]) if capacity is None else capacity), cache


def _measured_run(records: list[RequestRecord], policy: str, capacity: int, rate_scale: float,
                  calibration: Calibration | str, replayed_s: float) -> dict:
    """The results run of a replay: ``compare``'s fields that a server reports, measured.

    The token sums cover every request sent, answered or not, as a simulated run's cover its
    rejected requests: a request the server did not answer counts its prompt as uncached
    (docs/results-schema.md, ``token_hit_ratio``).
    """
    sent = [r for r in records if r.sent]
    ok = [r for r in sent if r.error is None]
    qttft = [r.qttft_s for r in ok]
    prompt_tokens = sum(r.prompt_tokens for r in sent)
    cached = sum(r.cached_tokens for r in ok)
    p50, p90, p99 = (float(v) for v in np.percentile(qttft, [50, 90, 99])) if qttft else (None,) * 3
    uncached = sum(r.prompt_tokens - r.cached_tokens for r in ok)
    load = (uncached / (calibration.prefill_tokens_per_s * replayed_s)
            if isinstance(calibration, Calibration) and replayed_s > 0 else None)
    return {
        "policy": policy,
        "capacity": capacity,
        "n_requests": len(sent), "n_rejected": 0,
        "n_errors": len(sent) - len(ok),
        "n_timeouts": sum(r.error_kind == "timeout" for r in sent),
        "n_skipped": len(records) - len(sent),
        "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "token_hit_ratio": (cached / prompt_tokens) if prompt_tokens else None,
        "qttft_mean_s": float(np.mean(qttft)) if qttft else None,
        "qttft_p50_s": p50, "qttft_p90_s": p90, "qttft_p99_s": p99,
        "ttft_mean_s": float(np.mean([r.ttft_s for r in ok])) if ok else None,
        "makespan_s": max((r.arrival_s / rate_scale + r.qttft_s for r in ok), default=None),
        "offered_load": load,
        "qttft_overloaded": load is not None and load > 1,
        "measured": True,
    }


def _write_records(out: Path, records: list[RequestRecord]) -> None:
    """requests.jsonl, first: whatever happens later, every measured request is on disk."""
    out.mkdir(parents=True, exist_ok=True)
    with atomic_open(out / REQUESTS_FILE) as handle:
        for record in records:
            line = asdict(record)
            if record.replica is None:  # one server: the lines replay always wrote
                del line["replica"]
            handle.write(json.dumps(line) + "\n")


def _write_results(out: Path, calibration: Calibration | str, document: dict, outputs: StagedFiles) -> None:
    """cost.json (when fitted) and results.json, staged in ``outputs``."""
    if isinstance(calibration, Calibration):
        fitted = CostModel(prefill_tokens_per_s=calibration.prefill_tokens_per_s,
                           step_overhead_s=calibration.step_overhead_s)
        fitted.write(outputs.stage(out / COST_FILE), {"fitted_by": "kvprof replay", "server": document["inputs"]["server"],
                                       "n_requests": calibration.n_requests, "created": document["created"]},
                     keys=("prefill_tokens_per_s", "step_overhead_s"))
    results.write(outputs.stage(out / results.FILE), document)
