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
    fills up or holds more dead entries than live ones. Memory: classes x width x 8 bytes, the
    width at least twice the longest row.

    Block ids are small non-negative ints (vLLM's block ids, the simulator's slots): the per-block
    table is an array indexed by id, grown by :meth:`reserve`.
    """

    def __init__(self, n_classes: int, width: int = 256) -> None:
        self.n_classes = n_classes
        self.width = width
        self.buffer = np.zeros(n_classes * width, dtype=np.int64)
        # Python lists: the one-block paths (remove on a hit, push_one, heads) update them one
        # at a time; the bulk paths turn them into arrays once per call.
        self.head = [0] * n_classes
        self.tail = [0] * n_classes
        self.live = [0] * n_classes
        self.dead = [0] * n_classes
        self.position = np.full(0, _NOWHERE, dtype=np.int64)
        self.size = 0
        self._class_ids = np.arange(n_classes)
        self._row_start = self._class_ids * width
        self._forget_heads()

    def _forget_heads(self) -> None:
        """Drop :meth:`heads`' memo of each row's first live entry (block, position).

        A remembered head stays right while its block is still at that position: rows only grow
        at the tail, and taking or removing the block moves it. Only moving entries (relocation,
        clear) can put another first entry in front of a block that is still live where it was.
        """
        self._known_heads = [(_NOWHERE, _NOWHERE)] * self.n_classes

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
            start = first * self.width + self.tail[first]
            self.buffer[start:start + k] = blocks
            self.position[blocks] = np.arange(start, start + k)
            self.tail[first] += k
            self.live[first] += k
        else:
            order = np.argsort(classes.astype(np.int16), kind="stable")  # int16: a radix sort
            blocks, classes = blocks[order], classes[order]
            counts = np.bincount(classes, minlength=self.n_classes)
            tail = np.array(self.tail)
            if (tail + counts > self.width).any():
                self._make_room(counts)
                tail = np.array(self.tail)
            positions = np.repeat(self._row_start + tail - (np.cumsum(counts) - counts), counts) + np.arange(k)
            self.buffer[positions] = blocks
            self.position[blocks] = positions
            self.tail = (tail + counts).tolist()
            self.live = (np.array(self.live) + counts).tolist()
        self.size += k

    def push_one(self, block: int, cls: int) -> None:
        """:meth:`push` of one block, in scalar steps (a short free costs less this way)."""
        tail = self.tail[cls]
        if tail == self.width:
            self._make_room(np.bincount([cls], minlength=self.n_classes))
            tail = self.tail[cls]
        at = cls * self.width + tail
        self.buffer[at] = block
        self.position[block] = at
        self.tail[cls] = tail + 1
        self.live[cls] += 1
        self.size += 1

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
            self._relocate(np.flatnonzero(np.array(self.tail) + incoming > self.width).tolist(), self.width)

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
        self._forget_heads()

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

    def heads(self) -> list[tuple[int, int, int]]:
        """``(class, block, position)`` of the first live entry of every non-empty row.

        Scalar reads, for taking a few blocks one at a time; dead entries met at a head are
        dropped on the way.
        """
        buffer, position, head, dead, width = self.buffer, self.position, self.head, self.dead, self.width
        known = self._known_heads
        found = []
        for cls, live in enumerate(self.live):
            if live:
                block, at = known[cls]
                if at < 0 or position.item(block) != at:
                    at = cls * width + head[cls]
                    block = buffer.item(at)
                    if position.item(block) != at:
                        while position.item(block) != at:  # a dead entry: the block was removed
                            at += 1
                            block = buffer.item(at)
                            dead[cls] -= 1
                        head[cls] = at - cls * width
                    known[cls] = (block, at)
                found.append((cls, block, at))
        return found

    def row_after(self, cls: int, after: int):
        """Live ``(block, position)`` entries of row ``cls`` past position ``after``, one at a time."""
        buffer, position = self.buffer, self.position
        at, end = after + 1, cls * self.width + self.tail[cls]
        while at < end:
            block = buffer.item(at)
            if position.item(block) == at:
                yield block, at
            at += 1

    def take_prefix(self, cls: int, blocks: list[int], last: int) -> None:
        """Remove ``blocks``, the first live entries of row ``cls`` up to position ``last``."""
        position = self.position
        for block in blocks:
            position[block] = _NOWHERE
        head = last + 1 - cls * self.width
        self.dead[cls] -= head - self.head[cls] - len(blocks)  # dead entries the head passed
        self.head[cls] = head
        self.live[cls] -= len(blocks)
        self.size -= len(blocks)

    def front(self, n: int) -> Candidates:
        """The first ``min(n, live[c])`` live blocks of every row; nothing changes until :meth:`take`."""
        want = np.minimum(self.live, n)
        if not any(self.dead):  # no dead entries: the first ``want`` entries are the answer
            return self._window(want)
        # Rows where hits left more dead entries than live ones are compacted first (each
        # remove pays for its entry once); then every row has its first ``want`` live entries
        # within ``want + dead``. Look a little past ``want`` first and widen only short rows.
        dead = np.array(self.dead)
        crowded = np.flatnonzero(dead > np.maximum(self.live, 64)).tolist()
        if crowded:
            self._relocate(crowded, self.width)
            dead = np.array(self.dead)
        room = np.array(self.tail) - np.array(self.head)
        width = np.minimum(room, want + np.minimum(dead, want) + 8)
        while True:
            window = self._window(width)
            alive = self.position[window.blocks] == window.positions
            found = np.bincount(window.classes[alive], minlength=self.n_classes)
            short = found < want
            if not short.any():
                break
            width = np.where(short, np.minimum(room, 2 * width), width)
        classes = window.classes[alive]
        keep = np.arange(len(classes)) - (np.cumsum(found) - found)[classes] < want[classes]
        picked = np.flatnonzero(alive)[keep]
        return Candidates(window.blocks[picked], classes[keep], window.positions[picked], np.cumsum(want) - want)

    def _window(self, width: np.ndarray) -> Candidates:
        """The first ``width[c]`` entries of every row, live or not."""
        starts = np.cumsum(width) - width
        positions = np.repeat(self._row_start + np.array(self.head) - starts, width) + np.arange(starts[-1] + width[-1])
        return Candidates(self.buffer[positions], np.repeat(self._class_ids, width), positions, starts)

    def take(self, candidates: Candidates, picked) -> None:
        """Remove ``candidates`` at ``picked``: from each row a prefix of its candidates."""
        self.position[candidates.blocks[picked]] = _NOWHERE
        counts = np.bincount(candidates.classes[picked], minlength=self.n_classes)
        taken = np.flatnonzero(counts)
        head, live, dead = np.array(self.head), np.array(self.live), np.array(self.dead)
        moved = candidates.positions[candidates.starts[taken] + counts[taken] - 1] + 1 - self._row_start[taken]
        dead[taken] -= moved - head[taken] - counts[taken]  # dead entries the head moved past
        head[taken] = moved
        live -= counts
        self.head, self.live, self.dead = head.tolist(), live.tolist(), dead.tolist()
        self.size -= int(counts.sum())

    def clear(self) -> None:
        self.position[:] = _NOWHERE
        self.head = [0] * self.n_classes
        self.tail = [0] * self.n_classes
        self.live = [0] * self.n_classes
        self.dead = [0] * self.n_classes
        self.size = 0
        self._forget_heads()
