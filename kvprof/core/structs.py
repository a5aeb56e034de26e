"""Compiled containers the policies are built from: intrusive linked lists and a binary heap.

Both live in numpy arrays inside numba structrefs, so compiled code updates them in place and
Python holds them as opaque handles. Ids are small non-negative ints (block slots, content ids,
request indices), below :data:`MAX_ID`; ``-1`` means none.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.experimental import structref

NONE = -1
#: Ids and list numbers are kept per id as int32 (4 bytes a block, not 8): every id is below this.
MAX_ID = (1 << 31) - 1


class StructType(types.StructRef):
    """A numba structref type whose fields keep no literal types (an int field takes any int)."""

    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(typ)) for name, typ in fields)


def struct(type_class: type, proxy_class: type, fields: list[tuple[str, types.Type]]):
    """Register ``type_class`` (a :class:`StructType` subclass) with Python handle ``proxy_class``;
    return its instance type with ``fields``."""
    structref.register(type_class)
    structref.define_boxing(type_class, proxy_class)
    return type_class(fields)


class ListsType(StructType):
    pass


class Lists(structref.StructRefProxy):
    """Python handle of compiled lists."""


class HeapType(StructType):
    pass


class Heap(structref.StructRefProxy):
    """Python handle of a compiled heap."""


#: Several disjoint FIFO lists over one id space, each id in at most one list; per id int32
#: (ids and list numbers below :data:`MAX_ID`), per list int64.
lists_type = struct(ListsType, Lists, [
    ("nxt", types.int32[:]), ("prv", types.int32[:]), ("where", types.int32[:]),
    ("head", types.int64[:]), ("tail", types.int64[:]), ("count", types.int64[:]),
])

#: A binary min-heap of entries ``(a, b, seq)`` (floats, floats, int; compared in that order), each
#: carrying an ``item``.
heap_type = struct(HeapType, Heap, [
    ("a", types.float64[:]), ("b", types.float64[:]), ("seq", types.int64[:]), ("item", types.int64[:]),
    ("n", types.int64),
])


def grown(array: np.ndarray, size: int, fill) -> np.ndarray:
    """``array`` extended to at least ``size`` entries (doubling), new entries ``fill``."""
    out = np.full(max(size, 2 * len(array), 16), fill, dtype=array.dtype)
    out[: len(array)] = array
    return out


grown = njit(cache=True)(grown)


@njit(cache=True)
def check_ids(n_ids):
    """Raise unless ids ``0 .. n_ids - 1`` fit the int32 per-id tables."""
    if n_ids > MAX_ID:
        raise ValueError("more than 2**31 - 1 ids (blocks or contents) for a compiled policy's int32 tables")


# -- lists --------------------------------------------------------------------------------------
@njit(cache=True)
def new_lists(n_ids, n_lists):
    """Empty lists: ``n_lists`` of them over ids ``0 .. n_ids - 1`` (both grow on demand).

    Invariant: ``where[x]`` is the list holding ``x`` or -1; each list is linked through
    ``nxt``/``prv`` from ``head`` to ``tail`` and holds ``count`` ids.
    """
    lists = structref.new(lists_type)
    lists.nxt = np.full(n_ids, NONE, np.int32)
    lists.prv = np.full(n_ids, NONE, np.int32)
    lists.where = np.full(n_ids, NONE, np.int32)
    lists.head = np.full(n_lists, NONE, np.int64)
    lists.tail = np.full(n_lists, NONE, np.int64)
    lists.count = np.zeros(n_lists, np.int64)
    return lists


@njit(cache=True)
def reserve_ids(lists, n_ids):
    """Make the lists cover ids ``0 .. n_ids - 1``."""
    if n_ids > len(lists.where):
        check_ids(n_ids)
        lists.nxt = grown(lists.nxt, n_ids, NONE)
        lists.prv = grown(lists.prv, n_ids, NONE)
        lists.where = grown(lists.where, n_ids, NONE)


@njit(cache=True)
def reserve_lists(lists, n_lists):
    """Make lists ``0 .. n_lists - 1`` exist."""
    if n_lists > len(lists.head):
        lists.head = grown(lists.head, n_lists, NONE)
        lists.tail = grown(lists.tail, n_lists, NONE)
        lists.count = grown(lists.count, n_lists, 0)


@njit(cache=True, inline="always")
def push_back(lists, which, x):
    """Append ``x`` (in no list) to the back of list ``which``."""
    last = lists.tail[which]
    lists.prv[x] = last
    lists.nxt[x] = NONE
    if last == NONE:
        lists.head[which] = x
    else:
        lists.nxt[last] = x
    lists.tail[which] = x
    lists.where[x] = which
    lists.count[which] += 1


@njit(cache=True, inline="always")
def unlink(lists, x):
    """Take ``x`` out of its list."""
    which = lists.where[x]
    before, after = lists.prv[x], lists.nxt[x]
    if before == NONE:
        lists.head[which] = after
    else:
        lists.nxt[before] = after
    if after == NONE:
        lists.tail[which] = before
    else:
        lists.prv[after] = before
    lists.where[x] = NONE
    lists.count[which] -= 1


# Batch forms of push_back and unlink, for a batch of ids: the lists' arrays are read once, and
# the loops are written out, not calls of push_back/unlink, since an inlined call takes
# a reference to each array it is passed, an atomic add and sub each, per id (property-tested
# against the one-id forms in tests/test_structs.py).
@njit(cache=True)
def push_back_n(lists, xs, n, list_of):
    """``push_back(lists, list_of[xs[i]], xs[i])`` for ``i < n``, in order (``list_of`` empty: list 0)."""
    nxt, prv, where, head, tail, count = lists.nxt, lists.prv, lists.where, lists.head, lists.tail, lists.count
    by_id = len(list_of) > 0
    for i in range(n):
        x = xs[i]
        which = np.int64(list_of[x]) if by_id else 0
        last = tail[which]
        prv[x] = last
        nxt[x] = NONE
        if last == NONE:
            head[which] = x
        else:
            nxt[last] = x
        tail[which] = x
        where[x] = which
        count[which] += 1


@njit(cache=True)
def unlink_held_n(lists, xs, n):
    """``unlink(lists, xs[i])`` for ``i < n`` in order, stopping at the first ``xs[i]`` in no list:
    how many were unlinked."""
    nxt, prv, where, head, tail, count = lists.nxt, lists.prv, lists.where, lists.head, lists.tail, lists.count
    for i in range(n):
        x = xs[i]
        if not (0 <= x < len(where) and where[x] != NONE):
            return i
        which = where[x]
        before, after = prv[x], nxt[x]
        if before == NONE:
            head[which] = after
        else:
            nxt[before] = after
        if after == NONE:
            tail[which] = before
        else:
            prv[after] = before
        where[x] = NONE
        count[which] -= 1
    return n


@njit(cache=True)
def unlink_n(lists, xs, n, was_held):
    """For ``i < n`` in order: ``was_held[i] = holds(lists, xs[i])``, then ``unlink(lists, xs[i])`` if it was."""
    nxt, prv, where, head, tail, count = lists.nxt, lists.prv, lists.where, lists.head, lists.tail, lists.count
    for i in range(n):
        x = xs[i]
        held = 0 <= x < len(where) and where[x] != NONE
        was_held[i] = held
        if not held:
            continue
        which = where[x]
        before, after = prv[x], nxt[x]
        if before == NONE:
            head[which] = after
        else:
            nxt[before] = after
        if after == NONE:
            tail[which] = before
        else:
            prv[after] = before
        where[x] = NONE
        count[which] -= 1


@njit(cache=True)
def move_to_back_n(lists, xs, n, which, was_held):
    """For ``i < n`` in order (ids within the lists): ``unlink(lists, xs[i])`` if it is in a list
    (``was_held[i]``: whether it was), then ``push_back(lists, which, xs[i])``."""
    nxt, prv, where, head, tail, count = lists.nxt, lists.prv, lists.where, lists.head, lists.tail, lists.count
    for i in range(n):
        x = xs[i]
        held = where[x] != NONE
        was_held[i] = held
        if held:
            old = where[x]
            before, after = prv[x], nxt[x]
            if before == NONE:
                head[old] = after
            else:
                nxt[before] = after
            if after == NONE:
                tail[old] = before
            else:
                prv[after] = before
            count[old] -= 1
        last = tail[which]
        prv[x] = last
        nxt[x] = NONE
        if last == NONE:
            head[which] = x
        else:
            nxt[last] = x
        tail[which] = x
        where[x] = which
        count[which] += 1


@njit(cache=True)
def pop_front_n(lists, which, n, out):
    """``out[i] = pop_front(lists, which)`` for ``i < n`` (the list holds at least ``n``)."""
    nxt, prv, where, head, tail, count = lists.nxt, lists.prv, lists.where, lists.head, lists.tail, lists.count
    x = head[which]
    for i in range(n):
        out[i] = x
        where[x] = NONE
        prv[x] = NONE  # (as the one-id pops leave it: each was the head)
        x = nxt[x]
    head[which] = x
    if x == NONE:
        tail[which] = NONE
    else:
        prv[x] = NONE
    count[which] -= n


@njit(cache=True, inline="always")
def pop_front(lists, which):
    """Take and return the front of list ``which`` (not empty)."""
    x = lists.head[which]
    unlink(lists, x)
    return x


@njit(cache=True, inline="always")
def holds(lists, x):
    """Whether ``x`` is in some list."""
    return 0 <= x < len(lists.where) and lists.where[x] != NONE


@njit(cache=True)
def clear_lists(lists):
    lists.nxt[:] = NONE
    lists.prv[:] = NONE
    lists.where[:] = NONE
    lists.head[:] = NONE
    lists.tail[:] = NONE
    lists.count[:] = 0


# -- heap ---------------------------------------------------------------------------------------
@njit(cache=True)
def new_heap(capacity):
    heap = structref.new(heap_type)
    capacity = max(capacity, 16)
    heap.a = np.empty(capacity, np.float64)
    heap.b = np.empty(capacity, np.float64)
    heap.seq = np.empty(capacity, np.int64)
    heap.item = np.empty(capacity, np.int64)
    heap.n = 0
    return heap


@njit(cache=True)
def _below(heap, i, j):
    """Entry ``i`` sorts before entry ``j``."""
    if heap.a[i] != heap.a[j]:
        return heap.a[i] < heap.a[j]
    if heap.b[i] != heap.b[j]:
        return heap.b[i] < heap.b[j]
    return heap.seq[i] < heap.seq[j]


@njit(cache=True)
def _swap(heap, i, j):
    heap.a[i], heap.a[j] = heap.a[j], heap.a[i]
    heap.b[i], heap.b[j] = heap.b[j], heap.b[i]
    heap.seq[i], heap.seq[j] = heap.seq[j], heap.seq[i]
    heap.item[i], heap.item[j] = heap.item[j], heap.item[i]


@njit(cache=True)
def _sift_down(heap, i):
    while True:
        child = 2 * i + 1
        if child >= heap.n:
            return
        if child + 1 < heap.n and _below(heap, child + 1, child):
            child += 1
        if not _below(heap, child, i):
            return
        _swap(heap, i, child)
        i = child


@njit(cache=True)
def heap_push(heap, a, b, seq, item):
    if heap.n == len(heap.a):
        heap.a = grown(heap.a, heap.n + 1, 0.0)
        heap.b = grown(heap.b, heap.n + 1, 0.0)
        heap.seq = grown(heap.seq, heap.n + 1, 0)
        heap.item = grown(heap.item, heap.n + 1, 0)
    i = heap.n
    heap.a[i], heap.b[i], heap.seq[i], heap.item[i] = a, b, seq, item
    heap.n += 1
    while i:
        parent = (i - 1) // 2
        if not _below(heap, i, parent):
            break
        _swap(heap, i, parent)
        i = parent


@njit(cache=True)
def heap_pop(heap):
    """Remove the lowest entry; return its item."""
    item = heap.item[0]
    heap.n -= 1
    if heap.n:
        _swap(heap, 0, heap.n)
        _sift_down(heap, 0)
    return item


@njit(cache=True)
def heap_keep(heap, keep):
    """Keep only the entries whose ``keep[k]`` is true (``k`` their current index), reordered as a heap."""
    n = 0
    for k in range(heap.n):
        if keep[k]:
            heap.a[n], heap.b[n], heap.seq[n], heap.item[n] = heap.a[k], heap.b[k], heap.seq[k], heap.item[k]
            n += 1
    heap.n = n
    for i in range(n // 2 - 1, -1, -1):
        _sift_down(heap, i)


# -- copies -------------------------------------------------------------------------------------
#: The compiled structs deep-copied by :mod:`kvprof.core.copiers`: (copier, type's name, its module).
COPIED = (("copy_lists", "lists_type", "kvprof.core.structs"), ("copy_heap", "heap_type", "kvprof.core.structs"),
          ("copy_core", "core_type", "kvprof.core.policies"))


def copiers_source() -> str:
    """The source of :mod:`kvprof.core.copiers`: one compiled deep copy per struct of :data:`COPIED`.

    Every array field is copied, every struct field by its own copier, scalars are assigned. The
    module is this source written out, not built at import (numba caches only functions from
    files, and an uncached copier was compiled at every start of a server, 7 s); a test keeps it
    equal to the structs' fields: ``python -m kvprof.core.copiers`` writes it again.
    """
    import importlib

    types_of = {name: getattr(importlib.import_module(module), type_name) for name, type_name, module in COPIED}
    copier_of = {typ: name for name, typ in types_of.items()}
    imports: dict[str, list[str]] = {}
    for _, type_name, module in COPIED:
        imports.setdefault(module, []).append(type_name)
    lines = ['"""Deep copies of the compiled structs. Generated by kvprof.core.structs.copiers_source: do not edit;',
             'after a change of a struct\'s fields run ``python -m kvprof.core.copiers``."""', "",
             "from numba import njit", "from numba.experimental import structref", ""]
    lines += [f"from {module} import {', '.join(sorted(names))}" for module, names in sorted(imports.items())]
    for (name, type_name, _), struct_type in zip(COPIED, types_of.values()):
        lines += ["", "", "@njit(cache=True)", f"def {name}(s):", f"    c = structref.new({type_name})"]
        for field, typ in struct_type.field_dict.items():
            if typ in copier_of:
                lines.append(f"    c.{field} = {copier_of[typ]}(s.{field})")
            elif isinstance(typ, types.Array):
                lines.append(f"    c.{field} = s.{field}.copy()")
            else:
                lines.append(f"    c.{field} = s.{field}")
        lines.append("    return c")
    lines += ["", "", 'if __name__ == "__main__":  # write this module again from the structs\' fields',
              "    from pathlib import Path", "", "    from kvprof.core.structs import copiers_source", "",
              "    Path(__file__).write_text(copiers_source())"]
    return "\n".join(lines) + "\n"
