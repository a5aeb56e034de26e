"""``kvprof show``: an hp file pretty-printed, results files side by side, or a recording's starts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from kvprof.cli.common import guarded, output_dir
from kvprof.cli.fit_cmd import JsonOpt
from kvprof.cli.hp_tables import (cells_table, classes_table, fmt, horizons, next_turn_line, retention_table,
                                  tuning_table)
from kvprof.cli.output import first_rows, plain, print_json, printable, show as show_table, table
from kvprof.errors import KvprofError


@guarded
def show(
    paths: Annotated[
        list[Path],
        typer.Argument(help="A hyperparameter file (kvprof.hp/6 to /1, or the published format), one or more "
                            "results.json files of compare, demo or replay to tabulate and plot together, or a "
                            "recording directory (vllm serve --kv-record)."),
    ],
    output: Annotated[
        Optional[Path], typer.Option("-o", "--output", help="Directory for the joint plots of results files (PNG, SVG).")
    ] = None,
    json_out: JsonOpt = False,
):
    """Pretty-print a hyperparameter file after validating it, put results files side by side, or list
    a recording's server starts with the hp file each began with and those reloaded while it ran.

    Results files share one table and, with --output, compare's hit-ratio and QTTFT plots: a
    simulated sweep next to a live replay at the server's capacity (policy marked "(live)").
    """
    from kvprof.cli.show_results import show_results
    from kvprof.recording import is_recording
    from kvprof.results import load_if_results

    if len(paths) == 1 and is_recording(paths[0]) and output is None:
        _show_recording(paths[0], json_out)
        return

    if output is not None:
        from kvprof.cli.plots import FILES

        output_dir(output, files=FILES, inputs=paths)
    from kvprof.errors import JsonFileError
    from kvprof.jsonfile import read_bounded

    # each read once (a FIFO or <(cat hp.json) has no second reading), and at most the bound of a JSON input
    raws = [read_bounded(path, JsonFileError) for path in paths]
    documents = [load_if_results(path, raw) for path, raw in zip(paths, raws)]
    if None not in documents:
        show_results(paths, documents, output, json_out)
        return
    if len(paths) == 1 and output is None:
        _show_hp(paths[0], raws[0], json_out)
        return
    other = documents.index(None)
    raise KvprofError(f"{paths[other]}: not a results file ({_not_results(paths[other], raws[other])}); several "
                      f"files, or -o, are shown only when each is a results.json of compare, demo or replay (give "
                      f"an hp file alone)")


def _not_results(path: Path, raw: bytes) -> str:
    """Why ``path`` (read: ``raw``) is not a results file, in a few words."""
    from kvprof.errors import ResultsFileError
    from kvprof.jsonfile import parse_json

    try:
        data = parse_json(raw, path, ResultsFileError)
    except ResultsFileError as exc:
        return exc.reason
    schema = data.get("schema") if type(data) is dict else None
    return f"its schema is {schema!r}" if schema is not None else "it has no schema"


def _show_hp(hp_path: Path, raw: bytes, json_out: bool) -> None:
    """The hp file's (read: ``raw``) rule, provenance, classes and sessions, after validating it."""
    from kvprof.errors import HpFileError
    from kvprof.jsonfile import parse_json
    from kvprof.models.hp import PUBLISHED_FORMAT, SCHEMAS, HpFile
    from kvprof.results import SCHEMA as RESULTS_SCHEMA

    try:
        hp = HpFile.from_dict(parse_json(raw, hp_path, HpFileError), str(hp_path))
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
    header.append(f"  {'published profiler format' if published else 'schema ' + hp.schema}  {horizons(hp)}  "
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
    show_table(classes_table(hp, title="classes: one cure exponential each (wa-paper's naive estimates beside)"))
    show_table(cells_table(hp, title="cells" if hp.cells else "cells (the classes, from a kvprof.hp/1 file)"))
    if hp.tuning:
        show_table(tuning_table(hp))
    if (line := next_turn_line(hp)) is not None:
        show_table(plain(line))
    if hp.sessions:
        types, more = first_rows(list(hp.sessions.items()), "types")
        sessions = table("sessions per type", {column: "left" if column == "type" else "right" for column in (
            "type", "sessions", "P(turn>=2)", "P(turn>=3)", "think mean (s)", "think median (s)")}, caption=more)
        for name, row in types:
            survival = row.get("survival", [])
            think = row.get("think_time_s") or {}
            sessions.add_row(name, fmt(row.get("n_sessions"), "d"),
                             fmt(survival[1] if len(survival) > 1 else None, ".3f"),
                             fmt(survival[2] if len(survival) > 2 else None, ".3f"),
                             fmt(think.get("mean")), fmt(think.get("median")))
        show_table(sessions)
    if hp.retention is not None:
        show_table(retention_table(hp))


def _show_recording(directory: Path, json_out: bool) -> None:
    """A recording's ``recording.json``: its starts, each with the hp file it began with and every
    reload that came in force while it ran (time since the recording's origin, sha256, path)."""
    from kvprof.recording import load_recording

    recording = load_recording(directory)
    if json_out:
        print_json(recording.to_dict())
        return
    starts = table(plain(f"{directory} ({recording.block_size}-token blocks): server starts"),
                   {column: "left" if column in ("policy", "hp file (sha256)") else "right"
                    for column in ("start", "rank", "at (s)", "blocks", "policy", "hp file (sha256)", "written")})
    reloads = table("hp files reloaded while a start ran",
                    {column: "left" if column in ("sha256", "path") else "right"
                     for column in ("start", "rank", "at (s)", "sha256", "path")})
    for i, start in enumerate(recording.starts):
        starts.add_row(str(i), str(start.rank), f"{start.time:,.1f}", f"{start.num_gpu_blocks:,}", plain(start.policy),
                       plain(start.hp_sha256[:12] if start.hp_sha256 else "-"), f"{start.written:,}")
        for reload in start.reloads:
            reloads.add_row(str(i), str(start.rank), f"{reload.time:,.1f}", plain(reload.sha256[:12]), plain(reload.path))
    show_table(starts)
    show_table(reloads if reloads.row_count else plain("no hp file was reloaded while the recording ran"))
