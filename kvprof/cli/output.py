"""Everything the CLI prints goes through here: tables and JSON on stdout, messages and progress on stderr.

Whatever kvprof prints of its input is shown as it is, whatever it holds:

* No rich markup and no emoji codes are read from text: the consoles are built without them, so
  ``[bold]``, ``[/]`` or ``:smile:`` in a path, a trace value, an hp file or a server's message
  is printed as those characters (never parsed, dropped or turned into a crash). kvprof's own
  styles are given as styles (:func:`message`), never as markup in a string.
* Text that UTF-8 cannot encode (a lone surrogate from a trace's JSON, a file name in another
  encoding) is written with backslash escapes (``\\ud800``) instead of crashing the print, and so
  are control characters but newline and tab (an escape sequence in a trace value would otherwise
  reach the terminal and act there).
* Progress bars and spinners draw only on a terminal; in a log they print nothing (a spinner's
  message once, as a line).
* A closed stdout (``kvprof inspect t.jsonl | head -1``) ends the command quietly with exit 0,
  as the reader asked for no more (:func:`kvprof.cli.common.guarded`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import re
import sys
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
from rich.table import Table
from rich.text import Text

#: Off a terminal (pipes, CI logs) rich would squeeze tables into 80 columns, so give them room.
_PIPE_WIDTH = 160

#: Data errors exit 1; usage errors exit 2 through click's own BadParameter handling.
EXIT_DATA_ERROR = 1


#: What :func:`printable` escapes: control characters but newline and tab, and lone surrogates.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with control characters (but newline and tab) and what UTF-8 cannot encode (lone
    surrogates) written as backslash escapes, as Python writes them (``\\x1b``, ``\\ud800``)."""
    if not _UNPRINTABLE.search(text):
        return text
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


class _PlainConsole(Console):
    """A console that reads no markup or emoji codes and escapes what UTF-8 cannot encode.

    Every string rich renders (a printed one, a table cell, title or caption) passes through
    :meth:`render_str`, so no text reaches the terminal unescaped.
    """

    def __init__(self, stderr: bool = False):
        stream = sys.stderr if stderr else sys.stdout
        super().__init__(stderr=stderr, markup=False, emoji=False, highlight=False,
                         width=None if stream.isatty() else _PIPE_WIDTH)

    def render_str(self, text: str, **kwargs) -> Text:
        return super().render_str(printable(text), **kwargs)

    def on_broken_pipe(self) -> None:
        """A closed pipe ends the command (:func:`end_quietly_on_closed_stdout`), not rich's exit 1."""
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of the output has gone")


console = _PlainConsole()
err_console = _PlainConsole(stderr=True)


def plain(value) -> Text:
    """Any value as plain rich text: its ``str``, escaped where UTF-8 cannot encode it, never markup."""
    return Text(printable(str(value)))


def message(text: str, label: str | None = None, style: str = "") -> Text:
    """A stderr line: kvprof's ``label`` (``error:``, ``warning:``) in ``style``, then ``text`` as it is."""
    line = Text()
    if label:
        line.append(label + " ", style=style)
    line.append(printable(text))
    return line


def say(text: str) -> None:
    """A plain message on stderr."""
    err_console.print(message(text), soft_wrap=True)


def warn(text: str) -> None:
    """A warning on stderr."""
    err_console.print(message(text, "warning:", "yellow"), soft_wrap=True)


def fail(text: str, code: int = EXIT_DATA_ERROR) -> typer.Exit:
    """Print ``text`` as an error on stderr and return the Exit to raise."""
    err_console.print(message(text, "error:", "bold red"), soft_wrap=True)
    return typer.Exit(code)


#: Whether this command's output file is stdout itself (``-o /dev/stdout``): what would be printed on
#: stdout goes to stderr instead, so that stdout carries the file alone (:func:`claim_stdout`).
_stdout_is_output = False


def claim_stdout(path, claimed: bool = True) -> None:
    """Note whether the output file ``path`` is this process's stdout (``-o /dev/stdout``, ``/dev/fd/1``,
    or a path that names where stdout is redirected): if so, tables and JSON go to stderr from now on.
    ``claimed=False`` forgets it (each command starts so). The null device is never claimed."""
    global _stdout_is_output
    if not claimed:
        _stdout_is_output = False
        return
    try:
        given, out = os.stat(path), os.fstat(sys.stdout.fileno())
        null = os.stat(os.devnull)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # no such file yet; no real stdout
        return
    same = (given.st_dev, given.st_ino) == (out.st_dev, out.st_ino)
    _stdout_is_output = _stdout_is_output or (same and (given.st_dev, given.st_ino) != (null.st_dev, null.st_ino))


def show(renderable) -> None:
    """A table (or a line) on stdout (on stderr where stdout carries the output file)."""
    (err_console if _stdout_is_output else console).print(renderable, soft_wrap=isinstance(renderable, (str, Text)))


