"""``kvprof replay``: options checked here (exit 2), the trace read as every command reads one, the
replay itself :func:`kvprof.replay.run_replay`, then compare's plots of its results."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn, TimeRemainingColumn

from kvprof.cli.common import (
    FormatOpt,
    LimitOpt,
    SkipOpt,
    TraceArg,
    TraceBlockTokensOpt,
    check_format,
    guarded,
    number_option,
    open_trace,
    output_dir,
    parse_window_option,
)
from kvprof.cli.fleet_cmd import LOAD_WEIGHT, IndexBlocksOpt, check_router_knobs
from kvprof.cli.output import fail, progress, say, show, warn
from kvprof.limits import BLOCKS, INT32_MAX, RATE_SCALE, TIMEOUT_SECONDS, TOKENS, Bound

#: Token ids replay draws start here (``kvprof.replay.prompts.FIRST_TOKEN_ID``), so the vocabulary must reach past it.
_SMALLEST_VOCABULARY = 5
#: Requests in flight at most: each holds a thread and a connection.
MAX_CONCURRENCY = 1024
_EXTRA = "kvprof replay needs the replay extra (httpx, httpx-sse, prometheus_client): pip install 'kvprof[replay]'"


def _http_url(url: str) -> str:
    """Option callback: an http(s) URL with a host (exit 2 otherwise)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is not a number
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        if valid:
            parts.hostname.encode("idna")  # what name resolution will do: empty or long labels, surrogates fail
    except (ValueError, UnicodeError):  # a port that is not a number, a bad IPv6 address or host name
        valid = False
    if not valid:
        raise typer.BadParameter(f"{url!r} is not an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000")
    return url


def _http_urls(urls: list[str]) -> list[str]:
    """Option callback: every --url an http(s) URL with a host, none twice (exit 2 otherwise)."""
    urls = [_http_url(url) for url in urls]
    twice = sorted({url for url in urls if urls.count(url) > 1})
    if twice:
        raise typer.BadParameter(f"{', '.join(twice)} given twice; each server of a fleet once")
    return urls


def _zmq_endpoints(endpoints: list[str] | None) -> list[str] | None:
    """Option callback: tcp://HOST:PORT endpoints, none twice (exit 2 otherwise)."""
    from urllib.parse import urlsplit

    for endpoint in endpoints or ():
        try:
            parts = urlsplit(endpoint)
            valid = parts.scheme == "tcp" and bool(parts.hostname) and parts.port is not None
        except ValueError:
            valid = False
        if not valid:
            raise typer.BadParameter(f"{endpoint!r} is not a tcp://HOST:PORT endpoint, e.g. tcp://127.0.0.1:5557")
    if endpoints and len(set(endpoints)) < len(endpoints):
        raise typer.BadParameter("an endpoint given twice; one per server")
    return endpoints


def _fleet_router(urls: list[str], router: str | None, kv_events: list[str] | None, load_weight: float | None,
                  index_blocks: int | None):
    """The router spec of a fleet replay, None for one server (exit 2 for options that do not fit)."""
    from kvprof.sim.fleet import ROUTERS, RouterSpec

    if router is None:
        if len(urls) > 1:
            raise typer.BadParameter(f"{len(urls)} servers need a router to pick one per request: --router "
                                     f"{' | '.join(ROUTERS)}", param_hint="--router")
        if kv_events:
            raise typer.BadParameter("KV events are read by --router prefix-precise only", param_hint="--kv-events")
        check_router_knobs((), load_weight, index_blocks)
        return None
    if router not in ROUTERS:
        raise typer.BadParameter(f"unknown router {router!r}; known: {', '.join(ROUTERS)}", param_hint="--router")
    if len(urls) < 2:
        raise typer.BadParameter(f"a router needs at least two servers to choose from; give --url once per server "
                                 f"(got {len(urls)})", param_hint="--router")
    if router == "prefix-precise":
        if len(kv_events or ()) != len(urls):
            raise typer.BadParameter(f"prefix-precise reads each server's KV events: give --kv-events once per "
                                     f"--url, in the same order ({len(urls)}), got {len(kv_events or ())}",
                                     param_hint="--kv-events")
    elif kv_events:
        raise typer.BadParameter("KV events are read by --router prefix-precise only", param_hint="--kv-events")
    check_router_knobs((router,), load_weight, index_blocks)
    return RouterSpec(router, 1.0 if load_weight is None else load_weight, index_blocks)


