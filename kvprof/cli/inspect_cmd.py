"""``kvprof inspect``: a trace's summary and its reuse models, without writing a file."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvprof.cli.common import (
    FormatOpt,
    RankOpt,
    SkipOpt,
    TraceArg,
    check_format,
    guarded,
    open_trace,
    parse_window_option,
)
from kvprof.cli.fit_cmd import (
    BlockSizeOpt,
    ClassFieldOpt,
    ClassKeyOpt,
    HorizonOpt,
    JsonOpt,
    MinGapOpt,
    TurnCapOpt,
    check_trace_fields,
    class_rule,
)
from kvprof.cli.hp_tables import fmt
from kvprof.cli.output import first_rows, print_json, show as show_table, table


#: The ``stop`` codes as inspect's overview names them.
_STOP_LABELS = {"unknown": "not recorded", "tool_call": "tool call", "end_turn": "end of turn",
                "other": "other (length, abort, ...)"}


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

    rule = class_rule(class_key, turn_cap, class_field)
    bounds = parse_window_option(window)
    check_format(format)
    trace = open_trace(trace_path, format=format, block_size=block_size, window=bounds, skip_invalid=skip_invalid,
                       rank=rank)
    check_trace_fields(trace, rule)
    summary = trace_summary(trace, rule, min_gap=min_gap)
    if json_out:
        print_json({**summary, "reuse_models": class_models(trace, rule, horizon, min_gap)})
        return
    overview = table(f"{trace_path.name} ({summary['format']}, {summary['block_size']}-token blocks)",
                     {"": "left", " ": "right"}, show_header=False)
    for label, value in (
        ("requests", f"{summary['requests']:,}"),
        ("duration (s)", f"{summary['duration_s']:,.1f}"),
        ("requests per second", fmt(summary["qps"], ".2f")),
        ("sessions (first turns)", f"{summary['sessions']:,}"),
        ("types", ", ".join(f"{k} {v:,}" for k, v in summary["types"].items())),
        ("turns", ", ".join(f"{k}: {v:,}" for k, v in list(summary["turns"].items())[:8])),
        ("mean input / output tokens", f"{summary['mean_input_tokens']:,.0f} / {summary['mean_output_tokens']:,.0f}"),
        ("block accesses / distinct", f"{summary['block_accesses']:,} / {summary['distinct_blocks']:,}"),
        ("ideal hit ratio (infinite cache)", f"{summary['ideal_hit_ratio']:.3f}"),
        ("how responses ended (stop)", None if summary["stops"] is None else
         ", ".join(f"{_STOP_LABELS[k]} {v:,}" for k, v in summary["stops"].items())),
        ("client hints", None if summary["hints"] is None else
         f"retain {summary['hints']['retain']:,}, release {summary['hints']['release']:,} "
         f"({summary['hints']['tags']:,} hint tag{'' if summary['hints']['tags'] == 1 else 's'})"),
    ):
        if value is not None:
            overview.add_row(label, value)
    show_table(overview)
    classes, more = first_rows(list(summary["classes"].items()), "classes")
    gaps = table(f"reuse gaps per class (s), concurrency floor {min_gap:g} s",
                 {column: "left" if column == "class" else "right"
                  for column in ("class", "requests", "accesses", "reused", "p10", "p50", "p90", "p99")}, caption=more)
    for name, row in classes:
        q = row["gap_quantiles_s"] or {}
        gaps.add_row(name, f"{row['requests']:,}", f"{row['accesses']:,}", f"{row['reuse_share']:.1%}",
                     *(fmt(q.get(k)) for k in ("p10", "p50", "p90", "p99")))
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
            ", ".join(fmt(g) for g in mix["mean_gaps_s"]) + " / " + fmt(single["mean_gaps_s"][0]),
            f"{fmt(mix['ks'], '.3f')} / {fmt(single['ks'], '.3f')}",
            f"{fmt(held.get('log_loss'), '.3f')} / {fmt(held_single.get('log_loss'), '.3f')}",
            f"{fmt(held.get('brier'), '.3f')} / {fmt(held_single.get('brier'), '.3f')}",
            fmt(held.get("n"), ",d"),
        )
    return out
