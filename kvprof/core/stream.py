"""The access sequence of a workload, streamed in chunks of requests for the compiled replay.

Nothing here holds one entry per block access of the whole trace. A content's number (the dense id
the tiers and policies index by) comes from a hash table over the trace hashes seen so far, in
order of first use, so streaming the chunks in request order numbers the contents exactly as a
pass over the whole trace would. Belady's next uses come from a backward pass over the chunks
(:func:`next_uses`): a table of each hash's earliest later request, each chunk's times written to
a file at its place, then read back one chunk at a time.
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


class TableType(structs.StructType):
    pass


class Table(structref.StructRefProxy):
    """Python handle of a compiled hash table from trace hashes to int64 values."""


#: Open addressing with linear probing over a power of two of entries, at most 3/4 of them filled
#: (``n``); an entry's value is -1 while it is empty. 12 bytes an entry.
table_type = structs.struct(TableType, Table, [
    ("keys", types.int64[:]), ("values", types.int32[:]), ("n", types.int64),
])


@njit(cache=True)
def new_table(size):
    """An empty table of ``size`` entries (a power of two)."""
    table = structref.new(table_type)
    table.keys = np.zeros(size, np.int64)
    table.values = np.full(size, -1, np.int32)
    table.n = 0
    return table


@njit(cache=True)
def _make_room(table):
    """Double the table if one more key would fill more than 3/4 of it."""
    if 4 * (table.n + 1) <= 3 * len(table.keys):
        return
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
    """``out[j]``: the number of ``hashes[j]``'s content, new contents numbered on from ``table.n``
    in order of first use; returns how many contents are numbered."""
    for j in range(len(hashes)):
        _make_room(table)
        i = _find(table, hashes[j])
        if table.values[i] < 0:
            table.keys[i] = hashes[j]
            table.values[i] = table.n
            table.n += 1
        out[j] = table.values[i]
    return table.n


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
            _make_room(table)
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


@contextmanager
def next_uses(workload, chunk: int = CHUNK_REQUESTS) -> Iterator[NextUses]:
    """The next uses of ``workload``'s accesses (:attr:`~kvprof.sim.workload.Workload.next_use`),
    computed backward over chunks of ``chunk`` requests into a temporary file, deleted on exit."""
    offsets, arrival = workload.offsets, workload.arrival
    table = new_table(1024)
    with tempfile.TemporaryDirectory(prefix="kvprof-next-use-") as tmp:
        path = Path(tmp) / "next_use.f64"
        with open(path, "wb") as out:
            out.truncate(8 * workload.n_accesses)
            for first, stop in reversed(chunk_bounds(workload.n_requests, chunk)):
                times = np.empty(offsets[stop] - offsets[first], np.float64)
                _next_uses_of_chunk(table, workload.engine_hashes(first, stop), np.diff(offsets[first:stop + 1]),
                                    first, arrival, times)
                out.seek(8 * offsets[first])
                out.write(times.tobytes())
        del table
        yield NextUses(path)
