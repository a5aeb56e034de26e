"""Read Bailian and Mooncake JSONL traces into a columnar :class:`~kvprof.profiler.trace.Trace`.

Reading is one streaming pass. Each line is decoded with :func:`json.loads`; its scalars go to
per-column buffers and its hash ids to one growing int64 buffer, so no list of records is ever
kept. Checks that need the decoded record (valid JSON, required fields, types) run per line;
checks on values (ranges, hash-list lengths, time order, parents) run vectorised once the file is
parsed, and only then is the offending line looked up for the message.

Decisions worth knowing (the README documents them):

* Check order. A line with several problems counts once, under the first of: ``malformed_json``,
  ``mixed_format``, ``missing_field``, ``wrong_type``, ``bad_value``, ``hash_length``,
  ``timestamp_backwards``, ``duplicate_chat_id``, ``unknown_parent``. Without ``skip_invalid`` the
  error is the earliest bad line of the file.
* One format per file. When the format is detected (not forced), a later line of the other format
  (a Mooncake line in a Bailian file: none of chat_id, type, turn; a Bailian line in a Mooncake
  file: any of them) is a ``mixed_format`` error at that line, not a record read the wrong way.
* Types are strict JSON types: integers must be JSON integers (``3.0`` and ``true`` are not),
  timestamps may be integers or floats, ``type`` is a string, ``hash_ids`` a list of integers.
  A key repeated in a line is a ``malformed_json`` error of that line (the decoder would keep the
  last value silently); lines are checked for it only when they hold more colons than keys.
* Values: timestamps finite, >= 0 and below 2**43 seconds (beyond it a float no longer holds a
  time to the millisecond, and one absurd timestamp would make every later line look out of order), lengths
  and hash ids >= 0, ``chat_id`` >= 0, ``parent_chat_id`` -1 or >= 0, ``turn`` from 1 to
  2**31 - 1; integers beyond 64 bits are bad values too. All of these are errors of their own line.
* ``chat_id`` is unique: a later line repeating one is a ``duplicate_chat_id`` (a parent naming it
  would be ambiguous).
* Time order: a timestamp may fall up to ``time_tolerance`` seconds below the largest earlier one
  (logging jitter); the rows are then stably sorted by time. Further back is an error.
* Parents: a ``parent_chat_id`` other than -1 must be the ``chat_id`` of an earlier (kept) line.
* Compression is detected from the first bytes: gzip, or zstd (also when the file starts with a
  skippable frame, as ``pzstd`` writes).
* Streams: a FIFO or a character device is read as it arrives (no progress total); one that closes
  without a line is an error saying nothing arrived.
* Extra fields: any other scalar field becomes a column of ``Trace.extra``: bool, int64, float64
  (also for ints mixed with floats) or an object array of str when every request has it with one
  kind; otherwise an object array holding ``None`` where the field is missing or ``null``. List or object values are not kept; the field
  names are listed in ``ReadReport.ignored_fields``.
* Mooncake rows get ``chat_id`` = their row in the returned (time-sorted, unwindowed) trace,
  ``parent_chat_id`` -1, type ``""`` and turn 1; millisecond timestamps become seconds before the
  time-order check, so ``time_tolerance`` is in seconds for both formats.
* Window: without ``window`` the trace covers ``[floor(first timestamp), inf)``, so a slice of a
  longer trace keeps its own origin; with one, the validated trace is cut with
  :meth:`Trace.time_window` and reuse is censored at its end. A negative bound counts back from
  the last arrival (``(-3600, None)``: the last hour).
* Recordings: a directory written by ``vllm serve --kv-record`` (:mod:`kvprof.recording`) is read
  as one trace: its files in write order (of the first chat id each name holds, whatever the
  clock said), as if concatenated (errors name the file and its own line), at the recording's
  block size, one file open at a time, each request with its data-parallel ``rank``. Lines are
  written when requests finish, so they are sorted by arrival whatever their order. A still-open
  ``.part`` file (a running or killed server) may end inside a zstd frame or a line: an
  unfinished line is counted as ``truncated``, a cut frame in ``cut_frames``, never an error; a
  ``.part`` renamed since the listing is read finished; an empty finished file is an error.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import json
import math
import operator
import os
import re
import stat
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import orjson
import zstandard

from kvprof.errors import TraceError
from kvprof.profiler.trace import FORMAT_BLOCK_SIZE, Trace
from kvprof.recording import CHAT_IDS_PER_START, Recording, RecordingError, load_recording, trace_files

__all__ = ["SKIP_KINDS", "ReadReport", "detect_format", "peek_format", "read_trace", "required_fields"]

#: Kinds of invalid line, in the order they are checked; ``ReadReport.skipped`` is keyed by these.
SKIP_KINDS = (
    "malformed_json",
    "mixed_format",
    "missing_field",
    "wrong_type",
    "bad_value",
    "hash_length",
    "timestamp_backwards",
    "duplicate_chat_id",
    "unknown_parent",
)
#: Lines lost at the end of a recording's still-open file (not an error, always counted).
TRUNCATED = "truncated"

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
#: Fields whose presence marks a Bailian record.
_SESSION_FIELDS = ("chat_id", "type", "turn")
#: Timestamp units per second.
_TIME_UNITS = {"bailian": 1, "mooncake": 1000}

_INT64_MIN, _INT64_END = -(2**63), 2**63
#: Timestamps stop here, in seconds (2**43 s, about 278,000 years): below it a float holds a time to the
#: millisecond (Bailian's seconds, Mooncake's milliseconds once converted); beyond it gaps are quantised.
_TIMESTAMP_END_S = 2.0**43
_INT32_MAX = 2**31 - 1
_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}
#: A zstd skippable frame (what pzstd writes first) starts with 0x184D2A5? little-endian.
_SKIPPABLE_END = b"\x2a\x4d\x18"
#: Bytes read at a time (zstd input is read in smaller pieces: it may expand 20-fold), and stored
#: bytes between progress calls.
_CHUNK_BYTES = 4 << 20
_ZSTD_INPUT_BYTES = 256 << 10
_PROGRESS_BYTES = 4 << 20


@dataclass
class ReadReport:
    """What :func:`read_trace` read, kept and skipped.

    Attributes
    ----------
    lines : int
        Non-blank lines read.
    requests : int
        Requests in the returned trace (after the window).
    skipped : dict of str to int
        Invalid lines skipped (only with ``skip_invalid``), by kind (see :data:`SKIP_KINDS`).
    outside_window : int
        Valid requests left out because they arrive outside the window.
    ignored_fields : tuple of str
        Fields that held a list or an object on some line; those values are not kept.
    truncated : int
        Unfinished last lines of a recording's still-open (``.part``) files.
    cut_frames : int
        Of those files, the ones that end inside an unfinished zstd frame: the requests it held
        (up to one flush interval's, 2 s) are lost, how many no file tells.
    missing : int
        Lines ``recording.json`` counts as written (``written``, saved with every closed frame)
        that no file held: frames cut or lost after they were counted.
    recording : Recording or None
        The recording's ``recording.json`` when ``path`` was a recording directory.
    """

    lines: int = 0
    requests: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    outside_window: int = 0
    ignored_fields: tuple[str, ...] = ()
    truncated: int = 0
    cut_frames: int = 0
    missing: int = 0
    recording: Recording | None = None

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())


def read_trace(
    path,
    *,
    format: str | None = None,
    block_size: int | None = None,
    window: tuple[float | None, float | None] | None = None,
    skip_invalid: bool = False,
    progress: Callable[[int, int], None] | None = None,
    time_tolerance: float = 1e-3,
    rank: int | None = None,
    earlier_chat_ids: np.ndarray | None = None,
) -> tuple[Trace, ReadReport]:
    """Read a Bailian or Mooncake JSONL trace (plain, gzip or zstd) into a :class:`Trace`.

    Parameters
    ----------
    path : str or Path
        The trace file. Compression is detected from the first bytes, not the suffix.
    format : {"bailian", "mooncake"} or None
        Force the format; None detects it from the first JSON object (Bailian records have
        ``chat_id``, ``type`` or ``turn``).
    block_size : int or None
        Tokens per hash id; None takes the format's (16 for Bailian, 512 for Mooncake). Every
        request must have ``ceil(input_length / block_size)`` hash ids.
    window : (start, end) or None
        Keep requests arriving in ``[start, end)`` seconds; either side may be None (open).
    skip_invalid : bool
        Skip invalid lines and count them in the report instead of raising.
    progress : callable(bytes_done, bytes_total) or None
        Called every few MB of the stored file and once at the end.
    time_tolerance : float
        Seconds a timestamp may fall below an earlier line's before it is an error.
    rank : int or None
        Of a recording of several data-parallel ranks, keep only this rank's requests (None: the
        fleet's, each with its ``rank`` in ``Trace.extra``).
    earlier_chat_ids : sorted int64 array or None
        Chat ids of earlier files of one trace read file by file: a parent may be one of them, a
        chat id may not repeat one.

    Returns
    -------
    trace : Trace
        Sorted by arrival time, timestamps in seconds.
    report : ReadReport

    Raises
    ------
    TraceError
        On an invalid line (unless ``skip_invalid``), an undecodable file, a file without
        requests, or a window without requests; the message names the file, line and field.
    ValueError
        On invalid arguments.
    OSError
        When the file cannot be opened or read.
    """
    _check_arguments(format, block_size, window, time_tolerance)
    name = str(path)
    report = ReadReport()
    files = [(path, False)]
    if Path(path).is_dir():
        if format not in (None, "bailian"):
            raise TraceError(name, f"a recording is Bailian-style JSONL (timestamps in seconds), not {format}")
        report.recording, files = _recording(path, block_size)
        block_size, time_tolerance = report.recording.block_size, math.inf
    with _StoredFiles(files, progress, recording=report.recording is not None) as stored:
        parser = _Parser(format, skip_invalid, report)
        parser.parse(stored.lines())
        report.truncated, report.cut_frames = stored.truncated, stored.cut_frames
        rows = parser.rows
        if rows is None:
            raise stored.error(parser.problem) if parser.problem else _no_requests(name, report, stored.is_stream)
        size = block_size or FORMAT_BLOCK_SIZE[rows.format]
        columns = rows.arrays()
        earlier = np.zeros(0, np.int64) if earlier_chat_ids is None else earlier_chat_ids
        keep = _validate(stored, columns, size, time_tolerance, skip_invalid, report, parser.problem, earlier)
        sha256 = stored.sha256()
    if not keep.any():
        raise _no_requests(name, report, False)
    trace = _build_trace(rows, columns, keep, size, source=Path(path).name, sha256=sha256)
    if report.recording is not None:
        trace = _with_ranks(name, trace, report.recording, rank, report)
    elif rank is not None:
        raise TraceError(name, "--rank selects one data-parallel rank of a vLLM recording; this is a trace file")
    report.ignored_fields = tuple(sorted(rows.ignored_fields))
    if window is not None:
        trace = _cut_window(name, trace, window, report)
    report.requests = trace.n_requests
    return trace, report


def _recording(path, block_size: int | None) -> tuple[Recording, list[tuple[Path, bool]]]:
    """A recording directory's ``recording.json`` and trace files (each with whether it is still open)."""
    try:
        recording = load_recording(path)
    except RecordingError as exc:
        raise TraceError(exc.path, exc.reason if exc.where is None else f"at {exc.where}: {exc.reason}") from None
    if block_size is not None and block_size != recording.block_size:
        raise TraceError(str(path), f"the recording's hash ids are {recording.block_size}-token blocks "
                                    f"(recording.json), not {block_size}: leave out the trace's block size")
    files = trace_files(path)
    if not files:
        raise TraceError(str(path), "the recording holds no trace files yet (the server writes its first "
                                    "when a request finishes)")
    return recording, files


def _with_ranks(name: str, trace: Trace, recording: Recording, rank: int | None, report: ReadReport) -> Trace:
    """The recording's trace with the data-parallel rank of each request (its start's) in ``extra``;
    only ``rank``'s requests when it is not None. Counts ``report.missing``."""
    start_rank = np.array([s.rank for s in recording.starts], dtype=np.int64)
    start = trace.chat_id // CHAT_IDS_PER_START
    if start.max() >= start_rank.size:
        i = int(np.argmax(start >= start_rank.size))
        raise TraceError(name, f"chat_id {int(trace.chat_id[i])} belongs to no start of recording.json "
                               f"({start_rank.size} start(s)): a line was written by another recording")
    ranks = start_rank[start]
    trace = replace(trace, extra={**trace.extra, "rank": ranks})
    read = np.bincount(start, minlength=start_rank.size)
    report.missing = int(sum(max(s.written - int(n), 0) for s, n in zip(recording.starts, read)))
    if rank is None:
        return trace
    if rank not in recording.ranks:
        raise TraceError(name, f"the recording holds no rank {rank} (ranks: "
                               f"{', '.join(map(str, recording.ranks))})")
    return _drop_unused_types(trace.select(np.flatnonzero(ranks == rank)))


def detect_format(record: dict) -> str:
    """``"bailian"`` if the record has any session field (chat_id, type, turn), else ``"mooncake"``."""
    return "bailian" if any(key in record for key in _SESSION_FIELDS) else "mooncake"


def peek_format(path) -> str | None:
    """The format :func:`read_trace` will detect, from the first line alone; None when that line does not
    tell (no line, not a JSON object, a file that cannot be read: :func:`read_trace` then says why).

    Lets a front end check options that depend on the format (block sizes) before reading a whole
    trace. Not for streams: it consumes what it reads.
    """
    try:
        with _StoredFile(path, None) as stored:
            for _, line in stored.lines():
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    return None
                return detect_format(record) if type(record) is dict else None
    except (OSError, TraceError):
        return None
    return None


def required_fields(format: str) -> tuple[str, ...]:
    """The fields every record of ``format`` has."""
    return tuple(_REQUIRED[format])


def _check_arguments(format, block_size, window, time_tolerance) -> None:
    if format is not None and format not in FORMAT_BLOCK_SIZE:
        raise ValueError(f"format {format!r} is not one of {', '.join(FORMAT_BLOCK_SIZE)}")
    if block_size is not None and (type(block_size) is not int or block_size < 1):
        raise ValueError(f"block size must be a positive integer, got {block_size!r}")
    if not (math.isfinite(time_tolerance) and time_tolerance >= 0):
        raise ValueError(f"time tolerance must be a finite number >= 0, got {time_tolerance!r}")
    if window is not None:
        lo, hi = window
        if any(v is not None and math.isnan(v) for v in (lo, hi)):
            raise ValueError(f"window {window!r} has a NaN bound")
        if lo is not None and hi is not None and hi <= lo:
            raise ValueError(f"window {window!r}: the end must be greater than the start")


def _no_requests(name: str, report: ReadReport, is_stream: bool) -> TraceError:
    if not report.lines:
        if is_stream:
            return TraceError(name, "nothing arrived: the stream closed before its first line")
        return TraceError(name, "the file holds no requests (it is empty)")
    counts = ", ".join(f"{kind}: {n}" for kind, n in report.skipped.items())
    return TraceError(name, f"no valid requests: all {report.lines} lines were skipped ({counts})")


# --- reading bytes ------------------------------------------------------------------------------


class _StoredFile:
    """A trace file read as lines, hashing and counting its stored bytes on the way."""

    def __init__(self, path, progress: Callable[[int, int], None] | None, tolerant: bool = False):
        self._name = str(path)
        #: A still-open recording file: what cannot be read at its end is counted, not an error.
        self._tolerant = tolerant
        self.truncated = 0
        self.cut = 0  # 1 when the file ends inside a zstd frame its writer never finished
        self._cut = False
        self.n_lines = 0  # lines (blank ones included) seen so far
        self._file = open(path, "rb")  # noqa: SIM115 - closed by __exit__
        info = os.fstat(self._file.fileno())
        self.is_stream = not stat.S_ISREG(info.st_mode)
        self._total = 0 if self.is_stream else info.st_size
        head = self._file.peek(4)
        self._codec = next((codec for magic, codec in _MAGIC.items() if head.startswith(magic)), None)
        if head[:1] and 0x50 <= head[0] <= 0x5F and head[1:4] == _SKIPPABLE_END:
            self._codec = "zstd"
        self._sha = hashlib.sha256()
        self._progress = progress
        self._done = self._reported = 0

    def __enter__(self) -> _StoredFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    @property
    def size(self) -> int:
        """Stored bytes read so far."""
        return self._done

    def read(self, size: int = -1) -> bytes:
        """Stored bytes (gzip reads through this too)."""
        data = self._file.read(size)
        self._sha.update(data)
        self._done += len(data)
        if self._done - self._reported >= _PROGRESS_BYTES:
            self._report_progress()
        return data

    def _report_progress(self) -> None:
        self._reported = self._done
        if self._progress is not None:
            self._progress(self._done, self._total)

    def lines(self) -> Iterator[tuple[int, bytes]]:
        """``(1-based line number, line)`` for every non-blank line of the decompressed text."""
        tail = b""
        line_no = 0  # lines before this chunk
        for chunk in self._text_chunks():
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()
            for offset, line in enumerate(lines, 1):
                if line and not line.isspace():
                    yield line_no + offset, line
            line_no += len(lines)
            self.n_lines = line_no
        partial = bool(tail) and not tail.isspace()
        if partial and not self._tolerant:
            yield line_no + 1, tail
        elif partial:  # the writer died inside this line
            self.truncated += 1
        self.cut = int(self._cut)  # or inside a frame: how many lines it held, nothing tells
        self.n_lines = line_no + partial

    def sha256(self) -> str:
        """Hex digest of every stored byte (reads whatever the decompressor left)."""
        while self.read(_CHUNK_BYTES):
            pass
        if self._reported < self._done:
            self._report_progress()
        return self._sha.hexdigest()

    def _text_chunks(self) -> Iterator[bytes]:
        """The decompressed bytes, a few MB at a time."""
        if self._codec is None:
            yield from iter(lambda: self.read(_CHUNK_BYTES), b"")
            return
        try:
            if self._codec == "gzip":
                stream = gzip.GzipFile(fileobj=self, mode="rb")
                yield from iter(lambda: stream.read(_CHUNK_BYTES), b"")
            else:
                yield from self._zstd_chunks()
        except (OSError, EOFError, zstandard.ZstdError) as exc:
            if not self._tolerant:
                raise TraceError(self._name, f"cannot decompress the {self._codec} stream: {exc}") from None
            self._cut = True  # the writer died inside a frame: at least one line is lost

    def _zstd_chunks(self) -> Iterator[bytes]:
        # One decompressobj per frame: unlike zstandard's stream reader, it tells a truncated file (no eof).
        decompressor = zstandard.ZstdDecompressor()
        frame, in_frame = decompressor.decompressobj(), False
        while data := self.read(_ZSTD_INPUT_BYTES):
            while data:
                yield frame.decompress(data)
                in_frame = not frame.eof
                if in_frame:
                    break
                data = frame.unused_data
                frame = decompressor.decompressobj()
        if in_frame:
            raise EOFError("the file ends inside a zstd frame (truncated?)")


def _size(path) -> int:
    """Stored bytes of a file (0 for a ``.part`` renamed since it was listed: progress only)."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


class _StoredFiles:
    """Several stored files read as one text, in order: lines are numbered across them, and
    :meth:`error` and :meth:`label` turn such a number back into a file and its own line.

    A single file is the common case; a recording directory is several.
    """

    def __init__(self, files: list[tuple[object, bool]], progress: Callable[[int, int], None] | None,
                 recording: bool = False):
        self._files = list(files)
        self._recording_files = recording
        self._progress = progress
        self._opened: list[_StoredFile] = []
        self._first_lines: list[int] = []  # global number of each opened file's line 1
        self._sha = hashlib.sha256() if len(files) > 1 else None
        self.truncated = 0
        self.cut_frames = 0
        self._total = sum(_size(f) for f, _ in files) if len(files) > 1 else None
        self._done = 0
        self.is_stream = False

    def __enter__(self) -> _StoredFiles:
        return self

    def __exit__(self, *exc_info) -> None:
        for stored in self._opened:
            stored.close()

    def lines(self) -> Iterator[tuple[int, bytes]]:
        offset = 0
        for k, (path, still_open) in enumerate(self._files):
            stored = self._open(k, path, still_open)
            self._first_lines.append(offset + 1)
            self.is_stream = stored.is_stream
            last = 0
            for last, line in stored.lines():
                yield offset + last, line
            self.truncated += stored.truncated
            self.cut_frames += stored.cut
            offset += stored.n_lines
            if self._sha is not None:  # several files: each closed once read (a directory may hold thousands)
                self._sha.update(bytes.fromhex(stored.sha256()))
                self._done += stored.size
                stored.close()

    def _open(self, k: int, path, still_open: bool) -> _StoredFile:
        """File ``k``, opened; a recording's ``.part`` finished (renamed) since the listing is read finished."""
        try:
            if not still_open and self._recording_files and os.stat(path).st_size == 0:
                raise TraceError(str(path), "a finished recording file is empty (a finished file holds at least "
                                            "one zstd frame: the file was truncated or replaced)")
            stored = _StoredFile(path, self._file_progress, tolerant=still_open)
        except FileNotFoundError:
            if not still_open:
                raise
            path = Path(path).with_name(Path(path).name.removesuffix(".part"))
            self._files[k] = (path, False)
            stored = _StoredFile(path, self._file_progress)
        self._opened.append(stored)
        return stored

    def _file_progress(self, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress(self._done + done, total if self._total is None else self._total)

    def sha256(self) -> str:
        """Hex digest of a single file's stored bytes; of the files' digests in order for several."""
        if self._sha is None:
            return self._opened[0].sha256()
        return self._sha.hexdigest()

    def locate(self, line: int) -> tuple[str, int]:
        """The file and its own line number of global line ``line``."""
        if len(self._files) == 1:
            return str(self._files[0][0]), line
        k = max(bisect.bisect_right(self._first_lines, line) - 1, 0)
        return str(self._files[k][0]), line - self._first_lines[k] + 1

    def label(self, line: int) -> str:
        """``line 12`` or, across several files, ``line 12 of NAME``."""
        path, own = self.locate(line)
        return f"line {own}" if len(self._files) == 1 else f"line {own} of {Path(path).name}"

    def error(self, problem: _Problem) -> TraceError:
        path, line = self.locate(problem.line)
        return TraceError(path, problem.message, line=line, field=problem.field)


# --- parsing lines ------------------------------------------------------------------------------


@dataclass
class _Problem:
    """One invalid line."""

    kind: str
    line: int
    field: str | None
    message: str


class _Rows:
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

    def append(self, line_no: int, record: dict, has_bool: bool) -> _Problem | None:
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

    def _other_format(self, line_no: int, record: dict) -> _Problem | None:
        """A ``mixed_format`` problem when the record is of the other format than the detected one."""
        other = detect_format(record)
        if not self.detected or other == self.format:
            return None
        message = (f"a {other} record in a file whose line {self.first_line} is {self.format} "
                   f"(pass --format to read every line as one format)")
        return _Problem("mixed_format", line_no, None, message)

    def _diagnose(self, line_no: int, record: dict) -> _Problem:
        """Why the fast path refused a record: the other format, or the first missing, mistyped or oversized field."""
        problem = self._other_format(line_no, record)
        if problem is not None:
            return problem
        for name, expected in self.required.items():
            value = record.get(name, _MISSING)
            if value is _MISSING:
                return _Problem("missing_field", line_no, name, f"required field '{name}' is missing")
            if type(value) not in _ALLOWED_TYPES[expected]:
                return _Problem("wrong_type", line_no, name, f"must be {expected}, got {_describe(value)}")
            if type(value) is int and not _INT64_MIN <= value < _INT64_END:
                return _Problem("bad_value", line_no, name, f"{value} does not fit in 64 bits")
        raise AssertionError(f"line {line_no} was refused without a reason")

    def _append_hash_ids(self, line_no: int, hash_ids: list, has_bool: bool) -> _Problem | None:
        start = len(self.hash_ids)
        try:
            self.hash_ids.extend(hash_ids)
        except TypeError:
            del self.hash_ids[start:]  # extend stops part-way
            bad = next(h for h in hash_ids if type(h) is not int)
            return _Problem("wrong_type", line_no, "hash_ids", f"must be {_INT_LIST}, holds {_describe(bad)}")
        except OverflowError:
            del self.hash_ids[start:]
            bad = next(h for h in hash_ids if not _INT64_MIN <= h < _INT64_END)
            return _Problem("bad_value", line_no, "hash_ids", f"hash id {bad} does not fit in 64 bits")
        # array('q') takes True as 1; look for bools only on the rare lines that spell one.
        if has_bool and any(type(h) is bool for h in hash_ids):
            del self.hash_ids[start:]
            return _Problem("wrong_type", line_no, "hash_ids", f"must be {_INT_LIST}, holds a boolean")
        self.n_hash_ids.append(len(hash_ids))
        return None

    def _append_extra(self, record: dict) -> None:
        row = len(self.line) - 1
        for name, value in record.items():
            if name in self.required or value is None:
                continue
            if isinstance(value, (list, dict)):
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
    column[np.frombuffer(rows, dtype=np.int64)] = values
    return column


class _Parser:
    """Decodes lines into :class:`_Rows`, skipping invalid ones or stopping at the first."""

    def __init__(self, fmt: str | None, skip_invalid: bool, report: ReadReport):
        self._format = fmt
        self._skip_invalid = skip_invalid
        self._report = report
        self.rows: _Rows | None = None  # created by the first JSON object (it sets the format)
        self.problem: _Problem | None = None  # the line parsing stopped at (without skip_invalid)

    def parse(self, lines: Iterator[tuple[int, bytes]]) -> None:
        for line_no, line in lines:
            self._report.lines += 1
            record = _fast_decode(line)
            problem = None if record is None else self._add(line_no, line, record)
            if record is None or problem is not None:  # json decides: its values, its errors
                problem = self._decode(line_no, line)
            if problem is not None:
                if not self._skip_invalid:
                    self.problem = problem
                    return
                _count(self._report, problem.kind)

    def _decode(self, line_no: int, line: bytes) -> _Problem | None:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and bad UTF-8
            return _Problem("malformed_json", line_no, None, f"not valid JSON ({exc})")
        return self._add(line_no, line, record)

    def _add(self, line_no: int, line: bytes, record) -> _Problem | None:
        if type(record) is not dict:
            message = f"a record must be a JSON object, got {_describe(record)}"
            return _Problem("malformed_json", line_no, None, message)
        if _may_repeat_a_key(line, len(record)):
            key = _repeated_key(line)
            if key is not None:
                return _Problem("malformed_json", line_no, key,
                                "the key appears twice in the line (a JSON object's keys must be unique)")
        if self.rows is None:
            self.rows = _Rows(self._format or detect_format(record), line_no, detected=self._format is None)
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


def _count(report: ReadReport, kind: str, n: int = 1) -> None:
    report.skipped[kind] = report.skipped.get(kind, 0) + n


# --- vectorised checks ---------------------------------------------------------------------------


@dataclass
class _BadRows:
    """Rows failing one check; ``message(i)`` explains row ``i`` (built only when raising)."""

    kind: str
    field: str
    mask: np.ndarray
    message: Callable[[int], str]


def _validate(
    stored: _StoredFiles,
    columns: dict[str, np.ndarray],
    block_size: int,
    tolerance: float,
    skip_invalid: bool,
    report: ReadReport,
    stopped_at: _Problem | None,
    earlier: np.ndarray,
) -> np.ndarray:
    """Run the value checks over all parsed rows; return the mask of rows to keep.

    Without ``skip_invalid`` raise the earliest problem, counting the line parsing stopped at.
    With it, each bad row is counted under the first check it fails and later checks see only
    the rows still kept (so a child of a skipped request is an ``unknown_parent``).
    """
    keep = np.ones(columns["line"].shape, dtype=bool)
    first = stopped_at
    for check in (_value_checks, _hash_length_check, _time_order_check, _duplicate_check, _parent_check):
        for bad in check(columns, keep, block_size=block_size, tolerance=tolerance, label=stored.label,
                         earlier=earlier):
            bad_rows = np.flatnonzero(bad.mask & keep)
            if not bad_rows.size:
                continue
            if skip_invalid:
                _count(report, bad.kind, bad_rows.size)
                keep[bad_rows] = False
            elif first is None or columns["line"][bad_rows[0]] < first.line:
                row = bad_rows[0]
                first = _Problem(bad.kind, int(columns["line"][row]), bad.field, bad.message(row))
    if first is not None:
        raise stored.error(first)
    return keep


def _value_checks(columns, keep, **_) -> Iterator[_BadRows]:
    """Negative, NaN and infinite values of the required fields."""
    ts, seconds = columns["raw_timestamp"], columns["timestamp"]
    bad = ~(np.isfinite(ts) & (ts >= 0) & (seconds < _TIMESTAMP_END_S))

    def time_message(i):
        raw, converted = ts[i].item(), seconds[i].item()
        shown = repr(raw) if raw == converted or not math.isfinite(raw) else f"{raw!r} ({converted:g} s)"
        return f"must be a finite number >= 0 and below 2**43 s, where a float still holds a millisecond, got {shown}"

    yield _BadRows("bad_value", "timestamp", bad, time_message)
    ranges = (
        ("chat_id", 0, None),
        ("parent_chat_id", -1, None),
        ("input_length", 0, None),
        ("output_length", 0, None),
        ("turn", 1, _INT32_MAX),
    )
    for name, low, high in ranges:
        values = columns[name]
        bad = values < low if high is None else (values < low) | (values > high)
        expected = f">= {low}" if high is None else f"between {low} and {high}"
        yield _BadRows("bad_value", name, bad, _range_message(values, expected))
    hash_ids, offsets = columns["hash_ids"], columns["hash_offsets"]
    bad = np.zeros(keep.shape, dtype=bool)
    bad[np.searchsorted(offsets, np.flatnonzero(hash_ids < 0), side="right") - 1] = True  # owning rows

    def message(i):
        return f"hash ids must be >= 0, got {hash_ids[offsets[i] : offsets[i + 1]].min()}"

    yield _BadRows("bad_value", "hash_ids", bad, message)


def _range_message(values: np.ndarray, expected: str) -> Callable[[int], str]:
    return lambda i: f"must be {expected}, got {values[i].item()!r}"


def _hash_length_check(columns, keep, *, block_size, **_) -> Iterator[_BadRows]:
    """``len(hash_ids) == ceil(input_length / block_size)``."""
    n_ids = np.diff(columns["hash_offsets"])
    expected = -(-columns["input_length"] // block_size)

    def message(i):
        length = columns["input_length"][i]
        return (
            f"holds {n_ids[i]} hash ids, but input_length {length} at {block_size} tokens per block "
            f"needs {expected[i]} (wrong format or block size?)"
        )

    yield _BadRows("hash_length", "hash_ids", n_ids != expected, message)


def _time_order_check(columns, keep, *, tolerance, label, **_) -> Iterator[_BadRows]:
    """No timestamp more than ``tolerance`` seconds below the latest earlier kept one."""
    kept = np.flatnonzero(keep)
    ts = columns["timestamp"][kept]
    latest_before = np.maximum.accumulate(ts)[:-1]
    bad = np.zeros(keep.shape, dtype=bool)
    bad[kept[1:]] = ts[1:] < latest_before - tolerance

    def message(i):
        earlier = kept[kept < i]
        j = earlier[np.argmax(columns["timestamp"][earlier])]
        t_i, t_j = columns["timestamp"][i], columns["timestamp"][j]
        return (
            f"timestamp {t_i:g} s goes back {t_j - t_i:g} s from {label(columns['line'][j])} "
            f"({t_j:g} s); at most {tolerance:g} s of jitter is accepted"
        )

    yield _BadRows("timestamp_backwards", "timestamp", bad, message)


def _duplicate_check(columns, keep, *, label, earlier, **_) -> Iterator[_BadRows]:
    """No kept row repeats the chat_id of an earlier kept row (file order) or of an earlier file."""
    kept = np.flatnonzero(keep)
    chat_id = columns["chat_id"]
    _, first = np.unique(chat_id[kept], return_index=True)
    bad = np.zeros(keep.shape, dtype=bool)
    bad[kept] = True
    bad[kept[first]] = False
    in_earlier = _member(chat_id, earlier)
    bad |= in_earlier

    def message(i):
        if in_earlier[i]:
            return f"chat_id {chat_id[i]} is already the chat_id of a line of an earlier file (the same file twice?)"
        j = kept[np.argmax(chat_id[kept] == chat_id[i])]
        return f"chat_id {chat_id[i]} is already the chat_id of {label(columns['line'][j])}"

    yield _BadRows("duplicate_chat_id", "chat_id", bad, message)


def _member(values: np.ndarray, sorted_ids: np.ndarray) -> np.ndarray:
    """Which of ``values`` are in ``sorted_ids`` (sorted)."""
    if not sorted_ids.size:
        return np.zeros(values.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_ids, values), sorted_ids.size - 1)
    return sorted_ids[pos] == values


def _parent_check(columns, keep, *, earlier, **_) -> Iterator[_BadRows]:
    """Every parent is the chat_id of an earlier kept row.

    Rows whose parent is missing are dropped and the check repeated, so a whole chain behind a
    skipped turn goes (one more round per turn of the longest such chain).
    """
    chat_id, parent = columns["chat_id"], columns["parent_chat_id"]
    bad = np.zeros(keep.shape, dtype=bool)
    while True:
        orphans = _orphans(chat_id, parent, np.flatnonzero(keep & ~bad), earlier)
        if not orphans.size:
            break
        bad[orphans] = True

    def message(i):
        return f"parent_chat_id {parent[i]} is not the chat_id of any earlier valid line{' or file' if earlier.size else ''}"

    yield _BadRows("unknown_parent", "parent_chat_id", bad, message)


def _orphans(chat_id: np.ndarray, parent: np.ndarray, rows: np.ndarray, earlier: np.ndarray) -> np.ndarray:
    """Those of ``rows`` (sorted) whose parent is neither the chat_id of an earlier one of ``rows``
    nor one of ``earlier`` (sorted: earlier files')."""
    children = rows[parent[rows] != -1]
    children = children[~_member(parent[children], earlier)]
    ids, first = np.unique(chat_id[rows], return_index=True)
    if not ids.size:
        return children
    pos = np.minimum(np.searchsorted(ids, parent[children]), ids.size - 1)
    known = (ids[pos] == parent[children]) & (rows[first[pos]] < children)
    return children[~known]


# --- building the trace --------------------------------------------------------------------------


def _build_trace(
    rows: _Rows,
    columns: dict[str, np.ndarray],
    keep: np.ndarray,
    block_size: int,
    *,
    source: str,
    sha256: str,
) -> Trace:
    """The kept rows as a time-sorted Trace with an open-ended window."""
    trace = Trace(
        timestamp=columns["timestamp"],
        input_length=columns["input_length"],
        output_length=columns["output_length"],
        chat_id=columns["chat_id"],
        parent_chat_id=columns["parent_chat_id"],
        type_code=columns["type_code"],
        type_names=rows.type_names,
        turn=columns["turn"].astype(np.int32),
        hash_offsets=columns["hash_offsets"],
        hash_ids=columns["hash_ids"],
        block_size=block_size,
        format=rows.format,
        source=source,
        sha256=sha256,
        extra=rows.extra_columns(),
    )
    kept = np.flatnonzero(keep)
    order = kept[np.argsort(trace.timestamp[kept], kind="stable")]
    if order.size < keep.size or np.any(order[1:] < order[:-1]):
        trace = _drop_unused_types(trace.select(order))
        if rows.format == "mooncake":  # row numbers of the trace as returned
            trace = replace(trace, chat_id=np.arange(trace.n_requests, dtype=np.int64))
    return replace(trace, window=(float(math.floor(trace.timestamp[0])), math.inf))


def _drop_unused_types(trace: Trace) -> Trace:
    """Renumber types so that only those of kept requests are named (in order of appearance)."""
    used, first = np.unique(trace.type_code, return_index=True)
    if used.size == len(trace.type_names):
        return trace
    used = used[np.argsort(first)]
    code = np.empty(len(trace.type_names), dtype=np.int32)
    code[used] = np.arange(used.size, dtype=np.int32)
    names = tuple(trace.type_names[c] for c in used)
    return replace(trace, type_code=code[trace.type_code], type_names=names)


def _cut_window(name: str, trace: Trace, window, report: ReadReport) -> Trace:
    cut = trace.time_window(*window)
    if not cut.n_requests:
        lo, hi = cut.window
        raise TraceError(
            name,
            f"window [{lo:g}, {hi:g}) of {name} holds no requests "
            f"(they arrive from {trace.timestamp[0]:g} to {trace.timestamp[-1]:g} s)",
        )
    report.outside_window = trace.n_requests - cut.n_requests
    return cut
