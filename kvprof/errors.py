"""Errors that carry where bad input was found, so every front end can say what and where."""

from __future__ import annotations


class KvprofError(Exception):
    """Base class: a problem with the user's input or configuration (CLI exit code 1)."""


class TraceError(KvprofError):
    """A trace line that cannot be used.

    The message always names the file and, where known, the 1-based line and the field.
    """

    def __init__(self, path: str, message: str, line: int | None = None, field: str | None = None):
        self.path = path
        self.line = line
        self.field = field
        self.reason = message
        where = str(path)
        if line is not None:
            where += f", line {line}"
        if field is not None:
            where += f", field '{field}'"
        super().__init__(f"{where}: {message}")


class JsonFileError(KvprofError):
    """A JSON file that cannot be used; the message names the file and the JSON location."""

    def __init__(self, path: str, message: str, where: str | None = None):
        self.path = path
        self.where = where
        self.reason = message
        loc = str(path) + (f", at {where}" if where else "")
        super().__init__(f"{loc}: {message}")


class HpFileError(JsonFileError):
    """A hyperparameter file that cannot be loaded; the message names the file and the JSON path."""


class ResultsFileError(JsonFileError):
    """A results file (``kvprof.results/1``) that cannot be read; the message names the file and the JSON path."""


class CostFileError(JsonFileError):
    """A cost-model file (``kvprof.cost/1``) that cannot be read; the message names the file and the JSON path."""


class ParallelError(KvprofError):
    """Tasks that cannot be run as asked: no workers (``n_jobs`` 0), or a Ray cluster that is not
    installed or does not answer (CLI exit code 1; 2 from the ``--ray`` option)."""
