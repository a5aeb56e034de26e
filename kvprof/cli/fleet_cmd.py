"""``kvprof fleet``: N replicas of the simulated server behind a router, swept over routers,
policies, replica counts and capacities (docs/fleet.md).

Wiring only: options are checked here, the work is :func:`kvprof.sim.fleet.run_fleet`, one task
per configuration on :func:`kvprof.parallel.run_tasks` (joblib here, or Ray); the document is
:mod:`kvprof.results`'s, the pictures :func:`kvprof.cli.plots.plot_results`'. As ``compare``,
outputs (``results.json``, the plots, the fitted hp files, ``--hp-per-replica``'s among them) are
written only once every configuration has run, and put in place together (:func:`kvprof.atomic.staged`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn

from kvprof import results as results_file
from kvprof.atomic import staged
from kvprof.cli.common import (
    FormatOpt,
    JobsOpt,
    LimitOpt,
    RayOpt,
    SkipOpt,
    TraceArg,
    TraceBlockTokensOpt,
    check_format,
    check_memory,
    guarded,
    make_dir,
    number_option,
    open_trace,
    output_dir,
    parse_list,
    parse_window_option,
    qttft_cell,
    trace_block_size,
)
from kvprof.cli.compare_cmd import (
    FITTED_HP,
    JsonOpt,
    OutputOpt,
    _check_multiple,
    _cost_model,
    _fit,
    _needs_hp,
    _policy_list,
)
from kvprof.cli.output import print_json, progress, say, show, table
from kvprof.limits import BLOCK_TOKENS, BLOCKS, RATE_SCALE, Bound
from kvprof.sim.config import COST_BOUNDS, SimConfig, SimulationError, default_engine_block

#: Replicas of one fleet: llm-d and Dynamo deployments run tens; each is a Python replay when routing reads them.
REPLICAS = Bound(1, 4096, whole=True)
#: How much the prefix routers weigh load against overlap.
LOAD_WEIGHT = Bound(0.0, 1e6)
IndexBlocksOpt = Annotated[
    Optional[int], number_option("--index-blocks", bound=BLOCKS,
                                 help="Blocks per replica prefix-approx's index remembers (default: the replica's "
                                      "capacity).")
]


@guarded
def fleet(
    trace_path: TraceArg,
    replicas: Annotated[str, typer.Option("--replicas", help="Comma-separated replica counts.")] = "4",
    router: Annotated[
        str, typer.Option("--router", help="Comma-separated routers: round-robin, least-loaded, session, "
                                           "prefix-approx, prefix-precise.")
    ] = "round-robin,least-loaded,session,prefix-approx,prefix-precise",
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated policy names (each replica's).")] = "lru",
    capacity: Annotated[
        str, typer.Option("--capacity", help="Comma-separated GPU capacities per replica, in engine blocks.")
    ] = "1024",
    config: Annotated[
        Optional[Path],
        typer.Option("--config", help="Hyperparameter file (hp.json) of every replica; without it, fit one on "
                                      "--fit-window first (on the whole trace)."),
    ] = None,
    load_weight: Annotated[
        float, number_option("--load-weight", bound=LOAD_WEIGHT,
                             help="Weight of load against prefix overlap in the prefix routers (0: overlap only).")
    ] = 1.0,
    index_blocks: IndexBlocksOpt = None,
    block_size: Annotated[
        Optional[int],
        number_option("--block-size", bound=BLOCK_TOKENS,
                      help="Engine block size in tokens, a multiple of the trace's block size "
                           "(default: the smallest such multiple >= 128)."),
    ] = None,
    fit_window: Annotated[
        str, typer.Option("--fit-window", help="START:END seconds to fit on when no --config is given.")
    ] = "0:3600",
    eval_window: Annotated[str, typer.Option("--eval-window", help="START:END seconds to replay.")] = "3600:",
    limit: LimitOpt = None,
    rate_scale: Annotated[
        float, number_option("--rate-scale", bound=RATE_SCALE, help="Speed-up of arrivals, as compare's.")
    ] = 1.0,
    cost_file: Annotated[
        Optional[Path], typer.Option("--cost", help="Cost-model file (kvprof.cost/1) of every replica.")
    ] = None,
    prefill_rate: Annotated[
        Optional[float],
        number_option("--prefill-rate", bound=COST_BOUNDS["prefill_tokens_per_s"],
                      help="Prefill throughput of each replica, tokens/s (default 13500)."),
    ] = None,
    decode: Annotated[
        Optional[bool], typer.Option("--decode/--no-decode", help="Model decoding, as compare's (default: off).")
    ] = None,
    hp_per_replica: Annotated[
        bool, typer.Option("--hp-per-replica",
                           help="Also run the policies that read an hp file with one per replica, fitted and tuned "
                                "on the --fit-window traffic the router sends it (rows say hp per-replica); writes "
                                "them as DIR/hp-ROUTER-xN-cCAPACITY-replica-K.json.")
    ] = False,
    jobs: JobsOpt = -1,
    ray: RayOpt = None,
    json_out: JsonOpt = False,
    output: OutputOpt = Path("results"),
    format: FormatOpt = None,
    trace_block_tokens: TraceBlockTokensOpt = None,
    skip_invalid: SkipOpt = False,
):
    """Replay a trace through N replicas behind a router, each the server compare models.

    Prints per configuration the fleet's token hit ratio, Belady's per replica as the bound, the
    load imbalance (max/mean prefill work) and modelled queued TTFT; writes results.json (one run
    per configuration) and the plots compare draws.
    """
    from kvprof.cli.plots import FILES
    from kvprof.sim.fleet import ROUTERS, RouterSpec

    counts = _unique(parse_list(replicas, REPLICAS, "--replicas", "replica count"), "--replicas")
    routers = _unique(tuple(name.strip() for name in router.split(",") if name.strip()), "--router")
    unknown = [name for name in routers if name not in ROUTERS]
    if not routers or unknown:
        raise typer.BadParameter(f"unknown router {', '.join(map(repr, unknown)) or '(none given)'}; known: "
                                 f"{', '.join(ROUTERS)}", param_hint="--router")
    names = _policy_list(policies)
    capacities = _unique(parse_list(capacity, BLOCKS, "--capacity", "capacity"), "--capacity")
    fit_bounds = parse_window_option(fit_window, "--fit-window")
    eval_bounds = parse_window_option(eval_window, "--eval-window")
    check_format(format)
    fits = config is None and _needs_hp(names)
    modes = {policy: (False, True) if hp_per_replica and _needs_hp([policy]) else (False,) for policy in names}
    replica_files = [replica_hp_file(name, n, c, j) for name in routers for n in counts for c in capacities
                     for j in range(n)] if any(True in mode for mode in modes.values()) else []
    output_dir(output, files=[results_file.FILE, *FILES, *((FITTED_HP,) if fits else ()), *replica_files],
               inputs=[trace_path, config, cost_file])
    tasks = [(RouterSpec(name, load_weight, index_blocks), n, policy, c, per_replica)
             for name in routers for n in counts for policy in names for c in capacities for per_replica in modes[policy]]
    check_memory([max(counts) * max(capacities)], 0, jobs, len(tasks), "--replicas/--capacity")
    cost = _cost_model(cost_file, prefill_tokens_per_s=prefill_rate, decode=decode)
    trace_block = trace_block_size(trace_path, format, trace_block_tokens)
    if block_size is not None and trace_block is not None:
        _check_multiple(block_size, trace_block)
    hp = hp_input = None
    if config is not None:
        from kvprof.models.hp import load_hp

        hp, hp_input = load_hp(config), {"path": str(config)}
    trace = open_trace(trace_path, format=format, block_size=trace_block_tokens, skip_invalid=skip_invalid)
    if block_size is not None:
        _check_multiple(block_size, trace.block_size)
    evaluated = trace.time_window(*eval_bounds)
    if limit is not None:
        evaluated = evaluated.head(limit)
    if evaluated.n_requests == 0:
        raise SimulationError(f"the evaluation window {eval_window} holds no requests (the trace's arrivals span "
                              f"{float(trace.timestamp[0]):g}..{float(trace.timestamp[-1]):g} s); pass --eval-window")
    sim_config = SimConfig(engine_block_size=block_size or default_engine_block(trace.block_size), cost=cost,
                           rate_scale=rate_scale, timing="model")
    fitted = None
    if fits:
        hp = fitted = _fit(trace, fit_bounds, capacities, sim_config, jobs, ray)
        hp_input = {"fitted_on_window": fit_window, "path": str(output / FITTED_HP)}
    inputs = {"trace_path": str(trace_path), "hp": hp_input, "eval_window": eval_window, "limit": limit}
    fit_part = trace.time_window(*fit_bounds) if hp_per_replica else None
    if fit_part is not None and fit_part.n_requests == 0:
        raise SimulationError(f"the fit window {fit_window} holds no requests to fit the replicas' hp files on")
    document, rows, replica_hps = _run(evaluated, hp, fit_part, tasks, sim_config, jobs, ray, inputs, json_out)
    from kvprof.cli.plots import plot_results

    make_dir(output)
    with staged() as outputs:  # all replaced together, or none (an interrupt while plotting)
        if fitted is not None:
            fitted.save(outputs.stage(output / FITTED_HP))
        for name, replica_hp in replica_hps.items():
            replica_hp.save(outputs.stage(output / name))
        results_file.write(outputs.stage(output / results_file.FILE), document)
        plots = plot_results(document, output, outputs)
    if json_out:
        print_json(rows)
        return
    show(_table(rows, document))
    say(f"wrote {output / results_file.FILE} and {len(plots)} plots in {document['wall_s']:.1f} s")


def _run(trace, hp, fit_part, tasks, config: SimConfig, jobs: int, ray, inputs: dict,
         quiet: bool) -> tuple[dict, list[dict], dict]:
    """Every configuration as a task; the results document, its rows (one per configuration) and
    the per-replica hp files by file name (:func:`replica_hp_file`)."""
    from kvprof.sim.fleet import label
    from kvprof.parallel import run_tasks
    from kvprof.sim.workload import prepare_workload

    started = time.perf_counter()
    workload = prepare_workload(trace, hp, config.engine_block_size, config.rate_scale)
    with progress(BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=quiet) as bar:
        task = bar.add_task("routing and replaying", total=len(tasks))
        outcomes = run_tasks(_one, (trace, workload, hp, fit_part), [(*task, config) for task in tasks], n_jobs=jobs,
                         ray=ray,
                         progress=lambda done, total: bar.update(task, completed=done))
    runs = [run for run, _ in outcomes]
    replica_hps = {replica_hp_file(run.router, run.replicas, run.capacity, j): one
                   for run, hps in outcomes for j, one in enumerate(hps or ())}
    rows = [run.to_dict() for run in runs]
    facts = {"trace": {"source": trace.source, "sha256": trace.sha256, "format": trace.format,
                       "block_size": trace.block_size, "window": [trace.window[0], trace.censor_time],
                       "n_requests": trace.n_requests, "n_engine_block_accesses": workload.n_accesses}}
    labels = [label(row["policy"], row["router"], row["replicas"], row["hp"]) for row in rows]
    document = results_file.build(
        inputs={**inputs, **facts},
        config={**config.to_dict(), "mode": "fleet", "policies": list(dict.fromkeys(labels)),
                "capacities": sorted({row["capacity"] for row in rows}),
                "routers": sorted({row["router"] for row in rows}), "load_weight": tasks[0][0].load_weight,
                "index_blocks": tasks[0][0].index_blocks},
        runs=[{**row, "policy": name, "fleet_policy": row["policy"]} for row, name in zip(rows, labels)],
        wall_s=time.perf_counter() - started)
    return document, rows, replica_hps


def replica_hp_file(router: str, replicas: int, capacity: int, replica: int) -> str:
    """The name of the hp file ``--hp-per-replica`` fitted for ``replica`` of ``replicas`` behind
    ``router`` at ``capacity`` (``kvprof fit --replica`` fits the same)."""
    return f"hp-{router}-x{replicas}-c{capacity}-replica-{replica}.json"


def _one(shared, spec, replicas: int, policy: str, capacity: int, per_replica: bool, config: SimConfig):
    from kvprof.sim.fleet import fit_per_replica, run_fleet

    trace, workload, hp, fit_part = shared
    hps = fit_per_replica(fit_part, spec, replicas, capacity, config, hp) if per_replica else None
    return run_fleet(trace, workload, hp, spec, replicas, policy, capacity, config, hps), hps


def _table(rows: list[dict], document: dict):
    facts = document["inputs"]["trace"]
    out = table(f"{facts['n_requests']:,} requests, {document['config']['engine_block_size']}-token engine blocks, "
                f"capacity per replica", {c: "left" if c in ("router", "policy") else "right" for c in _COLUMNS})
    for row in rows:
        ratios = row["replica_token_hit_ratios"]
        out.add_row(row["router"], row["policy"] + (" (hp per replica)" if row["hp"] != "fleet" else ""),
                    str(row["replicas"]), f"{row['capacity']:,}",
                    f"{row['fleet_token_hit_ratio']:.4f}", f"{row['belady_token_hit_ratio']:.4f}",
                    f"{min(ratios):.3f}..{max(ratios):.3f}", f"{row['load_imbalance']:.2f}",
                    qttft_cell(row["qttft_mean_s"], row["qttft_overloaded"]),
                    qttft_cell(row["qttft_p99_s"], row["qttft_overloaded"]))
    return out


_COLUMNS = ("router", "policy", "replicas", "capacity", "fleet hit ratio", "belady", "replica hit ratios",
            "imbalance", "QTTFT mean (s)", "QTTFT p99 (s)")


def _unique(values: tuple, option: str) -> tuple:
    if len(set(values)) != len(values):
        raise typer.BadParameter("a value is given twice", param_hint=option)
    return values
