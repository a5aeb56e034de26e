"""Offline commands: ``fit``, ``inspect``, ``show``, ``synth``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvprof.classes import CLASS_KEYS, MAX_TURN_CAP, ClassRule
from kvprof.cli.common import (
    FormatOpt,
    RayOpt,
    SkipOpt,
    TraceArg,
    capacity_list,
    recording_of,
    console,
    err_console,
    guarded,
    non_negative,
    open_trace,
    parse_window_option,
    positive,
    print_json,
)
from kvprof.errors import KvprofError

BlockSizeOpt = Annotated[
    Optional[int], typer.Option("--block-size", min=1, help="Tokens per trace block (default: 16 Bailian, 512 Mooncake).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
ClassKeyOpt = Annotated[
    str, typer.Option("--class-key", help=f"Workload class rule: {', '.join(CLASS_KEYS)}.")
]
TurnCapOpt = Annotated[
    int, typer.Option("--turn-cap", min=1, max=MAX_TURN_CAP, help="Pool turns >= this into <type>_<cap>+.")
]
ClassFieldOpt = Annotated[
    Optional[str], typer.Option("--class-field", help="Key classes on this trace field (implies --class-key field).")
]
MinGapOpt = Annotated[
    float, typer.Option("--min-gap", callback=non_negative, help="Seconds under which a reuse counts as concurrent use.")
]
HorizonOpt = Annotated[
    float, typer.Option("--horizon", callback=positive, help="H in seconds: score = P(reuse within H | idle age).")
]


def _class_rule(key: str, turn_cap: int, field: str | None) -> ClassRule:
    if field is not None:
        key = "field"
    try:
        return ClassRule(key=key, turn_cap=turn_cap, field=field)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--class-key/--class-field") from None


def _trace_and_rule(trace_path, window, format, block_size, skip_invalid, class_key, turn_cap, class_field):
    """What ``fit`` and ``inspect`` both start with: options checked (exit 2), then the trace read."""
    rule = _class_rule(class_key, turn_cap, class_field)
    bounds = parse_window_option(window)
    trace = open_trace(trace_path, format=format, block_size=block_size, window=bounds, skip_invalid=skip_invalid)
    return trace, rule


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
        int, typer.Option("--max-cells", min=0, max=256,
                          help="Most workload cells a learned tree may draw for wa; 0: each class is a cell.")
    ] = 16,
    cell_fields: Annotated[
        Optional[str], typer.Option("--cell-fields", help="Comma-separated trace fields clients tag (vllm_xargs) "
                                                         "that may split cells, e.g. model.")
    ] = None,
    max_components: Annotated[
        int, typer.Option("--max-components", min=1, max=5, help="Most exponentials per reuse model (chosen by BIC).")
    ] = 3,
    min_samples: Annotated[
        int, typer.Option("--min-samples", min=1, help="Classes and cells with fewer block accesses shrink toward more data.")
    ] = 200,
    min_gap: MinGapOpt = 0.3,
    capacity: Annotated[
        Optional[str], typer.Option("--capacity", help="Comma-separated GPU capacities (engine blocks) to tune wa "
                                                       "for, by replaying the fit window; without it, defaults (for a "
                                                       "vLLM recording: the server's usable blocks).")
    ] = None,
    engine_block_size: Annotated[
        Optional[int], typer.Option("--engine-block-size", min=1, help="Engine block of the tuning replays "
                                                                       "(default: the smallest multiple of the "
                                                                       "trace's block >= 128).")
    ] = None,
    jobs: Annotated[int, typer.Option("-j", "--jobs", help="Parallel tuning replays (joblib; -1: all cores).")] = -1,
    ray: RayOpt = None,
    sharded: Annotated[
        bool, typer.Option("--sharded", help="Fit in shards of the blocks on disk, for traces larger than memory: TRACE "
                                             "may then be a directory of trace files (one trace, read a file at a "
                                             "time); the same hp file as without it.")
    ] = False,
    spill_dir: Annotated[
        Optional[Path], typer.Option("--spill-dir", help="Where --sharded writes its shards (default: the system's "
                                                         "temporary directory; with --ray one the nodes share).")
    ] = None,
    format: FormatOpt = None,
    block_size: BlockSizeOpt = None,
    skip_invalid: SkipOpt = False,
    json_out: JsonOpt = False,
):
    """Fit per-workload reuse models on a trace window and write the hp file.

    Also learns wa's cells, fits a mixture per cell and reuse tier, reports each one's held-out
    quality on the window after the fit window (when the trace has it) next to one exponential's,
    and with --capacity tunes wa's horizon and starting order for those cache sizes.
    """
    from kvprof.profiler.fit import fit_trace

    rule = _class_rule(class_key, turn_cap, class_field)
    bounds = parse_window_option(window)
    capacities = _capacities(capacity)
    fields = tuple(f.strip() for f in (cell_fields or "").split(",") if f.strip())
    if sharded:
        if bounds and any(bound is not None and bound < 0 for bound in bounds):
            raise typer.BadParameter("--sharded reads windows from the trace's start, not back from its end",
                                     param_hint="--window/--sharded")
        if capacities:
            raise typer.BadParameter("tuning replays the fit window in memory: fit --sharded, then tune without it",
                                     param_hint="--capacity/--sharded")
        from kvprof.profiler.shards import fit_sharded, trace_paths

        if spill_dir is not None and spill_dir.exists() and not spill_dir.is_dir():
            raise typer.BadParameter(f"{spill_dir} exists and is not a directory", param_hint="--spill-dir")
        hp = fit_sharded(trace_paths(trace_path), rule, window=bounds, spill_dir=spill_dir, ray=ray,
                         read_options={"format": format, "block_size": block_size, "skip_invalid": skip_invalid},
                         horizon=horizon, min_gap=min_gap, min_samples=min_samples, max_cells=max_cells,
                         cell_fields=fields, max_components=max_components)
        _report_fit(hp, output, json_out, f"{trace_path.name} {window}: {hp.provenance['n_requests']} requests")
        return
    recording = recording_of(trace_path)
    if recording is not None and not capacities:  # tune for the server that recorded it
        capacities = (max(recording.num_gpu_blocks - 1, 1),)
    trace = open_trace(trace_path, format=format, block_size=block_size, skip_invalid=skip_invalid)
    if recording is not None:
        engine_block_size = engine_block_size or trace.block_size
    fitted = trace.time_window(*bounds)
    if fitted.n_requests == 0:
        raise KvprofError(f"{trace_path}: the fit window {window} holds no requests")
    hp = fit_trace(fitted, rule, horizon=horizon, min_gap=min_gap, min_samples=min_samples, max_cells=max_cells,
                   cell_fields=fields, max_components=max_components, holdout=_holdout(trace, fitted))
    if capacities:
        from kvprof.sim.config import SimConfig, default_engine_block
        from kvprof.sim.tune import tune

        with err_console.status(f"tuning wa for {len(capacities)} capacities on the fit window"):
            hp = tune(hp, fitted, capacities, SimConfig(engine_block_size=engine_block_size or
                                                        default_engine_block(trace.block_size)), n_jobs=jobs, ray=ray)
    _report_fit(hp, output, json_out, f"{trace_path.name} {window}: {fitted.n_requests} requests")


def _report_fit(hp, output: Path, json_out: bool, title: str) -> None:
    """Save the hp file, then print it (JSON, or the cells and tuning tables)."""
    hp.save(output)
    if json_out:
        print_json(hp.to_dict())
        return
    console.print(_cells_table(hp, title=title))
    if hp.tuning:
        console.print(_tuning_table(hp))
    err_console.print(f"wrote {output} ({len(hp.cell_names()) - 1} cells from {len(hp.classes)} classes, "
                      f"horizon {hp.horizon:g} s)")


def _holdout(trace, fitted):
    """The window after the fit window, as long as it (None when the fit window is open-ended)."""
    start, end = fitted.window
    if not (math.isfinite(start) and math.isfinite(end)):
        return None
    later = trace.time_window(end, end + (end - start))
    return later if later.n_requests else None


def _capacities(text: str | None) -> tuple[int, ...]:
    if text is None:
        return ()
    values = capacity_list(text)
    if any(value > 2**40 for value in values):
        raise typer.BadParameter(f"capacities must be from 1 to 2**40 blocks, got {text}", param_hint="--capacity")
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


def _cells_table(hp, title: str) -> Table:
    """Per cell and reuse tier: data, the mixture, KS, and held-out quality beside one exponential's."""
    from kvprof.cells import TIER_EDGES

    table = Table(title=f"{title}: wa's cells x reuse tiers (held-out log-loss / Brier: mixture vs one exponential)")
    for column in ("cell", "tier", "accesses", "reuses", "p", "components", "KS", "log-loss", "Brier", "source"):
        table.add_column(column, justify="left" if column in ("cell", "components", "source") else "right")
    labels = [f"{edge}" if i + 1 == len(TIER_EDGES) or TIER_EDGES[i + 1] == edge + 1 else f"{edge}-{TIER_EDGES[i + 1] - 1}"
              for i, edge in enumerate(TIER_EDGES)]
    labels[-1] += "+"
    for name, tiers in zip(hp.cell_names(), hp.cell_models()):
        for tier, row in enumerate(tiers):
            diag = row.diagnostics or {}
            held = diag.get("holdout") or {}
            single = held.get("single") or {}
            table.add_row(
                name if tier == 0 else "", f"{labels[tier]} hits",
                _fmt(diag.get("n_accesses"), ",d"), _fmt(diag.get("n_reuses"), ",d"),
                _fmt(row.p, ".3f"), _components(row), _fmt(diag.get("ks"), ".3f"),
                f"{_fmt(held.get('log_loss'), '.3f')} / {_fmt(single.get('log_loss'), '.3f')}" if held else "-",
                f"{_fmt(held.get('brier'), '.3f')} / {_fmt(single.get('brier'), '.3f')}" if held else "-",
                row.source,
                end_section=tier == len(tiers) - 1,
            )
    return table


