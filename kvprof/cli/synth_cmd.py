"""``kvprof synth``: a synthetic Bailian-format trace."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprof.cli.common import guarded, number_option, output_file
from kvprof.cli.output import say, status
from kvprof.limits import COUNT, HOURS


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
