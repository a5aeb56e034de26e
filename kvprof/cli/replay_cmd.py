"""``kvprof replay``: send a trace to a running vLLM server and measure what its cache does.

Each trace block hash id becomes a deterministic run of ``--trace-block-tokens`` token ids, so equal
hash-id prefixes are equal token prefixes; prompts go to the completions API as token ids (no
tokenizer in the way, blocks stay aligned). Every request carries its workload as ``vllm_xargs``
(``type`` and ``turn``; the plugin classifies them with the hp file's rule). Arrival times are
honoured (divided by ``--rate-scale``) with at most ``--max-concurrency`` requests in flight;
QTTFT is measured from the scheduled arrival to the first streamed token. Server errors and
timeouts are counted and reported, never retried.

The run's capacity is the server's GPU KV-cache size in blocks, so the live point sits on
``compare``'s capacity axis: ``--capacity``, or else ``num_gpu_blocks`` of vLLM's
``vllm:cache_config_info`` gauge on ``GET {url}/metrics`` (per engine, the null block included,
as vLLM's ``--num-gpu-blocks-override`` counts). Without either the replay stops before its first
request rather than writing results without plots: a replay runs as long as its trace, and a
mistake is cheapest before it starts.

Writes ``requests.jsonl`` (one line per request), the plots ``compare`` writes (``hit_ratio`` and
``qttft``, PNG and SVG) and, last, ``results.json`` (schema ``kvprof.results/1``, one run,
measured rather than modelled times) into the output directory, each atomically; a stale
``results.json`` is removed before the first request, so one that exists matches the plots.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import typer

from kvprof import __version__
from kvprof.atomic import atomic_open, atomic_write_text
from kvprof.errors import KvprofError


def load_trace_lines(path: Path, block_size: int | None = None) -> tuple[list[dict], dict]:
    """Requests of a trace as dicts (arrival ``t`` in seconds from the first request), and facts
    of the trace as ``compare`` records them (``source``, ``sha256``, ``format``, ``block_size``:
    tokens per hash id).

    The trace goes through :func:`kvprof.profiler.reader.read_trace`, the same validation as
    ``fit`` and ``compare`` (formats, compression, errors naming line and field).
    """
    from kvprof.profiler.reader import read_trace

    trace, _ = read_trace(path, block_size=block_size)
    facts = {"source": trace.source, "sha256": trace.sha256, "format": trace.format, "block_size": trace.block_size}
    start = float(trace.timestamp[0])
    types = trace.types
    return [
        {
            "t": float(trace.timestamp[i]) - start,
            "hash_ids": trace.blocks_of(i).tolist(),
            "input_length": int(trace.input_length[i]),
            "output_length": int(trace.output_length[i]),
            "type": types[i] or None,
            "turn": int(trace.turn[i]) if trace.has_types else None,
            "chat_id": int(trace.chat_id[i]),
        }
        for i in range(trace.n_requests)
    ], facts


def block_tokens(hash_id: int, n: int, vocab: int, first_id: int = 4) -> list[int]:
    """The deterministic token ids of one trace block (ids ``first_id`` .. ``vocab - 1``)."""
    rng = random.Random(hash_id * 1_000_003 + 17)
    return [rng.randrange(first_id, vocab) for _ in range(n)]


def prompt_of(req: dict, n: int, vocab: int) -> list[int]:
    tokens: list[int] = []
    for h in req["hash_ids"]:
        tokens.extend(block_tokens(h, n, vocab))
    length = req["input_length"] or len(tokens)
    return tokens[: max(1, min(length, len(tokens)))]


def _send(url: str, model: str, req: dict, prompt: list[int], max_tokens: int, timeout: float, due: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    xargs = {k: req[k] for k in ("type", "turn") if req.get(k) is not None}
    if xargs:
        body["vllm_xargs"] = xargs
    rec = {"chat_id": req["chat_id"], "arrival_s": req["t"], "prompt_tokens": len(prompt), "cached_tokens": None,
           "ttft_s": None, "qttft_s": None, "error": None}
    start = time.monotonic()
    http = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(http, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if rec["ttft_s"] is None and chunk.get("choices"):
                    now = time.monotonic()
                    rec["ttft_s"], rec["qttft_s"] = now - start, now - due
                usage = chunk.get("usage")
                if usage:
                    rec["prompt_tokens"] = usage.get("prompt_tokens", rec["prompt_tokens"])
                    rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except TimeoutError:
        rec["error"] = "timeout"
    except urllib.error.HTTPError as err:
        err.close()
        rec["error"] = f"http {err.code}"
    except (urllib.error.URLError, OSError, ValueError) as err:
        rec["error"] = "timeout" if "timed out" in str(err) else f"{type(err).__name__}: {err}"
    if rec["error"] is None and rec["cached_tokens"] is None:
        rec["error"] = "no usage in the response (start vLLM with --enable-prompt-tokens-details)"
    return rec


#: One series of vLLM's CacheConfig gauge: its labels are the config's fields, as strings.
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(.*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def server_cache(url: str, timeout: float) -> dict:
    """``num_gpu_blocks`` and ``block_size`` (None when not reported) of a vLLM server's KV cache.

    Read from the labels of the ``vllm:cache_config_info`` gauge in ``GET {url}/metrics``, one
    series per engine; engines must agree, as a capacity stands for one cache.

    Raises
    ------
    KvprofError
        No metrics, no gauge, no ``num_gpu_blocks`` in it, or engines that disagree.
    """
    where = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(where, timeout=timeout) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as err:
        err.close()
        raise KvprofError(f"cannot read {where}: HTTP {err.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise KvprofError(f"cannot read {where}: {err}") from None
    reported = {_cache_labels(labels) for labels in _CACHE_INFO.findall(text)}
    if len(reported) > 1:
        raise KvprofError(f"the engines behind {where} report different caches (num_gpu_blocks, block_size): "
                          f"{', '.join(map(str, reported))}")
    blocks, block_size = reported.pop() if reported else (None, None)
    if blocks is None:
        raise KvprofError(f"{where} reports no num_gpu_blocks in vllm:cache_config_info")
    return {"num_gpu_blocks": blocks, "block_size": block_size}


def _cache_labels(text: str) -> tuple[int | None, int | None]:
    """``num_gpu_blocks`` and ``block_size`` from one series' label text (vLLM writes "None" before they are known)."""
    labels = dict(_LABEL.findall(text))
    return tuple(int(labels[k]) if labels.get(k, "").isdigit() else None for k in ("num_gpu_blocks", "block_size"))