def _tuning_table(hp) -> Table:
    table = Table(title="tuned on the fit window (wa's token hit ratio per horizon; start: best shadow)")
    table.add_column("capacity", justify="right")
    table.add_column("hit ratio by H", justify="left")
    table.add_column("horizon (s)", justify="right")
    table.add_column("start", justify="left")
    for entry in hp.tuning:
        tried = entry.get("measured", {}).get("hit_ratio_by_horizon_s", {})
        table.add_row(f"{entry['capacity']:,}", ", ".join(f"{h} s: {r:.4f}" for h, r in tried.items()),
                      f"{entry['horizon_s']:g}", entry["start"])
    return table


def _classes_table(hp, title: str) -> Table:
    table = Table(title=title)
    for column in ("class", "accesses", "reuses", "censored", "p", "1/λ (s)", "naive p", "naive 1/λ",
                   "KS", "median gap (s)", "source"):
        table.add_column(column, justify="left" if column in ("class", "source") else "right")
    rows = list(hp.classes.items()) + [("(default)", hp.default)]
    for name, params in rows:
        diag = params.diagnostics or {}
        naive = params.naive or {}
        table.add_row(
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
    return table


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
    json_out: JsonOpt = False,
):
    """Print trace statistics: requests, sessions, types, turns, block reuse, ideal hit ratio, reuse gaps,
    and per class how a mixture of exponentials and one exponential predict reuse (KS, held-out log-loss
    and Brier score of P(reuse within --horizon | idle age), fitted on the first half, scored on the second)."""
    from kvprof.profiler.quality import class_models
    from kvprof.profiler.stats import trace_summary

    trace, rule = _trace_and_rule(trace_path, window, format, block_size, skip_invalid, class_key, turn_cap, class_field)
    try:
        summary = trace_summary(trace, rule, min_gap=min_gap)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--class-field") from None
    if json_out:
        print_json({**summary, "reuse_models": class_models(trace, rule, horizon, min_gap)})
        return
    overview = Table(title=f"{trace_path.name} ({summary['format']}, {summary['block_size']}-token blocks)",
                     show_header=False)
    overview.add_column(justify="left")
    overview.add_column(justify="right")
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
    console.print(overview)
    gaps = Table(title=f"reuse gaps per class (s), concurrency floor {min_gap:g} s")
    for column in ("class", "requests", "accesses", "reused", "p10", "p50", "p90", "p99"):
        gaps.add_column(column, justify="left" if column == "class" else "right")
    for name, row in summary["classes"].items():
        q = row["gap_quantiles_s"] or {}
        gaps.add_row(name, f"{row['requests']:,}", f"{row['accesses']:,}", f"{row['reuse_share']:.1%}",
                     *(_fmt(q.get(k)) for k in ("p10", "p50", "p90", "p99")))
    console.print(gaps)
    models = class_models(trace, rule, horizon, min_gap)
    if models:
        console.print(_class_models_table(models, horizon))


