"""Content numbers for vLLM's block hashes, looked up in compiled code.

The compiled policy keys its ghosts and shadows by content number (a dense int below
``max_contents``); the pool numbers every chain it hands the policy. A Python dict did that at
~0.1-0.3 us a key on the scheduler thread (1-6 ms for a 32k-token prompt); here a chain is one
pass of ``hash()`` over its keys (bytes cache their hash, so mostly a load) and one compiled
call into an open-addressing table.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Hashable, Sequence

import numpy as np
from numba import njit

#: A slot is three int32s, side by side so that a probe reads one cache line, not two: its fingerprint's
#: low and high halves and what it holds, its number + 1 or :data:`_FREE` (no fingerprint).
_FREE = 0
#: What a slot of the outgrown table holds once its entry moved to the new table or was forgotten
#: (lookups go on past it).
_GONE = -1
_SLOT = 3
#: ``_older``/``_newer``/``_state`` of no number.
_EMPTY = -1
#: Old slots moved per call while a grown table fills: this many, plus 8 per content looked up up to
#: :data:`MOVE_CAP` (so the old table, which every new content is also looked up in, goes soon) and never
#: fewer than 2 per content (so it is empty before the new table is half full). Each entry moved costs
#: ~0.1 us of cache misses: a one-block call each step should not pay for a thousand.
MOVE_MIN = 64
MOVE_CAP = 4096
#: The tables that replace the slot table and the tables by number when the slot table doubles are made
#: ready (their pages written, the numbers copied over) from when it is more than ``READY_FROM`` full, at
#: least ``READY_MIN`` slots and numbers a call plus ``READY_SLOTS``/``READY_NUMBERS`` per content looked up:
#: the kernel hands out a page as it is first written (~0.35 ms a MB here, in 4 KB pages), which cost the
#: call that doubled a 1M-slot table 2-4 ms when it came all at once. Between ``READY_FROM`` and half full
#: the table takes ``size / 16`` contents, over which 32 slots (of the table twice as large) and 16 numbers
#: each must be made ready: the rates below leave an eighth to spare.
READY_FROM = 7 / 16
READY_MIN = 1024
READY_SLOTS = 36
READY_NUMBERS = 18


def _libc_madvise():
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


_MADVISE = _libc_madvise()


def small_paged(n: int, dtype, fill=None) -> np.ndarray:
    """An array of ``n`` (filled with ``fill``, if given) whose pages the kernel hands out 4 KB at a time as
    they are first written. numpy asks for transparent huge pages for arrays from 4 MB on; the first write
    into each 2 MB then waits for the kernel to find and zero a huge page, 5-7 ms on a busy machine whose
    memory is fragmented (it compacts memory first), where 4 KB pages cost ~1.5 us each. For an array
    written a little at a time on the scheduler thread, such a write is a stall."""
    array = np.empty(n, dtype=dtype)
    if _MADVISE is not None and array.nbytes >= 1 << 21:
        start = -(-array.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (array.ctypes.data + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            _MADVISE(start, end - start, mmap.MADV_NOHUGEPAGE)  # advice only: nothing to do if refused
    if fill is not None:
        array.fill(fill)
    return array


class ContentNumbers:
    """Dense numbers for contents, first seen first, recycled oldest first past ``max_contents``.

    Invariants: the ``k``-th distinct content seen (from 0) gets number ``k % max_contents``,
    and when it does, the content that held that number before (the oldest still numbered) is
    forgotten -- the rule of :class:`kvprof.core.twin.CompiledTwin`'s own numbering, so the pool
    hands the policy the numbers the twin would have. Contents are known by a 64-bit
    fingerprint (Python's ``hash``; vLLM's keys are cryptographic digests), so two contents with
    the same fingerprint share a number: with ``m`` contents numbered, a new one does with
    probability ``m / 2**64``, and like a recycled number it only shifts ``wa``'s ghost and shadow
    statistics, never what the pool caches. ``_slots`` is a linear-probing table of the numbered
    fingerprints (:data:`_SLOT` int32s a slot: the fingerprint's halves, then number + 1, or
    :data:`_FREE` for none), at most half full; ``_number_fp[n]`` is number ``n``'s fingerprint, so recycling ``n`` deletes its entry.
    Every table by number (:attr:`BY_NUMBER`) is ``min(slots // 2, max_contents)`` long.

    The table doubles as contents come without stopping a call, neither for a rehash (60 ms at 1M
    slots) nor for the kernel's zeroing of new pages (2-4 ms at 1M slots). The tables that replace
    the slot table and the tables by number are made ready ahead (``_next``: written a few thousand
    entries a call from when the table is :data:`READY_FROM` full; ``_next_written`` slots of the slot
    table, ``_copied`` numbers of the tables by number, copied from the current ones or filled; a write
    by number below ``_copied`` goes to both, so the copy stays exact). Once it has doubled, the entries
    of the table it outgrew (``_old``, empty when none) move over 2-8 slots per
    content looked up (``_moved``: how many of its slots were done), and one found there first moves at
    once; every numbered fingerprint is in exactly one of the two tables, and a slot of the old one that
    gave up its entry is :data:`_GONE`, so the old table's probe runs stay whole. The old table is empty
    again before the new one is half full. Memory grows with the contents seen, to at most
    ``max_contents`` x 32-56 bytes (the table's 12-byte slots, a power of two at most half full, and
    the 8-byte reverse map), and up to three times as much in the last sixteenth before a doubling.
    """

    #: The tables indexed by content number: (attribute, dtype, what a number not handed out holds).
    BY_NUMBER: tuple[tuple[str, type, int], ...] = (("_number_fp", np.int64, 0),)

    def __init__(self, max_contents: int) -> None:
        if max_contents < 1:
            raise ValueError(f"max_contents must be positive, got {max_contents}")
        self.max_contents = max_contents
        #: Old slots moved per call at least (a test sets it low to see the tables mid-move).
        self.move_min = MOVE_MIN
        #: Slots and numbers made ready per call at least (a test sets it low to see them mid-way).
        self.ready_min = READY_MIN
        self.clear()

    def clear(self) -> None:
        """Forget every content (numbering restarts at 0)."""
        self._slots = np.zeros(64 * _SLOT, dtype=np.int32)
        self._old = np.zeros(0, dtype=np.int32)
        self._moved = 0
        for name, dtype, fill in self.BY_NUMBER:
            setattr(self, name, np.full(min(32, self.max_contents), fill, dtype=dtype))
        self._seen = np.zeros(1, dtype=np.int64)  # distinct contents numbered so far (in the compiled call)
        self._prepare(0)

    def __len__(self) -> int:
        """Contents holding a number now."""
        return int(min(self._seen[0], self.max_contents))

    @property
    def size(self) -> int:
        """Slots of the table."""
        return len(self._slots) // _SLOT

    def numbers(self, contents: Sequence[Hashable]) -> np.ndarray:
        """The numbers of ``contents`` (no None) in order, as int64, numbering the new ones."""
        n = len(contents)
        fingerprints = np.fromiter(map(hash, contents), dtype=np.int64, count=n)
        out = np.empty(n, dtype=np.int64)
        if n:
            self._reserve(n)
            _number_all(self._slots, self._old, self._number_fp, self._next["_number_fp"], self._copied, self._seen,
                        self.max_contents, fingerprints, out)
        return out

    def number(self, content: Hashable) -> int:
        """The number of ``content`` (not None), numbering it if new: :meth:`numbers` of one, without arrays."""
        self._reserve(1)
        return int(_number_one(self._slots, self._old, self._number_fp, self._next["_number_fp"], self._copied,
                               self._seen, self.max_contents, hash(content)))

    def _reserve(self, n: int) -> None:
        """Room for ``n`` more contents: the table at most half full, the tables by number long enough; the
        next slots of an outgrown table moved over, and the tables that replace these made ready further."""
        if len(self._old):
            self._move(max(2 * n, min(8 * n, MOVE_CAP)) + self.move_min)
        live = min(int(self._seen[0]) + n, self.max_contents)
        size = self.size
        if 2 * live > size:
            grown = 2 * size
            while 2 * live > grown:
                grown *= 2
            if len(self._next["_slots"]) != grown * _SLOT:  # (only a call of many contents comes here unready)
                self._prepare(grown)
            self._make_ready(grown, grown)
            if len(self._old):  # (only a call of more contents than the table held comes here)
                self._move(len(self._old) // _SLOT)
            self._old = self._slots
            for name, table in self._next.items():
                setattr(self, name, table)
            self._moved = 0
            self._prepare(0)
        elif live > READY_FROM * size and size < 2 * self.max_contents:
            if not len(self._next["_slots"]):
                self._prepare(2 * size)
            self._make_ready(READY_SLOTS * n + self.ready_min, READY_NUMBERS * n + self.ready_min)

    def _prepare(self, size: int) -> None:
        """Start the tables that replace these when the slot table grows to ``size`` slots (none for 0); their
        pages are written by :meth:`_make_ready`, not here (a large array is only mapped until written)."""
        by_number = min(size // 2, self.max_contents)
        self._next = {"_slots": small_paged(size * _SLOT, np.int32),
                      **{name: small_paged(by_number, dtype) for name, dtype, _ in self.BY_NUMBER}}
        self._next_written = 0
        self._copied = 0

    def _make_ready(self, slots: int, numbers: int) -> None:
        """Write the next ``slots`` slots of the next slot table (free) and the next ``numbers`` entries of
        each next table by number (copied from the current one below its length, else its fill)."""
        table = self._next["_slots"]
        start, end = self._next_written, min(self._next_written + slots, len(table) // _SLOT)
        table[start * _SLOT:end * _SLOT] = _FREE
        self._next_written = end
        start = self._copied
        end = min(start + numbers, len(self._next["_number_fp"]))
        for name, _, fill in self.BY_NUMBER:
            current, target = getattr(self, name), self._next[name]
            kept = max(start, min(end, len(current)))
            target[start:kept] = current[start:kept]
            target[kept:end] = fill
        self._copied = end

    def _move(self, budget: int) -> None:
        """Move the outgrown table's next ``budget`` slots over; drop it when all are."""
        self._moved = _move(self._slots, self._old, self._moved, budget)
        if self._moved >= len(self._old) // _SLOT:
            self._old = np.zeros(0, dtype=np.int32)


class RecentContentNumbers(ContentNumbers):
    """Dense numbers for contents, handed out from 0 up, recycled least recently used first past
    ``max_contents``: the rule of the live counterfactual (:class:`kvprof.vllm.observe.Counterfactual`).

    Invariants: while fewer than ``max_contents`` contents were seen, a new one gets the next number;
    after that it gets the number of the content seen (numbered or looked up) least recently, which
    is forgotten. ``_older``/``_newer`` link the numbers in use from the least to the most recently
    seen (``_state``: how many numbers were handed out, the oldest, the newest; -1 for none), so a
    content costs the base table's 32-56 bytes plus 8. Fingerprints and tables as in :class:`ContentNumbers`.
    """

    BY_NUMBER = (*ContentNumbers.BY_NUMBER, ("_older", np.int32, _EMPTY), ("_newer", np.int32, _EMPTY))

    def clear(self) -> None:
        super().clear()
        self._state = np.array([0, _EMPTY, _EMPTY], dtype=np.int64)
        self._seen = self._state[:1]

    def renumber(self, contents: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray]:
        """The numbers of ``contents`` in order (int64), numbering the new ones, and the numbers
        whose old contents were forgotten to do so (in the order they were, possibly repeated)."""
        n = len(contents)
        fingerprints = np.fromiter(map(hash, contents), dtype=np.int64, count=n)
        out = np.empty(n, dtype=np.int64)
        recycled = np.empty(n, dtype=np.int64)
        n_recycled = 0
        if n:
            self._reserve(n)
            following = self._next
            n_recycled = _number_all_recent(self._slots, self._old,
                                            self._number_fp, self._older, self._newer, following["_number_fp"],
                                            following["_older"], following["_newer"], self._copied, self._state,
                                            self.max_contents, fingerprints, out, recycled)
        return out, recycled[:n_recycled]

    def numbers(self, contents: Sequence[Hashable]) -> np.ndarray:
        return self.renumber(contents)[0]

    def number(self, content: Hashable) -> int:
        return int(self.renumber((content,))[0][0])


@njit(cache=True)
def _home(fingerprint, mask):
    # Fibonacci hashing: Python's hash of small ints is the int itself, so spread the bits.
    return ((fingerprint * np.int64(-7046029254386353131)) >> np.int64(17)) & mask


@njit(cache=True)
def _fp(slots, i):
    """Slot ``i``'s fingerprint."""
    return (np.int64(slots[_SLOT * i + 1]) << 32) | (np.int64(slots[_SLOT * i]) & np.int64(0xFFFFFFFF))


@njit(cache=True)
def _held(slots, i):
    """What slot ``i`` holds: number + 1, :data:`_FREE` or :data:`_GONE`."""
    return slots[_SLOT * i + 2]


@njit(cache=True)
def _fill(slots, i, fingerprint, held):
    slots[_SLOT * i] = (fingerprint << 32) >> 32  # the low half, sign-extended: an int32
    slots[_SLOT * i + 1] = fingerprint >> 32
    slots[_SLOT * i + 2] = held


@njit(cache=True)
def _move(slots, old, moved, budget):
    """Move the entries of old slots ``moved`` .. ``moved + budget`` into the table; returns the slots done."""
    mask = len(slots) // _SLOT - 1
    end = min(moved + budget, len(old) // _SLOT)
    for k in range(moved, end):
        held = _held(old, k)
        if held > _FREE:
            fingerprint = _fp(old, k)
            i = _home(fingerprint, mask)
            while _held(slots, i) != _FREE:
                i = (i + 1) & mask
            _fill(slots, i, fingerprint, held)
            old[_SLOT * k + 2] = _GONE
    return end


@njit(cache=True)
def _delete(slots, fingerprint, number, mask):
    """Remove ``fingerprint``'s entry (holding ``number``), shifting its run back (no tombstones);
    False if the table has none."""
    i = _home(fingerprint, mask)
    while not (_held(slots, i) == number + 1 and _fp(slots, i) == fingerprint):
        if _held(slots, i) == _FREE:
            return False
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if _held(slots, j) == _FREE:
            break
        home = _home(_fp(slots, j), mask)
        # the entry at j may fill the hole at i when its home is not cyclically in (i, j]
        if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
            for part in range(_SLOT):
                slots[_SLOT * i + part] = slots[_SLOT * j + part]
            i = j
    slots[_SLOT * i + 2] = _FREE
    return True


@njit(cache=True)
def _find_old(old, fingerprint, number):
    """The outgrown table's slot holding ``fingerprint`` (with ``number`` + 1 unless ``number`` < 0), or -1."""
    if len(old) == 0:
        return -1
    mask = len(old) // _SLOT - 1
    i = _home(fingerprint, mask)
    while _held(old, i) != _FREE:
        if _held(old, i) > _FREE and _fp(old, i) == fingerprint and (number < 0 or _held(old, i) == number + 1):
            return i
        i = (i + 1) & mask
    return -1


@njit(cache=True)
def _look_up(slots, old, fingerprint, mask):
    """The slot holding ``fingerprint``, or the free slot that ends its run; one still in the outgrown table
    moves over first."""
    i = _find(slots, fingerprint, mask)
    if _held(slots, i) == _FREE:
        j = _find_old(old, fingerprint, -1)
        if j >= 0:
            _fill(slots, i, fingerprint, _held(old, j))
            old[_SLOT * j + 2] = _GONE
    return i


@njit(cache=True)
def _number_all(slots, old, number_fp, next_number_fp, copied, seen, max_contents, fingerprints, out):
    for k in range(len(fingerprints)):
        out[k] = _number_one(slots, old, number_fp, next_number_fp, copied, seen, max_contents, fingerprints[k])


@njit(cache=True)
def _number_one(slots, old, number_fp, next_number_fp, copied, seen, max_contents, fingerprint):
    """:class:`ContentNumbers`'s rule for one content; returns its number."""
    mask = len(slots) // _SLOT - 1
    i = _look_up(slots, old, fingerprint, mask)
    if _held(slots, i) != _FREE:
        return np.int64(_held(slots, i) - 1)
    number = seen[0] % max_contents
    if seen[0] >= max_contents:  # the number's old content is forgotten first
        i = _renumber(slots, old, number_fp, number, fingerprint, mask)
    _enter(slots, number_fp, next_number_fp, copied, i, number, fingerprint)
    seen[0] += 1
    return number


@njit(cache=True)
def _find(slots, fingerprint, mask):
    """The slot holding ``fingerprint``, or the free slot that ends its run."""
    i = _home(fingerprint, mask)
    while _held(slots, i) != _FREE and _fp(slots, i) != fingerprint:
        i = (i + 1) & mask
    return i


@njit(cache=True)
def _renumber(slots, old, number_fp, number, fingerprint, mask):
    """Forget ``number``'s content (in whichever table holds it); returns the free slot where ``fingerprint`` goes."""
    forgotten = number_fp[number]
    if not _delete(slots, forgotten, number, mask):
        j = _find_old(old, forgotten, number)
        if j >= 0:
            old[_SLOT * j + 2] = _GONE
    return _find(slots, fingerprint, mask)


@njit(cache=True)
def _enter(slots, number_fp, next_number_fp, copied, i, number, fingerprint):
    _fill(slots, i, fingerprint, number + 1)
    _put(number_fp, next_number_fp, copied, number, fingerprint)


@njit(cache=True)
def _put(table, next_table, copied, number, value):
    """``table[number] = value``, and in the table that replaces it where that was copied already."""
    table[number] = value
    if number < copied:
        next_table[number] = value


@njit(cache=True)
def _number_all_recent(slots, old, number_fp, older, newer, next_number_fp, next_older, next_newer, copied, state,
                       max_contents, fingerprints, out, recycled):
    """:class:`RecentContentNumbers`'s rule; returns how many numbers it wrote to ``recycled``."""
    mask = len(slots) // _SLOT - 1
    n_recycled = 0
    for k in range(len(fingerprints)):
        fingerprint = fingerprints[k]
        i = _look_up(slots, old, fingerprint, mask)
        if _held(slots, i) != _FREE:
            number = np.int64(_held(slots, i) - 1)
            _unlink(older, newer, next_older, next_newer, copied, state, number)
        else:
            if state[0] < max_contents:
                number = state[0]
                state[0] += 1
            else:  # the least recently used content gives up its number
                number = state[1]
                _unlink(older, newer, next_older, next_newer, copied, state, number)
                i = _renumber(slots, old, number_fp, number, fingerprint, mask)
                recycled[n_recycled] = number
                n_recycled += 1
            _enter(slots, number_fp, next_number_fp, copied, i, number, fingerprint)
        # the newest end of the recency list
        _put(older, next_older, copied, number, state[2])
        _put(newer, next_newer, copied, number, _EMPTY)
        if state[2] != _EMPTY:
            _put(newer, next_newer, copied, state[2], number)
        else:
            state[1] = number
        state[2] = number
        out[k] = number
    return n_recycled


@njit(cache=True)
def _unlink(older, newer, next_older, next_newer, copied, state, number):
    before, after = older[number], newer[number]
    if before != _EMPTY:
        _put(newer, next_newer, copied, before, after)
    else:
        state[1] = after
    if after != _EMPTY:
        _put(older, next_older, copied, after, before)
    else:
        state[2] = before
