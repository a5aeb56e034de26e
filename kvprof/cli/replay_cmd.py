"""``kvprof replay``: options checked here (exit 2), the trace read as every command reads one, the
replay itself :func:`kvprof.replay.run_replay`, then compare's plots of its results."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

from kvprof.cli.common import (
    FormatOpt,
    LimitOpt,
    SkipOpt,
    TraceArg,
    TraceBlockTokensOpt,
    console,
    err_console,
    fail,
    guarded,
    open_trace,
    output_dir,
    parse_window_option,
    positive,
)

#: Token ids replay draws start here (``kvprof.replay.prompts.FIRST_TOKEN_ID``), so the vocabulary must reach past it.
_SMALLEST_VOCABULARY = 5
_EXTRA = "kvprof replay needs the replay extra (httpx, httpx-sse, prometheus_client): pip install 'kvprof[replay]'"


def _http_url(url: str) -> str:
    """Option callback: an http(s) URL with a host (exit 2 otherwise)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise typer.BadParameter(f"{url!r} is not an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000")
    return url


def _known_policy(name: str | None) -> str | None:
    """Option callback: a policy name kvprof knows (exit 2 otherwise)."""
    from kvprof.policy import POLICIES

    if name is not None and name not in POLICIES:
        raise typer.BadParameter(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return name


@guarded
def replay(
    trace_path: TraceArg,
    model: Annotated[str, typer.Option("--model", help="Model name the server serves.")],
    url: Annotated[
        str, typer.Option("--url", callback=_http_url, help="Base URL of a running vLLM (OpenAI-compatible) server.")
    ] = "http://127.0.0.1:8000",
    config: Annotated[
        Optional[Path], typer.Option("--config", help="The hp file the server runs (recorded; labels the run).")
    ] = None,
    policy: Annotated[
        Optional[str],
        typer.Option("--policy", callback=_known_policy,
                     help="The eviction policy the server runs, to label the run (default: the plugin's default "
                          "with --config, else lru, vLLM's own)."),
    ] = None,
    capacity: Annotated[
        Optional[int],
        typer.Option("--capacity", min=1, help="The server's GPU KV-cache size in blocks (default: from its /metrics)."),
    ] = None,
    rate_scale: Annotated[
        float, typer.Option("--rate-scale", callback=positive, help="Speed-up of arrivals: 2 replays twice as fast.")
    ] = 1.0,
    max_concurrency: Annotated[int, typer.Option("--max-concurrency", min=1, help="Requests in flight at most.")] = 8,
    window: Annotated[Optional[str], typer.Option("--window", help="Only requests in START:END seconds.")] = None,
    limit: LimitOpt = None,
    format: FormatOpt = None,
    trace_block_tokens: TraceBlockTokensOpt = None,
    skip_invalid: SkipOpt = False,
    vocab_size: Annotated[
        int,
        typer.Option("--vocab-size", min=_SMALLEST_VOCABULARY,
                     help="Token ids are drawn below this; at most the model's vocabulary (a test request checks)."),
    ] = 1000,
    max_output_tokens: Annotated[
        int, typer.Option("--max-output-tokens", min=1, help="Cap on generated tokens per request.")
    ] = 16,
    timeout: Annotated[
        float, typer.Option("--timeout", callback=positive, help="Seconds without an answer before a request counts as a timeout.")
    ] = 120.0,
    output: Annotated[Path, typer.Option("-o", "--output", "--out", help="Output directory.")] = Path("results"),
):
    """Replay a trace against a running vLLM server and record cached tokens, TTFT and errors.

    Writes requests.jsonl, cost.json (the server's prefill rate and step overhead fitted to the
    measured TTFTs, for compare --cost), results.json and compare's hit-ratio and QTTFT plots; the
    capacity is --capacity or the server's num_gpu_blocks from its /metrics.
    """
    try:
        from kvprof.replay import Pacing, ReplaySettings, run_replay
    except ImportError as exc:
        raise fail(f"{_EXTRA} ({exc})") from None
    from kvprof.cli.plots import plot_results
    from kvprof.vllm.spec import DEFAULT_POLICY

    bounds = parse_window_option(window)
    out = output_dir(output)
    trace = open_trace(trace_path, format=format, block_size=trace_block_tokens, window=bounds,
                       skip_invalid=skip_invalid)
    if limit is not None:
        trace = trace.head(limit)
    settings = ReplaySettings(
        url=url, model=model, timeout_s=timeout, capacity=capacity,
        policy=policy or (DEFAULT_POLICY if config is not None else "lru"),
        hp_path=None if config is None else str(config),
        pacing=Pacing(rate_scale=rate_scale, max_concurrency=max_concurrency, max_output_tokens=max_output_tokens,
                      block_tokens=trace.block_size, vocab_size=vocab_size),
    )
    inputs = {"trace_path": str(trace_path), "eval_window": window, "limit": limit}
    with Progress("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task(f"replaying against {url}", total=trace.n_requests)
        outcome = run_replay(trace, settings, out, inputs=inputs,
                             progress=lambda done, total: bar.update(task, completed=done))
    plots = plot_results(outcome.document, out)
    _report(outcome, out, len(plots))


def _report(outcome, out: Path, n_plots: int) -> None:
    """One summary line on stdout, the calibration and the commonest error on stderr; exit 1 if any request failed."""
    run = outcome.document["runs"][0]
    hit, qttft = run["token_hit_ratio"], run["qttft_mean_s"]
    console.print(f"{run['n_requests']} requests, {run['n_errors']} errors ({run['n_timeouts']} timeouts), "
                  f"hit ratio {'-' if hit is None else format(hit, '.4f')} at {run['capacity']:,} blocks, "
                  f"QTTFT mean {'-' if qttft is None else format(qttft, '.3f')} s", highlight=False)
    calibration = outcome.calibration
    if isinstance(calibration, str):
        err_console.print(f"no cost.json: {calibration}", highlight=False)
    else:
        err_console.print(f"fitted server: {calibration.prefill_tokens_per_s:,.0f} prefill tokens/s, "
                          f"{calibration.step_overhead_s * 1000:.1f} ms per step ({out / 'cost.json'}, "
                          f"for compare --cost)", highlight=False)
    err_console.print(f"wrote {out / 'requests.jsonl'}, {out / 'results.json'} and {n_plots} plots", highlight=False)
    if outcome.commonest_error:
        message, count = outcome.commonest_error
        raise fail(f"{run['n_errors']} of {run['n_requests']} requests failed; the commonest error ({count}x): {message}")
