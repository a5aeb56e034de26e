"""``kvprof fleet``: N replicas of the simulated server behind a router, swept over routers,
policies, replica counts and capacities (docs/fleet.md).

Wiring only: options are checked here, the work is :func:`kvprof.sim.fleet.run_fleet`, one task
per configuration on :func:`kvprof.parallel.run_tasks` (joblib here, or Ray); the document is
:mod:`kvprof.results`'s, the pictures :func:`kvprof.cli.plots.plot_results`'. As ``compare``,
outputs (``results.json``, the plots, the fitted hp files, ``--hp-per-replica``'s among them) are
written only once every configuration has run, and put in place together (:func:`kvprof.atomic.staged`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvprof import results as results_file
from kvprof.atomic import staged
from kvprof.cli.common import (
    FITTED_HP,
    REJECTED_NOTE,
    EvalWindowOpt,
    FitWindowOpt,
    FormatOpt,
    JobsOpt,
    LimitOpt,
    OutputOpt,
    RayOpt,
    SkipOpt,
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
    parse_list,
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
    recorded_hint_budget,
    hinted,
    warn_empty_budgets,
    with_hinted_twins,
)
from kvprof.cli.output import print_json, say, show, table, task_progress, warn
from kvprof.limits import BLOCK_TOKENS, BLOCKS, RATE_SCALE, Bound
from kvprof.sim.config import COST_BOUNDS, SimConfig, SimulationError, default_engine_block

#: Replicas of one fleet: llm-d and Dynamo deployments run tens; each is a Python replay when routing reads them.
REPLICAS = Bound(1, 4096, whole=True)
#: Replicas of a fleet of a trace file when --replicas is not given.
DEFAULT_REPLICAS = 4
#: Configurations one sweep runs at most: each is a whole fleet's replay, and the table and plots show them all.
MAX_CONFIGURATIONS = 1024
#: How much the prefix routers weigh load against overlap.
LOAD_WEIGHT = Bound(0.0, 1e6)
TracesArg = Annotated[
    list[Path], typer.Argument(metavar="TRACE...", help="Trace file (Bailian or Mooncake JSONL, plain, .gz or .zst), or the vLLM recording "
                                    "directories of a fleet's servers (vllm serve --kv-record on each): one fleet "
                                    "trace.")
]
IndexBlocksOpt = Annotated[
    Optional[int], number_option("--index-blocks", bound=BLOCKS,
                                 help="Blocks per replica prefix-approx's index remembers (default: the replica's "
                                      "capacity); refused without --router prefix-approx.")
]


@guarded
def fleet(
    trace_paths: TracesArg,
    replicas: Annotated[
        Optional[str], typer.Option("--replicas", help="Comma-separated replica counts (default 4; for recordings, "
                                                       "their servers' count). The recorded router always replays "
                                                       "the recordings' servers: refused with it alone.")
    ] = None,
    router: Annotated[
        Optional[str], typer.Option("--router", help="Comma-separated routers: round-robin, least-loaded, session, "
                                                     "prefix-approx, prefix-precise; recorded for recordings, where "
                                                     "each request went (default: all that apply).")
    ] = None,
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated policy names (each replica's).")] = "lru",
    capacity: Annotated[
        Optional[str], typer.Option("--capacity", help="Comma-separated GPU capacities per replica, in engine blocks "
                                                       "(default 1024; for recordings, their servers' usable blocks).")
    ] = None,
    config: Annotated[
        Optional[Path],
        typer.Option("--config", help="Hyperparameter file (hp.json) of every replica; without it, fit one on "
                                      "--fit-window first (on the whole trace)."),
    ] = None,
    load_weight: Annotated[
        Optional[float], number_option("--load-weight", bound=LOAD_WEIGHT,
                                       help="Weight of load against prefix overlap in the prefix routers (0: overlap "
                                            "only; default 1); refused without one.")
    ] = None,
    index_blocks: IndexBlocksOpt = None,
    block_size: Annotated[
        Optional[int],
        number_option("--block-size", bound=BLOCK_TOKENS,
                      help="Engine block size in tokens, a multiple of the trace's block size "
                           "(default: the smallest such multiple >= 128; for recordings, the servers')."),
    ] = None,
    fit_window: FitWindowOpt = "0:3600",
    eval_window: EvalWindowOpt = "3600:",
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
                                "them as DIR/hp-ROUTER-xN-cCAPACITY-replica-K.json. Refused when no policy of "
                                "--policies reads an hp file.")
    ] = False,
    jobs: JobsOpt = -1,
    ray: RayOpt = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the configurations' rows (one object per configuration: its "
                                          "router, replicas, policy, capacity, hit ratios, rejected requests, load "
                                          "and QTTFT; results.json's runs) as a JSON list instead of a table.")
    ] = False,
    output: OutputOpt = Path("results"),
    format: FormatOpt = None,
    trace_block_tokens: TraceBlockTokensOpt = None,
    skip_invalid: SkipOpt = False,
    hints: HintsOpt = "trace",
    hint_share: HintShareOpt = None,
    hint_end_turn: HintEndTurnOpt = None,
    hint_tool_call: HintToolCallOpt = None,
    hint_max_fraction: HintMaxFractionOpt = None,
    ignore_hints: IgnoreHintsOpt = False,
):
    """Replay a trace through N replicas behind a router, each the server compare models.

    Prints per configuration the fleet's token hit ratio, Belady's per replica as the bound, the
    load imbalance (max/mean prefill work) and modelled queued TTFT; writes results.json (one run
    per configuration) and the plots compare draws. Several vLLM recordings (one per server) are
    one fleet trace: the recorded router replays what each server received. Client hints are
    replayed as compare replays them: each online policy P also as P+hints, on every replica.
    """
    from kvprof.cli.plots import FILES
    from kvprof.sim.fleet import RECORDED, ROUTERS, RouterSpec

    recordings = fleet_recordings(trace_paths)
    recorded = sum(len(recording.ranks) for recording in recordings) if recordings else None
    known = (RECORDED, *ROUTERS) if recordings else ROUTERS
    counts = distinct(parse_list(str(recorded or DEFAULT_REPLICAS) if replicas is None else replicas, REPLICAS,
                                 "--replicas", "replica count"), "--replicas")
    routers = distinct(tuple(list_items(router, "--router")) if router is not None else known, "--router", "router")
    unknown = [name for name in routers if name not in known]
    if unknown:
        raise typer.BadParameter(f"unknown router {', '.join(map(repr, unknown))}; known: "
                                 f"{', '.join(known)}" + ("" if recordings else f" ({RECORDED}: for vLLM recordings)"),
                                 param_hint="--router")
    names = policy_list(policies)
    stop = hint_options(hints, hint_share, hint_end_turn, hint_tool_call, hint_max_fraction, ignore_hints)
    check_hinted_policies(names, hints, hint_max_fraction, ignore_hints)
    if capacity is None:
        capacity = recorded_capacity(trace_paths, recordings) if recordings else "1024"
    capacities = distinct(capacity_list(capacity), "--capacity", "capacity")
    fit_bounds = parse_window_option(fit_window, "--fit-window")
    eval_bounds = parse_window_option(eval_window, "--eval-window")
    check_format(format)
    fits = config is None and (needs_hp(names) or (hints == "stop" and not ignore_hints))
    counts_of = {name: (recorded,) if name == RECORDED else counts for name in routers}
    replica_files = [replica_hp_file(name, n, c, j) for name in routers for n in counts_of[name] for c in capacities
                     for j in range(n)] if hp_per_replica and needs_hp(names) else []
    output_dir(output, files=[results_file.FILE, *FILES, *((FITTED_HP,) if fits else ()), *replica_files],
               inputs=[*trace_paths, config, cost_file])
    _check_knobs(routers, names, replicas, hp_per_replica, load_weight, index_blocks)
    specs = {name: RouterSpec(name, 1.0 if load_weight is None else load_weight, index_blocks) for name in routers}
    _check_offline_policies(specs.values(), names)
    # before any reading: the most configurations the sweep may run (each online policy also with hints)
    _configurations(specs, counts_of, names if ignore_hints else with_hinted_twins(names), capacities, hp_per_replica)
    tasks = _configurations(specs, counts_of, names, capacities, hp_per_replica)
    check_memory([max(task[1] for task in tasks) * max(capacities)], 0, jobs, len(tasks), "--replicas/--capacity")
    cost = cost_model(cost_file, prefill_tokens_per_s=prefill_rate, decode=decode)
    trace_block = recordings[0].block_size if recordings else trace_block_size(trace_paths[0], format,
                                                                                trace_block_tokens)
    if block_size is not None and trace_block is not None:
        check_multiple(block_size, trace_block)
    hp = hp_input = None
    if config is not None:
        from kvprof.models.hp import load_hp

        hp, hp_input = load_hp(config), {"path": str(config)}
    traces = [open_trace(path, format=format, block_size=trace_block_tokens, skip_invalid=skip_invalid,
                         block_option="--trace-block-tokens") for path in trace_paths]
    trace = joined_trace(trace_paths, traces, recordings, routers)
    if block_size is not None:
        check_multiple(block_size, trace.block_size)
    evaluated = evaluation_window(trace, eval_bounds, eval_window, limit, fits or hp_per_replica)
    engine_block = block_size or (trace.block_size if recordings else default_engine_block(trace.block_size))
    sim_config = SimConfig(engine_block_size=engine_block, cost=cost, rate_scale=rate_scale, timing="model")
    if hints == "stop" and not ignore_hints:  # what the fit and the replays would find out only after them
        check_stop_hints(evaluated, hp, stop, fits)
    fitted = None
    if fits:
        hp = fitted = fit_and_tune(trace, fit_bounds, capacities, sim_config, jobs, ray, evaluated)
        hp_input = {"fitted_on_window": fit_window, "path": str(output / FITTED_HP)}
    inputs = {"trace_path": " + ".join(map(str, trace_paths)), "hp": hp_input, "eval_window": eval_window,
              "limit": limit}
    evaluated, names, hint_facts = hinted(evaluated, hp, names, hints, stop, hint_max_fraction, ignore_hints)
    if hint_facts is not None:
        if recordings and hint_max_fraction is None and hints == "trace":  # the servers' own bound
            hint_max_fraction = hint_facts["max_fraction"] = recorded_hint_budget(recordings)
        inputs["hints"] = hint_facts
        warn_empty_budgets(hint_max_fraction, capacities)
        tasks = _configurations(specs, counts_of, names, capacities, hp_per_replica)
    fit_part = trace.time_window(*fit_bounds) if hp_per_replica else None
    if fit_part is not None and fit_part.n_requests == 0:
        raise SimulationError(f"the fit window {fit_window} holds no requests to fit the replicas' hp files on")
    document, rows, replica_hps = _run(evaluated, hp, fit_part, tasks, sim_config, jobs, ray, inputs, json_out,
                                       hint_max_fraction)
    from kvprof.cli.plots import plot_results

    with made_dir(output), staged(final=True) as outputs:  # all replaced together or none (an interrupt)
        if fitted is not None:
            fitted.save(outputs.stage(output / FITTED_HP))
        for name, replica_hp in replica_hps.items():
            replica_hp.save(outputs.stage(output / name))
        results_file.write(outputs.stage(output / results_file.FILE), document)
        plots = plot_results(document, output, outputs)
    if json_out:
        print_json(rows)
        return
    show(_table(rows, document, of_recordings=bool(recordings)))
    hinted_rows = [(row["policy"], row["capacity"], row["hints"]) for row in document["runs"] if row.get("hints")]
    if hinted_rows:
        show(hint_table(hinted_rows))
    say(f"wrote {output / results_file.FILE} and {len(plots)} plots; routing and replaying took "
        f"{document['wall_s']:.1f} s")


def _run(trace, hp, fit_part, tasks, config: SimConfig, jobs: int, ray, inputs: dict,
         quiet: bool, hint_max_fraction: float | None = None) -> tuple[dict, list[dict], dict]:
    """Every configuration as a task; the results document, its rows (one per configuration) and
    the per-replica hp files by file name (:func:`replica_hp_file`)."""
    from kvprof.sim.fleet import label
    from kvprof.parallel import run_tasks
    from kvprof.sim.workload import prepare_workload

    started = time.perf_counter()
    workload = prepare_workload(trace, hp, config.engine_block_size, config.rate_scale)
    with task_progress(f"routing and replaying {len(tasks):,} configurations", len(tasks), quiet) as update:
        outcomes = run_tasks(run_configuration, (trace, workload, hp, fit_part),
                             [(*task, config, hint_max_fraction) for task in tasks], n_jobs=jobs, ray=ray,
                             progress=update)
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


def _configurations(specs: dict, counts_of: dict, policies: tuple, capacities, hp_per_replica: bool) -> list[tuple]:
    """The sweep's configurations ``(router spec, replicas, policy, capacity, hp per replica)``; a policy that
    reads an hp file runs both ways with ``--hp-per-replica``. More than MAX_CONFIGURATIONS is a usage error."""
    from kvprof.sim.hints import base_name

    tasks = [(spec, n, policy, c, per_replica)
             for name, spec in specs.items() for n in counts_of[name] for policy in policies for c in capacities
             for per_replica in ((False, True) if hp_per_replica and needs_hp([base_name(policy)]) else (False,))]
    if len(tasks) > MAX_CONFIGURATIONS:
        raise typer.BadParameter(f"{len(tasks):,} configurations (routers x replica counts x policies x capacities, "
                                 f"x2 for a policy run --hp-per-replica too, x2 for one replayed with hints too, "
                                 f"where the trace may carry hints: --ignore-hints leaves them out) is "
                                 f"more than the {MAX_CONFIGURATIONS:,} one fleet sweep runs: split the sweep",
                                 param_hint="--router/--replicas/--policies/--capacity")
    return tasks


def _check_knobs(routers: tuple, policies: tuple, replicas: str | None, hp_per_replica: bool,
                 load_weight: float | None, index_blocks: int | None) -> None:
    """Options no configuration of the sweep would read are usage errors (exit 2), not silently ignored."""
    from kvprof.sim.fleet import RECORDED

    check_router_knobs(routers, load_weight, index_blocks)
    if replicas is not None and set(routers) == {RECORDED}:
        raise typer.BadParameter(f"{RECORDED} replays the recordings' own servers, as many as they hold: leave "
                                 f"--replicas out", param_hint="--replicas")
    if hp_per_replica and not needs_hp(policies):
        raise typer.BadParameter(f"fits an hp file per replica for the policies that read one; none of "
                                 f"{', '.join(policies)} does", param_hint="--hp-per-replica")


def check_router_knobs(routers, load_weight: float | None, index_blocks: int | None) -> None:
    """``--load-weight`` and ``--index-blocks`` given where no router of ``routers`` reads them are usage
    errors (exit 2), in fleet, fit --replica and replay alike."""
    if load_weight is not None and not any(name.startswith("prefix") for name in routers):
        raise typer.BadParameter("weighs load in the prefix routers (prefix-approx, prefix-precise); none is in "
                                 "--router", param_hint="--load-weight")
    if index_blocks is not None and "prefix-approx" not in routers:
        raise typer.BadParameter("sizes prefix-approx's index; it is not in --router", param_hint="--index-blocks")


def _check_offline_policies(specs, policies: tuple) -> None:
    """A policy that reads the future (belady) behind a router that decides as it goes is a usage error (exit 2)."""
    from kvprof.policy import POLICIES

    for spec in specs:
        for name in policies:
            if POLICIES[name].offline and spec.reads_replicas:
                raise typer.BadParameter(f"{name} cannot run behind {spec.name}: it reads each replica's future "
                                         f"traffic, which this router decides as it goes ({name} is reported as each "
                                         f"replica's bound instead)", param_hint="--policies/--router")


def fleet_recordings(paths: list[Path]) -> list:
    """The ``recording.json`` of each input when they are vLLM recordings, [] for one trace file.

    Several inputs are a fleet only as recordings (a usage error otherwise)."""
    recordings = [recording_of(path) for path in paths]
    files = [path for path, recording in zip(paths, recordings) if recording is None]
    if files and len(paths) > 1:
        raise typer.BadParameter(f"several inputs are one fleet trace only as vLLM recording directories (vllm serve "
                                 f"--kv-record, one per server); {files[0]} is a file", param_hint="TRACE")
    return [] if files else recordings


def joined_trace(paths: list[Path], traces: list, recordings: list, routers: tuple):
    """The fleet's trace: the one trace file, or the recordings joined (:func:`kvprof.sim.recorded.fleet_trace`),
    with a warning where ``routers`` other than ``recorded`` would route traffic recorded under unshared keys."""
    if not recordings:
        return traces[0]
    from kvprof.sim.fleet import RECORDED
    from kvprof.sim.recorded import fleet_trace

    fleet = fleet_trace([(str(path), trace, recording) for path, trace, recording in zip(paths, traces, recordings)])
    if len(fleet.replicas) > 1 and fleet.unshared and any(name != RECORDED for name in routers):
        warn(f"{fleet.unshared} (the servers did not share one vllm serve --kv-record-key; docs/recording.md), so a "
             f"prefix {len(fleet.replicas)} servers all received counts as up to {fleet.n_keys} different contents "
             f"(one per key): routers other than {RECORDED} see the union of the traffic with no reuse across what "
             f"those servers received, a lower bound on their hits (docs/fleet.md)")
    return fleet.trace


def replica_hp_file(router: str, replicas: int, capacity: int, replica: int) -> str:
    """The name of the hp file ``--hp-per-replica`` fitted for ``replica`` of ``replicas`` behind
    ``router`` at ``capacity`` (``kvprof fit --replica`` fits the same)."""
    return f"hp-{router}-x{replicas}-c{capacity}-replica-{replica}.json"


def run_configuration(shared, spec, replicas: int, policy: str, capacity: int, per_replica: bool,
                      config: SimConfig, hint_max_fraction: float | None = None):
    """One configuration, a task of the sweep: ``(FleetRun, per-replica hp files or None)``;
    ``shared`` is ``(trace, workload, hp, fit window)``, the window read only with ``per_replica``."""
    from kvprof.profiler.fit import fit_trace
    from kvprof.sim.fleet import fit_per_replica, run_fleet

    trace, workload, hp, fit_part = shared
    hps = fit_per_replica(fit_part, spec, replicas, capacity, config, hp, fit_trace) if per_replica else None
    return run_fleet(trace, workload, hp, spec, replicas, policy, capacity, config, hps, hint_max_fraction), hps


def _table(rows: list[dict], document: dict, of_recordings: bool):
    """The sweep's rows, with a note under them for what a row cannot say (rejected requests; the
    ``session`` router over recordings)."""
    facts = document["inputs"]["trace"]
    notes = [note for note, shown in (
        (REJECTED_NOTE, any(row["n_rejected"] for row in rows)),
        (SESSION_OF_RECORDINGS_NOTE, of_recordings and any(row["router"] == "session" for row in rows))) if shown]
    out = table(f"{facts['n_requests']:,} requests, {document['config']['engine_block_size']}-token engine blocks, "
                f"capacity per replica", {c: "left" if c in ("router", "policy") else "right" for c in _COLUMNS},
                caption="\n".join(notes) or None)
    for row in rows:
        ratios = row["replica_token_hit_ratios"]
        out.add_row(row["router"], row["policy"] + (" (hp per replica)" if row["hp"] != "fleet" else ""),
                    str(row["replicas"]), f"{row['capacity']:,}",
                    f"{row['fleet_token_hit_ratio']:.4f}", f"{row['belady_token_hit_ratio']:.4f}",
                    f"{min(ratios):.3f}..{max(ratios):.3f}", rejected_cell(row["n_rejected"], row["n_requests"]),
                    f"{row['load_imbalance']:.2f}",
                    qttft_cell(row["qttft_mean_s"], row["qttft_overloaded"]),
                    qttft_cell(row["qttft_p99_s"], row["qttft_overloaded"]))
    return out


#: Under the table of a fleet of recordings (docs/fleet.md, "A fleet of recordings").
SESSION_OF_RECORDINGS_NOTE = (
    "session: hashes the chat ids the recorder numbered, not the ids a live session router hashed, so it "
    "places conversations as such a router would, not where the live fleet's session router placed them")

_COLUMNS = ("router", "policy", "replicas", "capacity", "fleet hit ratio", "belady", "replica hit ratios",
            "rejected", "imbalance", "QTTFT mean (s)", "QTTFT p99 (s)")

