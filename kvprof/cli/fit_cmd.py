"""``kvprof fit``: a trace's reuse models, tuned, into an hp file; and the options it shares with ``inspect``."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvprof.classes import CLASS_KEYS, MAX_TURN_CAP, ClassRule
from kvprof.cli.common import (
    FormatOpt,
    JobsOpt,
    RayOpt,
    RankOpt,
    SkipOpt,
    capacity_list,
    check_format,
    check_memory,
    guarded,
    list_items,
    made_dir,
    number_option,
    open_trace,
    output_dir,
    output_file,
    parse_list,
    parse_window_option,
    recorded_capacity,
    trace_block_size,
    tune_with_progress,
)
from kvprof.cli.fleet_cmd import (DEFAULT_REPLICAS, LOAD_WEIGHT, REPLICAS, IndexBlocksOpt, check_router_knobs,
                                 fleet_recordings, joined_trace)
from kvprof.cli.hp_tables import cells_table, horizons, next_turn_line, retention_line, tuning_table
from kvprof.cli.output import print_json, say, show as show_table, status, warn
from kvprof.errors import KvprofError
from kvprof.limits import BLOCK_TOKENS, COUNT, POSITIVE_SECONDS, SECONDS, Bound


BlockSizeOpt = Annotated[
    Optional[int], number_option("--block-size", bound=BLOCK_TOKENS,
                                 help="Tokens per trace block (default: 16 Bailian, 512 Mooncake).")
]


JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]


ClassKeyOpt = Annotated[
    str, typer.Option("--class-key", help=f"Workload class rule: {', '.join(CLASS_KEYS)}.")
]


TurnCapOpt = Annotated[
    int, number_option("--turn-cap", bound=Bound(1, MAX_TURN_CAP, whole=True),
                       help="Pool turns >= this into <type>_<cap>+.")
]


ClassFieldOpt = Annotated[
    Optional[str], typer.Option("--class-field", help="Key classes on this trace field (implies --class-key field).")
]


MinGapOpt = Annotated[
    float, number_option("--min-gap", bound=SECONDS, help="Seconds under which a reuse counts as concurrent use.")
]


HorizonOpt = Annotated[
    float, number_option("--horizon", bound=POSITIVE_SECONDS,
                         help="H in seconds: score = P(reuse within H | idle age).")
]


#: Largest capacity fit tunes for (blocks); compare's is what memory allows.
MAX_TUNED_CAPACITY = 2**40


TUNED_BLOCKS = Bound(1, MAX_TUNED_CAPACITY, whole=True)


def class_rule(key: str, turn_cap: int, field: str | None) -> ClassRule:
    if field is not None:
        key = "field"
    try:
        return ClassRule(key=key, turn_cap=turn_cap, field=field)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--class-key/--class-field") from None


def _cell_fields(text: str | None) -> tuple[str, ...]:
    """``--cell-fields``: names a feature ``<field>=<value>`` can be built from (exit 2 otherwise)."""
    from kvprof.cells import field_name_problem

    fields = tuple(list_items(text, "--cell-fields")) if text is not None else ()
    for name in fields:
        problem = field_name_problem(name)
        if problem:
            raise typer.BadParameter(problem, param_hint="--cell-fields")
    if len(set(fields)) != len(fields):
        raise typer.BadParameter("a field is named twice", param_hint="--cell-fields")
    return fields


def check_trace_fields(trace, rule: ClassRule, cell_fields=()) -> None:
    """The fields ``--class-field`` and ``--cell-fields`` name are in the trace (exit 2 otherwise), checked
    right after reading, before any work on it."""
    from kvprof.profiler.reader import required_fields
    from kvprof.profiler.records import LIST_FIELDS

    extra = sorted(name for name in trace.extra if name not in LIST_FIELDS)
    known = ", ".join(extra) or "none"
    required = required_fields(trace.format)
    listed = "is a list per request (a recording's), not a tag a class can be keyed on"
    if rule.field in LIST_FIELDS:
        raise typer.BadParameter(f"{rule.field!r} {listed} (other fields: {known})", param_hint="--class-field")
    if rule.field is not None and rule.field not in trace.extra and rule.field not in ("type", "turn"):
        raise typer.BadParameter(f"{rule.field!r} is not a field of {trace.source}'s requests (other fields: {known})",
                                 param_hint="--class-field")
    for name in cell_fields:
        if name in trace.extra and name not in LIST_FIELDS:
            continue
        if name in LIST_FIELDS:
            why = listed
        elif name in required:
            why = (f"is a field every {trace.format} record has, not a tag clients set; the class rule and the "
                   f"turn feature already read type and turn")
        else:
            why = f"is not a field of {trace.source}'s requests"
        raise typer.BadParameter(f"{name!r} {why} (fields --cell-fields can name: {known})",
                                 param_hint="--cell-fields")


TracesArg = Annotated[
    list[Path], typer.Argument(metavar="TRACE...", help="Trace file (Bailian or Mooncake JSONL, plain, .gz or .zst), "
                                                        "or a vLLM recording directory (vllm serve --kv-record); the "
                                                        "recordings of a fleet's servers are one fleet trace, as "
                                                        "kvprof fleet reads them (with --router recorded --replica K: "
                                                        "what server K received).")
]


@guarded
def fit(
    trace_paths: TracesArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the hp file (JSON).")],
    window: Annotated[
        str, typer.Option("--window", help="Fit window START:END in seconds; the published workflow fits hour one.")
    ] = "0:3600",
    horizon: HorizonOpt = 60.0,
    class_key: ClassKeyOpt = "type_turn",
    turn_cap: TurnCapOpt = 5,
    class_field: ClassFieldOpt = None,
    max_cells: Annotated[
        int, number_option("--max-cells", bound=Bound(0, 256, whole=True),
                           help="Most workload cells a learned tree may draw for wa; 0: each class is a cell.")
    ] = 16,
    cell_fields: Annotated[
        Optional[str], typer.Option("--cell-fields", help="Comma-separated trace fields clients tag (vllm_xargs) "
                                                         "that may split cells, e.g. model.")
    ] = None,
    max_components: Annotated[
        int, number_option("--max-components", bound=Bound(1, 5, whole=True),
                           help="Most exponentials per reuse model (chosen by BIC).")
    ] = 3,
    min_samples: Annotated[
        int, number_option("--min-samples", bound=Bound(1, COUNT.high, whole=True),
                           help="Classes and cells with fewer block accesses shrink toward more data.")
    ] = 200,
    min_gap: MinGapOpt = 0.3,
    capacity: Annotated[
        Optional[str], typer.Option("--capacity", help="Comma-separated GPU capacities (engine blocks) to tune wa "
                                                       "for, by replaying the fit window; without it, defaults (for a "
                                                       "vLLM recording: the server's usable blocks).")
    ] = None,
    engine_block_size: Annotated[
        Optional[int], number_option("--engine-block-size", bound=BLOCK_TOKENS,
                                     help="Engine block of the tuning replays, with --capacity (default: the "
                                          "smallest multiple of the trace's block >= 128).")
    ] = None,
    jobs: JobsOpt = -1,
    ray: RayOpt = None,
    sharded: Annotated[
        bool, typer.Option("--sharded", help="Fit in shards of the blocks on disk, for traces larger than memory: TRACE "
                                             "may then be a directory of trace files (one trace, read a file at a "
                                             "time); the same hp file as without it.")
    ] = False,
    learned: Annotated[
        bool, typer.Option("--learned", help="With --capacity: train wa's learned candidate on Belady's decisions on "
                                             "the fit window (a compiled Belady replay per capacity labels every "
                                             "access; features: cell, reuse tier, depth, tail distance, the chain's "
                                             "turn and gap, fan-out; experimental, no net gain on the quality suite) "
                                             "and report its held-out log-loss and accuracy.")
    ] = False,
    spill_dir: Annotated[
        Optional[Path], typer.Option("--spill-dir", help="Where --sharded writes its shards (default: the system's "
                                                         "temporary directory; with --ray one the nodes share).")
    ] = None,
    replica: Annotated[
        Optional[int], number_option("--replica", bound=Bound(0, REPLICAS.high - 1, whole=True),
                                     help="Fit on the traffic --router sends replica K (from 0) of --replicas in "
                                          "the fit window, as kvprof fleet --hp-per-replica does; needs --capacity.")
    ] = None,
    replicas: Annotated[
        Optional[int], number_option("--replicas", bound=REPLICAS, help="Replicas behind the router, with --replica "
                                                                        "(default as fleet's: 4; for recordings, "
                                                                        "their servers' count).")
    ] = None,
    router: Annotated[
        Optional[str], typer.Option("--router", help="The fleet's router, with --replica: round-robin, session or "
                                                     "prefix-approx with --load-weight 0; recorded for the recordings "
                                                     "of a fleet's servers (what each received).")
    ] = None,
    load_weight: Annotated[
        Optional[float], number_option("--load-weight", bound=LOAD_WEIGHT,
                                       help="prefix-approx's weight of load against overlap, as fleet's (default 1; "
                                            "fit routes only with 0).")
    ] = None,
    index_blocks: IndexBlocksOpt = None,
    format: FormatOpt = None,
    block_size: BlockSizeOpt = None,
    skip_invalid: SkipOpt = False,
    rank: RankOpt = None,
    retention_shares: Annotated[
        Optional[str], typer.Option("--retention-shares", help="Comma-separated shares of a session's returns "
                                                               "(each > 0 and <= 1) to give the retention a client "
                                                               "should ask for, per class and hint kind "
                                                               "(docs/hints.md; default: 0.5,0.9,0.99).")
    ] = None,
    json_out: JsonOpt = False,
):
    """Fit per-workload reuse models on a trace window and write the hp file.

    Also learns wa's cells, fits a mixture per cell and reuse tier, reports each one's held-out
    quality on the window after the fit window (when the trace has it) next to one exponential's,
    and with --capacity tunes wa's horizon and starting order for those cache sizes. With --replica,
    fits and tunes on the part of the window a fleet's router sends that replica.
    """
    from kvprof.profiler.fit import fit_trace

    if len(trace_paths) > 1 and (sharded or rank is not None):
        raise typer.BadParameter("reads one input (a fleet's recordings are one trace in memory; --replica K picks "
                                 "a server): give one TRACE", param_hint="--sharded" if sharded else "--rank")
    if replica is not None and sharded:
        raise typer.BadParameter("routes the fit window in memory: fit --replica without --sharded",
                                 param_hint="--replica/--sharded")
    trace_path = trace_paths[0]
    output_file(output, inputs=trace_paths)  # before any input is read: its refusal is a usage error
    recordings = [] if sharded else fleet_recordings(trace_paths)  # --sharded reads a directory of trace files
    recorded = sum(len(recording.ranks) for recording in recordings) if recordings else None
    fleet_spec, replicas = _fleet_spec(replica, replicas, router, load_weight, index_blocks, recorded, rank)
    rule = class_rule(class_key, turn_cap, class_field)
    bounds = parse_window_option(window)
    fields = _cell_fields(cell_fields)
    shares = _retention_shares(retention_shares)
    check_format(format)
    if spill_dir is not None and not sharded:
        raise typer.BadParameter("is where --sharded writes its shards: give it with --sharded", param_hint="--spill-dir")
    if sharded:
        from kvprof.profiler.trace import counts_back

        if bounds and any(counts_back(bound) for bound in bounds):
            raise typer.BadParameter("--sharded reads windows from the trace's start, not back from its end",
                                     param_hint="--window/--sharded")
        if capacity is not None or learned:
            raise typer.BadParameter("tuning replays the fit window in memory: fit --sharded, then tune without it",
                                     param_hint="--capacity/--sharded")
        if spill_dir is not None:
            output_dir(spill_dir, option="--spill-dir")
        from kvprof.profiler.shards import fit_sharded, trace_paths as shard_files

        with made_dir(spill_dir, scratch=True) if spill_dir is not None else contextlib.nullcontext():
            hp = fit_sharded(shard_files(trace_path), rule, window=bounds, spill_dir=spill_dir, ray=ray,
                             read_options={"format": format, "block_size": block_size, "skip_invalid": skip_invalid},
                             horizon=horizon, min_gap=min_gap, min_samples=min_samples, max_cells=max_cells,
                             cell_fields=fields, max_components=max_components, retention_shares=shares)
        _report_fit(hp, output, json_out, f"{trace_path.name} {window}: {hp.provenance['n_requests']} requests")
        return
    recording = recordings[0] if recordings else None
    if recording is not None and capacity is None:  # tune for the servers that recorded it
        capacity = recorded_capacity(trace_paths, recordings, TUNED_BLOCKS)
    capacities = _capacities(capacity, jobs)
    if engine_block_size is not None and not capacities:
        raise typer.BadParameter("is the block of the tuning replays: give it with --capacity",
                                 param_hint="--engine-block-size")
    if learned and not capacities:
        raise typer.BadParameter("trains the learned candidate per tuned capacity: give it with --capacity",
                                 param_hint="--learned")
    if fleet_spec is not None:
        _check_fleet_capacities(fleet_spec, capacities)
    if ray is not None and not capacities:
        raise typer.BadParameter("runs the tuning replays (or, with --sharded, the shards): give it with --capacity",
                                 param_hint="--ray")
    trace_block = recording.block_size if recording else trace_block_size(trace_path, format, block_size)
    if capacities and trace_block is not None:
        _engine_block(engine_block_size, trace_block)
    trace = _read(trace_paths, recordings, fleet_spec, format=format, block_size=block_size,
                  skip_invalid=skip_invalid, rank=rank)
    check_trace_fields(trace, rule, fields)
    if recording is not None:
        engine_block_size = engine_block_size or trace.block_size
    engine_block = _engine_block(engine_block_size, trace.block_size) if capacities else None
    fitted = trace.time_window(*bounds)
    where = " + ".join(map(str, trace_paths))
    if fitted.n_requests == 0:
        raise KvprofError(f"{where}: the fit window {window} holds no requests")
    if retention_shares is not None and not (fitted.parent_chat_id >= 0).any():
        raise typer.BadParameter(f"no request of {where}'s fit window names a parent (no sessions come back), so no "
                                 "retention is fitted and the shares would change nothing",
                                 param_hint="--retention-shares")
    holdout, no_holdout = _holdout(trace, fitted)
    names = " + ".join(path.name for path in trace_paths)
    title = f"{names} {window}: {fitted.n_requests} requests"
    timing = {}
    if fleet_spec is not None:
        fitted = _replica_share(fitted, fleet_spec, replicas, replica, capacities[0], engine_block,
                                f"{where} {window}")
        holdout, no_holdout = None, "the next window's traffic to the replica depends on routing beyond this one"
        timing = {"timing": "model"}  # as a fleet's replicas are timed
        title = f"{names} {window}, replica {replica} of {replicas} behind {router}: {fitted.n_requests} requests"
    def refit(window, holdout=None):
        return fit_trace(window, rule, horizon=horizon, min_gap=min_gap, min_samples=min_samples, max_cells=max_cells,
                         cell_fields=fields, max_components=max_components, holdout=holdout, retention_shares=shares)

    with status(f"fitting reuse models on {fitted.n_requests:,} requests"):
        hp = refit(fitted, holdout)
    from kvprof.models.retention import start_problems

    for problem in start_problems(fitted) if hp.retention is not None else ():
        warn(problem)
    if capacities:
        from kvprof.sim.config import SimConfig

        hp = tune_with_progress(hp, fitted, capacities, SimConfig(engine_block_size=engine_block, **timing), jobs,
                                ray, holdout=holdout, learn=learned, refit=refit)
    if fleet_spec is not None:
        from kvprof.sim.fleet import routed

        hp = routed(hp, fleet_spec, replicas, replica)
    _report_fit(hp, output, json_out, title, learned, no_holdout)


def _retention_shares(text: str | None) -> tuple[float, ...]:
    """``--retention-shares``: distinct shares within (0, 1], in rising order (exit 2 otherwise)."""
    from kvprof.models.retention import RETENTION_SHARES, SHARE

    if text is None:
        return RETENTION_SHARES
    shares = parse_list(text, SHARE, "--retention-shares", "share")
    if len(set(shares)) != len(shares):
        raise typer.BadParameter("a share is given twice", param_hint="--retention-shares")
    return tuple(sorted(shares))


def _fleet_spec(replica: int | None, replicas: int | None, router: str | None, load_weight: float | None,
                index_blocks: int | None, recorded: int | None, rank: int | None):
    """``--replica`` and the fleet it is in, checked (exit 2): ``(router, replicas)``, the router None
    without ``--replica``; ``recorded`` is the replicas of the input's recordings (None: a trace file)."""
    from kvprof.sim.fleet import RECORDED, ROUTERS, RouterSpec

    if replica is None:
        given = [name for name, value in (("--replicas", replicas), ("--router", router),
                                          ("--load-weight", load_weight), ("--index-blocks", index_blocks))
                 if value is not None]
        if given:
            raise typer.BadParameter("describes the fleet --replica K is in: give it with --replica",
                                     param_hint="/".join(given))
        return None, None
    if router == RECORDED:
        if rank is not None:
            raise typer.BadParameter("keeps one data-parallel rank's requests, but recorded routing makes each rank a "
                                     "replica of its own: pick it with --replica", param_hint="--rank")
        return RouterSpec(RECORDED), _recorded_replicas(replica, replicas, load_weight, index_blocks, recorded)
    if router is None:
        raise typer.BadParameter("names a replica of a fleet behind a router: give --router R too",
                                 param_hint="--replica")
    if replicas is None:  # fleet's default, so that its --hp-per-replica files are these
        replicas = recorded or DEFAULT_REPLICAS
    if replica >= replicas:
        raise typer.BadParameter(f"replica {replica} is not one of --replicas {replicas} (numbered 0 to "
                                 f"{replicas - 1})", param_hint="--replica")
    if router not in ROUTERS:
        raise typer.BadParameter(f"unknown router {router!r}; known: {', '.join((*ROUTERS, RECORDED))}",
                                 param_hint="--router")
    check_router_knobs((router,), load_weight, index_blocks)
    spec = RouterSpec(router, 1.0 if load_weight is None else load_weight, index_blocks)
    if spec.reads_replicas:
        raise typer.BadParameter(
            f"{router}{' weighing load' if router == 'prefix-approx' else ''} routes on the replicas' state (their "
            f"loads or caches), which depends on their cost model and policy: fit --replica routes only from the "
            f"trace, behind round-robin, session or prefix-approx --load-weight 0; for this router, kvprof fleet "
            f"--hp-per-replica -o DIR writes every replica's hp file", param_hint="--router")
    return spec, replicas


