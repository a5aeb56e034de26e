"""Records to a JSONL file, plain or compressed by suffix, written atomically."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable
from pathlib import Path

from kvprof.atomic import atomic_open


#: Suffixes (any case) that compress what is written.
COMPRESSED_SUFFIXES = (".gz", ".zst")
#: Suffixes of other compressions: a file so named would not hold what its name says, so it is refused.
OTHER_COMPRESSIONS = (".bz2", ".xz", ".lzma", ".lz4", ".zip", ".zstd", ".gzip", ".br", ".7z", ".z", ".tgz", ".sz")


def compression_problem(path: str | os.PathLike) -> str | None:
    """Why ``path``'s suffix cannot be written (a compression other than gzip and zstd), or None."""
    suffix = Path(path).suffix.lower()
    if suffix in OTHER_COMPRESSIONS:
        return (f"{path}: kvprof writes plain JSONL, gzip ({COMPRESSED_SUFFIXES[0]}) or zstd "
                f"({COMPRESSED_SUFFIXES[1]}), not {Path(path).suffix}")
    return None


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Write records as JSON lines, atomically.

    The file appears complete or not at all: lines go to a temporary file in the same
    directory, which replaces ``path`` only once every record is written. A ``.gz`` or
    ``.zst`` suffix, in any case, compresses; another compression's suffix is refused.

    Returns
    -------
    int
        Number of records written.
    """
    path = Path(path)
    problem = compression_problem(path)
    if problem:
        raise ValueError(problem)
    count = 0
    with atomic_open(path, "wb") as raw, _compressor(raw, path.suffix.lower()) as out:
        for record in records:
            out.write(json.dumps(record).encode() + b"\n")
            count += 1
    return count


def _compressor(raw, suffix: str):
    """A binary writer over ``raw`` that compresses by file suffix; closing it leaves ``raw`` open."""
    if suffix == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="wb", mtime=0)  # mtime 0: same records, same bytes
    if suffix == ".zst":
        import zstandard

        return zstandard.ZstdCompressor().stream_writer(raw, closefd=False)
    return _Unclosed(raw)


class _Unclosed:
    """Pass-through writer whose ``close`` leaves the underlying file to its owner."""

    def __init__(self, raw):
        self.write = raw.write

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
