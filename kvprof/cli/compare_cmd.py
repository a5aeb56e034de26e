"""``kvprof compare`` and ``kvprof demo``: replay a trace under several policies and cache sizes.

Wiring only: options are checked here, the work is :func:`kvprof.sim.sweep.run_sweep`, the
document :mod:`kvprof.results`, the pictures :func:`kvprof.cli.plots.plot_results`.

Outputs: a fitted ``hp.json``, ``results.json`` and the plots are written only once the sweep has
finished, each to a temporary file, then renamed into place together (:func:`kvprof.atomic.staged`);
until then the previous outputs stay as they were, so a failed or interrupted run never leaves a
half-new directory behind.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvprof.cli.common import (
    FITTED_HP,
    REJECTED_NOTE,
    EvalWindowOpt,
    FitWindowOpt,
    FormatOpt,
    JobsOpt,
    JsonOpt,
    LimitOpt,
    OutputOpt,
    RankOpt,
    RayOpt,
    SkipOpt,
    TraceArg,
    TraceBlockTokensOpt,
    capacity_list,
    check_format,
    check_memory,
    check_multiple,
    cost_model,
    distinct,
    evaluation_window,
    fit_and_tune,
    guarded,
    list_items,
    made_dir,
    needs_hp,
    number_option,
    open_trace,
    output_dir,
    parse_window_option,
    policy_list,
    qttft_cell,
    recorded_capacity,
    rejected_cell,
    recording_of,
    trace_block_size,
)
from kvprof.cli.hint_options import (
    HintEndTurnOpt,
    HintMaxFractionOpt,
    HintShareOpt,
    HintsOpt,
    HintToolCallOpt,
    IgnoreHintsOpt,
    check_hinted_policies,
    check_stop_hints,
    hint_options,
    hint_table,
    hinted,
    recorded_hint_budget,
    warn_empty_budgets,
)
from kvprof.cli.output import print_json, say, show, status, table, task_progress, warn
from kvprof import results as results_file
from kvprof.atomic import staged
from kvprof.limits import BLOCK_TOKENS, COUNT, RATE_SCALE, SAMPLE_RATE
from kvprof.sim.config import (
    COST_BOUNDS,
    TIMINGS,
    CostModel,
    SimConfig,
    SimulationError,
    default_engine_block,
    parse_schedule,
)

DEMO_CAPACITIES = tuple(range(1024, 8193, 1024))
DEFAULT_CAPACITIES = "1024,2048,4096,8192"
DEMO_POLICIES = ("lru", "wa-paper", "wa", "belady")
SeedOpt = Annotated[int, number_option("--seed", bound=COUNT, help="Seed of the synthetic trace.")]
_COST = "Modelled server (default: the published A800 node; see --cost)"


def _warn_if_sampling_empties_budgets(results, hint_max_fraction) -> None:
    """Warn where a sample's scaled cache leaves the hint budget no block that the full cache has
    (warn_empty_budgets has said where the full cache has none)."""
    budgets = results.inputs.get("hint_budget_blocks") or {}
    empty = [int(c) for c, blocks in budgets.items() if blocks == 0 and int(hint_max_fraction * int(c)) > 0]
    if empty and "sample" in results.inputs:
        warn(f"--hint-max-fraction {hint_max_fraction:g} holds no whole block of the cache --sample scales capacity "
             f"{', '.join(f'{c:,}' for c in empty)} to: no hint tag retained anything in those replays")


@guarded
def compare(
    trace_path: TraceArg,
    config: Annotated[
        Optional[Path],
        typer.Option("--config", help="Hyperparameter file (hp.json); without it, fit one on --fit-window first."),
    ] = None,
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated policy names.")] = "lru,wa,belady",
    capacity: Annotated[
        Optional[str],
        typer.Option("--capacity", help="Comma-separated GPU capacities in engine blocks (default 1024,2048,4096,8192; "
                                        "for a vLLM recording, the server's usable blocks).")
    ] = None,
    block_size: Annotated[
        Optional[int],
        number_option("--block-size", bound=BLOCK_TOKENS,
                      help="Engine block size in tokens, a multiple of the trace's block size "
                           "(default: the smallest such multiple >= 128; for a vLLM recording, the server's)."),
    ] = None,
    timing: Annotated[
        str,
        typer.Option("--timing", help="How long requests hold their blocks: recorded (as the server did: a vLLM "
                                      "recording's scheduled and finished times), model (the cost model below), or "
                                      "auto (recorded where the trace has it).")
    ] = "auto",
    cpu_capacity: Annotated[
        int, number_option("--cpu-capacity", bound=COUNT, help="Blocks in a CPU offload tier (0: none).")
    ] = 0,
    capacity_schedule: Annotated[
        Optional[str],
        typer.Option(
            "--capacity-schedule",
            help="Elastic GPU capacity SECONDS:BLOCKS,... from the evaluation start, e.g. 0:4096,1800:2048 "
            "(instead of --capacity).",
        ),
    ] = None,
    fit_window: FitWindowOpt = "0:3600",
    eval_window: EvalWindowOpt = "3600:",
    limit: LimitOpt = None,
    rate_scale: Annotated[
        float, number_option("--rate-scale", bound=RATE_SCALE,
                             help="Speed-up of arrivals: 2 replays twice as fast, as replay's --rate-scale.")
    ] = 1.0,
    jobs: JobsOpt = -1,
    ray: RayOpt = None,
    sample: Annotated[
        float, number_option("--sample", bound=SAMPLE_RATE,
                      help="Replay only the conversations whose first request hashes into a sample of this "
                           "rate (0 < R <= 1), at caches scaled to it: about 1/R as fast, an estimate "
                           "(README: Fleet-scale traces).")
    ] = 1.0,
    seed: Annotated[
        int,
        number_option("--seed", bound=COUNT,
                      help="Recorded in results.json; replays are deterministic and draw no random numbers."),
    ] = 0,
    hints: HintsOpt = "trace",
    hint_share: HintShareOpt = None,
    hint_end_turn: HintEndTurnOpt = None,
    hint_tool_call: HintToolCallOpt = None,
    hint_max_fraction: HintMaxFractionOpt = None,
    ignore_hints: IgnoreHintsOpt = False,
    json_out: JsonOpt = False,
    output: OutputOpt = Path("results"),
    format: FormatOpt = None,
    trace_block_tokens: TraceBlockTokensOpt = None,
    skip_invalid: SkipOpt = False,
    rank: RankOpt = None,
    cost_file: Annotated[
        Optional[Path],
        typer.Option("--cost", help="Cost-model file (kvprof.cost/1), e.g. the cost.json kvprof replay "
                                    "calibrates on a live server; options below override its values.",
                     rich_help_panel=_COST),
    ] = None,
    prefill_rate: Annotated[
        Optional[float],
        number_option("--prefill-rate", bound=COST_BOUNDS["prefill_tokens_per_s"],
                      help="Prefill throughput, tokens/s (default 13500).", rich_help_panel=_COST),
    ] = None,
    step_overhead: Annotated[
        Optional[float],
        number_option("--step-overhead", bound=COST_BOUNDS["step_overhead_s"],
                      help="Fixed seconds per engine step (default 0.005).", rich_help_panel=_COST),
    ] = None,
    max_batched_tokens: Annotated[
        Optional[int],
        number_option("--max-batched-tokens", bound=COST_BOUNDS["max_batched_tokens"],
                      help="Token budget of one step (default 16384).", rich_help_panel=_COST),
    ] = None,
    max_num_seqs: Annotated[
        Optional[int],
        number_option("--max-num-seqs", bound=COST_BOUNDS["max_num_seqs"],
                      help="Requests running at once (default 256).", rich_help_panel=_COST),
    ] = None,
    decode: Annotated[
        Optional[bool],
        typer.Option("--decode/--no-decode", help="Model decoding, blocks held until the last output token "
                                                  "(default: off, prefill only).", rich_help_panel=_COST),
    ] = None,
    decode_time: Annotated[
        Optional[float],
        number_option("--decode-time", bound=COST_BOUNDS["time_per_output_token_s"],
                      help="Seconds per output token with --decode (default 0.02).", rich_help_panel=_COST),
    ] = None,
):
    """Replay a trace through a model of vLLM's prefix cache under each policy at each capacity.

    Prints hit ratios, gains over LRU, the share of the LRU-to-Belady gap closed and modelled
    queued TTFT (marked where the modelled server is overloaded); writes results.json and
    hit-ratio and QTTFT plots.
    """
    from kvprof.cli.plots import FILES

    names = policy_list(policies)
    hint_share, hint_end_turn, hint_tool_call = hint_options(hints, hint_share, hint_end_turn, hint_tool_call,
                                                              hint_max_fraction, ignore_hints)
    check_hinted_policies(names, hints, hint_max_fraction, ignore_hints)
    schedule = _schedule(capacity_schedule)
    if timing not in TIMINGS:
        raise typer.BadParameter(f"{timing!r} is not one of {', '.join(TIMINGS)}", param_hint="--timing")
    if schedule and capacity is not None:
        raise typer.BadParameter("give --capacity or --capacity-schedule, not both (a schedule sets the capacity)",
                                 param_hint="--capacity/--capacity-schedule")
    if capacity is not None:
        _capacity_list(capacity)  # checked before the paths
    fit_bounds = parse_window_option(fit_window, "--fit-window")
    eval_bounds = parse_window_option(eval_window, "--eval-window")
    check_format(format)
    fits = config is None and (needs_hp(names) or (hints == "stop" and not ignore_hints))
    output_dir(output, files=[results_file.FILE, *FILES, *((FITTED_HP,) if fits else ())],
               inputs=[trace_path, config, cost_file])
    recording = recording_of(trace_path)
    if capacity is None:
        capacity = recorded_capacity([trace_path], [recording]) if recording else DEFAULT_CAPACITIES
    capacities = (schedule[0][1],) if schedule else _capacity_list(capacity)
    check_memory([*capacities, *(blocks for _, blocks in schedule)], cpu_capacity, jobs, len(names) * len(capacities),
                 "--capacity/--cpu-capacity/--capacity-schedule")
    cost = cost_model(cost_file, prefill_tokens_per_s=prefill_rate, step_overhead_s=step_overhead,
                       max_batched_tokens=max_batched_tokens, max_num_seqs=max_num_seqs, decode=decode,
                       time_per_output_token_s=decode_time)
    if decode_time is not None and not cost.decode:
        raise typer.BadParameter("is the time per output token of --decode; give --decode too (or a --cost file "
                                 "with decode: true)", param_hint="--decode-time")
    trace_block = recording.block_size if recording else trace_block_size(trace_path, format, trace_block_tokens)
    if block_size is not None and trace_block is not None:
        check_multiple(block_size, trace_block)
    hp = hp_input = None
    if config is not None:
        from kvprof.models.hp import load_hp

        hp, hp_input = load_hp(config), {"path": str(config)}
    trace = open_trace(trace_path, format=format, block_size=trace_block_tokens, skip_invalid=skip_invalid, rank=rank,
                       block_option="--trace-block-tokens")
    if block_size is not None:
        check_multiple(block_size, trace.block_size)
    evaluated = evaluation_window(trace, eval_bounds, eval_window, limit, fits)
    engine_block = block_size or (trace.block_size if recording else default_engine_block(trace.block_size))
    from kvprof.sim.recorded import resolve_timing

    # results.json records what ran, not "auto"
    timing = resolve_timing(timing, evaluated, engine_block, rate_scale, cpu_capacity, tuple(schedule))
    sim_config = dataclasses.replace(_sim_config(engine_block, cpu_capacity, schedule, cost, rate_scale, sample),
                                     timing=timing)
    if hints == "stop" and not ignore_hints:  # what the fit and the replays would find out only after them
        check_stop_hints(evaluated, hp, (hint_share, hint_end_turn, hint_tool_call), fits)
    fitted = None
    if fits:
        hp = fitted = fit_and_tune(trace, fit_bounds, capacities, sim_config, jobs, ray, evaluated)
        hp_input = {"fitted_on_window": fit_window, "path": str(output / FITTED_HP)}
    document_inputs = {"trace_path": str(trace_path), "hp": hp_input, "eval_window": eval_window, "limit": limit,
                       "seed": seed}
    evaluated, names, hint_facts = hinted(evaluated, hp, names, hints, (hint_share, hint_end_turn, hint_tool_call),
                                           hint_max_fraction, ignore_hints)
    if hint_facts is not None:
        if recording is not None and hint_max_fraction is None and hints == "trace":  # the server's own bound
            hint_max_fraction = hint_facts["max_fraction"] = recorded_hint_budget([recording])
        document_inputs["hints"] = hint_facts
        warn_empty_budgets(hint_max_fraction, capacities)
    _run_and_report(evaluated, hp, names, capacities, sim_config, jobs, output, json_out, document_inputs, fitted,
                    default_block=block_size is None and recording is None, cost_file=cost_file, ray=ray,
                    hint_max_fraction=hint_max_fraction)


@guarded
def demo(
    output: OutputOpt = Path("results"),
    seed: SeedOpt = 0,
    jobs: JobsOpt = -1,
    json_out: JsonOpt = False,
):
    """The published experiment on a synthetic Bailian trace A: fit hour one, compare on hour two.

    Generates a two-hour bailian-a trace into the output directory, reads it back like any trace,
    fits the reuse models on the first hour and replays the second under lru, wa-paper, wa and
    belady at 1024..8192 blocks of 128 tokens.
    """
    from kvprof.cli.plots import FILES
    from kvprof.profiler.synth import generate, write_jsonl

    check_memory(DEMO_CAPACITIES, 0, jobs, len(DEMO_POLICIES) * len(DEMO_CAPACITIES), "-j/--jobs")
    trace_name = f"bailian-a-2h-seed{seed}.jsonl"
    output_dir(output, files=[trace_name, FITTED_HP, results_file.FILE, *FILES])
    with made_dir(output):
        trace_path = output / trace_name
        with status(f"generating {trace_path}"):
            write_jsonl(trace_path, generate("bailian-a", 2.0, seed))
        trace = open_trace(trace_path)
        hp = fit_and_tune(trace, (0.0, 3600.0), DEMO_CAPACITIES, SimConfig(), jobs)
        inputs = {"trace_path": str(trace_path), "synthetic": {"preset": "bailian-a", "hours": 2.0, "seed": seed},
                  "hp": {"fitted_on_window": "0:3600", "path": str(output / FITTED_HP)}, "eval_window": "3600:"}
        _run_and_report(trace.time_window(3600.0, None), hp, DEMO_POLICIES, DEMO_CAPACITIES, SimConfig(), jobs, output,
                        json_out, inputs, hp)


def _run_and_report(trace, hp, policies, capacities, sim_config, jobs, output, json_out, inputs, fitted,
                    default_block=False, cost_file=None, ray=None, hint_max_fraction=None) -> None:
    """Sweep; then the fitted hp file, results.json and the plots, put in place together; print the table."""
    from kvprof.cli.plots import plot_results
    from kvprof.sim.sweep import run_sweep

    with task_progress("replaying", len(policies) * len(capacities), json_out) as update:
        results = run_sweep(trace, hp, policies, capacities, sim_config, n_jobs=jobs, ray=ray, inputs=inputs,
                            progress=update, hint_max_fraction=hint_max_fraction)
    document = results.to_dict()
    with made_dir(output), staged(final=True) as outputs:  # all replaced together or none (an interrupt)
        if fitted is not None:
            fitted.save(outputs.stage(output / FITTED_HP))
        results_file.write(outputs.stage(output / results_file.FILE), document)
        plots = plot_results(document, output, outputs)
    _warn_if_overloaded(results, cost_file)
    _warn_if_sampling_empties_budgets(results, hint_max_fraction)
    if json_out:
        print_json(document)
        return
    show(_table(results, default_block))
    hinted_runs = [(run.policy, run.capacity, run.hints) for run in results.runs if run.hints is not None]
    if hinted_runs:
        show(hint_table(hinted_runs))
    say(f"wrote {output / results_file.FILE} and {len(plots)} plots; the replays took {results.wall_s:.1f} s")


def _table(results, default_block: bool):
    from kvprof.sim.sample import hit_ratio_error

    config = results.config
    trace_facts = results.inputs["trace"]
    block = f"{config.engine_block_size}-token engine blocks"
    if default_block:
        block += f" (default: the smallest multiple of the trace's {trace_facts['block_size']}-token blocks >= 128)"
    speed = f" at {config.rate_scale:g}x speed" if config.rate_scale != 1 else ""
    error = None
    if "sample" in results.inputs:
        sample = results.inputs["sample"]
        speed += (f"; estimated on a sample of {config.sample_rate:g}: {sample['requests']:,} requests in "
                  f"{sample['chains']:,} conversations, caches scaled to it; hit ratio ± at most 2 standard "
                  f"errors of the conversations drawn, plus the tokens of requests only the scaled cache rejects "
                  f"(not the error of scaling the cache itself)")
        error = functools.partial(hit_ratio_error, rate=config.sample_rate, n_effective=sample["effective_chains"])
        lost = sample["lost_token_share"]
    two_tiers = bool(config.cpu_capacity)
    columns = ["capacity (usable blocks)", "policy", "hit ratio", "vs lru", "belady gap closed", "rejected",
               "QTTFT mean (s)", "QTTFT p99 (s)"]
    if two_tiers:
        columns += ["device hits", "host hits", "misses"]
    out = table(f"{trace_facts['n_requests']:,} requests{speed}, {block}; {_qttft_source(results)}",
                {column: "left" if column == "policy" else "right" for column in columns},
                caption=REJECTED_NOTE if any(run.n_rejected for run in results.runs) else None)
    for capacity in results.capacities:
        for policy in results.policies:
            run, gains = results.get(policy, capacity), results.comparison(policy, capacity)
            row = [
                f"{capacity:,}",
                policy,
                f"{run.token_hit_ratio:.4f}" + (f" ± {error(run.token_hit_ratio, lost_share=lost[str(capacity)]):.4f}" if error else ""),
                _percent(gains["hit_gain_over_lru"]) if policy != "lru" else "",
                _percent(gains["belady_gap_closed"]) if policy not in ("lru", "belady") else "",
                rejected_cell(run.n_rejected, run.n_requests),
                qttft_cell(run.qttft_mean_s, run.qttft_overloaded),
                qttft_cell(run.qttft_p99_s, run.qttft_overloaded),
            ]
            if two_tiers:
                row += [f"{run.hits_device:,}", f"{run.hits_host:,}", f"{run.misses:,}"]
            out.add_row(*row, end_section=policy == results.policies[-1])
    return out


def _qttft_source(results) -> str:
    """Where the QTTFT columns come from: the cost model, or nowhere on recorded timing (and why)."""
    if _on_recorded_timing(results):
        return ("QTTFT -: on recorded timing every policy keeps the server's own schedule, so queueing is the "
                "recording's, not a policy's (--timing model models it)")
    return f"QTTFT modelled at {results.config.cost.prefill_tokens_per_s:,.0f} prefill tokens/s"


def _on_recorded_timing(results) -> bool:
    """Whether the runs replayed recorded timing (``auto`` picks it where the trace has it; then no
    run has a modelled QTTFT)."""
    timing = results.config.timing
    return timing == "recorded" or (timing == "auto" and not any(_seconds(run.qttft_mean_s) for run in results.runs))


def _seconds(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def _warn_if_overloaded(results, cost_file: Path | None) -> None:
    """Say once, on stderr, which runs' modelled server could not keep up, and what to do about it."""
    if _on_recorded_timing(results):
        return  # nothing was modelled
    overloaded = [run for run in results.runs if run.qttft_overloaded]
    if not overloaded:
        return
    worst = max(overloaded, key=lambda run: run.offered_load)
    rate = results.config.cost.prefill_tokens_per_s
    advice = (f"The server of {cost_file} is slower than this traffic needs: check that file, or pass "
              f"--prefill-rate." if cost_file is not None else
              "Model the real server: --prefill-rate, or --cost FILE from kvprof replay.")
    warn(f"the modelled server is overloaded in {len(overloaded)} of {len(results.runs)} runs: uncached prompt "
         f"tokens arrive at up to {worst.offered_load * rate:,.0f} tokens/s ({worst.policy} at {worst.capacity:,} "
         f"blocks) but it prefills {rate:,.0f} tokens/s, so their queued TTFT (marked overloaded) grows with the "
         f"trace's length and compares no policies. {advice}")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _capacity_list(text: str) -> tuple[int, ...]:
    return distinct(capacity_list(text), "--capacity", "capacity")


def _schedule(text: str | None) -> tuple[tuple[float, int], ...]:
    if text is None:
        return ()
    list_items(text, "--capacity-schedule")  # the list rule every list option follows
    try:
        return parse_schedule(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--capacity-schedule") from None


def _sim_config(block_size: int, cpu_capacity: int, schedule, cost: CostModel, rate_scale: float,
                sample_rate: float = 1.0) -> SimConfig:
    try:
        return SimConfig(engine_block_size=block_size, cpu_capacity=cpu_capacity, capacity_schedule=schedule, cost=cost,
                         rate_scale=rate_scale, sample_rate=sample_rate)
    except SimulationError as exc:
        raise typer.BadParameter(str(exc), param_hint="--block-size/--capacity-schedule") from None