def _recorded_replicas(replica: int, replicas: int | None, load_weight: float | None, index_blocks: int | None,
                       recorded: int | None) -> int:
    """``--router recorded``'s replica count: the recordings' servers (and their data-parallel ranks), checked."""
    from kvprof.sim.fleet import RECORDED

    if recorded is None:
        raise typer.BadParameter(f"{RECORDED} routes each request to the server whose recording holds it: give the "
                                 f"recording directories of a fleet's servers (vllm serve --kv-record on each)",
                                 param_hint="--router")
    given = [name for name, value in (("--load-weight", load_weight), ("--index-blocks", index_blocks))
             if value is not None]
    if given:
        raise typer.BadParameter(f"is a knob of the prefix routers; {RECORDED} routing is what the servers received",
                                 param_hint="/".join(given))
    if replicas is not None and replicas != recorded:
        raise typer.BadParameter(f"the recordings hold {recorded} replicas (servers and their data-parallel ranks), "
                                 f"not {replicas}: leave --replicas out", param_hint="--replicas")
    if replica >= recorded:
        raise typer.BadParameter(f"replica {replica} is not one of the recordings' {recorded} (numbered 0 to "
                                 f"{recorded - 1}, in the order given, each server's ranks in turn)",
                                 param_hint="--replica")
    return recorded


