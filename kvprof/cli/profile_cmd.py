"""Offline commands: ``fit``, ``inspect``, ``show``, ``synth``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from kvprof.classes import CLASS_KEYS, MAX_TURN_CAP, ClassRule
from kvprof.cli.common import (
    FormatOpt,
    JobsOpt,
    RayOpt,
    RankOpt,
    SkipOpt,
    TraceArg,
    capacity_list,
    recording_of,
    check_format,
    check_memory,
    guarded,
    number_option,
    open_trace,
    output_dir,
    output_file,
    parse_window_option,
    trace_block_size,
    tune_with_progress,
)
from kvprof.cli.fleet_cmd import LOAD_WEIGHT, REPLICAS, IndexBlocksOpt
from kvprof.cli.output import first_rows, plain, print_json, printable, say, show as show_table, status, table
from kvprof.errors import KvprofError
from kvprof.limits import BLOCK_TOKENS, COUNT, HOURS, POSITIVE_SECONDS, SECONDS, Bound, usable_blocks

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


def _class_rule(key: str, turn_cap: int, field: str | None) -> ClassRule:
    if field is not None:
        key = "field"
    try:
        return ClassRule(key=key, turn_cap=turn_cap, field=field)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--class-key/--class-field") from None


def _cell_fields(text: str | None) -> tuple[str, ...]:
    """``--cell-fields``: names a feature ``<field>=<value>`` can be built from (exit 2 otherwise)."""
    from kvprof.cells import field_name_problem

    fields = tuple(f.strip() for f in (text or "").split(",") if f.strip())
    for name in fields:
        problem = field_name_problem(name)
        if problem:
            raise typer.BadParameter(problem, param_hint="--cell-fields")
    if len(set(fields)) != len(fields):
        raise typer.BadParameter("a field is named twice", param_hint="--cell-fields")
    return fields


def _check_trace_fields(trace, rule: ClassRule, cell_fields=()) -> None:
    """The fields ``--class-field`` and ``--cell-fields`` name are in the trace (exit 2 otherwise), checked
    right after reading, before any work on it."""
    from kvprof.profiler.reader import required_fields

    extra = sorted(trace.extra)
    known = ", ".join(extra) or "none"
    required = required_fields(trace.format)
    if rule.field is not None and rule.field not in trace.extra and rule.field not in ("type", "turn"):
        raise typer.BadParameter(f"{rule.field!r} is not a field of {trace.source}'s requests (other fields: {known})",
                                 param_hint="--class-field")
    for name in cell_fields:
        if name in trace.extra:
            continue
        if name in required:
            why = (f"is a field every {trace.format} record has, not a tag clients set; the class rule and the "
                   f"turn feature already read type and turn")
        else:
            why = f"is not a field of {trace.source}'s requests"
        raise typer.BadParameter(f"{name!r} {why} (fields --cell-fields can name: {known})",
                                 param_hint="--cell-fields")


@guarded
def fit(
    trace_path: TraceArg,
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
                                             "the fit window (Belady replays per capacity; experimental, no gain "
                                             "measured yet) and report its held-out quality.")
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
        Optional[int], number_option("--replicas", bound=REPLICAS, help="Replicas behind the router, with --replica.")
    ] = None,
    router: Annotated[
        Optional[str], typer.Option("--router", help="The fleet's router, with --replica: round-robin, session or "
                                                     "prefix-approx with --load-weight 0.")
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
    json_out: JsonOpt = False,
):
    """Fit per-workload reuse models on a trace window and write the hp file.

    Also learns wa's cells, fits a mixture per cell and reuse tier, reports each one's held-out
    quality on the window after the fit window (when the trace has it) next to one exponential's,
    and with --capacity tunes wa's horizon and starting order for those cache sizes. With --replica,
    fits and tunes on the part of the window a fleet's router sends that replica.
    """
    from kvprof.profiler.fit import fit_trace

    fleet_spec = _fleet_spec(replica, replicas, router, load_weight, index_blocks)
    if fleet_spec is not None and sharded:
        raise typer.BadParameter("routes the fit window in memory: fit --replica without --sharded",
                                 param_hint="--replica/--sharded")
    rule = _class_rule(class_key, turn_cap, class_field)
    bounds = parse_window_option(window)
    fields = _cell_fields(cell_fields)
    check_format(format)
    if spill_dir is not None and not sharded:
        raise typer.BadParameter("is where --sharded writes its shards: give it with --sharded", param_hint="--spill-dir")
    output_file(output, inputs=[trace_path])
    if sharded:
        if bounds and any(bound is not None and bound < 0 for bound in bounds):
            raise typer.BadParameter("--sharded reads windows from the trace's start, not back from its end",
                                     param_hint="--window/--sharded")
        if capacity is not None or learned:
            raise typer.BadParameter("tuning replays the fit window in memory: fit --sharded, then tune without it",
                                     param_hint="--capacity/--sharded")
        if spill_dir is not None:
            output_dir(spill_dir, option="--spill-dir")
        from kvprof.profiler.shards import fit_sharded, trace_paths

        hp = fit_sharded(trace_paths(trace_path), rule, window=bounds, spill_dir=spill_dir, ray=ray,
                         read_options={"format": format, "block_size": block_size, "skip_invalid": skip_invalid},
                         horizon=horizon, min_gap=min_gap, min_samples=min_samples, max_cells=max_cells,
                         cell_fields=fields, max_components=max_components)
        _report_fit(hp, output, json_out, f"{trace_path.name} {window}: {hp.provenance['n_requests']} requests")
        return
    recording = recording_of(trace_path)
    if recording is not None and capacity is None:  # tune for the server that recorded it
        capacity = str(usable_blocks(recording.num_gpu_blocks))
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
    trace = open_trace(trace_path, format=format, block_size=block_size, skip_invalid=skip_invalid, rank=rank)
    _check_trace_fields(trace, rule, fields)
    if recording is not None:
        engine_block_size = engine_block_size or trace.block_size
    engine_block = _engine_block(engine_block_size, trace.block_size) if capacities else None
    fitted = trace.time_window(*bounds)
    if fitted.n_requests == 0:
        raise KvprofError(f"{trace_path}: the fit window {window} holds no requests")
    holdout = _holdout(trace, fitted)
    title = f"{trace_path.name} {window}: {fitted.n_requests} requests"
    timing = {}
    if fleet_spec is not None:
        fitted = _replica_share(fitted, fleet_spec, replicas, replica, capacities[0], engine_block,
                                f"{trace_path} {window}")
        holdout = None  # the next window's traffic to the replica depends on routing beyond this one
        timing = {"timing": "model"}  # as a fleet's replicas are timed
        title = f"{trace_path.name} {window}, replica {replica} of {replicas} behind {router}: " \
                f"{fitted.n_requests} requests"
    with status(f"fitting reuse models on {fitted.n_requests:,} requests"):
        hp = fit_trace(fitted, rule, horizon=horizon, min_gap=min_gap, min_samples=min_samples, max_cells=max_cells,
                       cell_fields=fields, max_components=max_components, holdout=holdout)
    if capacities:
        from kvprof.sim.config import SimConfig

        hp = tune_with_progress(hp, fitted, capacities, SimConfig(engine_block_size=engine_block, **timing), jobs,
                                ray, holdout=holdout, learn=learned)
    if fleet_spec is not None:
        from kvprof.sim.fleet import routed

        hp = routed(hp, fleet_spec, replicas, replica)
    _report_fit(hp, output, json_out, title, learned)


def _fleet_spec(replica: int | None, replicas: int | None, router: str | None, load_weight: float | None,
                index_blocks: int | None):
    """``--replica`` and the fleet it is in, checked (exit 2): the router, or None without ``--replica``."""
    from kvprof.sim.fleet import ROUTERS, RouterSpec

    if replica is None:
        given = [name for name, value in (("--replicas", replicas), ("--router", router),
                                          ("--load-weight", load_weight), ("--index-blocks", index_blocks))
                 if value is not None]
        if given:
            raise typer.BadParameter("describes the fleet --replica K is in: give it with --replica",
                                     param_hint="/".join(given))
        return None
    if replicas is None or router is None:
        raise typer.BadParameter("names a replica of a fleet: give --replicas N and --router R too",
                                 param_hint="--replica")
    if replica >= replicas:
        raise typer.BadParameter(f"replica {replica} is not one of --replicas {replicas} (numbered 0 to "
                                 f"{replicas - 1})", param_hint="--replica")
    if router not in ROUTERS:
        raise typer.BadParameter(f"unknown router {router!r}; known: {', '.join(ROUTERS)}", param_hint="--router")
    spec = RouterSpec(router, 1.0 if load_weight is None else load_weight, index_blocks)
    if spec.reads_replicas:
        raise typer.BadParameter(
            f"{router}{' weighing load' if router == 'prefix-approx' else ''} routes on the replicas' state (their "
            f"loads or caches), which depends on their cost model and policy: fit --replica routes only from the "
            f"trace, behind round-robin, session or prefix-approx --load-weight 0; for this router, kvprof fleet "
            f"--hp-per-replica -o DIR writes every replica's hp file", param_hint="--router")
    return spec


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


def _report_fit(hp, output: Path, json_out: bool, title: str, learned: bool = False) -> None:
    """Save the hp file, then print it (JSON, or the cells and tuning tables)."""
    hp.save(output)
    if json_out:
        print_json(hp.to_dict())
        return
    show_table(_cells_table(hp, title=title))
    if hp.tuning:
        show_table(_tuning_table(hp, learn_asked=learned))
    say(f"wrote {output} ({len(hp.cell_names()) - 1} cells from {len(hp.classes)} classes, {_horizons(hp)})")


def _horizons(hp) -> str:
    """The fitted horizon and wa's tuned ones, each named for what it is (a server runs a tuned one)."""
    text = f"fitted horizon {hp.horizon:g} s"
    tuned = sorted({entry["horizon_s"] for entry in hp.tuning})
    if tuned:
        span = f"{tuned[0]:g}" if len(tuned) == 1 else f"{tuned[0]:g} to {tuned[-1]:g}"
        text += f", wa's tuned horizon {span} s"
    return text


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
    """The window after the fit window, as long as it (None when the fit window is open-ended)."""
    start, end = fitted.window
    if not (math.isfinite(start) and math.isfinite(end)):
        return None
    later = trace.time_window(end, end + (end - start))
    return later if later.n_requests else None


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


