"""Trace lines parsed into column buffers: decoding and the checks that need the decoded record.

Each line is decoded by orjson, or by :func:`json.loads` where the two could differ (see
:func:`_fast_decode`: a line orjson refuses, a number beyond 64 bits, and any line the checks
refuse, so errors and values are json's). A record is checked for what needs it (an object, no
repeated key, the format's required fields with strict JSON types, ``stop`` a string where given,
the hint fields of :mod:`kvprof.models.hints` where given, one format per file) and its scalars go to per-column buffers (:class:`Rows`), its hash ids to one
growing int64 buffer, so no list of records is ever kept. Checks on values run later, vectorised (:mod:`kvprof.profiler.value_checks`).
"""

from __future__ import annotations

import json
import operator
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import orjson

from kvprof.models.finish import FINISH_FIELD
from kvprof.models.hints import CONTRADICTION, HINT_FIELDS, RELEASE_FIELD, RETAIN_FIELD, hint_problem

#: Fields each format requires, with the JSON types they may have.
_INT, _NUMBER, _STR, _INT_LIST = "an integer", "a number", "a string", "a list of integers"
_ALLOWED_TYPES = {_INT: (int,), _NUMBER: (int, float), _STR: (str,), _INT_LIST: (list,)}
_REQUIRED = {
    "bailian": {
        "chat_id": _INT,
        "parent_chat_id": _INT,
        "timestamp": _NUMBER,
        "input_length": _INT,
        "output_length": _INT,
        "type": _STR,
        "turn": _INT,
        "hash_ids": _INT_LIST,
    },
    "mooncake": {"timestamp": _NUMBER, "input_length": _INT, "output_length": _INT, "hash_ids": _INT_LIST},
}
#: Optional list fields a record may have (a vLLM recording writes them, :mod:`kvprof.recording`), kept in
#: ``Trace.extra`` as object columns of arrays (None where a record has none): the ids of the blocks a
#: response filled, in depth order from the prompt's last full block on (the same id space as
#: ``hash_ids``: a later prompt that sends the response back names them), and the times (seconds, the
#: timestamps' clock) at which the server gave the request each block it took after its first ones,
#: while it decoded (and any later prefill chunk).
OUTPUT_HASH_IDS, GROWN = "output_hash_ids", "grown"
LIST_FIELDS = {OUTPUT_HASH_IDS: _INT_LIST, GROWN: "a list of numbers of seconds"}
#: Fields whose presence marks a Bailian record.
_SESSION_FIELDS = ("chat_id", "type", "turn")
#: Timestamp units per second.
_TIME_UNITS = {"bailian": 1, "mooncake": 1000}

_INT64_MIN, _INT64_END = -(2**63), 2**63


def detect_format(record: dict) -> str:
    """``"bailian"`` if the record has any session field (chat_id, type, turn), else ``"mooncake"``."""
    return "bailian" if any(key in record for key in _SESSION_FIELDS) else "mooncake"

def required_fields(format: str) -> tuple[str, ...]:
    """The fields every record of ``format`` has."""
    return tuple(_REQUIRED[format])


@dataclass
class Problem:
    """One invalid line."""

    kind: str
    line: int
    field: str | None
    message: str