def _read(paths: list[Path], recordings: list, spec, **options):
    """The trace to fit on: the one input, or the fleet trace of several recordings (also of one
    recording routed ``recorded``: its data-parallel ranks are its replicas)."""
    from kvprof.sim.fleet import RECORDED

    traces = [open_trace(path, **options) for path in paths]
    if len(paths) == 1 and (spec is None or spec.name != RECORDED):
        return traces[0]
    return joined_trace(paths, traces, recordings, (spec.name if spec else RECORDED,))


def _check_fleet_capacities(spec, capacities: tuple[int, ...]) -> None:
    """``--replica`` tunes for the replica's capacity, which prefix-approx's index also defaults to (exit 2)."""
    if not capacities:
        raise typer.BadParameter("tunes the replica's hp file for its capacity, as kvprof fleet --hp-per-replica "
                                 "does: give --capacity", param_hint="--replica")
    if spec.name == "prefix-approx" and spec.index_blocks is None and len(capacities) > 1:
        raise typer.BadParameter("prefix-approx's index remembers --index-blocks, by default the replica's capacity: "
                                 "give one capacity or --index-blocks", param_hint="--capacity")


def _replica_share(fitted, spec, replicas: int, replica: int, capacity: int, engine_block: int, where: str):
    """The part of the fit window ``fitted`` that ``spec`` sends ``replica`` of ``replicas`` of
    ``capacity`` blocks (exit 1 if none of it)."""
    from kvprof.sim.config import SimConfig
    from kvprof.sim.fleet import replica_shares

    with status(f"routing {fitted.n_requests:,} requests over {replicas} replicas"):
        share = replica_shares(fitted, spec, replicas, capacity, SimConfig(engine_block_size=engine_block))[replica]
    if share is None:
        raise KvprofError(f"{where}: {spec.name} sends replica {replica} of {replicas} none of the fit window's "
                          f"{fitted.n_requests} requests; kvprof fleet runs the fleet's hp file there")
    return share