def _fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _mean_time(lam: float | None) -> float | None:
    """1/λ, the mean reuse time in seconds, which reads better than a rate."""
    return 1 / lam if lam else None


def _components(row) -> str:
    """Mixture components as mean gap (weight): ``2.1 s (62%), 140 s (38%)``."""
    return ", ".join(f"{1 / rate:.3g} s ({weight:.0%})" if rate > 0 else f"never ({weight:.0%})"
                     for weight, rate in zip(row.weights, row.rates))


def _cells_table(hp, title: str):
    """Per cell and reuse tier: data, the mixture, KS, and held-out quality beside one exponential's."""
    from kvprof.cells import TIER_EDGES

    cells, more = first_rows(list(zip(hp.cell_names(), hp.cell_models())), "cells", len(TIER_EDGES))
    out = table(f"{title}: wa's cells x reuse tiers (held-out log-loss / Brier: mixture vs one exponential)",
                {column: "left" if column in ("cell", "components", "source") else "right"
                 for column in ("cell", "tier", "accesses", "reuses", "p", "components", "KS", "log-loss", "Brier",
                                "source")}, caption=more)
    labels = [f"{edge}" if i + 1 == len(TIER_EDGES) or TIER_EDGES[i + 1] == edge + 1 else f"{edge}-{TIER_EDGES[i + 1] - 1}"
              for i, edge in enumerate(TIER_EDGES)]
    labels[-1] += "+"
    for name, tiers in cells:
        for tier, row in enumerate(tiers):
            diag = row.diagnostics or {}
            held = diag.get("holdout") or {}
            single = held.get("single") or {}
            out.add_row(
                name if tier == 0 else "", f"{labels[tier]} hits",
                _fmt(diag.get("n_accesses"), ",d"), _fmt(diag.get("n_reuses"), ",d"),
                _fmt(row.p, ".3f"), _components(row), _fmt(diag.get("ks"), ".3f"),
                f"{_fmt(held.get('log_loss'), '.3f')} / {_fmt(single.get('log_loss'), '.3f')}" if held else "-",
                f"{_fmt(held.get('brier'), '.3f')} / {_fmt(single.get('brier'), '.3f')}" if held else "-",
                row.source,
                end_section=tier == len(tiers) - 1,
            )
    return out