def _capacity(url: str, capacity: int | None, timeout: float) -> tuple[int, dict]:
    """The run's capacity (``capacity``, else the server's) and what the server reports of its cache."""
    try:
        cache = server_cache(url, timeout)
    except KvprofError as err:
        if capacity is None:
            raise KvprofError(f"{err}; pass --capacity BLOCKS, the server's GPU KV-cache size") from None
        cache = {"num_gpu_blocks": None, "block_size": None}
    return (cache["num_gpu_blocks"] if capacity is None else capacity), cache


def _percentiles(values: list[float]) -> tuple:
    """p50, p90, p99 as the simulator computes them (numpy's interpolation); Nones when empty."""
    return tuple(float(v) for v in np.percentile(values, [50, 90, 99])) if values else (None, None, None)


def run_replay(trace: Path, url: str, model: str, out: Path, *, config: Path | None = None, policy_label: str | None = None,
               capacity: int | None = None, rate_scale: float = 1.0, max_concurrency: int = 8,
               trace_block_tokens: int | None = None, vocab_size: int = 1000, max_output_tokens: int = 16,
               timeout: float = 120.0, limit: int | None = None) -> dict:
    """Replay ``trace`` against ``url``; write and return the results (see the module docstring).

    ``capacity`` (blocks) is recorded as the run's; None reads it from the server's ``/metrics``.
    """
    if rate_scale <= 0 or max_concurrency < 1 or (capacity is not None and capacity < 1):
        raise KvprofError("--rate-scale must be > 0, --max-concurrency >= 1 and --capacity >= 1")
    reqs, trace_facts = load_trace_lines(Path(trace), trace_block_tokens)
    reqs = reqs[: limit or None]
    capacity, cache = _capacity(url, capacity, timeout)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").unlink(missing_ok=True)
    started = time.monotonic()
    records = _send_all(reqs, url, model, trace_facts["block_size"], rate_scale=rate_scale, max_concurrency=max_concurrency,
                        vocab_size=vocab_size, max_output_tokens=max_output_tokens, timeout=timeout)
    wall = time.monotonic() - started
    run = _measured_run(records, policy_label or ("served" if config is None else f"served:{Path(config).name}"),
                        capacity, rate_scale)
    results = {
        "schema": "kvprof.results/1",
        "kvprof_version": __version__,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "inputs": {"trace_path": str(trace), "hp": None if config is None else {"path": str(config)},
                   "eval_window": None, "server": {"url": url, "model": model, **cache},
                   "trace": {**trace_facts, "n_requests": len(reqs)}},
        "config": {"mode": "replay", "engine_block_size": cache["block_size"], "rate_scale": rate_scale,
                   "max_concurrency": max_concurrency, "trace_block_tokens": trace_facts["block_size"],
                   "vocab_size": vocab_size, "max_output_tokens": max_output_tokens, "timeout_s": timeout,
                   "policies": [run["policy"]], "capacities": [capacity]},
        "wall_s": wall,
        "runs": [run],
        "complete": True,
    }
    _write_outputs(out, records, results)
    return results


