"""What every command shares: error handling with the documented exit codes, option values, outputs, reading a trace.

Three rules every command follows, each kept here once:

* **Option values** (:func:`number_option`): every integer and float option is read by
  :meth:`kvprof.limits.Bound.parse` (ASCII digits, inside the quantity's bounds); anything else
  exits 2 naming the option, before any work.
* **Checks before work**: options, the output paths (:func:`output_file`, :func:`output_dir`) and
  the input files they must not replace are checked before a trace is read; a refused run
  creates nothing.
* **Outputs**: written atomically (:mod:`kvprof.atomic`), the output directory created only once
  there is something to write in it (:func:`made_dir`), never over an input of the same run.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import DownloadColumn, TimeRemainingColumn

from kvprof.cli.output import (claim_stdout, count, end_quietly_on_closed_stdout, fail, progress, say, status,
                               task_progress, warn)
from kvprof import atomic
from kvprof.errors import KvprofError, ParallelError
from kvprof.limits import BLOCK_TOKENS, BLOCKS, INT64_MAX, Bound, usable_blocks
from kvprof.profiler.trace import FORMAT_BLOCK_SIZE

#: Exit code of a command stopped by SIGINT; SIGTERM (:class:`kvprof.cli.app.Terminated`) says its own.
EXIT_INTERRUPTED = 130


def guarded(command: Callable) -> Callable:
    """Turn kvprof's input errors into a message on stderr and exit 1.

    Usage errors (bad option values) are raised as ``typer.BadParameter`` and exit 2 through
    click; a closed stdout ends the command quietly (exit 0); an interrupt (SIGINT, or SIGTERM
    turned into one) unwinds cleanly, temporary files removed, and exits 130 (143), unless it came
    once the command's final outputs were in place (``staged(final=True)``): then it says so and
    exits 0, as the outputs are complete. Anything else is a bug and keeps its traceback.
    """

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        claim_stdout(None, claimed=False)  # a command in-process after another (tests) starts with stdout its own
        atomic.final_outputs_written = False
        try:
            return command(*args, **kwargs)
        except KvprofError as exc:
            raise fail(str(exc)) from None
        except BrokenPipeError:
            raise end_quietly_on_closed_stdout() from None
        except OSError as exc:
            raise fail(f"{exc.filename or ''}: {exc.strerror or exc}") from None
        except KeyboardInterrupt as exc:
            if atomic.final_outputs_written:
                say("interrupted once its outputs were written: they are complete")
                return None
            raise fail("interrupted", getattr(exc, "exit_code", EXIT_INTERRUPTED)) from None

    return wrapper


# --- option values --------------------------------------------------------------------------------


class _BoundedParser:
    """Typer's ``parser`` for one bounded number option: text -> the number, or a usage error (exit 2)."""

    def __init__(self, bound: Bound, check: Callable[[int | float], str | None] | None = None):
        self.bound = bound
        self.check = check
        self.__name__ = "integer" if bound.whole else "number"  # click's metavar

    def __call__(self, value):
        try:
            number = self.bound.parse(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        problem = self.check(number) if self.check else None
        if problem:
            raise typer.BadParameter(problem)
        return number


def number_option(*names: str, bound: Bound, help: str, check=None, **kwargs):
    """A ``typer.Option`` whose value is read and bounded by ``bound`` (see the module notes)."""
    return typer.Option(*names, parser=_BoundedParser(bound, check), help=help, **kwargs)


def bounded_parser(param) -> _BoundedParser | None:
    """The :func:`number_option` parser of a command's parameter, None if it has none (for the option sweeps)."""
    info = getattr(getattr(param, "type_descriptor", None), "parameter_info", None)
    parser = getattr(info, "parser", None) or getattr(getattr(param, "type", None), "func", None)
    return parser if isinstance(parser, _BoundedParser) else None


def _not_zero(jobs: int) -> str | None:
    return "must not be 0 (-1: every core, -2: all but one)" if jobs == 0 else None


JOBS = Bound(-INT64_MAX, INT64_MAX, whole=True)
JobsOpt = Annotated[
    int, number_option("-j", "--jobs", bound=JOBS, check=_not_zero,
                       help="Parallel replays (joblib: -1 every core, -2 all but one); capped at the runs and the cores.")
]


def ray_cluster(address: str | None) -> str | None:
    """Option callback: connect to the Ray cluster at ``address`` now, before any work (exit 2 if
    Ray is missing or no cluster answers); None leaves the work on this machine."""
    if address is None:
        return None
    from kvprof.parallel import connect_ray

    try:
        connect_ray(address)
    except ParallelError as exc:
        raise typer.BadParameter(str(exc)) from None
    return address


# Help texts are rich markup: "\\[" keeps a bracket that would read as a tag (tests/test_hostile_options.py).
RayOpt = Annotated[
    Optional[str],
    typer.Option("--ray", callback=ray_cluster, metavar="ADDRESS",
                 help="Run the replays as tasks of this Ray cluster (auto: RAY_ADDRESS, else the cluster running "
                      "here, within 30 s); needs pip install 'kvprof\\[ray]'. Same results as on this machine."),
]


def list_items(text: str, option: str) -> list[str]:
    """The items of a comma-separated option, as written: none empty (``4,,8``, ``''``, a trailing comma
    are usage errors naming ``option``); the one rule of every list option."""
    items = text.split(",")
    if text == "":
        raise typer.BadParameter("is empty: give at least one item", param_hint=option)
    if "" in items:
        raise typer.BadParameter(f"{text!r} has an empty item: give the items separated by single commas, "
                                 f"e.g. a,b", param_hint=option)
    return items


def parse_list(text: str, bound: Bound, option: str, what: str, note: str = "") -> tuple:
    """Comma-separated numbers, each read by ``bound`` (a usage error naming ``option`` otherwise,
    ``note`` added to it)."""
    values = []
    for part in list_items(text, option):
        try:
            values.append(bound.parse(part, f"each {what}"))
        except ValueError as exc:
            raise typer.BadParameter(f"{exc}{note}", param_hint=option) from None
    return tuple(values)


def capacity_bound(bound: Bound = BLOCKS) -> tuple[Bound, str]:
    """A simulated cache's capacities: ``bound``, lowered to what this machine's memory holds for one
    replay; and the note saying why, when memory is the limit ('' otherwise)."""
    from kvprof.sim.config import BYTES_PER_SLOT

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    held = memory // BYTES_PER_SLOT
    if held >= bound.high:
        return bound, ""
    return (Bound(bound.low, held, whole=True),
            f" ({held:,} blocks fill this machine's {memory / 2**30:,.1f} GiB at ~{BYTES_PER_SLOT} bytes each)")


def capacity_list(text: str, option: str = "--capacity", bound: Bound = BLOCKS) -> tuple[int, ...]:
    """``--capacity``'s comma-separated whole numbers of blocks, each inside :func:`capacity_bound` (a usage
    error stating the bound that applies otherwise)."""
    bound, note = capacity_bound(bound)
    return parse_list(text, bound, option, "capacity", note)


def recorded_capacity(paths: list[Path], recordings: list, bound: Bound = BLOCKS) -> str:
    """``--capacity``'s default for vLLM recordings: their servers' usable blocks (``num_gpu_blocks`` less
    the null block; all alike, a usage error otherwise), inside :func:`capacity_bound`; a recording whose
    cache is outside it is named by file and field (exit 1), with the option that replaces it."""
    from kvprof.recording import FILE

    sizes = {usable_blocks(recording.num_gpu_blocks) for recording in recordings}
    if len(sizes) > 1:
        raise typer.BadParameter(f"the recorded servers had {', '.join(map(str, sorted(sizes)))} usable blocks; a "
                                 f"fleet's replicas have one capacity: give it", param_hint="--capacity")
    blocks = sizes.pop()
    bound, note = capacity_bound(bound)
    if not bound.accepts(blocks):
        where = f"{paths[0] / FILE}, at starts[{len(recordings[0].starts) - 1}].num_gpu_blocks"
        raise KvprofError(f"{where}: {recordings[0].num_gpu_blocks:,} blocks, {blocks:,} usable (less vLLM's null "
                          f"block), but a simulated cache must be {bound.describe()}{note}; give --capacity")
    return str(blocks)


def parse_window_option(text: str | None, option: str = "--window") -> tuple[float | None, float | None] | None:
    """``START:END`` from the command line, or a usage error (exit 2) naming the option."""
    if text is None:
        return None
    from kvprof.profiler.trace import parse_window

    try:
        return parse_window(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


def check_memory(capacities: Iterable[int], cpu_capacity: int, jobs: int, n_runs: int, option: str) -> None:
    """Refuse, before any work, capacities whose replays would not fit in this machine's memory (exit 2)."""
    from kvprof.parallel import sweep_workers
    from kvprof.sim.config import SimulationError, check_memory as estimate

    try:
        estimate(max(capacities), cpu_capacity, sweep_workers(jobs, n_runs))
    except (ParallelError, SimulationError) as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


TraceArg = Annotated[Path, typer.Argument(help="Trace file (Bailian or Mooncake JSONL, plain, .gz or .zst), or a "
                                                "vLLM recording directory (vllm serve --kv-record).")]
FormatOpt = Annotated[
    Optional[str], typer.Option("--format", help=f"Force the trace format ({', '.join(FORMAT_BLOCK_SIZE)}).")
]
SkipOpt = Annotated[
    bool, typer.Option("--skip-invalid", help="Skip invalid lines (reported by kind) instead of stopping.")
]
TraceBlockTokensOpt = Annotated[
    Optional[int],
    number_option("--trace-block-tokens", bound=BLOCK_TOKENS,
                  help="Tokens per trace hash id (default: 16 Bailian, 512 Mooncake)."),
]
LimitOpt = Annotated[
    Optional[int], number_option("--limit", bound=Bound(1, INT64_MAX, whole=True),
                                 help="Only the first N requests (of the window).")
]


def check_format(format: str | None) -> None:
    """An unknown ``--format`` is a usage error (exit 2)."""
    if format is not None and format not in FORMAT_BLOCK_SIZE:
        raise typer.BadParameter(f"{format!r} is not one of {', '.join(FORMAT_BLOCK_SIZE)}", param_hint="--format")


def trace_block_size(path: Path, format: str | None, block_size: int | None) -> int | None:
    """The trace's tokens per hash id as it will be read: the option, else its format's (forced or
    detected from the first record); None when it cannot be known before reading (a stream)."""
    from kvprof.profiler.reader import peek_format

    if block_size is not None:
        return block_size
    if format is None and not _is_stream(path):
        format = peek_format(path)
    return FORMAT_BLOCK_SIZE.get(format) if format else None


RankOpt = Annotated[
    Optional[int], number_option("--rank", bound=Bound(0, INT64_MAX, whole=True),
                                 help="Of a vLLM recording of several data-parallel ranks, only this rank's "
                                      "requests (default: the whole fleet's).")
]


def check_recording_options(path, format, block_size, rank, block_option: str = "--block-size") -> None:
    """Options that contradict a recording (a format, a block size other than its own), or
    ``--rank`` of a trace file, are usage errors (exit 2)."""
    recording = recording_of(path)
    if recording is None:
        if rank is not None:
            raise typer.BadParameter("selects a data-parallel rank of a vLLM recording directory; "
                                     f"{path} is a trace file", param_hint="--rank")
        return
    if format not in (None, "bailian"):
        raise typer.BadParameter(f"a recording is Bailian-style JSONL with its timestamps in seconds: leave out "
                                 f"--format {format}", param_hint="--format")
    if block_size not in (None, recording.block_size):
        raise typer.BadParameter(f"the recording's hash ids are {recording.block_size}-token blocks (recording.json): "
                                 f"leave it out", param_hint=block_option)
    if rank is not None and rank not in recording.ranks:
        raise typer.BadParameter(f"the recording holds rank(s) {', '.join(map(str, recording.ranks))}",
                                 param_hint="--rank")


def open_trace(path, *, format=None, block_size=None, window=None, skip_invalid=False, rank=None,
               block_option="--block-size"):
    """Read a trace with a progress bar on stderr, reporting skipped lines; returns the Trace.

    An unknown ``format`` and options that contradict a recording are usage errors (exit 2).
    Skipped lines (``--skip-invalid``) are always reported, never dropped silently.
    """
    from kvprof.profiler.reader import read_trace

    check_format(format)
    check_recording_options(path, format, block_size, rank, block_option)
    if _is_stream(path):
        say(f"reading {path}, a stream: waiting for its lines (until the writer closes it)")
    with progress(DownloadColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task(f"reading {path}", total=None)
        trace, report = read_trace(
            path,
            format=format,
            block_size=block_size,
            window=window,
            skip_invalid=skip_invalid,
            rank=rank,
            progress=lambda done, total: bar.update(task, completed=done, total=total or None),
        )
    if report.skipped:
        detail = ", ".join(f"{count} {kind}" for kind, count in sorted(report.skipped.items()))
        warn(f"skipped {sum(report.skipped.values())} invalid lines of {path}: {detail}")
    if report.truncated or report.cut_frames:
        say(f"note: {path} is a recording with open files (a server still writing, or killed unfinished): "
            f"{report.truncated} unfinished last line(s) skipped; {report.cut_frames} file(s) end inside an "
            f"unfinished zstd frame, whose requests (up to 2 s of them each) are lost")
    if report.missing:
        warn(f"{report.missing:,} requests recording.json counts as written are in no file of {path} "
             f"(a file cut or removed after they were written)")
    if report.recording is not None and report.recording.dropped:
        warn(f"the server could not record {report.recording.dropped:,} requests (recording.json says why): "
             f"they are missing from {path}")
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
    """A QTTFT table cell: seconds with two decimals, marked when the server was overloaded; ``-`` for
    none (None, or NaN: a replay on recorded timing models none)."""
    if seconds is None or math.isnan(seconds):
        return "-"
    return f"{seconds:.2f}" + (OVERLOADED if overloaded else "")


# --- what compare and fleet share -----------------------------------------------------------------


def rejected_cell(rejected: int, requests: int) -> str:
    """A table's ``rejected`` cell: requests too long for the whole cache, not served, and their share."""
    return f"{rejected:,} ({rejected / requests:.1%})" if rejected else "0"


#: Said under a table with rejected requests: what the hit ratio and QTTFT of those runs mean.
REJECTED_NOTE = ("rejected: requests longer than the whole cache, never served; the hit ratio counts their prompt "
                 "tokens as uncached and QTTFT is over the served requests only")

#: The hp file compare and fleet write when they fit one.
FITTED_HP = "hp.json"

OutputOpt = Annotated[Path, typer.Option("-o", "--output", help="Directory for results.json, plots (PNG, SVG).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the results document as JSON instead of a table.")]
FitWindowOpt = Annotated[
    str, typer.Option("--fit-window", help="START:END seconds to fit on when no --config is given.")
]
EvalWindowOpt = Annotated[str, typer.Option("--eval-window", help="START:END seconds to replay.")]


def policy_list(text: str) -> tuple[str, ...]:
    """``--policies``: comma-separated names of registered policies, none twice (a usage error otherwise)."""
    from kvprof.policy import POLICIES

    names = distinct(tuple(list_items(text, "--policies")), "--policies", "policy")
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        raise typer.BadParameter(f"unknown policy {', '.join(map(repr, unknown))}; known: {', '.join(POLICIES)}",
                                 param_hint="--policies")
    return names


def distinct(values: tuple, option: str, what: str = "value") -> tuple:
    """``values`` if none is given twice (a usage error naming ``option`` otherwise)."""
    if len(set(values)) != len(values):
        raise typer.BadParameter(f"a {what} is given twice", param_hint=option)
    return values


def needs_hp(names) -> bool:
    """Whether any of the policies ``names`` (or the simulator's CPU tier's) reads an hp file."""
    from kvprof.policy import POLICIES
    from kvprof.sim.config import SimConfig

    return any(hasattr(POLICIES[name], "from_hp") for name in (*names, SimConfig.cpu_policy))


def check_multiple(engine_block: int, trace_block: int) -> None:
    """The engine block holds whole trace blocks (exit 2 otherwise)."""
    if engine_block % trace_block:
        raise typer.BadParameter(f"{engine_block} tokens is not a multiple of the trace's {trace_block}-token blocks",
                                 param_hint="--block-size")


def cost_model(path: Path | None, **given):
    """The cost model: defaults, then ``--cost`` FILE's values, then the options given (each checked already)."""
    import dataclasses

    from kvprof.sim.config import CostModel

    base = CostModel.from_file(path) if path is not None else CostModel()
    return dataclasses.replace(base, **{name: value for name, value in given.items() if value is not None})


def evaluation_window(trace, bounds, text: str, limit: int | None, fits: bool):
    """The requests ``--eval-window`` (``text``, read as ``bounds``) and ``--limit`` replay; none is a usage
    error (exit 2) that says which windows fit a trace this short: its arrivals, and to fit on about 40 %
    and replay the rest when ``fits``, else to replay it all."""
    evaluated = trace.time_window(*bounds)
    if limit is not None:
        evaluated = evaluated.head(limit)
    if evaluated.n_requests:
        return evaluated
    first, last = float(trace.timestamp[0]), float(trace.timestamp[-1])
    split = f"{first + 0.4 * (last - first):.0f}"
    hint = f"--fit-window {first:.0f}:{split} --eval-window {split}:" if fits else f"--eval-window {first:.0f}:"
    raise typer.BadParameter(f"the window {text} holds no requests of {trace.source} (its arrivals span "
                             f"{first:g}..{last:g} s); for a trace this short pass e.g. {hint}",
                             param_hint="--eval-window")


def fit_and_tune(trace, bounds, capacities, sim_config, jobs: int, ray=None, evaluated=None):
    """Fit the reuse models on a window (the published workflow: hour one) and tune wa for the
    capacities on it (``kvprof fit --capacity``); saved once the sweep is done. A warning says when
    the window holds requests of ``evaluated``, the evaluation window's (fitted on what is then scored)."""
    import dataclasses

    from kvprof.profiler.fit import fit_trace

    window = trace.time_window(*bounds)
    if evaluated is not None:
        _warn_if_overlapping(window, evaluated)
    with status(f"fitting reuse models on {window.n_requests:,} requests"):
        hp = fit_trace(window)
    return tune_with_progress(hp, window, capacities,
                              dataclasses.replace(sim_config, cpu_capacity=0, capacity_schedule=()), jobs, ray,
                              refit=fit_trace)


def _warn_if_overlapping(fitted, evaluated) -> None:
    """Warn when requests of the evaluation window ``evaluated`` are also in the fit window ``fitted``."""
    import numpy as np

    first, last = np.searchsorted(evaluated.timestamp, fitted.window, side="left")
    if last > first:
        lo, hi = fitted.window
        warn(f"the fit window [{lo:g}, {min(hi, fitted.censor_time):g}) s holds {last - first:,} of the "
             f"{evaluated.n_requests:,} requests of the evaluation window: wa is fitted and tuned on requests it is "
             f"then scored on (a trace shorter than the windows? give --fit-window and --eval-window that do not "
             f"overlap)")


# --- outputs --------------------------------------------------------------------------------------


def output_file(path: Path, inputs: Iterable[Path | None] = (), option: str = "-o/--output") -> Path:
    """``path`` if a file can be written there without replacing an input; a usage error otherwise.
    Where ``path`` is stdout itself (``-o /dev/stdout``), what the command prints on stdout goes to
    stderr instead (:func:`kvprof.cli.output.claim_stdout`).

    Checked before any work: its directory exists (``-o t.jsonl/hp.json`` with ``t.jsonl`` a
    file, or a directory not made yet, are refused), ``path`` is not a directory, and ``path`` is
    not one of ``inputs`` (``fit t.jsonl -o t.jsonl``).
    """
    directory = path.parent
    if not directory.is_dir():
        what = "is not a directory" if os.path.lexists(directory) else "does not exist"
        raise typer.BadParameter(f"{path}: {directory} {what}", param_hint=option)
    longest = os.pathconf(directory, "PC_NAME_MAX")
    if len(os.fsencode(path.name)) > longest:
        raise typer.BadParameter(f"{path}: the file name is longer than {longest} bytes, the most its directory takes",
                                 param_hint=option)
    try:
        os.stat(path)
    except FileNotFoundError:
        pass  # a new file, or a link to one
    except OSError as exc:  # a loop of links, a component that cannot be searched
        raise typer.BadParameter(f"{path}: {exc.strerror}", param_hint=option) from None
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory; give a file name", param_hint=option)
    if not _is_stream(path):  # a device or pipe (/dev/stdout) is written through: nothing is created beside it
        _check_creatable(directory, path, option)
    _check_not_an_input(path, inputs, option)
    claim_stdout(path)  # -o /dev/stdout: stdout carries the file, tables go to stderr
    return path


def output_dir(path: Path, files: Iterable[str] = (), inputs: Iterable[Path | None] = (),
               option: str = "-o/--output") -> Path:
    """``path`` if it is a directory or can be made one, and none of ``files`` in it is one of ``inputs``.

    Nothing is created here (a refused run creates nothing): :func:`made_dir` makes the directory
    when there is something to write.
    """
    try:
        if path.exists() and not path.is_dir():
            raise typer.BadParameter(f"{path} exists and is not a directory", param_hint=option)
    except OSError as exc:  # a name too long, a loop of links
        raise typer.BadParameter(f"{path}: {exc.strerror}", param_hint=option) from None
    _check_creatable(path, path, option)
    for name in files:
        _check_not_an_input(path / name, inputs, option)
    return path


@contextlib.contextmanager
def made_dir(path: Path, scratch: bool = False) -> Iterator[Path]:
    """``path`` made a directory (with its missing parents; errors name ``path``) for the block's writes.

    The directories this made are removed again, as far as they are empty, when the block fails (a
    full disk: a failed run leaves no empty output directory behind), and also when it succeeds
    for a ``scratch`` directory (``--spill-dir``'s shards are removed after use).
    """
    made = []
    missing = path
    while not os.path.lexists(missing) and missing != missing.parent:
        made.append(missing)
        missing = missing.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        yield path
    except BaseException:
        _remove_empty(made)
        raise
    if scratch:
        _remove_empty(made)


def _remove_empty(directories: list[Path]) -> None:
    """Remove ``directories`` (deepest first) while they are empty."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (or gone): its parents stay too


def _check_creatable(directory: Path, given: Path, option: str) -> None:
    """The nearest existing ancestor of ``directory`` (itself included) is a directory we may write in."""
    ancestor = directory
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise typer.BadParameter(f"{given}: {ancestor} is not a directory", param_hint=option)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"{given}: cannot write in {ancestor} (permission denied)", param_hint=option)


def _check_not_an_input(output: Path, inputs: Iterable[Path | None], option: str) -> None:
    for given in inputs:
        if given is not None and any(_same_file(output, read) for read in _files_read(given)):
            raise typer.BadParameter(f"{output} is also an input of this run ({given}); it would be replaced",
                                     param_hint=option)


def _files_read(given: Path) -> list[Path]:
    """The files an input path stands for: itself, or a recording directory's files."""
    from kvprof.recording import FILE, is_recording, trace_files

    try:
        return [given / FILE, *(path for path, _ in trace_files(given))] if is_recording(given) else [given]
    except OSError:  # a directory that cannot be listed: the reader will say so
        return [given]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _is_stream(path) -> bool:
    """Whether ``path`` is a FIFO or a character device (read as it arrives, of unknown length)."""
    try:
        mode = Path(path).stat().st_mode
    except (OSError, ValueError):
        return False  # the reader reports it
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def tune_with_progress(hp, fitted, capacities, config, jobs: int, ray: str | None = None, holdout=None,
                       learn: bool = False, refit=None):
    """``kvprof.sim.tune`` (fit's --capacity, compare without --config) with a progress bar of its replays."""
    from kvprof.sim.tune import tune

    say(f"tuning wa for {count(len(capacities), 'capacity', 'capacities')} on the fit window (the simulator "
        f"compiles on first use)")
    with task_progress("tuning replays", None) as update:
        return tune(hp, fitted, capacities, config, n_jobs=jobs, ray=ray, holdout=holdout, learn=learn,
                    progress=update, refit=refit)