def _tuning_table(hp, learn_asked: bool = False):
    entries, more = first_rows(list(hp.tuning), "capacities")
    out = table("tuned on the fit window (wa's token hit ratio per horizon H; wa's horizon: the one a server runs "
                "at that size; start: best shadow; learned: frees Belady kept, and the predictor's held-out "
                "log-loss vs the base rate's, accuracy)",
                {"capacity": "right", "hit ratio by H": "left", "wa's horizon (s)": "right", "start": "left",
                 "learned": "left"}, caption=more)
    for entry in entries:
        tried = entry.get("measured", {}).get("hit_ratio_by_horizon_s", {})
        out.add_row(f"{entry['capacity']:,}", ", ".join(f"{h} s: {r:.4f}" for h, r in tried.items()),
                    f"{entry['horizon_s']:g}", entry["start"], _learned_text(entry.get("learned"), learn_asked))
    return out


#: Why ``fit --learned`` learned nothing at a capacity (:func:`kvprof.sim.learn.fit_learned`).
NOTHING_TO_LEARN = ("none: Belady kept all or none of the frees on this window, or it had none (one label, "
                    "nothing to learn); "
                    "wa starts on its best shadow")


def _learned_text(model, asked: bool = False) -> str:
    """The learned predictor's labels and held-out quality in one cell ("-": none asked for)."""
    if model is None:
        return NOTHING_TO_LEARN if asked else "-"
    quality = model.quality
    text = f"{quality.get('friendly_share', math.nan):.1%} of {quality.get('n_frees', 0):,} kept"
    if "holdout_log_loss" in quality:
        text += (f"; log-loss {quality['holdout_log_loss']:.3f} vs {quality['holdout_base_log_loss']:.3f}, "
                 f"accuracy {quality['holdout_accuracy']:.1%} (base rate {quality['holdout_base_rate']:.1%}) on "
                 + ("the next window" if quality.get("holdout_window") else "the last third"))
    return text