def _class_models_table(models: dict, horizon: float) -> Table:
    """Per class: a mixture of exponentials against one exponential, fitted on the window's first half."""
    table = Table(title=f"reuse models per class, fitted on the first half, scored on the second "
                        f"(P(reuse within {horizon:g} s | idle age); mixture / one exponential)")
    for column in ("class", "p", "components (mean gap s)", "KS", "log-loss", "Brier", "questions"):
        table.add_column(column, justify="left" if column in ("class", "components (mean gap s)") else "right")
    for name, row in models.items():
        mix, single = row["mixture"], row["single"]
        held, held_single = mix["holdout"] or {}, single["holdout"] or {}
        table.add_row(
            name, f"{mix['p']:.3f} / {single['p']:.3f}",
            ", ".join(_fmt(g) for g in mix["mean_gaps_s"]) + " / " + _fmt(single["mean_gaps_s"][0]),
            f"{_fmt(mix['ks'], '.3f')} / {_fmt(single['ks'], '.3f')}",
            f"{_fmt(held.get('log_loss'), '.3f')} / {_fmt(held_single.get('log_loss'), '.3f')}",
            f"{_fmt(held.get('brier'), '.3f')} / {_fmt(held_single.get('brier'), '.3f')}",
            _fmt(held.get("n"), ",d"),
        )
    return table


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

    documents = [load_if_results(path) for path in paths]
    if None not in documents:
        show_results(paths, documents, output, json_out)
    elif len(paths) > 1 or output is not None:
        raise typer.BadParameter("only results.json files are shown together or plotted; give an hp file alone",
                                 param_hint="PATHS")
    else:
        _show_hp(paths[0], json_out)


