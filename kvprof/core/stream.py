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
come from a backward pass over the chunks (:func:`next_uses`): a table of each hash's earliest
later request (one entry per distinct hash: offline policies only), each chunk's times written to
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
    """``out[j]``: the number of ``hashes[j]``'s content, a new content taking the last number
    freed (:func:`forget_unmarked`), else the next never used; returns how many numbers were ever
    handed out (every number is below it)."""
    for j in range(len(hashes)):
        _make_room(table)
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