def _classes_table(hp, title: str):
    rows, more = first_rows(list(hp.classes.items()) + [("(default)", hp.default)], "classes")
    out = table(title, {column: "left" if column in ("class", "source") else "right"
                        for column in ("class", "accesses", "reuses", "censored", "p", "1/λ (s)", "naive p",
                                       "naive 1/λ", "KS", "median gap (s)", "source")}, caption=more)
    for name, params in rows:
        diag = params.diagnostics or {}
        naive = params.naive or {}
        out.add_row(
            name,
            _fmt(diag.get("n_accesses"), "d"),
            _fmt(diag.get("n_reuses"), "d"),
            _fmt(diag.get("n_censored"), "d"),
            _fmt(params.p, ".3f"),
            _fmt(_mean_time(params.lam)),
            _fmt(naive.get("p"), ".3f"),
            _fmt(_mean_time(naive.get("lambda"))),
            _fmt(diag.get("ks"), ".3f"),
            _fmt(diag.get("median_gap_s"), ".3g"),
            params.source,
        )
    return out


@guarded
def inspect(
    trace_path: TraceArg,
    window: Annotated[Optional[str], typer.Option("--window", help="Only requests in START:END seconds.")] = None,
    horizon: HorizonOpt = 60.0,
    class_key: ClassKeyOpt = "type_turn",
    turn_cap: TurnCapOpt = 5,
    class_field: ClassFieldOpt = None,
    min_gap: MinGapOpt = 0.3,
    format: FormatOpt = None,
    block_size: BlockSizeOpt = None,
    skip_invalid: SkipOpt = False,
    rank: RankOpt = None,
    json_out: JsonOpt = False,
):
    """Print trace statistics: requests, sessions, types, turns, block reuse, ideal hit ratio, reuse gaps,
    and per class how a mixture of exponentials and one exponential predict reuse (KS, held-out log-loss
    and Brier score of P(reuse within --horizon | idle age), fitted on the first half, scored on the second)."""
    from kvprof.profiler.quality import class_models
    from kvprof.profiler.stats import trace_summary

    rule = _class_rule(class_key, turn_cap, class_field)
    bounds = parse_window_option(window)
    check_format(format)
    trace = open_trace(trace_path, format=format, block_size=block_size, window=bounds, skip_invalid=skip_invalid,
                       rank=rank)
    _check_trace_fields(trace, rule)
    summary = trace_summary(trace, rule, min_gap=min_gap)
    if json_out:
        print_json({**summary, "reuse_models": class_models(trace, rule, horizon, min_gap)})
        return
    overview = table(f"{trace_path.name} ({summary['format']}, {summary['block_size']}-token blocks)",
                     {"": "left", " ": "right"}, show_header=False)
    for label, value in (
        ("requests", f"{summary['requests']:,}"),
        ("duration (s)", f"{summary['duration_s']:,.1f}"),
        ("requests per second", _fmt(summary["qps"], ".2f")),
        ("sessions (first turns)", f"{summary['sessions']:,}"),
        ("types", ", ".join(f"{k} {v:,}" for k, v in summary["types"].items())),
        ("turns", ", ".join(f"{k}: {v:,}" for k, v in list(summary["turns"].items())[:8])),
        ("mean input / output tokens", f"{summary['mean_input_tokens']:,.0f} / {summary['mean_output_tokens']:,.0f}"),
        ("block accesses / distinct", f"{summary['block_accesses']:,} / {summary['distinct_blocks']:,}"),
        ("ideal hit ratio (infinite cache)", f"{summary['ideal_hit_ratio']:.3f}"),
    ):
        overview.add_row(label, value)
    show_table(overview)
    classes, more = first_rows(list(summary["classes"].items()), "classes")
    gaps = table(f"reuse gaps per class (s), concurrency floor {min_gap:g} s",
                 {column: "left" if column == "class" else "right"
                  for column in ("class", "requests", "accesses", "reused", "p10", "p50", "p90", "p99")}, caption=more)
    for name, row in classes:
        q = row["gap_quantiles_s"] or {}
        gaps.add_row(name, f"{row['requests']:,}", f"{row['accesses']:,}", f"{row['reuse_share']:.1%}",
                     *(_fmt(q.get(k)) for k in ("p10", "p50", "p90", "p99")))
    show_table(gaps)
    models = class_models(trace, rule, horizon, min_gap)
    if models:
        show_table(_class_models_table(models, horizon))


