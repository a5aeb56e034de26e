"""One FIFO of evictable blocks per workload class, operated on in bulk with numpy.

The storage behind :class:`kvprof.policy.classed.ClassedLRUPolicy`. vLLM frees and evicts blocks
hundreds at a time (``append_n``, ``popleft_n``), so every operation here takes or returns whole
arrays and costs a fixed handful of numpy calls however many classes and blocks it touches; a
Python loop per block or per class would cost more than vLLM's own free list.
"""

from __future__ import annotations

import numpy as np

_NOWHERE = -1


class ClassFifos:
    """Evictable blocks in one first-in-first-out list per class, all rows of one 2-d buffer.

    Invariant: for each class ``c`` the *live* entries of row ``c`` between ``head[c]`` and
    ``tail[c]`` are exactly the blocks pushed to class ``c`` and neither removed nor taken since,
    in push order (``live[c]`` of them). Entry ``(c, j)`` holding block ``b`` is live exactly when
    ``where[b] == c`` and ``column[b] == j``. ``remove`` only clears ``where[b]``, so it is O(1);
    the dead entry it leaves (``dead[c]`` counts them) is skipped by :meth:`front`, dropped when
    the head passes it, and compacted away once a row fills up.

    Block ids are small non-negative ints (vLLM's block ids, the simulator's slots): the per-block
    tables are arrays indexed by id, grown on demand.
    """

    def __init__(self, n_classes: int, width: int = 256) -> None:
        self.n_classes = n_classes
        self._class_ids = np.arange(n_classes)
        self.rows = np.zeros((n_classes, width), dtype=np.int64)
        self.head = np.zeros(n_classes, dtype=np.int64)
        self.tail = np.zeros(n_classes, dtype=np.int64)
        # Python lists: remove, the per-hit path, updates them one at a time.
        self.live = [0] * n_classes
        self.dead = [0] * n_classes
        self.where = np.full(0, _NOWHERE, dtype=np.int64)
        self.column = np.zeros(0, dtype=np.int64)
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block: int) -> bool:
        return 0 <= block < len(self.where) and self.where[block] != _NOWHERE

    def reserve(self, n_blocks: int) -> None:
        """Make the per-block tables cover block ids ``0 .. n_blocks - 1``."""
        have = len(self.where)
        if n_blocks > have:
            grown = max(n_blocks, 2 * have, 64)
            self.where = np.concatenate([self.where, np.full(grown - have, _NOWHERE, dtype=np.int64)])
            self.column = np.concatenate([self.column, np.zeros(grown - have, dtype=np.int64)])

    # -- in ---------------------------------------------------------------------------------
    def push(self, blocks: np.ndarray, classes: np.ndarray) -> None:
        """Append ``blocks`` (not evictable now, ids reserved) to the rows of ``classes``, in order."""
        k = len(blocks)
        first = int(classes[0])
        if (classes == first).all():  # the usual free: one request's blocks, one class
            tail = int(self.tail[first])
            if tail + k > self.rows.shape[1]:
                incoming = np.zeros(self.n_classes, dtype=np.int64)
                incoming[first] = k
                self._make_room(incoming)
                tail = int(self.tail[first])
            self.rows[first, tail:tail + k] = blocks
            self.where[blocks] = first
            self.column[blocks] = np.arange(tail, tail + k)
            self.tail[first] = tail + k
            self.live[first] += k
        else:
            order = np.argsort(classes, kind="stable")
            blocks, classes = blocks[order], classes[order]
            counts = np.bincount(classes, minlength=self.n_classes)
            if (self.tail + counts > self.rows.shape[1]).any():
                self._make_room(counts)
            columns = np.repeat(self.tail - (np.cumsum(counts) - counts), counts) + np.arange(k)
            self.rows[classes, columns] = blocks
            self.where[blocks] = classes
            self.column[blocks] = columns
            self.tail += counts
            self.live = (np.array(self.live) + counts).tolist()
        self.size += k

    def _make_room(self, incoming: np.ndarray) -> None:
        """Compact every row to its live entries, then widen the buffer if still short."""
        n_classes, width = self.rows.shape
        need = np.array(self.live) + incoming
        while (need > width // 2).any():  # leave half a row free: compactions stay rare
            width *= 2
        rows = np.zeros((n_classes, width), dtype=np.int64)
        for c in range(n_classes):
            columns = np.arange(self.head[c], self.tail[c])
            entries = self.rows[c, columns]
            live = entries[(self.where[entries] == c) & (self.column[entries] == columns)]
            rows[c, : len(live)] = live
            self.column[live] = np.arange(len(live))
            self.tail[c] = len(live)
        self.head[:] = 0
        self.dead = [0] * n_classes
        self.rows = rows

    # -- out --------------------------------------------------------------------------------
    def remove(self, block: int) -> None:
        """Take an evictable block out (a prefix hit). Raises KeyError if it is not evictable."""
        try:
            cls = self.where.item(block)
        except IndexError:
            raise KeyError(block) from None
        if cls == _NOWHERE:
            raise KeyError(block)
        self.where[block] = _NOWHERE
        self.live[cls] -= 1
        self.dead[cls] += 1
        self.size -= 1

    def front(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The first ``min(n, live[c])`` live blocks of every row, rows in class order.

        Returns ``(blocks, classes, columns)``, each block's class and buffer column; nothing
        changes until :meth:`take`.
        """
        live = np.array(self.live)
        want = np.minimum(live, n)
        dead = np.array(self.dead)
        if not dead[want > 0].any():  # no dead entry in any window: the windows are the answer
            return self._window(want)
        # The first ``want`` live entries lie within ``want + dead`` entries, but scanning every
        # dead entry of a long row for a few blocks is wasteful: look a little past ``want``
        # first, and only for the rows still short scan the whole guaranteed window.
        room = self.tail - self.head
        width = np.minimum(room, want + np.minimum(dead, want) + 8)
        blocks, classes, columns, alive, found = self._live_window(width)
        short = found < want
        if short.any():
            width = np.where(short, np.minimum(room, want + dead), width)
            blocks, classes, columns, alive, found = self._live_window(width)
        blocks, classes, columns = blocks[alive], classes[alive], columns[alive]
        rank = np.arange(len(blocks)) - (np.cumsum(found) - found)[classes]
        keep = rank < want[classes]
        return blocks[keep], classes[keep], columns[keep]

    def _live_window(self, width: np.ndarray):
        """:meth:`_window` with which entries are live and how many per row."""
        blocks, classes, columns = self._window(width)
        alive = (self.where[blocks] == classes) & (self.column[blocks] == columns)
        return blocks, classes, columns, alive, np.bincount(classes[alive], minlength=self.n_classes)

    def _window(self, width: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Entries ``head[c] .. head[c] + width[c]`` of every row, concatenated in class order."""
        classes = np.repeat(self._class_ids, width)
        columns = np.repeat(self.head - (np.cumsum(width) - width), width) + np.arange(len(classes))
        return self.rows[classes, columns], classes, columns

    def take(self, blocks: np.ndarray, classes: np.ndarray, columns: np.ndarray) -> None:
        """Remove ``blocks``: from each row a prefix of its live entries, as :meth:`front` gave them."""
        self.where[blocks] = _NOWHERE
        counts = np.bincount(classes, minlength=self.n_classes)
        head = self.head.copy()
        np.maximum.at(self.head, classes, columns + 1)
        # The head moved past the taken entries and the dead ones among them.
        self.dead = (np.array(self.dead) - (self.head - head - counts)).tolist()
        self.live = (np.array(self.live) - counts).tolist()
        self.size -= len(blocks)

    def clear(self) -> None:
        self.where[:] = _NOWHERE
        self.head[:] = 0
        self.tail[:] = 0
        self.live = [0] * self.n_classes
        self.dead = [0] * self.n_classes
        self.size = 0
