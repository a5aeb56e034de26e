"""``kvprof compare`` and ``kvprof demo``: replay a trace under several policies and cache sizes.

Wiring only: options are checked here, the work is :func:`kvprof.sim.sweep.run_sweep`, the
pictures :func:`kvprof.cli.plots.plot_results`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from kvprof.cli.common import (
    FormatOpt,
    SkipOpt,
    TraceArg,
    console,
    err_console,
    guarded,
    open_trace,
    parse_window_option,
    print_json,
)
from kvprof.errors import KvprofError
from kvprof.sim.config import SimConfig, SimulationError, parse_schedule

RESULTS_FILE = "results.json"
DEMO_CAPACITIES = tuple(range(1024, 8193, 1024))
DEMO_POLICIES = ("lru", "wa-paper", "wa", "belady")

OutputOpt = Annotated[Path, typer.Option("-o", "--output", help="Directory for results.json, plots (PNG, SVG).")]
JobsOpt = Annotated[int, typer.Option("-j", "--jobs", help="Parallel replays (joblib workers; -1: all cores).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the results document as JSON instead of a table.")]


@guarded
def compare(
    trace_path: TraceArg,
    config: Annotated[
        Optional[Path],
        typer.Option("--config", help="Hyperparameter file (hp.json); without it, fit one on --fit-window first."),
    ] = None,
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated policy names.")] = "lru,wa,belady",
    capacity: Annotated[
        str, typer.Option("--capacity", help="Comma-separated GPU capacities in engine blocks.")
    ] = "1024,2048,4096,8192",
    block_size: Annotated[
        int, typer.Option("--block-size", help="Engine block size in tokens; a multiple of the trace's block size.")
    ] = 128,
    cpu_capacity: Annotated[
        int, typer.Option("--cpu-capacity", min=0, help="Blocks in a CPU offload tier (0: none).")
    ] = 0,
    capacity_schedule: Annotated[
        Optional[str],
        typer.Option(
            "--capacity-schedule",
            help="Elastic GPU capacity SECONDS:BLOCKS,... from the evaluation start, e.g. 0:4096,1800:2048 "
            "(replaces --capacity).",
        ),
    ] = None,
    fit_window: Annotated[
        str, typer.Option("--fit-window", help="START:END seconds to fit on when no --config is given.")
    ] = "0:3600",
    eval_window: Annotated[str, typer.Option("--eval-window", help="START:END seconds to replay.")] = "3600:",
    jobs: JobsOpt = -1,
    seed: Annotated[
        int,
        typer.Option("--seed", help="Recorded in results.json; replays are deterministic and draw no random numbers."),
    ] = 0,
    json_out: JsonOpt = False,
    output: OutputOpt = Path("results"),
    format: FormatOpt = None,
    trace_block_tokens: Annotated[
        Optional[int],
        typer.Option("--trace-block-tokens", min=1, help="Tokens per trace hash id (default: 16 Bailian, 512 Mooncake)."),
    ] = None,
    skip_invalid: SkipOpt = False,
):
    """Replay a trace through a model of vLLM's prefix cache under each policy at each capacity.

    Prints hit ratios, gains over LRU, the share of the LRU-to-Belady gap closed and modelled
    queued TTFT; writes results.json and hit-ratio and QTTFT plots.
    """
    names = _policy_list(policies)
    schedule = _schedule(capacity_schedule)
    capacities = (schedule[0][1],) if schedule else _capacity_list(capacity)
    sim_config = _sim_config(block_size, cpu_capacity, schedule)
    fit_bounds = parse_window_option(fit_window, "--fit-window")
    eval_bounds = parse_window_option(eval_window, "--eval-window")
    trace = open_trace(trace_path, format=format, block_size=trace_block_tokens, skip_invalid=skip_invalid)
    if config is not None:
        from kvprof.models.hp import load_hp

        hp, hp_input = load_hp(config), {"path": str(config)}
    elif _needs_hp(names, sim_config):
        hp = _fit(trace, fit_bounds, output)
        hp_input = {"fitted_on_window": fit_window, "path": str(output / "hp.json")}
    else:
        hp, hp_input = None, None
    evaluated = trace.time_window(*eval_bounds)
    if evaluated.n_requests == 0:
        raise SimulationError(
            f"the evaluation window {eval_window} holds no requests "
            f"(the trace's arrivals span {trace.timestamp[0]:g}..{trace.timestamp[-1]:g} s)"
        )
    inputs = {"trace_path": str(trace_path), "hp": hp_input, "eval_window": eval_window, "seed": seed}
    _run_and_report(evaluated, hp, names, capacities, sim_config, jobs, output, json_out, inputs)


@guarded
def demo(
    output: OutputOpt = Path("results"),
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic trace.")] = 0,
    jobs: JobsOpt = -1,
    json_out: JsonOpt = False,
):
    """The published experiment on a synthetic Bailian trace A: fit hour one, compare on hour two.

    Generates a two-hour bailian-a trace into the output directory, reads it back like any trace,
    fits the reuse models on the first hour and replays the second under lru, wa-paper, wa and
    belady at 1024..8192 blocks of 128 tokens.
    """
    from kvprof.profiler.synth import generate, write_jsonl

    output.mkdir(parents=True, exist_ok=True)
    trace_path = output / f"bailian-a-2h-seed{seed}.jsonl"
    with err_console.status(f"generating {trace_path}"):
        write_jsonl(trace_path, generate("bailian-a", 2.0, seed))
    trace = open_trace(trace_path)
    hp = _fit(trace, (0.0, 3600.0), output)
    inputs = {"trace_path": str(trace_path), "synthetic": {"preset": "bailian-a", "hours": 2.0, "seed": seed},
              "hp": {"fitted_on_window": "0:3600", "path": str(output / "hp.json")}, "eval_window": "3600:"}
    _run_and_report(trace.time_window(3600.0, None), hp, DEMO_POLICIES, DEMO_CAPACITIES, SimConfig(), jobs, output,
                    json_out, inputs)


def _run_and_report(trace, hp, policies, capacities, sim_config, jobs, output, json_out, inputs) -> None:
    """Sweep, then write plots and results.json (last, atomically) and print the table."""
    from kvprof.cli.plots import plot_results
    from kvprof.sim.sweep import run_sweep

    output.mkdir(parents=True, exist_ok=True)
    # A stale results.json next to new plots would look complete: it goes before anything is replayed.
    (output / RESULTS_FILE).unlink(missing_ok=True)
    with Progress("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True, disable=json_out) as bar:
        task = bar.add_task("replaying", total=len(policies) * len(capacities))
        results = run_sweep(trace, hp, policies, capacities, sim_config, n_jobs=jobs, inputs=inputs,
                            progress=lambda done, total: bar.update(task, completed=done))
    document = results.to_dict()
    plots = plot_results(document, output)
    results.write(output / RESULTS_FILE)
    if json_out:
        print_json(document)
        return
    console.print(_table(results))
    err_console.print(f"wrote {output / RESULTS_FILE} and {len(plots)} plots in {results.wall_s:.1f} s")


def _table(results) -> Table:
    two_tiers = bool(results.config.cpu_capacity)
    table = Table(title=f"{results.inputs['trace']['n_requests']:,} requests, "
                        f"{results.config.engine_block_size}-token blocks (QTTFT modelled)")
    columns = ["capacity", "policy", "hit ratio", "vs lru", "belady gap closed", "QTTFT mean (s)", "QTTFT p99 (s)"]
    if two_tiers:
        columns += ["device hits", "host hits", "misses"]
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for capacity in results.capacities:
        for policy in results.policies:
            run, gains = results.get(policy, capacity), results.comparison(policy, capacity)
            row = [
                f"{capacity:,}",
                policy,
                f"{run.token_hit_ratio:.4f}",
                _percent(gains["hit_gain_over_lru"]) if policy != "lru" else "",
                _percent(gains["belady_gap_closed"]) if policy not in ("lru", "belady") else "",
                f"{run.qttft_mean_s:.2f}",
                f"{run.qttft_p99_s:.2f}",
            ]
            if two_tiers:
                row += [f"{run.hits_device:,}", f"{run.hits_host:,}", f"{run.misses:,}"]
            table.add_row(*row, end_section=policy == results.policies[-1])
    return table


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _fit(trace, bounds, output: Path):
    """Fit the reuse models on a window (the published workflow: hour one) and keep the hp file."""
    from kvprof.profiler.fit import fit_trace

    with err_console.status("fitting reuse models"):
        hp = fit_trace(trace.time_window(*bounds))
    output.mkdir(parents=True, exist_ok=True)
    hp.save(output / "hp.json")
    return hp


def _needs_hp(names, sim_config: SimConfig) -> bool:
    from kvprof.policy import POLICIES

    return any(hasattr(POLICIES[name], "from_hp") for name in (*names, sim_config.cpu_policy))


def _policy_list(text: str) -> tuple[str, ...]:
    from kvprof.policy import POLICIES

    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in POLICIES]
    if not names or unknown:
        raise typer.BadParameter(
            f"unknown policy {', '.join(map(repr, unknown)) or '(none given)'}; known: {', '.join(POLICIES)}",
            param_hint="--policies",
        )
    if len(set(names)) != len(names):
        raise typer.BadParameter("a policy is named twice", param_hint="--policies")
    return names


def _capacity_list(text: str) -> tuple[int, ...]:
    try:
        capacities = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} must be comma-separated whole numbers of blocks", param_hint="--capacity"
        ) from None
    if any(c <= 0 for c in capacities):
        raise typer.BadParameter(f"capacities must be > 0 blocks, got {text}", param_hint="--capacity")
    if len(set(capacities)) != len(capacities):
        raise typer.BadParameter("a capacity is given twice", param_hint="--capacity")
    return capacities


def _schedule(text: str | None) -> tuple[tuple[float, int], ...]:
    if text is None:
        return ()
    try:
        return parse_schedule(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--capacity-schedule") from None


def _sim_config(block_size: int, cpu_capacity: int, schedule) -> SimConfig:
    try:
        return SimConfig(engine_block_size=block_size, cpu_capacity=cpu_capacity, capacity_schedule=schedule)
    except KvprofError as exc:
        raise typer.BadParameter(str(exc), param_hint="--block-size/--capacity-schedule") from None