def _live_policy(name: str | None) -> str | None:
    """Option callback: a policy kvprof knows and a server can run (exit 2 otherwise)."""
    from kvprof.policy import POLICIES

    if name is None:
        return None
    live = [known for known, cls in POLICIES.items() if not cls.offline]
    if name not in POLICIES:
        raise typer.BadParameter(f"unknown policy {name!r}; a server runs one of: {', '.join(live)}")
    if POLICIES[name].offline:
        raise typer.BadParameter(f"{name!r} needs the future and runs in no server; a server runs one of: "
                                 f"{', '.join(live)}")
    return name


def _require_replay_extra() -> None:
    """The replay extra is installed: checked by whatever needs it first, an option's callback or the
    command (exit 2 saying what to install, as --ray does)."""
    try:
        import kvprof.replay  # noqa: F401
    except ImportError as exc:
        raise typer.BadParameter(f"{_EXTRA} ({exc})", param_hint="kvprof replay") from None


def _too_long(choice: str) -> str:
    _require_replay_extra()
    from kvprof.replay.runner import TOO_LONG

    if choice not in TOO_LONG:
        raise typer.BadParameter(f"{choice!r} is not one of {', '.join(TOO_LONG)}")
    return choice


@guarded
def replay(
    trace_path: TraceArg,
    model: Annotated[str, typer.Option("--model", help="Model name the server serves.")],
    url: Annotated[
        list[str], typer.Option("--url", callback=_http_urls, metavar="URL",
                                help="Base URL of a running vLLM (OpenAI-compatible) server; give it once per "
                                     "server of a fleet, with --router.")
    ] = ["http://127.0.0.1:8000"],
    router: Annotated[
        Optional[str], typer.Option("--router", help="With several --url: route each request as kvprof fleet's "
                                                     "router does (round-robin, least-loaded, session, "
                                                     "prefix-approx, prefix-precise).")
    ] = None,
    load_weight: Annotated[
        Optional[float], number_option("--load-weight", bound=LOAD_WEIGHT,
                                       help="The prefix routers' weight of load (each server's requests in flight) "
                                            "against overlap, as kvprof fleet's (0: overlap only; default 1); "
                                            "refused without one.")
    ] = None,
    index_blocks: IndexBlocksOpt = None,
    kv_events: Annotated[
        Optional[list[str]], typer.Option("--kv-events", callback=_zmq_endpoints, metavar="ENDPOINT",
                                          help="prefix-precise: where to listen for each server's KV events, one "
                                               "per --url in order (tcp://HOST:PORT, the endpoint of its "
                                               "--kv-events-config).")
    ] = None,
    config: Annotated[
        Optional[Path], typer.Option("--config", help="The hp file the server runs (checked, recorded; labels the "
                                                      "run and names each request's class in requests.jsonl).")
    ] = None,
    policy: Annotated[
        Optional[str],
        typer.Option("--policy", callback=_live_policy,
                     help="The eviction policy the server runs, to label the run (default: the plugin's default "
                          "with --config, else lru, vLLM's own)."),
    ] = None,
    capacity: Annotated[
        Optional[int],
        number_option("--capacity", bound=BLOCKS,
                      help="The blocks the server's cache holds (default: from its /metrics, num_gpu_blocks - 1: "
                           "vLLM's null block holds none)."),
    ] = None,
    rate_scale: Annotated[
        float, number_option("--rate-scale", bound=RATE_SCALE, help="Speed-up of arrivals: 2 replays twice as fast.")
    ] = 1.0,
    max_concurrency: Annotated[
        int, number_option("--max-concurrency", bound=Bound(1, MAX_CONCURRENCY, whole=True),
                           help="Requests in flight at most.")
    ] = 8,
    window: Annotated[Optional[str], typer.Option("--window", help="Only requests in START:END seconds.")] = None,
    limit: LimitOpt = None,
    format: FormatOpt = None,
    trace_block_tokens: TraceBlockTokensOpt = None,
    skip_invalid: SkipOpt = False,
    vocab_size: Annotated[
        int,
        number_option("--vocab-size", bound=Bound(_SMALLEST_VOCABULARY, INT32_MAX, whole=True),
                      help="Token ids are drawn below this; at most the model's vocabulary (a test request checks)."),
    ] = 1000,
    max_output_tokens: Annotated[
        int, number_option("--max-output-tokens", bound=TOKENS, help="Cap on generated tokens per request.")
    ] = 16,
    timeout: Annotated[
        float, number_option("--timeout", bound=TIMEOUT_SECONDS,
                             help="Seconds without progress (no token) before a request counts as a timeout.")
    ] = 120.0,
    too_long: Annotated[
        str, typer.Option("--too-long", callback=_too_long,
                          help="A prompt longer than the server's max_model_len (less its output): skip it "
                               "(counted, reported) or clip it to fit.")
    ] = "skip",
    ignore_hints: Annotated[
        bool, typer.Option("--ignore-hints", help="Send no client hints: requests carry the trace's retain_s, "
                                                  "retain_priority, release, hint_tag and hint_session (docs/hints.md) unless "
                                                  "given; a run without them is what they are measured against.")
    ] = False,
    output: Annotated[Path, typer.Option("-o", "--output", "--out", help="Output directory.")] = Path("results"),
):
    """Replay a trace against a running vLLM server and record cached tokens, TTFT and errors.

    Writes requests.jsonl, cost.json (the server's prefill rate and step overhead fitted to the
    measured TTFTs, for compare --cost), results.json and compare's hit-ratio and QTTFT plots; the
    capacity is --capacity or the server's num_gpu_blocks from its /metrics. Stopped early (an
    error, Ctrl-C, SIGTERM), it writes the requests answered so far as an incomplete run.

    With --url given once per server and --router, replay is the router of that fleet (kvprof
    fleet's routers): each server's part is written in DIR/replica-K as a replay of it alone, the
    fleet's in DIR (each request's replica in requests.jsonl, per replica cached tokens in
    results.json).
    """
    _require_replay_extra()
    from kvprof.replay import Pacing, ReplaySettings, run_replay
    from kvprof.replay.fleet import REPLICA_DIR, run_fleet_replay
    from kvprof.replay.run import COST_FILE, REQUESTS_FILE
    from kvprof import results
    from kvprof.cli.plots import FILES, plot_results
    from kvprof.vllm.spec import DEFAULT_POLICY

    spec = _fleet_router(url, router, kv_events, load_weight, index_blocks)
    bounds = parse_window_option(window)
    check_format(format)
    written = [REQUESTS_FILE, COST_FILE, results.FILE]
    replica_files = [f"{REPLICA_DIR.format(j)}/{name}" for j in range(len(url) if spec else 0) for name in written]
    output_dir(output, files=[*written, *FILES, *replica_files], inputs=[trace_path, config])
    hp = None
    if config is not None:
        from kvprof.models.hp import load_hp

        hp = load_hp(config)
    trace = open_trace(trace_path, format=format, block_size=trace_block_tokens, window=bounds,
                       skip_invalid=skip_invalid)
    if limit is not None:
        trace = trace.head(limit)
    if ignore_hints:
        from kvprof.sim.hints import with_hints

        trace = with_hints(trace, None)
    settings = ReplaySettings(
        url=url[0], model=model, timeout_s=timeout, capacity=capacity,
        policy=policy or (DEFAULT_POLICY if config is not None else "lru"),
        hp_path=None if config is None else str(config),
        classes=None if hp is None else _classifier(hp),
        pacing=Pacing(rate_scale=rate_scale, max_concurrency=max_concurrency, max_output_tokens=max_output_tokens,
                      block_tokens=trace.block_size, vocab_size=vocab_size, too_long=too_long),
    )
    inputs = {"trace_path": str(trace_path), "eval_window": window, "limit": limit,
              "hinted_requests": 0 if trace.hints is None else trace.hints.n_hinted}
    with progress(BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()) as bar:
        where = url[0] if spec is None else f"{len(url)} servers behind {spec.name}"
        task = bar.add_task(f"replaying against {where}", total=trace.n_requests)
        advance = lambda done, total: bar.update(task, completed=done)  # noqa: E731
        if spec is None:
            outcome = run_replay(trace, settings, output, inputs=inputs, progress=advance, plot=plot_results)
        else:
            outcome = run_fleet_replay(trace, settings, url, spec, output, events=kv_events or (), inputs=inputs,
                                       progress=advance, plot=plot_results)
    _report(outcome, output, len(outcome.plots), max_concurrency, rate_scale)