def _show_hp(hp_path: Path, json_out: bool) -> None:
    """The hp file's rule, provenance, classes and sessions, after validating it."""
    from kvprof.models.hp import load_hp

    hp = load_hp(hp_path)
    if json_out:
        print_json(hp.to_dict())
        return
    prov = hp.provenance or {}
    rule = hp.class_rule
    console.print(
        f"[bold]{hp_path}[/]  {'schema ' + hp.schema if prov else 'published profiler format'}  horizon {hp.horizon:g} s  concurrency floor {hp.min_gap:g} s\n"
        f"class rule: {rule.key}" + (f" (turns capped at {rule.turn_cap})" if rule.key == "type_turn" else "")
        + (f" on field {rule.field}" if rule.field else "") + "\n"
        + (f"fitted on {prov.get('trace')} window {prov.get('window')} ({prov.get('n_requests')} requests, "
           f"{prov.get('block_size')}-token blocks) by kvprof {prov.get('kvprof_version')} at {prov.get('created')}"
           if prov else "no provenance (published profiler format)"),
        highlight=False,
    )
    console.print(_classes_table(hp, title="classes: one cure exponential each (wa-paper's naive estimates beside)"))
    console.print(_cells_table(hp, title="cells" if hp.cells else "cells (the classes, from a kvprof.hp/1 file)"))
    if hp.tuning:
        console.print(_tuning_table(hp))
    if hp.sessions:
        sessions = Table(title="sessions per type")
        for column in ("type", "sessions", "P(turn>=2)", "P(turn>=3)", "think mean (s)", "think median (s)"):
            sessions.add_column(column, justify="left" if column == "type" else "right")
        for name, row in hp.sessions.items():
            survival = row.get("survival", [])
            think = row.get("think_time_s") or {}
            sessions.add_row(name, _fmt(row.get("n_sessions"), "d"),
                             _fmt(survival[1] if len(survival) > 1 else None, ".3f"),
                             _fmt(survival[2] if len(survival) > 2 else None, ".3f"),
                             _fmt(think.get("mean")), _fmt(think.get("median")))
        console.print(sessions)


@guarded
def synth(
    output: Annotated[Path, typer.Option("-o", "--output", help="Trace file to write (.jsonl, .jsonl.gz, .jsonl.zst).")],
    preset: Annotated[str, typer.Option("--preset", help="Calibration preset: bailian-a or bailian-b.")] = "bailian-a",
    hours: Annotated[float, typer.Option("--hours", callback=positive, help="Trace length in hours.")] = 2.0,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Random seed; equal seeds give equal traces.")] = 0,
):
    """Write a synthetic Bailian-format trace calibrated to the published statistics."""
    from kvprof.profiler.synth import PRESETS, generate, write_jsonl

    if preset not in PRESETS:
        raise typer.BadParameter(f"{preset!r} is not one of {', '.join(PRESETS)}", param_hint="--preset")
    count = write_jsonl(output, generate(preset, hours, seed))
    err_console.print(f"wrote {output}: {count:,} requests, {hours:g} h of {preset} (seed {seed})")