def print_json(data) -> None:
    """Machine-readable output on stdout, nothing else on it: strict JSON (a NaN or an infinity is null,
    and JSON escapes what UTF-8 cannot encode). On stderr where stdout carries the output file."""
    from kvprof.jsonfile import json_safe

    stream = sys.stderr if _stdout_is_output else sys.stdout
    stream.write(json.dumps(json_safe(data), indent=2, sort_keys=False, allow_nan=False) + "\n")


def percent(share: float, among=()) -> str:
    """``share`` (0.995) as a percentage label (``99.5%``) that says which share it is.

    Whole percentages as such (``50%``), others with a decimal or as many more as it takes: to tell
    ``share`` from each other share of ``among`` (shares listed together: ``99.91%`` and ``99.92%``,
    not two ``99.9%``), never to show a share below 1 as ``100%`` nor one above 0 as ``0%``. Never ``-0%``.
    """
    share = float(share) + 0.0  # -0.0 + 0.0 is 0.0
    if not math.isfinite(share):
        return f"{share}%"
    others = {float(other) * 100 for other in among if math.isfinite(other) and float(other) != share}
    scaled = share * 100
    for digits in range(0, 20):
        text = f"{scaled:.{digits}f}"
        shown = float(text)
        if (share < 1 and shown >= 100) or (share > 0 and shown <= 0) or (share < 0 and shown >= 0):
            continue  # rounded onto a bound it is not
        if any(f"{other:.{digits}f}" == text for other in others):
            continue
        if digits or abs(shown - scaled) <= 1e-12 * max(1.0, abs(scaled)):  # a fraction keeps a decimal
            return f"{text}%"
    return f"{scaled!r}%"  # tinier than 20 decimals show (1e-30): Python's shortest form, an exponent


#: Rows a table shows at most (rich takes about 2 ms a row); the rest are counted under it, ``--json`` has all.
MAX_ROWS = 256


def first_rows(items: list, noun: str, rows_each: int = 1) -> tuple[list, str | None]:
    """The items a table of at most :data:`MAX_ROWS` rows shows (``rows_each`` rows per item), and the
    caption that counts the others (None when all are shown)."""
    shown = max(1, MAX_ROWS // rows_each)
    if len(items) <= shown:
        return items, None
    return items[:shown], f"... and {len(items) - shown:,} more {noun} (--json shows them all)"


def table(title: str, columns: dict[str, str], **kwargs) -> Table:
    """A table of ``columns`` (name -> ``"left"`` or ``"right"``); left columns (names, labels) fold
    rather than cut a long value, so a cell name is shown whole."""
    out = Table(title=title, **kwargs)
    for name, justify in columns.items():
        out.add_column(name, justify=justify, overflow="fold" if justify == "left" else "ellipsis")
    return out


def progress(*columns: ProgressColumn, disable: bool = False) -> Progress:
    """A transient progress display on stderr, its description plain text; drawn only on a terminal."""
    return Progress(TextColumn("{task.description}", markup=False), *(columns or (BarColumn(),)),
                    console=err_console, transient=True, disable=disable or not err_console.is_terminal)


def count(number: int, one: str, many: str) -> str:
    """``1 capacity``, ``4 capacities``: a number and its noun in the right form."""
    return f"{number:,} {one if number == 1 else many}"


#: Off a terminal, a sweep of at least this many tasks says how far it is at each tenth.
_TELL_FROM = 10


@contextlib.contextmanager
def task_progress(description: str, total: int | None, quiet: bool = False) -> Iterator:
    """Progress of a sweep's tasks, as a callback ``(done, total)``: a bar on a terminal (none when
    ``quiet``, e.g. ``--json``); without the bar, a line on stderr at each tenth of a sweep of 10
    tasks or more, so a long sweep is not silent."""
    from rich.progress import MofNCompleteColumn, TimeElapsedColumn

    told = 0

    with progress(BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=quiet) as bar:
        task = bar.add_task(description, total=total)

        def update(done: int, total: int | None = total) -> None:
            nonlocal told
            bar.update(task, completed=done, total=total)
            if bar.disable and total and total >= _TELL_FROM and done * 10 // total > told:
                told = done * 10 // total
                say(f"{description}: {done:,} of {total:,} done")

        yield update


@contextlib.contextmanager
def status(text: str) -> Iterator[None]:
    """A spinner with ``text`` while the block runs; off a terminal ``text`` is said once instead."""
    if not err_console.is_terminal:
        say(text)
        yield
        return
    with err_console.status(plain(text)):
        yield


def end_quietly_on_closed_stdout() -> typer.Exit:
    """The reader of the output has gone (``| head``): send what is left to /dev/null, end with exit 0."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
    return typer.Exit(0)


def escape_unencodable_streams() -> None:
    """Let stdout and stderr write what UTF-8 cannot encode with backslash escapes (click's and typer's own
    messages, which do not pass through these consoles, may quote such text)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")
