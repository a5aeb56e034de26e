"""Stored trace files read as numbered lines: bytes in, lines out.

A file is read once, a few MB at a time: decompressed (gzip or zstd, told from its first bytes, also
when a zstd file starts with a skippable frame as ``pzstd`` writes), hashed (SHA-256 of the stored
bytes) and counted for progress on the way. Several files (a recording directory) read as one text
whose lines are numbered across them; :meth:`StoredFiles.locate` turns such a number back into a
file and its own line. A still-open recording file (``tolerant``) may end inside a zstd frame or a
line: what cannot be read at its end is counted, not an error.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import zstandard

from kvprof.errors import TraceError

_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}
#: A zstd skippable frame (what pzstd writes first) starts with 0x184D2A5? little-endian.
_SKIPPABLE_END = b"\x2a\x4d\x18"
#: Bytes read at a time (zstd input is read in smaller pieces: it may expand 20-fold), and stored
#: bytes between progress calls.
_CHUNK_BYTES = 4 << 20
_ZSTD_INPUT_BYTES = 256 << 10
_PROGRESS_BYTES = 4 << 20


class StoredFile:
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

    def __enter__(self) -> StoredFile:
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


class StoredFiles:
    """Several stored files read as one text, in order: lines are numbered across them, and
    :meth:`error` and :meth:`label` turn such a number back into a file and its own line.

    A single file is the common case; a recording directory is several.
    """

    def __init__(self, files: list[tuple[object, bool]], progress: Callable[[int, int], None] | None,
                 recording: bool = False):
        self._files = list(files)
        self._recording_files = recording
        self._progress = progress
        self._opened: list[StoredFile] = []
        self._first_lines: list[int] = []  # global number of each opened file's line 1
        self._sha = hashlib.sha256() if len(files) > 1 else None
        self.truncated = 0
        self.cut_frames = 0
        self._total = sum(_size(f) for f, _ in files) if len(files) > 1 else None
        self._done = 0
        self.is_stream = False

    def __enter__(self) -> StoredFiles:
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

    def _open(self, k: int, path, still_open: bool) -> StoredFile:
        """File ``k``, opened; a recording's ``.part`` finished (renamed) since the listing is read finished."""
        try:
            if not still_open and self._recording_files and os.stat(path).st_size == 0:
                raise TraceError(str(path), "a finished recording file is empty (a finished file holds at least "
                                            "one zstd frame: the file was truncated or replaced)")
            stored = StoredFile(path, self._file_progress, tolerant=still_open)
        except FileNotFoundError:
            if not still_open:
                raise
            path = Path(path).with_name(Path(path).name.removesuffix(".part"))
            self._files[k] = (path, False)
            stored = StoredFile(path, self._file_progress)
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

    def error(self, line: int, message: str, field: str | None = None) -> TraceError:
        """The error of global line ``line``, naming its file and its own line."""
        path, own = self.locate(line)
        return TraceError(path, message, line=own, field=field)