def _class_models_table(models: dict, horizon: float):
    """Per class: a mixture of exponentials against one exponential, fitted on the window's first half."""
    rows, more = first_rows(list(models.items()), "classes")
    out = table(f"reuse models per class, fitted on the first half, scored on the second "
                f"(P(reuse within {horizon:g} s | idle age); mixture / one exponential)",
                {column: "left" if column in ("class", "components (mean gap s)") else "right"
                 for column in ("class", "p", "components (mean gap s)", "KS", "log-loss", "Brier", "questions")},
                caption=more)
    for name, row in rows:
        mix, single = row["mixture"], row["single"]
        held, held_single = mix["holdout"] or {}, single["holdout"] or {}
        out.add_row(
            name, f"{mix['p']:.3f} / {single['p']:.3f}",
            ", ".join(_fmt(g) for g in mix["mean_gaps_s"]) + " / " + _fmt(single["mean_gaps_s"][0]),
            f"{_fmt(mix['ks'], '.3f')} / {_fmt(single['ks'], '.3f')}",
            f"{_fmt(held.get('log_loss'), '.3f')} / {_fmt(held_single.get('log_loss'), '.3f')}",
            f"{_fmt(held.get('brier'), '.3f')} / {_fmt(held_single.get('brier'), '.3f')}",
            _fmt(held.get("n"), ",d"),
        )
    return out


@guarded
def show(
    paths: Annotated[
        list[Path],
        typer.Argument(help="A hyperparameter file (kvprof.hp/1, or the published format), or one or more "
                            "results.json files of compare, demo or replay to tabulate and plot together."),
    ],
    output: Annotated[
        Optional[Path], typer.Option("-o", "--output", help="Directory for the joint plots of results files (PNG, SVG).")
    ] = None,
    json_out: JsonOpt = False,
):
    """Pretty-print a hyperparameter file after validating it, or put results files side by side.

    Results files share one table and, with --output, compare's hit-ratio and QTTFT plots: a
    simulated sweep next to a live replay at the server's capacity (policy marked "(live)").
    """
    from kvprof.cli.show_results import show_results
    from kvprof.results import load_if_results

    if output is not None:
        from kvprof.cli.plots import FILES

        output_dir(output, files=FILES, inputs=paths)
    documents = [load_if_results(path) for path in paths]
    if None not in documents:
        show_results(paths, documents, output, json_out)
        return
    if len(paths) == 1 and output is None:
        _show_hp(paths[0], json_out)
        return
    other = paths[documents.index(None)]
    raise KvprofError(f"{other}: not a results file ({_not_results(other)}); several files, or -o, are shown "
                      f"only when each is a results.json of compare, demo or replay (give an hp file alone)")


def _not_results(path: Path) -> str:
    """Why ``path`` is not a results file, in a few words."""
    from kvprof.errors import ResultsFileError
    from kvprof.jsonfile import read_json

    try:
        data = read_json(path, ResultsFileError)
    except ResultsFileError as exc:
        return exc.reason
    schema = data.get("schema") if type(data) is dict else None
    return f"its schema is {schema!r}" if schema is not None else "it has no schema"