def _classifier(hp):
    """A request's workload class under ``hp``'s rule, from the tags replay sends (as the plugin classifies)."""
    from kvprof.classes import workload_class

    rule = hp.class_rule

    def classify(request) -> str:
        tags = request.workload
        return workload_class(rule, tags.get("type"), tags.get("turn"), tags.get(rule.field) if rule.field else None)

    return classify


def _report(outcome, out: Path, n_plots: int, max_concurrency: int, rate_scale: float) -> None:
    """One summary line on stdout; the calibration, overload and errors by kind on stderr; exit 1 if any
    request failed, 130 (143) if interrupted."""
    run = outcome.document["runs"][0]
    hit, qttft = run["token_hit_ratio"], run["qttft_mean_s"]
    skipped = f", {run['n_skipped']} skipped (too long)" if run["n_skipped"] else ""
    show(f"{run['n_requests']} requests, {run['n_errors']} errors ({run['n_timeouts']} timeouts){skipped}, "
         f"hit ratio {'-' if hit is None else format(hit, '.4f')} at {run['capacity']:,} blocks, "
         f"QTTFT mean {'-' if qttft is None else format(qttft, '.3f')} s")
    if "replica_cached_tokens" in run:
        show(f"{run['router']} x{run['replicas']}: " + ", ".join(
            f"replica {j}: {n} requests, {cached:,} of {prompt:,} prompt tokens cached"
            for j, (n, cached, prompt) in enumerate(zip(run["replica_requests"], run["replica_cached_tokens"],
                                                        run["replica_prompt_tokens"]))))
    if "replica_kv_events" in run:
        events = run["replica_kv_events"]
        show("KV events received: " + ", ".join(f"replica {j}: {n:,}" for j, n in enumerate(events)))
        silent = [j for j, n in enumerate(events) if not n]
        if silent:
            warn(f"no KV events came from replica(s) {', '.join(map(str, silent))}: {run['router']} routed "
                 f"their requests on load alone (is each server's --kv-events-config endpoint this replay's "
                 f"--kv-events address?)")
    calibration = outcome.calibration
    if isinstance(calibration, str):
        say(f"no cost.json: {calibration}")
    else:
        say(f"fitted server: {calibration.prefill_tokens_per_s:,.0f} prefill tokens/s, "
            f"{calibration.step_overhead_s * 1000:.1f} ms per step ({out / 'cost.json'}, for compare --cost)")
    _warn_if_overloaded(outcome, run, max_concurrency, rate_scale)
    if run["n_skipped"]:
        first = next(r.skipped for r in outcome.records if r.skipped)
        warn(f"{run['n_skipped']} requests were not sent, their prompts longer than the server takes (e.g. {first}); "
             f"--too-long clip sends them cut to fit")
    plots = f" and {n_plots} plots" if n_plots else ""
    say(f"wrote {out / 'requests.jsonl'}, {out / 'results.json'}{plots}")
    if outcome.interrupted is not None:
        raise fail(f"interrupted after {run['n_requests']} of {outcome.document['inputs']['trace']['n_requests']} "
                   f"requests; wrote them as an incomplete run (complete: false)",
                   getattr(outcome.interrupted, "exit_code", 130))
    if run["n_errors"]:
        raise fail(_errors_line(outcome, run))


