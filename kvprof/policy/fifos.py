"""One FIFO of evictable blocks per workload class, operated on in bulk with numpy.

The storage behind :class:`kvprof.policy.classed.ClassedLRUPolicy`. vLLM frees and evicts blocks
hundreds at a time (``append_n``, ``popleft_n``), so every operation here takes or returns whole
arrays and costs a fixed handful of numpy calls however many classes and blocks it touches; a
Python loop per block or per class would cost more than vLLM's own free list.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NOWHERE = -1


@dataclass(frozen=True)
class Candidates:
    """The first live blocks of every row, rows in class order, as :meth:`ClassFifos.front` gives them.

    ``blocks[i]`` sits at flat buffer position ``positions[i]`` in the row of ``classes[i]``; the
    candidates of class ``c`` start at index ``starts[c]``.
    """

    blocks: np.ndarray
    classes: np.ndarray
    positions: np.ndarray
    starts: np.ndarray


class ClassFifos:
    """Evictable blocks in one first-in-first-out row per class, all rows in one flat buffer.

    Invariant: for each class ``c`` the *live* entries of row ``c`` (buffer positions
    ``c * width + head[c]`` up to ``c * width + tail[c]``) are exactly the blocks pushed to class
    ``c`` and neither removed nor taken since, in push order (``live[c]`` of them). The entry at
    position ``q`` holding block ``b`` is live exactly when ``position[b] == q``; ``remove`` only
    clears ``position[b]``, so it is O(1), and the dead entry it leaves (``dead[c]`` counts them)
    is skipped by :meth:`front`, dropped when the head passes it, and compacted away once a row
    fills up.

    Block ids are small non-negative ints (vLLM's block ids, the simulator's slots): the per-block
    table is an array indexed by id, grown by :meth:`reserve`.
    """

    def __init__(self, n_classes: int, width: int = 256) -> None:
        self.n_classes = n_classes
        self.width = width
        self.buffer = np.zeros(n_classes * width, dtype=np.int64)
        self.head = np.zeros(n_classes, dtype=np.int64)
        self.tail = np.zeros(n_classes, dtype=np.int64)
        # Python lists: remove, the per-hit path, updates them one at a time.
        self.live = [0] * n_classes
        self.dead = [0] * n_classes
        self.position = np.full(0, _NOWHERE, dtype=np.int64)
        self.size = 0
        self._class_ids = np.arange(n_classes)
        self._row_start = self._class_ids * width

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block: int) -> bool:
        return 0 <= block < len(self.position) and self.position[block] != _NOWHERE

    def reserve(self, n_blocks: int) -> None:
        """Make the per-block table cover block ids ``0 .. n_blocks - 1``."""
        have = len(self.position)
        if n_blocks > have:
            self.position = np.concatenate([self.position, np.full(n_blocks - have, _NOWHERE, dtype=np.int64)])

    # -- in ---------------------------------------------------------------------------------
    def push(self, blocks: np.ndarray, classes: np.ndarray) -> None:
        """Append ``blocks`` (not evictable now, ids reserved) to the rows of ``classes``, in order."""
        k = len(blocks)
        first = int(classes[0])
        if (classes == first).all():  # the usual free: one request's blocks, one class
            if self.tail[first] + k > self.width:
                self._make_room(np.bincount(classes, minlength=self.n_classes))
            start = first * self.width + int(self.tail[first])
            self.buffer[start:start + k] = blocks
            self.position[blocks] = np.arange(start, start + k)
            self.tail[first] += k
            self.live[first] += k
        else:
            order = np.argsort(classes.astype(np.int16), kind="stable")  # int16: a radix sort
            blocks, classes = blocks[order], classes[order]
            counts = np.bincount(classes, minlength=self.n_classes)
            if (self.tail + counts > self.width).any():
                self._make_room(counts)
            positions = np.repeat(self._row_start + self.tail - (np.cumsum(counts) - counts), counts) + np.arange(k)
            self.buffer[positions] = blocks
            self.position[blocks] = positions
            self.tail += counts
            self.live = (np.array(self.live) + counts).tolist()
        self.size += k

    def _make_room(self, incoming: np.ndarray) -> None:
        """Compact the rows that would overflow to their live entries; widen all rows if that is
        not enough. Rows are kept at least four times what they must hold, so this is rare."""
        need = np.array(self.live) + incoming
        if (need > self.width // 2).any():
            width = self.width
            while (need > width // 4).any():
                width *= 2
            self._relocate(range(self.n_classes), width)
        else:
            self._relocate(np.flatnonzero(self.tail + incoming > self.width).tolist(), self.width)

    def _relocate(self, rows, width: int) -> None:
        """Move the live entries of ``rows`` to the start of their rows in a buffer of ``width``."""
        buffer = self.buffer if width == self.width else np.zeros(self.n_classes * width, dtype=np.int64)
        for c in rows:
            positions = np.arange(c * self.width + self.head[c], c * self.width + self.tail[c])
            entries = self.buffer[positions]
            live = entries[self.position[entries] == positions]
            buffer[c * width:c * width + len(live)] = live
            self.position[live] = np.arange(c * width, c * width + len(live))
            self.head[c], self.tail[c], self.dead[c] = 0, len(live), 0
        self.buffer, self.width = buffer, width
        self._row_start = self._class_ids * width

    # -- out --------------------------------------------------------------------------------
    def remove(self, block: int) -> None:
        """Take an evictable block out (a prefix hit). Raises KeyError if it is not evictable."""
        try:
            position = self.position.item(block)
        except IndexError:
            raise KeyError(block) from None
        if position == _NOWHERE:
            raise KeyError(block)
        self.position[block] = _NOWHERE
        cls = position // self.width
        self.live[cls] -= 1
        self.dead[cls] += 1
        self.size -= 1

    def front(self, n: int) -> Candidates:
        """The first ``min(n, live[c])`` live blocks of every row; nothing changes until :meth:`take`."""
        want = np.minimum(self.live, n)
        if not any(self.dead):  # no dead entries: the first ``want`` entries are the answer
            return self._window(want)
        # The first ``want`` live entries lie within ``want + dead`` entries, but scanning every
        # dead entry of a long row for a few blocks is wasteful: look a little past ``want``
        # first, and only for the rows still short scan the whole guaranteed window.
        room = self.tail - self.head
        dead = np.array(self.dead)
        window = self._window(np.minimum(room, want + np.minimum(dead, want) + 8))
        alive = self.position[window.blocks] == window.positions
        found = np.bincount(window.classes[alive], minlength=self.n_classes)
        if (found < want).any():
            window = self._window(np.minimum(room, want + dead))
            alive = self.position[window.blocks] == window.positions
            found = np.bincount(window.classes[alive], minlength=self.n_classes)
        classes = window.classes[alive]
        keep = np.arange(len(classes)) - (np.cumsum(found) - found)[classes] < want[classes]
        picked = np.flatnonzero(alive)[keep]
        return Candidates(window.blocks[picked], classes[keep], window.positions[picked], np.cumsum(want) - want)

    def _window(self, width: np.ndarray) -> Candidates:
        """The first ``width[c]`` entries of every row, live or not."""
        starts = np.cumsum(width) - width
        positions = np.repeat(self._row_start + self.head - starts, width) + np.arange(starts[-1] + width[-1])
        return Candidates(self.buffer[positions], np.repeat(self._class_ids, width), positions, starts)

    def take(self, candidates: Candidates, picked) -> None:
        """Remove ``candidates`` at ``picked``: from each row a prefix of its candidates."""
        self.position[candidates.blocks[picked]] = _NOWHERE
        counts = np.bincount(candidates.classes[picked], minlength=self.n_classes)
        taken = np.flatnonzero(counts)
        head = candidates.positions[candidates.starts[taken] + counts[taken] - 1] + 1 - self._row_start[taken]
        passed = head - self.head[taken]
        self.head[taken] = head
        live, dead = np.array(self.live), np.array(self.dead)
        live -= counts
        dead[taken] -= passed - counts[taken]  # dead entries the head moved past
        self.live, self.dead = live.tolist(), dead.tolist()
        self.size -= int(counts.sum())

    def clear(self) -> None:
        self.position[:] = _NOWHERE
        self.head[:] = 0
        self.tail[:] = 0
        self.live = [0] * self.n_classes
        self.dead = [0] * self.n_classes
        self.size = 0