def _send_all(reqs: list[dict], url: str, model: str, block_tokens: int, *, rate_scale: float, max_concurrency: int,
              vocab_size: int, max_output_tokens: int, timeout: float) -> list[dict]:
    """Send every request at its scheduled time, at most ``max_concurrency`` in flight; records in arrival order."""
    records: list[dict] = []
    lock = threading.Lock()
    t_start = time.monotonic()
    slots = threading.Semaphore(max_concurrency)

    def work(req, prompt, due):
        try:
            rec = _send(url, model, req, prompt, max(1, min(req["output_length"], max_output_tokens)), timeout, due)
        finally:
            slots.release()
        with lock:
            records.append(rec)

    with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
        for req in reqs:
            prompt = prompt_of(req, block_tokens, vocab_size)
            due = t_start + req["t"] / rate_scale
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            slots.acquire()  # bounded concurrency: waiting here counts in QTTFT
            pool.submit(work, req, prompt, due)
    records.sort(key=lambda r: (r["arrival_s"], str(r["chat_id"])))
    return records


def _measured_run(records: list[dict], policy: str, capacity: int, rate_scale: float) -> dict:
    """The results run of a replay: ``compare``'s fields that a server reports, measured."""
    ok = [r for r in records if r["error"] is None]
    qttft = [r["qttft_s"] for r in ok if r["qttft_s"] is not None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    return {
        "policy": policy,
        "capacity": capacity,
        "n_requests": len(records), "n_rejected": 0,
        "n_errors": sum(r["error"] is not None for r in records),
        "n_timeouts": sum(r["error"] == "timeout" for r in records),
        "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "token_hit_ratio": (cached / prompt_tokens) if prompt_tokens else None,
        "qttft_mean_s": (sum(qttft) / len(qttft)) if qttft else None,
        **dict(zip(("qttft_p50_s", "qttft_p90_s", "qttft_p99_s"), _percentiles(qttft))),
        "ttft_mean_s": (sum(ttft) / len(ttft)) if ttft else None,
        "makespan_s": max((r["arrival_s"] / rate_scale + r["qttft_s"] for r in ok if r["qttft_s"] is not None), default=None),
        "measured": True,
    }


def _write_outputs(out: Path, records: list[dict], results: dict) -> None:
    """requests.jsonl, the plots, then results.json: one that exists is complete and matches the plots."""
    from kvprof.cli.plots import plot_results

    with atomic_open(out / "requests.jsonl") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    plot_results(results, out)
    atomic_write_text(out / "results.json", json.dumps(results, indent=2) + "\n")


def replay(
    trace: Path = typer.Argument(..., help="Bailian/Mooncake JSONL trace to replay."),
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="Base URL of a running vLLM server."),
    model: str = typer.Option(..., "--model", help="Model name the server serves."),
    config: Path | None = typer.Option(None, "--config", help="hp file the server runs with (recorded in results)."),
    capacity: int | None = typer.Option(None, "--capacity", min=1,
                                        help="The server's GPU KV-cache size in blocks (default: from its /metrics)."),
    rate_scale: float = typer.Option(1.0, "--rate-scale", help="Speed-up of arrivals: 2 replays twice as fast."),
    max_concurrency: int = typer.Option(8, "--max-concurrency", help="Requests in flight at most."),
    trace_block_tokens: int | None = typer.Option(None, "--trace-block-tokens", help="Tokens per trace hash id (default: 16 Bailian, 512 Mooncake)."),
    vocab_size: int = typer.Option(1000, "--vocab-size", help="Token ids are drawn below this (at most the model's vocabulary)."),
    max_output_tokens: int = typer.Option(16, "--max-output-tokens", help="Cap on generated tokens per request."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds per request before it counts as a timeout."),
    limit: int | None = typer.Option(None, "--limit", help="Replay only the first N requests."),
    out: Path = typer.Option(Path("results"), "-o", "--out", help="Output directory."),
):
    """Replay a trace against a running vLLM server and record cached tokens, TTFT and errors.

    Writes results.json and the hit-ratio and QTTFT plots of compare; the capacity is --capacity
    or the server's num_gpu_blocks from its /metrics.
    """
    from kvprof.cli.common import guarded

    def body():
        res = run_replay(trace, url, model, out, config=config, capacity=capacity, rate_scale=rate_scale,
                         max_concurrency=max_concurrency, trace_block_tokens=trace_block_tokens,
                         vocab_size=vocab_size, max_output_tokens=max_output_tokens, timeout=timeout, limit=limit)
        run = res["runs"][0]
        hit = run["token_hit_ratio"]
        typer.echo(f"{run['n_requests']} requests, {run['n_errors']} errors ({run['n_timeouts']} timeouts), "
                   f"hit ratio {hit if hit is None else round(hit, 4)} at {run['capacity']} blocks, "
                   f"QTTFT mean {run['qttft_mean_s']}; wrote {Path(out) / 'results.json'} and plots")
        if run["n_errors"]:
            raise typer.Exit(1)

    return guarded(body)()