def _show_hp(hp_path: Path, json_out: bool) -> None:
    """The hp file's rule, provenance, classes and sessions, after validating it."""
    from kvprof.errors import HpFileError
    from kvprof.models.hp import PUBLISHED_FORMAT, SCHEMAS, load_hp
    from kvprof.results import SCHEMA as RESULTS_SCHEMA

    try:
        hp = load_hp(hp_path)
    except HpFileError as exc:
        if exc.where != "schema":
            raise
        raise KvprofError(f"{exc}; show reads hp files ({', '.join(SCHEMAS)}, or the published format) and "
                          f"results files ({RESULTS_SCHEMA})") from None
    if json_out:
        print_json(hp.to_dict())
        return
    prov = hp.provenance or {}
    rule = hp.class_rule
    published = hp.schema == PUBLISHED_FORMAT
    header = Text()
    header.append(printable(str(hp_path)), style="bold")
    header.append(f"  {'published profiler format' if published else 'schema ' + hp.schema}  {_horizons(hp)}  "
                  f"concurrency floor {hp.min_gap:g} s\n")
    header.append_text(plain(f"class rule: {rule.key}" + (f" (turns capped at {rule.turn_cap})" if rule.key == "type_turn" else "")
                             + (f" on field {rule.field}" if rule.field else "") + "\n"))
    if prov:
        header.append_text(plain(
            f"fitted on {prov.get('trace')} window {prov.get('window')} ({prov.get('n_requests')} requests, "
            f"{prov.get('block_size')}-token blocks) by kvprof {prov.get('kvprof_version')} at {prov.get('created')}"))
    else:
        header.append("no provenance" + (" (the published format has none)" if published else ""))
    show_table(header)
    show_table(_classes_table(hp, title="classes: one cure exponential each (wa-paper's naive estimates beside)"))
    show_table(_cells_table(hp, title="cells" if hp.cells else "cells (the classes, from a kvprof.hp/1 file)"))
    if hp.tuning:
        show_table(_tuning_table(hp))
    if hp.sessions:
        types, more = first_rows(list(hp.sessions.items()), "types")
        sessions = table("sessions per type", {column: "left" if column == "type" else "right" for column in (
            "type", "sessions", "P(turn>=2)", "P(turn>=3)", "think mean (s)", "think median (s)")}, caption=more)
        for name, row in types:
            survival = row.get("survival", [])
            think = row.get("think_time_s") or {}
            sessions.add_row(name, _fmt(row.get("n_sessions"), "d"),
                             _fmt(survival[1] if len(survival) > 1 else None, ".3f"),
                             _fmt(survival[2] if len(survival) > 2 else None, ".3f"),
                             _fmt(think.get("mean")), _fmt(think.get("median")))
        show_table(sessions)


@guarded
def synth(
    output: Annotated[Path, typer.Option("-o", "--output", help="Trace file to write (.jsonl, .jsonl.gz, .jsonl.zst).")],
    preset: Annotated[str, typer.Option("--preset", help="Calibration preset: bailian-a or bailian-b.")] = "bailian-a",
    hours: Annotated[float, number_option("--hours", bound=HOURS, help="Trace length in hours.")] = 2.0,
    seed: Annotated[int, number_option("--seed", bound=COUNT, help="Random seed; equal seeds give equal traces.")] = 0,
):
    """Write a synthetic Bailian-format trace calibrated to the published statistics."""
    import itertools

    from kvprof.profiler.synth import PRESETS, generate, write_jsonl
    from kvprof.profiler.synth.writer import compression_problem

    if preset not in PRESETS:
        raise typer.BadParameter(f"{preset!r} is not one of {', '.join(PRESETS)}", param_hint="--preset")
    output_file(output)
    problem = compression_problem(output)
    if problem:
        raise typer.BadParameter(problem, param_hint="-o/--output")
    with status(f"planning {hours:g} h of {preset}"):
        records = generate(preset, hours, seed)
        first = next(records, None)
    if first is None:
        raise typer.BadParameter(f"{hours:g} h of {preset} (seed {seed}) holds no request; give more hours",
                                 param_hint="--hours")
    count = write_jsonl(output, itertools.chain([first], records))
    say(f"wrote {output}: {count:,} requests, {hours:g} h of {preset} (seed {seed})")