class Rows:
    """Growing column buffers for the records parsed so far, in file order.

    The integer fields of a record go to one row-major buffer in a single call (then split into
    columns by :meth:`arrays`); timestamps stay in the file's unit until then. Extra fields are
    stored sparsely (row numbers and values) because most lines may lack them.
    """

    def __init__(self, fmt: str, first_line: int, detected: bool):
        self.format = fmt
        self.first_line = first_line
        #: Lines of the other format are errors only when the first line chose the format.
        self.detected = detected
        self._check_sessions = detected and fmt == "mooncake"
        self.required = _REQUIRED[fmt]
        self.int_fields = tuple(name for name, kind in self.required.items() if kind is _INT)
        self._get_ints = operator.itemgetter(*self.int_fields)
        self._int_types = (int,) * len(self.int_fields)
        self._has_type = "type" in self.required
        self.line = array("q")
        self.ints = array("q")
        self.timestamp = array("d")
        self.type_code = array("i")
        self.type_index: dict[str, int] = {}
        self.n_hash_ids = array("q")
        self.hash_ids = array("q")
        self.extra: dict[str, tuple[array, list]] = {}
        self.ignored_fields: set[str] = set()

    def __len__(self) -> int:
        return len(self.line)

    def append(self, line_no: int, record: dict, has_bool: bool) -> Problem | None:
        """Add one decoded record, or return why it is invalid (then nothing is added)."""
        # Fast path: plain lookups and one type comparison; anything unusual goes to _diagnose.
        try:
            ints = self._get_ints(record)
            timestamp = record["timestamp"]
            hash_ids = record["hash_ids"]
            type_name = record["type"] if self._has_type else ""
        except KeyError:
            return self._diagnose(line_no, record)
        if (
            tuple(map(type, ints)) != self._int_types
            or type(timestamp) not in (float, int)
            or type(hash_ids) is not list
            or type(type_name) is not str
        ):
            return self._diagnose(line_no, record)
        if self._check_sessions and len(record) > len(self.required):
            problem = self._other_format(line_no, record)
            if problem is not None:
                return problem
        finish = record.get(FINISH_FIELD)
        if finish is not None and type(finish) is not str:
            return Problem("wrong_type", line_no, FINISH_FIELD, f"must be a string (how the response ended: "
                                                                f"tool_use, end_turn, ...) or null, got {_describe(finish)}")
        if len(record) > len(self.required):
            problem = _hint_problem(line_no, record) or _list_problem(line_no, record)
            if problem is not None:
                return problem
        n_ints, n_times = len(self.ints), len(self.timestamp)
        try:
            self.ints.extend(ints)
            self.timestamp.append(timestamp)
        except OverflowError:
            del self.ints[n_ints:], self.timestamp[n_times:]
            return self._diagnose(line_no, record)
        problem = self._append_hash_ids(line_no, hash_ids, has_bool)
        if problem is not None:
            del self.ints[n_ints:], self.timestamp[n_times:]
            return problem
        self.line.append(line_no)
        if self._has_type:
            self.type_code.append(self.type_index.setdefault(type_name, len(self.type_index)))
        if len(record) > len(self.required):
            self._append_extra(record)
        return None

    def _other_format(self, line_no: int, record: dict) -> Problem | None:
        """A ``mixed_format`` problem when the record is of the other format than the detected one."""
        other = detect_format(record)
        if not self.detected or other == self.format:
            return None
        message = (f"a {other} record in a file whose line {self.first_line} is {self.format} "
                   f"(pass --format to read every line as one format)")
        return Problem("mixed_format", line_no, None, message)

    def _diagnose(self, line_no: int, record: dict) -> Problem:
        """Why the fast path refused a record: the other format, or the first missing, mistyped or oversized field."""
        problem = self._other_format(line_no, record)
        if problem is not None:
            return problem
        for name, expected in self.required.items():
            value = record.get(name, _MISSING)
            if value is _MISSING:
                return Problem("missing_field", line_no, name, f"required field '{name}' is missing")
            if type(value) not in _ALLOWED_TYPES[expected]:
                return Problem("wrong_type", line_no, name, f"must be {expected}, got {_describe(value)}")
            if type(value) is int and not _INT64_MIN <= value < _INT64_END:
                return Problem("bad_value", line_no, name, f"{value} does not fit in 64 bits")
        raise AssertionError(f"line {line_no} was refused without a reason")

    def _append_hash_ids(self, line_no: int, hash_ids: list, has_bool: bool) -> Problem | None:
        start = len(self.hash_ids)
        try:
            self.hash_ids.extend(hash_ids)
        except TypeError:
            del self.hash_ids[start:]  # extend stops part-way
            bad = next(h for h in hash_ids if type(h) is not int)
            return Problem("wrong_type", line_no, "hash_ids", f"must be {_INT_LIST}, holds {_describe(bad)}")
        except OverflowError:
            del self.hash_ids[start:]
            bad = next(h for h in hash_ids if not _INT64_MIN <= h < _INT64_END)
            return Problem("bad_value", line_no, "hash_ids", f"hash id {bad} does not fit in 64 bits")
        # array('q') takes True as 1; look for bools only on the rare lines that spell one.
        if has_bool and any(type(h) is bool for h in hash_ids):
            del self.hash_ids[start:]
            return Problem("wrong_type", line_no, "hash_ids", f"must be {_INT_LIST}, holds a boolean")
        self.n_hash_ids.append(len(hash_ids))
        return None

    def _append_extra(self, record: dict) -> None:
        row = len(self.line) - 1
        for name, value in record.items():
            if name in self.required or value is None:
                continue
            if name in LIST_FIELDS:
                value = np.array(value, dtype=np.int64 if name == OUTPUT_HASH_IDS else np.float64)
            elif isinstance(value, (list, dict)):
                self.ignored_fields.add(name)
                continue
            rows, values = self.extra.setdefault(name, (array("q"), []))
            rows.append(row)
            values.append(value)

    def arrays(self) -> dict[str, np.ndarray]:
        """The numeric columns as numpy arrays (file order; timestamps in seconds)."""
        n = len(self)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(self.n_hash_ids, dtype=np.int64), out=offsets[1:])
        ints = np.frombuffer(self.ints, dtype=np.int64).reshape(n, len(self.int_fields))
        columns = {name: np.ascontiguousarray(ints[:, j]) for j, name in enumerate(self.int_fields)}
        columns.update(
            line=np.frombuffer(self.line, dtype=np.int64),
            raw_timestamp=np.frombuffer(self.timestamp, dtype=np.float64),
            hash_offsets=offsets,
            hash_ids=np.frombuffer(self.hash_ids, dtype=np.int64),
        )
        columns["timestamp"] = columns["raw_timestamp"] / _TIME_UNITS[self.format]
        if self._has_type:
            columns["type_code"] = np.frombuffer(self.type_code, dtype=np.int32)
        else:
            columns["chat_id"] = np.arange(n, dtype=np.int64)
            columns["parent_chat_id"] = np.full(n, -1, dtype=np.int64)
            columns["turn"] = np.ones(n, dtype=np.int64)
            columns["type_code"] = np.zeros(n, dtype=np.int32)
        return columns

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(self.type_index) if self._has_type else ("",)

    def extra_columns(self) -> dict[str, np.ndarray]:
        """Extra scalar fields as arrays of shape (n,) (see the module notes for the dtypes)."""
        return {name: _extra_column(len(self), rows, values) for name, (rows, values) in self.extra.items()}


