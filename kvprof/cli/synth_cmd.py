"""``kvprof synth``: a synthetic Bailian-format trace, optionally with client hints of a chosen accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvprof.cli.common import guarded, number_option, output_file
from kvprof.cli.output import percent, say, status
from kvprof.limits import COUNT, HOURS, RATE_SCALE, Bound
from kvprof.models.hints import MAX_RETAIN_S

_HINTS = "Client hints (docs/hints.md), made from each session's true future"
ACCURACY = Bound(0.0, 1.0)
#: A retention the trace reader takes back (a longer one would write a trace no command reads).
RETENTION = Bound(0.0, MAX_RETAIN_S, low_open=True)


@guarded
def synth(
    output: Annotated[Path, typer.Option("-o", "--output", help="Trace file to write (.jsonl, .jsonl.gz, .jsonl.zst).")],
    preset: Annotated[str, typer.Option("--preset", help="Calibration preset: bailian-a or bailian-b.")] = "bailian-a",
    hours: Annotated[float, number_option("--hours", bound=HOURS, help="Trace length in hours.")] = 2.0,
    seed: Annotated[int, number_option("--seed", bound=COUNT, help="Random seed; equal seeds give equal traces.")] = 0,
    hints: Annotated[
        str,
        typer.Option("--hints", help="none; future (retain until the session's next request, release where it "
                                     "ends, --hint-accuracy of them right); retain-all (every request retains for "
                                     "--hint-retain-s); random (retain or release by a coin). The requests are the "
                                     "same whatever the hints.", rich_help_panel=_HINTS),
    ] = "none",
    hint_accuracy: Annotated[
        Optional[float],
        number_option("--hint-accuracy", bound=ACCURACY,
                      help="With --hints future: the share of right hints; the others say the opposite "
                           "(default 1).", rich_help_panel=_HINTS),
    ] = None,
    hint_time_factor: Annotated[
        Optional[float],
        number_option("--hint-time-factor", bound=RATE_SCALE,
                      help="With --hints future: retention times are the true ones times this (default 1).",
                      rich_help_panel=_HINTS),
    ] = None,
    hint_retain_s: Annotated[
        Optional[float],
        number_option("--hint-retain-s", bound=RETENTION,
                      help="With --hints retain-all: the retention every request asks for (default 600).",
                      rich_help_panel=_HINTS),
    ] = None,
):
    """Write a synthetic Bailian-format trace calibrated to the published statistics."""
    import itertools

    from kvprof.profiler.synth import PRESETS, generate, write_jsonl
    from kvprof.profiler.synth.hints import HINT_MODES, HintSpec
    from kvprof.profiler.synth.writer import compression_problem

    if preset not in PRESETS:
        raise typer.BadParameter(f"{preset!r} is not one of {', '.join(PRESETS)}", param_hint="--preset")
    if hints not in ("none", *HINT_MODES):
        raise typer.BadParameter(f"{hints!r} is not one of none, {', '.join(HINT_MODES)}", param_hint="--hints")
    for value, option, mode in ((hint_accuracy, "--hint-accuracy", "future"),
                                (hint_time_factor, "--hint-time-factor", "future"),
                                (hint_retain_s, "--hint-retain-s", "retain-all")):
        if value is not None and hints != mode:
            raise typer.BadParameter(f"applies to --hints {mode} only", param_hint=option)
    spec = None if hints == "none" else HintSpec(
        hints, 1.0 if hint_accuracy is None else hint_accuracy, 1.0 if hint_time_factor is None else hint_time_factor,
        600.0 if hint_retain_s is None else hint_retain_s)
    output_file(output)
    problem = compression_problem(output)
    if problem:
        raise typer.BadParameter(problem, param_hint="-o/--output")
    with status(f"planning {hours:g} h of {preset}"):
        records = generate(preset, hours, seed, spec)
        first = next(records, None)
    if first is None:
        raise typer.BadParameter(f"{hours:g} h of {preset} (seed {seed}) holds no request; give more hours",
                                 param_hint="--hours")
    count = write_jsonl(output, itertools.chain([first], records))
    hinted = "" if spec is None else f", {hints} hints" + (
        f" ({percent(spec.accuracy)} right, times x{spec.time_factor:g})" if hints == "future" else "")
    say(f"wrote {output}: {count:,} requests, {hours:g} h of {preset} (seed {seed}){hinted}")
