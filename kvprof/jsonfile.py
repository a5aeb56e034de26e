"""Strict reading of kvprof's JSON files, with errors that name the file and the place in it.

JSON as Python reads it accepts things a kvprof file must not hold: ``NaN`` and ``Infinity``,
duplicate keys (the last silently wins), numbers that overflow to infinity, and nesting deep
enough to exhaust the stack. :func:`read_json` refuses each with a located error;
:class:`JsonChecks` checks the types and ranges of a decoded document's values.

Every JSON input is read by :func:`read_bounded`: at most :data:`kvprof.limits.MAX_JSON_BYTES`
bytes, refused beyond that (an endless stream stops there).

Locations (``where``) are JSON paths such as ``classes.text_1.p`` or ``runs[2].capacity``, or the
line and column of a syntax error.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from kvprof.errors import JsonFileError
from kvprof.limits import INT64_MAX, MAX_JSON_BYTES, Bound

#: A byte-order mark some editors put before UTF-8 text; it is not part of the JSON.
_BOM = "\ufeff"


def json_safe(value):
    """``value`` with NaN and infinities as None (JSON has no such numbers), numpy scalars as Python's."""
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):  # a numpy scalar
        return json_safe(value.item())
    return value


def member(where: str | None, key: str) -> str:
    """The location of ``key`` in the object at ``where`` (None: the document itself)."""
    return f"{where}.{key}" if where else key


@dataclass(frozen=True)
class _NotANumber:
    """Stands where the decoder met ``NaN``, ``Infinity`` or ``-Infinity``, until it is located."""

    token: str


def read_json(path: str | Path, error: type[JsonFileError]) -> object:
    """The decoded JSON of ``path``.

    Raises
    ------
    error
        Not UTF-8, not JSON (located by line and column), ``NaN``/``Infinity``, a duplicate key
        (located by its JSON path), nested too deeply, or larger than :data:`~kvprof.limits.MAX_JSON_BYTES`.
    OSError
        The file cannot be read.
    """
    return parse_json(read_bounded(path, error), path, error)


def read_bounded(path: str | Path, error: type[JsonFileError]) -> bytes:
    """The bytes of the JSON input ``path``, read once (a FIFO has no second reading) and at most
    :data:`~kvprof.limits.MAX_JSON_BYTES` of them: one byte more is read, no more, so an endless input
    (``/dev/zero``, a pipe) stops there.

    Raises
    ------
    error
        ``path`` holds more than the bound; the message names the file and the bound.
    OSError
        The file cannot be read.
    """
    with open(path, "rb") as handle:
        raw = handle.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise error(str(path), f"larger than {MAX_JSON_BYTES // 2**20} MiB ({MAX_JSON_BYTES:,} bytes), the most "
                               f"kvprof reads of a JSON file")
    return raw


def parse_json(raw: bytes, path: str | Path, error: type[JsonFileError]) -> object:
    """The decoded JSON of ``raw``, the bytes of ``path`` already read (for a file read once);
    refused as :func:`read_json` refuses."""
    try:
        text = raw.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as exc:
        raise error(str(path), f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    # The decoder does not say where it is, so what it cannot refuse itself is marked while
    # decoding and located afterwards: objects that repeat a key, and non-numbers.
    repeated: dict[int, str] = {}  # id of an object that repeats a key -> the first repeated key
    not_numbers: list[str] = []

    def to_dict(pairs: list[tuple[str, object]]) -> dict:
        out = {}
        for key, value in pairs:
            if key in out:
                repeated.setdefault(id(out), key)
            out[key] = value
        return out

    def not_a_number(token: str) -> _NotANumber:
        not_numbers.append(token)
        return _NotANumber(token)

    try:
        document = json.loads(text, object_pairs_hook=to_dict, parse_constant=not_a_number)
    except RecursionError:
        raise error(str(path), "nested too deeply to be a kvprof file") from None
    except json.JSONDecodeError as exc:
        raise error(str(path), f"not valid JSON: {exc.msg}", f"line {exc.lineno}, column {exc.colno}") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise error(str(path), f"not valid JSON ({exc})") from None
    if repeated or not_numbers:
        for where, value in _values(document):
            if type(value) is _NotANumber:
                raise error(str(path), f"{value.token} is not a JSON number", where)
            if type(value) is dict and id(value) in repeated:
                key = repeated[id(value)]
                raise error(str(path), f"the key {key!r} appears twice in one object", member(where, key))
    return document


def _values(document: object) -> Iterator[tuple[str | None, object]]:
    """Every value of a decoded document and its location, in document order (an object before its members).

    Iterative, so that it works at any depth the decoder accepted.
    """
    pending: list[tuple[object, str | None]] = [(document, None)]
    while pending:
        value, where = pending.pop()
        yield where, value
        if type(value) is dict:
            pending.extend((child, member(where, key)) for key, child in reversed(value.items()))
        elif type(value) is list:
            pending.extend((value[i], f"{where or ''}[{i}]") for i in reversed(range(len(value))))


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

    def fields(self, value, where: str | None, *, required=(), optional=()) -> dict:
        """``value`` if it is an object with every key of ``required`` and no keys but those and ``optional``."""
        self.mapping(value, where)
        self.known_keys(value, where, (*required, *optional))
        for key in required:
            if key not in value:
                self.fail(member(where, key), "is missing (a required key)")
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

    def one_of(self, value, where: str, options: tuple[str, ...]) -> str:
        if type(value) is not str or value not in options:
            self.fail(where, f"must be one of {', '.join(options)}, got {_describe(value)}")
        return value

    def boolean(self, value, where: str) -> bool:
        if type(value) is not bool:
            self.fail(where, f"must be true or false, got {_describe(value)}")
        return value

    def bounded(self, value, where: str, bound: Bound, *, null: bool = False):
        """``value`` if ``bound`` (:class:`kvprof.limits.Bound`) accepts it (or it is null and ``null``)."""
        if value is None and null:
            return None
        if not bound.accepts(value):
            self.fail(where, f"must be {bound.describe()}{' or null' if null else ''}, got {_describe(value)}")
        return value

    def integer(self, value, where: str, *, low: int = 0, high: int = INT64_MAX, null: bool = False) -> int | None:
        return self.bounded(value, where, Bound(low, high, whole=True), null=null)

    def number(self, value, where: str, *, low: float = 0.0, high: float = math.inf, null: bool = False) -> float | None:
        return self.bounded(value, where, Bound(low, high), null=null)

    def known_keys(self, value: dict, where: str | None, allowed) -> None:
        """Refuse the first key of ``value`` (sorted) that is not in ``allowed``, at that key's location."""
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            self.fail(member(where, unknown[0]), f"unknown key {unknown[0]!r} (known: {', '.join(allowed)})")


def _describe(value) -> str:
    """Type and a bounded repr (deep, long or huge values are abbreviated)."""
    if value is None:
        return "null"
    return f"{type(value).__name__} {reprlib.repr(value)}"