_MISSING = object()


def _hint_problem(line_no: int, record: dict) -> Problem | None:
    """The first of the record's hint fields (:mod:`kvprof.models.hints`) that is not a valid value."""
    for name in HINT_FIELDS:
        problem = hint_problem(name, record.get(name))
        if problem is not None:
            return Problem(problem[0], line_no, name, problem[1])
    if record.get(RELEASE_FIELD) and (record.get(RETAIN_FIELD) or 0) > 0:
        return Problem("bad_value", line_no, RELEASE_FIELD, CONTRADICTION)
    return None


def _list_problem(line_no: int, record: dict) -> Problem | None:
    """The first of the record's list fields (:data:`LIST_FIELDS`) that is not a valid value."""
    for name, expected in LIST_FIELDS.items():
        value = record.get(name)
        if value is None:
            continue
        if type(value) is not list:
            return Problem("wrong_type", line_no, name, f"must be {expected}, got {_describe(value)}")
        allowed = (int,) if name == OUTPUT_HASH_IDS else (int, float)
        bad = next((v for v in value if type(v) not in allowed), _MISSING)
        if bad is not _MISSING:
            return Problem("wrong_type", line_no, name, f"must be {expected}, holds {_describe(bad)}")
        if name == OUTPUT_HASH_IDS:
            bad = next((v for v in value if not _INT64_MIN <= v < _INT64_END), _MISSING)
            if bad is not _MISSING:
                return Problem("bad_value", line_no, name, f"hash id {bad} does not fit in 64 bits")
        else:
            bad = next((v for v in value if not 0 <= v < 2**43), _MISSING)  # NaN fails both
            if bad is not _MISSING:
                return Problem("bad_value", line_no, name, f"times must be finite seconds >= 0, holds {bad!r}")
    return None


def _describe(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r:.40}"