def _report_fit(hp, output: Path, json_out: bool, title: str, learned: bool = False,
                no_holdout: str | None = None) -> None:
    """Save the hp file, then print it (JSON, or the cells and tuning tables; ``no_holdout`` says why
    they have no held-out quality)."""
    hp.save(output)
    if json_out:
        print_json(hp.to_dict())
        return
    show_table(cells_table(hp, title=title))
    if hp.tuning:
        show_table(tuning_table(hp, learn_asked=learned))
    if no_holdout is not None:
        say(f"held-out quality -: {no_holdout}")
    for line in (next_turn_line(hp), retention_line(hp)):
        if line is not None:
            say(line)
    say(f"wrote {output} ({len(hp.cell_names()) - 1} cells from {len(hp.classes)} classes, {horizons(hp)})")


def _engine_block(engine_block_size: int | None, trace_block: int) -> int:
    """The tuning replays' engine block: a multiple of the trace's block (exit 2 otherwise)."""
    from kvprof.sim.config import default_engine_block

    if engine_block_size is None:
        return default_engine_block(trace_block)
    if engine_block_size % trace_block:
        raise typer.BadParameter(f"{engine_block_size} tokens is not a multiple of the trace's {trace_block}-token "
                                 f"blocks", param_hint="--engine-block-size")
    return engine_block_size


def _holdout(trace, fitted):
    """The window after the fit window, as long as it, and None; or None and why there is none (the
    held-out columns then say -)."""
    start, end = fitted.window
    if not (math.isfinite(start) and math.isfinite(end)):
        return None, "the fit window is open-ended: no window after it to score on"
    later = trace.time_window(end, end + (end - start))
    if later.n_requests:
        return later, None
    return None, (f"the window after the fit window, [{end:g}, {end + (end - start):g}) s, holds no requests (the "
                  f"trace's last arrival is at {float(trace.timestamp[-1]):g} s): give a --window that leaves some")


def _capacities(text: str | None, jobs: int) -> tuple[int, ...]:
    """``--capacity``: whole numbers of blocks up to :data:`MAX_TUNED_CAPACITY`, whose tuning replays fit in memory."""
    from kvprof.sim.tune import HORIZON_FACTORS

    if text is None:
        return ()
    values = capacity_list(text, bound=TUNED_BLOCKS)
    if len(set(values)) != len(values):
        raise typer.BadParameter("a capacity is given twice", param_hint="--capacity")
    check_memory(values, 0, jobs, len(values) * len(HORIZON_FACTORS), "--capacity")
    return values
