"""Read Bailian and Mooncake JSONL traces into a columnar :class:`~kvprof.profiler.trace.Trace`.

Reading is one streaming pass in three rooms: :mod:`kvprof.profiler.stored` turns the stored bytes
into numbered lines (decompressing, hashing, counting progress); :mod:`kvprof.profiler.records`
decodes each line (orjson, or :func:`json.loads` wherever the two could differ) and runs the checks
that need the decoded record (valid JSON, required fields, types), its scalars going to per-column
buffers and its hash ids to one growing int64 buffer, so no list of records is ever kept;
:mod:`kvprof.profiler.value_checks` runs the checks on values (ranges, hash-list lengths, time order,
parents) vectorised once the file is parsed, and only then looks up the offending line for the
message. This module runs them and builds the trace.

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
  ``stop`` (how the response ended, :mod:`kvprof.models.finish`) is a string or null where a line
  has it; it stays in ``Trace.extra`` and ``Trace.finish`` codes it per request. The hint fields
  (``retain_s``, ``retain_priority``, ``release``, ``hint_tag``: :mod:`kvprof.models.hints`) are checked
  where a line has them (type and range, ``wrong_type``/``bad_value`` of that field) and read by
  ``Trace.hints``.
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

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from kvprof.errors import TraceError
from kvprof.profiler.records import Parser, Rows, detect_format, required_fields
from kvprof.profiler.stored import StoredFile, StoredFiles
from kvprof.profiler.trace import FORMAT_BLOCK_SIZE, Trace, check_window_order
from kvprof.profiler.value_checks import validate
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
    with StoredFiles(files, progress, recording=report.recording is not None) as stored:
        parser = Parser(format, skip_invalid)
        parser.parse(stored.lines())
        report.lines, report.skipped = parser.lines, parser.skipped
        report.truncated, report.cut_frames = stored.truncated, stored.cut_frames
        rows, problem = parser.rows, parser.problem
        if rows is None:
            if problem is not None:
                raise stored.error(problem.line, problem.message, problem.field)
            raise _no_requests(name, report, stored.is_stream)
        size = block_size or FORMAT_BLOCK_SIZE[rows.format]
        columns = rows.arrays()
        earlier = np.zeros(0, np.int64) if earlier_chat_ids is None else earlier_chat_ids
        keep = validate(stored, columns, size, time_tolerance, skip_invalid, report.skipped, problem, earlier)
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


def peek_format(path) -> str | None:
    """The format :func:`read_trace` will detect, from the first line alone; None when that line does not
    tell (no line, not a JSON object, a file that cannot be read: :func:`read_trace` then says why).

    Lets a front end check options that depend on the format (block sizes) before reading a whole
    trace. Not for streams: it consumes what it reads.
    """
    try:
        with StoredFile(path, None) as stored:
            for _, line in stored.lines():
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    return None
                return detect_format(record) if type(record) is dict else None
    except (OSError, TraceError):
        return None
    return None



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
        check_window_order(lo, hi, f"window {window!r}")


def _no_requests(name: str, report: ReadReport, is_stream: bool) -> TraceError:
    if not report.lines:
        if is_stream:
            return TraceError(name, "nothing arrived: the stream closed before its first line")
        return TraceError(name, "the file holds no requests (it is empty)")
    counts = ", ".join(f"{kind}: {n}" for kind, n in report.skipped.items())
    return TraceError(name, f"no valid requests: all {report.lines} lines were skipped ({counts})")


# --- building the trace --------------------------------------------------------------------------


def _build_trace(
    rows: Rows,
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