def _extra_column(n: int, rows: array, values: list) -> np.ndarray:
    kinds = {type(v) for v in values}
    if len(values) == n and len(kinds) == 1 and kinds <= {bool, int, float}:
        dtype = {bool: np.bool_, int: np.int64, float: np.float64}[kinds.pop()]
        try:
            return np.array(values, dtype=dtype)
        except OverflowError:  # ints beyond 64 bits stay Python ints
            pass
    elif len(values) == n and kinds == {int, float}:
        return np.array(values, dtype=np.float64)
    column = np.full(n, None, dtype=object)
    where = np.frombuffer(rows, dtype=np.int64)
    if np.ndarray in kinds:  # a list field: one array per row (numpy would read equal lengths as a 2-D block)
        for row, value in zip(where.tolist(), values):
            column[row] = value
    else:
        column[where] = values
    return column


class Parser:
    """Decodes lines into :class:`Rows`, skipping invalid ones or stopping at the first."""

    def __init__(self, fmt: str | None, skip_invalid: bool):
        self._format = fmt
        self._skip_invalid = skip_invalid
        self.lines = 0  # non-blank lines read
        self.skipped: dict[str, int] = {}  # invalid lines skipped, by kind (with skip_invalid)
        self.rows: Rows | None = None  # created by the first JSON object (it sets the format)
        self.problem: Problem | None = None  # the line parsing stopped at (without skip_invalid)

    def parse(self, lines: Iterator[tuple[int, bytes]]) -> None:
        for line_no, line in lines:
            self.lines += 1
            record = _fast_decode(line)
            problem = None if record is None else self._add(line_no, line, record)
            if record is None or problem is not None:  # json decides: its values, its errors
                problem = self._decode(line_no, line)
            if problem is not None:
                if not self._skip_invalid:
                    self.problem = problem
                    return
                count_skipped(self.skipped, problem.kind)

    def _decode(self, line_no: int, line: bytes) -> Problem | None:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and bad UTF-8
            return Problem("malformed_json", line_no, None, f"not valid JSON ({exc})")
        return self._add(line_no, line, record)

    def _add(self, line_no: int, line: bytes, record) -> Problem | None:
        if type(record) is not dict:
            message = f"a record must be a JSON object, got {_describe(record)}"
            return Problem("malformed_json", line_no, None, message)
        if _may_repeat_a_key(line, len(record)):
            key = _repeated_key(line)
            if key is not None:
                return Problem("malformed_json", line_no, key,
                                "the key appears twice in the line (a JSON object's keys must be unique)")
        if self.rows is None:
            self.rows = Rows(self._format or detect_format(record), line_no, detected=self._format is None)
        return self.rows.append(line_no, record, has_bool=b"true" in line or b"false" in line)


def _fast_decode(line: bytes):
    """The line decoded by orjson (several times faster than json), or None where json must
    decide: what orjson refuses (json also reads NaN and lone surrogates), and a record with a
    number at the top beyond 64 bits (an integer orjson turned into a float). A record the checks
    refuse is decoded again by json too, so errors and values are json's wherever they differ."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if type(record) is dict and any(type(v) is float and not -_INT64_END <= v < _INT64_END for v in record.values()):
        return None
    return record


#: What ends a key: its closing quote, blanks, the colon (string values hold it too, rarely).
_KEY_END = re.compile(rb'"[ \t\r\n]*:')


def _may_repeat_a_key(line: bytes, n_keys: int) -> bool:
    """Whether a line that decoded to an object of ``n_keys`` keys may have repeated one (both decoders
    keep the last value silently).

    Every key ends in a quote, maybe blanks, and a colon: as many colons as keys (almost every line)
    rule a repeat out, and failing that (a colon in a value) as many key ends. More (a nested
    object, a quote and a colon in a value, or a repeated key) are left to :func:`_repeated_key`.
    """
    return line.count(b":") > n_keys and len(_KEY_END.findall(line)) > n_keys


def _repeated_key(line: bytes) -> str | None:
    """The first key an object of ``line`` repeats, or None (also when json cannot read the line)."""
    repeated: list[str] = []

    def pairs(items: list) -> dict:
        seen = set()
        for key, _ in items:
            if key in seen:
                repeated.append(key)
            seen.add(key)
        return dict(items)

    try:
        json.loads(line, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    return repeated[0] if repeated else None


def count_skipped(skipped: dict[str, int], kind: str, n: int = 1) -> None:
    """Count ``n`` more lines skipped as ``kind``."""
    skipped[kind] = skipped.get(kind, 0) + n
