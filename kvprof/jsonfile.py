"""Strict reading of kvprof's JSON files, with errors that name the file and the place in it.

JSON as Python reads it accepts things a kvprof file must not hold: ``NaN`` and ``Infinity``,
duplicate keys (the last silently wins), numbers that overflow to infinity, and nesting deep
enough to exhaust the stack. :func:`read_json` refuses each with a located error;
:class:`JsonChecks` checks the types and ranges of a decoded document's values.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from kvprof.errors import JsonFileError

#: Largest integer kvprof stores (numpy int64).
INT64_MAX = 2**63 - 1


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def read_json(path: str | Path, error: type[JsonFileError]) -> object:
    """The decoded JSON of ``path``.

    Raises
    ------
    error
        Not UTF-8, not JSON, ``NaN``/``Infinity``, a duplicate key, or nested too deeply.
    OSError
        The file cannot be read.
    """
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(str(path), f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Duplicate as exc:
        raise error(str(path), str(exc)) from None
    except RecursionError:
        raise error(str(path), "nested too deeply to be a kvprof file") from None
    except ValueError as exc:  # JSONDecodeError, NaN and Infinity
        raise error(str(path), f"not valid JSON ({exc})") from None


@dataclass(frozen=True)
class JsonChecks:
    """Type and range checks on the values of one decoded document.

    Every check returns the value when it is acceptable and otherwise raises
    ``error(path, message, where)``, ``where`` being the JSON location (``runs[2].capacity``).
    Integers are JSON integers (``true`` and ``3.0`` are not); numbers are finite.
    """

    path: str
    error: type[JsonFileError]

    def fail(self, where: str | None, message: str) -> NoReturn:
        raise self.error(self.path, message, where)

    def mapping(self, value, where: str | None) -> dict:
        if type(value) is not dict:
            self.fail(where, f"must be an object, got {_describe(value)}")
        return value

    def sequence(self, value, where: str, *, empty: bool = True) -> list:
        if type(value) is not list:
            self.fail(where, f"must be a list, got {_describe(value)}")
        if not value and not empty:
            self.fail(where, "must not be empty")
        return value

    def string(self, value, where: str) -> str:
        if type(value) is not str or not value:
            self.fail(where, f"must be a non-empty string, got {_describe(value)}")
        return value

    def boolean(self, value, where: str) -> bool:
        if type(value) is not bool:
            self.fail(where, f"must be true or false, got {_describe(value)}")
        return value

    def integer(self, value, where: str, *, low: int = 0, high: int = INT64_MAX, null: bool = False) -> int | None:
        if value is None and null:
            return None
        if type(value) is not int or not low <= value <= high:
            self.fail(where, f"must be an integer from {low} to {high}{' or null' if null else ''}, "
                             f"got {_describe(value)}")
        return value

    def number(self, value, where: str, *, low: float = 0.0, high: float = math.inf, null: bool = False) -> float | None:
        if value is None and null:
            return None
        if type(value) not in (int, float) or not (math.isfinite(value) and low <= value <= high):
            bounds = f">= {low:g}" if high == math.inf else f"from {low:g} to {high:g}"
            self.fail(where, f"must be a finite number {bounds}{' or null' if null else ''}, got {_describe(value)}")
        return value

    def known_keys(self, value: dict, where: str | None, allowed) -> None:
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            self.fail(where, f"unknown key {unknown[0]!r} (known: {', '.join(allowed)})")


def _describe(value) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
