"""What every command shares: error handling with the documented exit codes, consoles, JSON output."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable

import typer
from rich.console import Console

from kvprof.errors import KvprofError

#: Tables and progress go to stdout; messages and errors to stderr.
console = Console()
err_console = Console(stderr=True)

EXIT_DATA_ERROR = 1
EXIT_USAGE_ERROR = 2


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