def _errors_line(outcome, run: dict) -> str:
    """The failed requests by kind: ``all 12 requests failed: HTTP 400 (...)`` or ``4 of 12 ...: 3 timeout, 1 ...``."""
    kinds = outcome.errors_by_kind
    total, failed = run["n_requests"], run["n_errors"]
    head = f"all {total} requests failed" if failed == total else f"{failed} of {total} requests failed"
    if len(kinds) == 1:
        return f"{head} alike: {kinds[0][2]}"
    return f"{head}: " + "; ".join(f"{count} {kind} (e.g. {example})" for kind, count, example in kinds)


def _warn_if_overloaded(outcome, run: dict, max_concurrency: int, rate_scale: float) -> None:
    """Say when the server could not keep up with the trace at this rate: requests waited for a slot, or
    the fitted server's offered load is above 1; their QTTFT then measures the queue."""
    late = outcome.late
    if late:
        warn(f"the server fell behind: {late} of {run['n_requests']} requests left more than 1 s after their "
             f"scheduled arrival, --max-concurrency {max_concurrency} requests being in flight; their QTTFT "
             f"includes that wait (lower --rate-scale {rate_scale:g} to measure the cache, not the queue)")
    elif run.get("qttft_overloaded"):
        warn(f"the server is overloaded at --rate-scale {rate_scale:g}: its fitted prefill rate is below the "
             f"uncached tokens arriving (offered load {run['offered_load']:.2f}), so QTTFT grows with the trace")
