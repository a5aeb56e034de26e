"""The access sequence of a workload, streamed in chunks of requests for the compiled replay.

Nothing here holds one entry per block access of the whole trace, nor (for the replay) one per
distinct content. A content's number (the dense id the tiers and policies index by) comes from a
hash table over the trace hashes seen so far, in order of first use; once the table has grown past
twice what was live at its last sweep, the replay marks every number some structure still holds
(a cache slot, a ghost, a shadow, the window of requests still to run:
:func:`kvprof.core.tiers.recycle_contents`) and :func:`forget_unmarked` drops the others' hashes,
their numbers going to new contents. A number names one content for as long as anything refers to
it, so the replay is the one a pass numbering the whole trace would give, number aside, and the
tables indexed by number stay within a multiple of what the caches hold. Belady's next uses
come from backward passes over the chunks, one per bucket of hashes (:func:`next_uses`): a table
of each of the bucket's hashes' earliest later request, so that what is held at once is bounded
by the bucket's size, not the trace's distinct contents; the times are written to a file at
their places, then read back one chunk at a time.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import njit, types
from numba.experimental import structref

from kvprof.core import structs

#: Requests per streamed chunk: about 300 k accesses of bailian's 16-token blocks.
CHUNK_REQUESTS = 2048

#: Accesses per bucket of Belady's next-use pass (:func:`next_uses`) on average: its one table
#: holds at most about this many hashes (12 MB at 12 bytes a slot, 1/2 to 3/4 filled, doubling).
BUCKET_ACCESSES = 1 << 19


class TableType(structs.StructType):
    pass


class Table(structref.StructRefProxy):
    """Python handle of a compiled hash table from trace hashes to int64 values."""


#: Open addressing with linear probing over a power of two of entries, at most 3/4 of them filled
#: (``n``); an entry's value is -1 while it is empty. 12 bytes an entry. As a numbering, ``top``
#: numbers were handed out, ``free[:n_free]`` of them are unused again (:func:`forget_unmarked`),
#: and the next sweep is due once ``n`` reaches ``sweep_at``.
table_type = structs.struct(TableType, Table, [
    ("keys", types.int64[:]), ("values", types.int32[:]), ("n", types.int64),
    ("top", types.int64), ("free", types.int32[:]), ("n_free", types.int64), ("sweep_at", types.int64),
])

#: The fewest numbered contents before the first sweep (:func:`due`).
MIN_SWEEP = 1 << 10


@njit(cache=True)
def new_table(size):
    """An empty table of ``size`` entries (a power of two)."""
    table = structref.new(table_type)
    table.keys = np.zeros(size, np.int64)
    table.values = np.full(size, -1, np.int32)
    table.n = 0
    table.top = 0
    table.free = np.zeros(0, np.int32)
    table.n_free = 0
    table.sweep_at = MIN_SWEEP
    return table


@njit(cache=True)
def _has_room(n, size):
    """Whether a table of ``size`` entries holding ``n`` keys takes one more within 3/4 of it
    (scalars: a call per key that took the table would count a reference to it)."""
    return 4 * (n + 1) <= 3 * size


@njit(cache=True)
def _double(table):
    """Double the table."""
    keys, values = table.keys, table.values
    table.keys = np.zeros(2 * len(keys), np.int64)
    table.values = np.full(2 * len(keys), -1, np.int32)
    for i in range(len(keys)):
        if values[i] >= 0:
            j = _find(table, keys[i])
            table.keys[j] = keys[i]
            table.values[j] = values[i]


@njit(cache=True)
def _home(key, mask):
    """A well-mixed start position for ``key`` (splitmix64's finaliser)."""
    x = np.uint64(key)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return np.int64(x & np.uint64(mask))


@njit(cache=True)
def _find(table, key):
    """The entry holding ``key``, or the empty entry where it would go."""
    mask = len(table.keys) - 1
    i = _home(key, mask)
    while table.values[i] >= 0 and table.keys[i] != key:
        i = (i + 1) & mask
    return i


@njit(cache=True)
def number(table, hashes, out):
    """``out[j]``: the number of ``hashes[j]``'s content, a new content taking the last number
    freed (:func:`forget_unmarked`), else the next never used; returns how many numbers were ever
    handed out (every number is below it)."""
    for j in range(len(hashes)):
        if not _has_room(table.n, len(table.keys)):
            _double(table)
        i = _find(table, hashes[j])
        if table.values[i] < 0:
            table.keys[i] = hashes[j]
            if table.n_free:
                table.n_free -= 1
                table.values[i] = table.free[table.n_free]
            else:
                table.values[i] = table.top
                table.top += 1
            table.n += 1
        out[j] = table.values[i]
    return table.top


@njit(cache=True)
def due(table):
    """Whether the numbering should be swept: it holds twice what was live at the last sweep."""
    return table.n >= table.sweep_at


@njit(cache=True)
def sizes(table):
    """Contents numbered now, numbers ever handed out (``top``) and entries of the table."""
    return table.n, table.top, len(table.keys)


@njit(cache=True)
def forget_unmarked(table, live):
    """Drop every content whose number is not marked in ``live`` (one flag per number below
    ``table.top``): its hash is forgotten, its number free for a new content."""
    keys, values = table.keys, table.values
    table.keys = np.zeros(len(keys), np.int64)
    table.values = np.full(len(keys), -1, np.int32)
    table.n = 0
    if len(table.free) < table.top:
        table.free = np.zeros(table.top, np.int32)
    table.n_free = 0
    for number in range(table.top - 1, -1, -1):  # reused lowest first
        if not live[number]:
            table.free[table.n_free] = number
            table.n_free += 1
    for i in range(len(keys)):
        if values[i] >= 0 and live[values[i]]:
            j = _find(table, keys[i])
            table.keys[j] = keys[i]
            table.values[j] = values[i]
            table.n += 1
    table.sweep_at = max(MIN_SWEEP, 2 * table.n)


@njit(cache=True)
def _next_uses_of_chunk(table, hashes, lengths, first, arrival, out):
    """Backward over the requests ``first ..`` of one chunk (``lengths`` accesses each): each
    access's next use is the arrival of the earliest later request seen with its hash (``inf``
    if none); then the request itself becomes its hashes' earliest later request."""
    stop = len(hashes)
    for k in range(len(lengths) - 1, -1, -1):
        start = stop - lengths[k]
        for j in range(start, stop):
            i = _find(table, hashes[j])
            out[j] = arrival[table.values[i]] if table.values[i] >= 0 else math.inf
        for j in range(start, stop):
            if not _has_room(table.n, len(table.keys)):
                _double(table)
            i = _find(table, hashes[j])
            if table.values[i] < 0:
                table.keys[i] = hashes[j]
                table.n += 1
            table.values[i] = first + k
        stop = start


@dataclass(frozen=True)
class NextUses:
    """Belady's next use of every access, on disk (float64 in access order), read a chunk at a time."""

    path: Path

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.fromfile(self.path, dtype=np.float64, count=stop - start, offset=8 * start)


def chunk_bounds(n_requests: int, chunk: int) -> list[tuple[int, int]]:
    return [(first, min(first + chunk, n_requests)) for first in range(0, n_requests, chunk)]


def n_buckets_for(n_accesses: int, bucket_accesses: int) -> int:
    """The fewest buckets, a power of two, that hold ``bucket_accesses`` accesses each on average."""
    return 1 << max(0, math.ceil(math.log2(max(1, -(-n_accesses // bucket_accesses)))))


def bucket_of(hashes: np.ndarray, n_buckets: int) -> np.ndarray:
    """Each hash's bucket (Fibonacci hashing: the top bits of the hash times 2^64 / phi)."""
    if n_buckets == 1:
        return np.zeros(len(hashes), np.int64)
    mixed = hashes.astype(np.int64, copy=False).view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (mixed >> np.uint64(64 - n_buckets.bit_length() + 1)).astype(np.int64)


#: Bucket records on disk: an access's hash and its place in its chunk.
RECORD = np.dtype([("hash", np.int64), ("place", np.int64)])


@contextmanager
def next_uses(workload, chunk: int = CHUNK_REQUESTS, bucket_accesses: int = BUCKET_ACCESSES) -> Iterator[NextUses]:
    """The next uses of ``workload``'s accesses (:attr:`~kvprof.sim.workload.Workload.next_use`),
    computed into a temporary file, deleted on exit.

    A content's accesses all fall in one of ``n_buckets_for(n_accesses, bucket_accesses)`` buckets by
    its hash (:func:`bucket_of`). Forward over chunks of ``chunk`` requests, each chunk's accesses are
    written to disk sorted by bucket, in access order within one (``starts[c, b]``: where chunk ``c``'s
    bucket ``b`` begins). Then each bucket is swept backward over the chunks with a table of its own
    hashes only (:func:`_next_uses_of_chunk`: the earliest later request of each), its times written at
    its records' places; last, each chunk's times are put back in access order. The one table held
    at a time has one entry per distinct hash of one bucket, about ``bucket_accesses`` at most: memory
    is bounded whatever the trace's length, and the times are the single table's, exactly.
    """
    offsets, arrival = workload.offsets, workload.arrival
    bounds = chunk_bounds(workload.n_requests, chunk)
    n_buckets = n_buckets_for(workload.n_accesses, bucket_accesses)
    starts = np.empty((len(bounds), n_buckets + 1), np.int64)
    with tempfile.TemporaryDirectory(prefix="kvprof-next-use-") as tmp:
        records, path = Path(tmp) / "by_bucket.rec", Path(tmp) / "next_use.f64"
        with open(records, "wb") as out:
            for c, (first, stop) in enumerate(bounds):
                hashes = workload.engine_hashes(first, stop)
                bucket = bucket_of(hashes, n_buckets)
                order = np.argsort(bucket, kind="stable")
                starts[c] = offsets[first] + np.searchsorted(bucket[order], np.arange(n_buckets + 1))
                sorted_records = np.empty(len(order), RECORD)
                sorted_records["hash"], sorted_records["place"] = hashes[order], order
                out.write(sorted_records.tobytes())
        with open(path, "wb") as out:
            out.truncate(8 * workload.n_accesses)
            for b in range(n_buckets):
                table = new_table(1024)
                for c in range(len(bounds) - 1, -1, -1):
                    first, stop = bounds[c]
                    begin, end = starts[c, b], starts[c, b + 1]
                    mine = np.fromfile(records, RECORD, count=end - begin, offset=RECORD.itemsize * begin)
                    owner = np.searchsorted(offsets[first:stop + 1], offsets[first] + mine["place"], "right") - 1
                    times = np.empty(len(mine), np.float64)
                    _next_uses_of_chunk(table, np.ascontiguousarray(mine["hash"]),
                                        np.bincount(owner, minlength=stop - first), first, arrival, times)
                    out.seek(8 * begin)
                    out.write(times.tobytes())
                del table
        with open(path, "r+b") as out:
            for first, stop in bounds:
                begin, end = offsets[first], offsets[stop]
                places = np.fromfile(records, RECORD, count=end - begin, offset=RECORD.itemsize * begin)["place"]
                times = np.empty(end - begin, np.float64)
                times[places] = np.fromfile(path, np.float64, count=end - begin, offset=8 * begin)
                out.seek(8 * begin)
                out.write(times.tobytes())
        records.unlink()
        yield NextUses(path)
