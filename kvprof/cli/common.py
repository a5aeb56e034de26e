"""What every command shares: error handling with the documented exit codes, consoles, JSON output."""

from __future__ import annotations

import functools
import json
import math
import stat
import sys
from collections.abc import Callable

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from kvprof.errors import KvprofError
from kvprof.profiler.trace import FORMAT_BLOCK_SIZE

#: Tables go to stdout; progress, messages and errors to stderr. Off a terminal (pipes, CI logs)
#: rich would squeeze tables into 80 columns, so give them room.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

#: Data errors exit 1; usage errors exit 2 through click's own BadParameter handling.
EXIT_DATA_ERROR = 1


def fail(message: str, code: int = EXIT_DATA_ERROR) -> typer.Exit:
    """Print ``message`` on stderr and return the Exit to raise."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def guarded(command: Callable) -> Callable:
    """Turn kvprof's input errors into a message on stderr and exit 1.

    Usage errors (bad option values) are raised as ``typer.BadParameter`` and exit 2 through
    click; anything else is a bug and keeps its traceback.
    """

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KvprofError as exc:
            raise fail(str(exc)) from None
        except OSError as exc:
            raise fail(f"{exc.filename or ''}: {exc.strerror or exc}") from None

    return wrapper


def print_json(data) -> None:
    """Machine-readable output on stdout, nothing else on it."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def positive(value: float) -> float:
    """Option callback: the value must be a finite number > 0 (exit 2 otherwise)."""
    if not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"must be a finite number > 0, got {value}")
    return value


def non_negative(value: float) -> float:
    """Option callback: the value must be a finite number >= 0 (exit 2 otherwise)."""
    if not (math.isfinite(value) and value >= 0):
        raise typer.BadParameter(f"must be a finite number >= 0, got {value}")
    return value


def sample_rate(value: float) -> float:
    """Option callback: a sampling rate, a number in (0, 1] (exit 2 otherwise)."""
    if not (math.isfinite(value) and 0 < value <= 1):
        raise typer.BadParameter(f"must be a number in (0, 1], got {value}")
    return value


def ray_cluster(address: str | None) -> str | None:
    """Option callback: connect to the Ray cluster at ``address`` now, before any work (exit 2 if
    Ray is missing or no cluster answers); None leaves the work on this machine."""
    if address is None:
        return None
    from kvprof.sim.config import SimulationError
    from kvprof.sim.runner import connect_ray

    try:
        connect_ray(address)
    except SimulationError as exc:
        raise typer.BadParameter(str(exc)) from None
    return address


RayOpt = Annotated[
    Optional[str],
    typer.Option("--ray", callback=ray_cluster, metavar="ADDRESS",
                 help="Run the replays as tasks of this Ray cluster (auto: RAY_ADDRESS, else the cluster running "
                      "here); needs pip install 'kvprof[ray]'. Same results as on this machine."),
]


def capacity_list(text: str) -> tuple[int, ...]:
    """``--capacity``'s comma-separated whole numbers of blocks, each > 0 (a usage error otherwise)."""
    try:
        capacities = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} must be comma-separated whole numbers of blocks", param_hint="--capacity"
        ) from None
    if any(c <= 0 for c in capacities):
        raise typer.BadParameter(f"capacities must be > 0 blocks, got {text}", param_hint="--capacity")
    return capacities


def parse_window_option(text: str | None, option: str = "--window") -> tuple[float | None, float | None] | None:
    """``START:END`` from the command line, or a usage error (exit 2) naming the option."""
    if text is None:
        return None
    from kvprof.profiler.trace import parse_window

    try:
        return parse_window(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


TraceArg = Annotated[Path, typer.Argument(help="Trace file (Bailian or Mooncake JSONL, plain, .gz or .zst), or a vLLM recording directory (vllm serve --kv-record).")]
FormatOpt = Annotated[
    Optional[str], typer.Option("--format", help=f"Force the trace format ({', '.join(FORMAT_BLOCK_SIZE)}).")
]
SkipOpt = Annotated[
    bool, typer.Option("--skip-invalid", help="Skip invalid lines (reported by kind) instead of stopping.")
]
TraceBlockTokensOpt = Annotated[
    Optional[int],
    typer.Option("--trace-block-tokens", min=1, help="Tokens per trace hash id (default: 16 Bailian, 512 Mooncake)."),
]
LimitOpt = Annotated[
    Optional[int], typer.Option("--limit", min=1, help="Only the first N requests (of the window).")
]


def open_trace(path, *, format=None, block_size=None, window=None, skip_invalid=False):
    """Read a trace with a progress bar on stderr, reporting skipped lines; returns the Trace.

    An unknown ``format`` is a usage error (exit 2). Skipped lines (``--skip-invalid``) are always
    reported, never dropped silently.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from kvprof.profiler.reader import read_trace

    if format is not None and format not in FORMAT_BLOCK_SIZE:
        raise typer.BadParameter(f"{format!r} is not one of {', '.join(FORMAT_BLOCK_SIZE)}", param_hint="--format")

    if _is_stream(path):
        err_console.print(f"reading {path}, a stream: waiting for its lines (until the writer closes it)")
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task(f"reading {path}", total=None)
        trace, report = read_trace(
            path,
            format=format,
            block_size=block_size,
            window=window,
            skip_invalid=skip_invalid,
            progress=lambda done, total: bar.update(task, completed=done, total=total or None),
        )
    if report.skipped:
        detail = ", ".join(f"{count} {kind}" for kind, count in sorted(report.skipped.items()))
        err_console.print(f"[yellow]warning:[/] skipped {sum(report.skipped.values())} invalid lines of {path}: {detail}")
    if report.truncated:
        err_console.print(f"note: {path} is a recording whose open file ends in an unfinished line or zstd frame "
                          f"(a server still writing, or killed): skipped {report.truncated} line(s) at its end")
    if report.recording is not None and report.recording.dropped:
        err_console.print(f"[yellow]warning:[/] the server could not record {report.recording.dropped:,} requests "
                          f"(recording.json says why): they are missing from {path}")
    return trace


def recording_of(path):
    """The ``recording.json`` of a vLLM recording directory (``vllm serve --kv-record``), None for a file.

    Raises
    ------
    kvprof.recording.RecordingError
        A directory that is not a valid recording.
    """
    from kvprof.recording import is_recording, load_recording

    return load_recording(path) if is_recording(path) else None


#: Marks a modelled QTTFT whose server was overloaded: the number grows with the trace's length.
OVERLOADED = " (overloaded)"


def qttft_cell(seconds: float | None, overloaded: bool = False) -> str:
    """A QTTFT table cell: seconds with two decimals, ``-`` for none, marked when the server was overloaded."""
    return ("-" if seconds is None else f"{seconds:.2f}") + (OVERLOADED if overloaded else "")


def output_dir(path: Path) -> Path:
    """``path`` as an existing directory (created with its parents); something else there is a usage error."""
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{path} exists and is not a directory", param_hint="-o/--output")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _is_stream(path) -> bool:
    """Whether ``path`` is a FIFO or a character device (read as it arrives, of unknown length)."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return False  # the reader reports it
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)
