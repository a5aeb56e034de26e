"""Class lists of evictable blocks and their greedy merge, the engine of ``ClassedLRUPolicy``.

vLLM evicts one block at a time while decoding and hundreds at once for a prefill, and frees a
finished request's blocks together; both ends must stay cheap. Blocks freed together share a
stamp, hence a score, and leave together whenever their score is below every other list's
head: the merge moves such *runs* as numpy slices and steps block by block only through ties.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

_NOWHERE = -1


class ClassFifos:
    """Evictable blocks in one first-in-first-out row per class, all rows in one flat buffer.

    Invariant: for each class ``c`` the *live* entries of row ``c`` (buffer positions
    ``c * width + head[c]`` up to ``c * width + tail[c]``) are exactly the blocks pushed to class
    ``c`` and neither removed nor taken since, in push order (``live[c]`` of them). The entry at
    position ``q`` holding block ``b`` is live exactly when ``position[b] == q``; ``remove`` only
    clears ``position[b]``, so it is O(1), and the dead entry it leaves (``dead[c]`` counts them)
    is skipped by the merge, dropped when the head passes it, and compacted away when a row fills
    up or holds more dead entries (over 64) than live ones.

    ``runs[c]`` cuts row ``c`` from its head to its tail into runs ``[start, end, stamp]`` (flat
    positions, in row order): entries pushed together with one stamp.

    Block ids are small non-negative ints (vLLM's block ids, the simulator's slots): the per-block
    table is an array indexed by id, grown by :meth:`reserve`. Memory: classes x width x 8 bytes,
    the width at least twice the longest row.
    """

    def __init__(self, n_classes: int, width: int = 256) -> None:
        self.n_classes = n_classes
        self.width = width
        self.buffer = np.zeros(n_classes * width, dtype=np.int64)
        self.position = np.full(0, _NOWHERE, dtype=np.int64)
        # Python lists: the one-block paths (remove on a hit, push_one, the merge's steps) update
        # them one at a time; the bulk paths turn them into arrays once per call.
        self.head = [0] * n_classes
        self.tail = [0] * n_classes
        self.live = [0] * n_classes
        self.dead = [0] * n_classes
        self.runs: list[list[list]] = [[] for _ in range(n_classes)]
        self.size = 0
        self._row_start = np.arange(n_classes) * width
        self._known_heads: list[tuple | None] = [None] * n_classes
        self._crowded: set[int] = set()  # rows where hits left more dead entries than live ones

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
    def push(self, blocks: np.ndarray, classes: np.ndarray, stamps) -> None:
        """Append ``blocks`` (not evictable now, ids reserved) to the rows of ``classes``, in order.

        ``stamps``: one stamp for all (a free stamps them all with its time) or one per block.
        """
        k = len(blocks)
        one_stamp = np.ndim(stamps) == 0
        first = int(classes[0])
        if (classes == first).all():  # the usual free: one request's blocks, one class
            if self.tail[first] + k > self.width:
                self._make_room(np.bincount(classes[:1], minlength=self.n_classes) * k)
            start = first * self.width + self.tail[first]
            positions = np.arange(start, start + k)
            self.buffer[start:start + k] = blocks
            self.tail[first] += k
            self.live[first] += k
            row_starts, counts = {first: start}, {first: k}
        else:
            order = np.argsort(classes.astype(np.int16), kind="stable")  # int16: a radix sort
            blocks, classes = blocks[order], classes[order]
            stamps = stamps if one_stamp else stamps[order]
            counts = np.bincount(classes, minlength=self.n_classes)
            tail = np.array(self.tail)
            if (tail + counts > self.width).any():
                self._make_room(counts)
                tail = np.array(self.tail)
            starts = self._row_start + tail
            positions = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(k)
            self.buffer[positions] = blocks
            self.tail = (tail + counts).tolist()
            self.live = (np.array(self.live) + counts).tolist()
            present = np.flatnonzero(counts).tolist()
            row_starts = dict(zip(present, starts[present].tolist()))
            counts = dict(zip(present, counts[present].tolist()))
        self.position[blocks] = positions
        self.size += k
        if one_stamp:  # one run per class
            stamp = float(stamps)
            for cls, start in row_starts.items():
                self._add_run(cls, start, start + counts[cls], stamp)
        else:  # a run wherever the class or the stamp changes
            cuts = np.flatnonzero((classes[1:] != classes[:-1]) | (stamps[1:] != stamps[:-1])) + 1
            bounds = [0, *cuts.tolist(), k]
            firsts = bounds[:-1]
            for cls, start, end, stamp in zip(classes[firsts].tolist(), positions[firsts].tolist(),
                                              (positions[np.array(bounds[1:]) - 1] + 1).tolist(), stamps[firsts].tolist()):
                self._add_run(cls, start, end, stamp)

    def push_one(self, block: int, cls: int, stamp: float) -> None:
        """:meth:`push` of one block, in scalar steps (a short free costs less this way)."""
        if self.tail[cls] == self.width:
            self._make_room(np.bincount([cls], minlength=self.n_classes))
        at = cls * self.width + self.tail[cls]
        self.buffer[at] = block
        self.position[block] = at
        self.tail[cls] += 1
        self.live[cls] += 1
        self.size += 1
        self._add_run(cls, at, at + 1, stamp)

    def _add_run(self, cls: int, start: int, end: int, stamp: float) -> None:
        """Record entries ``start .. end`` of row ``cls`` as a run, extending the last one if it
        ends there with the same stamp."""
        runs = self.runs[cls]
        if runs and runs[-1][1] == start and runs[-1][2] == stamp:
            runs[-1][1] = end
        else:
            runs.append([start, end, stamp])

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
            if not self.live[c]:  # nothing to keep: an empty row starts over
                self.head[c], self.tail[c], self.dead[c], self.runs[c] = 0, 0, 0, []
                continue
            base = c * self.width + self.head[c]
            positions = np.arange(base, c * self.width + self.tail[c])
            entries = self.buffer[positions]
            alive = self.position[entries] == positions
            live = entries[alive]
            buffer[c * width:c * width + len(live)] = live
            self.position[live] = np.arange(c * width, c * width + len(live))
            # Each run keeps its live entries: its bounds become counts of live entries before them.
            before = np.concatenate([[0], np.cumsum(alive)])
            runs = self.runs[c]
            if runs:
                starts = before[np.array([run[0] for run in runs]) - base] + c * width
                ends = before[np.array([run[1] for run in runs]) - base] + c * width
                self.runs[c] = [[s, e, run[2]] for s, e, run in zip(starts.tolist(), ends.tolist(), runs) if s < e]
            self.head[c], self.tail[c], self.dead[c] = 0, len(live), 0
        self.buffer, self.width = buffer, width
        self._row_start = np.arange(self.n_classes) * width
        self._known_heads = [None] * self.n_classes
        self._crowded.difference_update(rows)

    # -- out --------------------------------------------------------------------------------
    def remove(self, block: int) -> None:
        """Take an evictable block out (a prefix hit). Raises KeyError if it is not evictable."""
        try:
            position = self.position.item(block) if block >= 0 else _NOWHERE
        except IndexError:
            raise KeyError(block) from None
        if position == _NOWHERE:
            raise KeyError(block)
        self.position[block] = _NOWHERE
        cls = position // self.width
        self.live[cls] -= 1
        self.dead[cls] += 1
        self.size -= 1
        if self.dead[cls] > 64 and self.dead[cls] > self.live[cls]:
            self._crowded.add(cls)

    def merge(self, n: int, key: Callable[[int, int, float, float], tuple], now: float, uniform_runs: bool = False,
              take: bool = True) -> list | np.ndarray:
        """The first ``n`` blocks of the greedy merge of the rows: repeatedly the row head with the
        lowest ``key(class, block, stamp, now)`` (the stamp its run was pushed with); removed from
        the rows if ``take``.

        ``key`` must give every block of a run the same first element (its score) and end with the
        class, so that no two heads tie; ``uniform_runs`` says it gives them the same key outright.
        A head whose score is below every other head's (or any head, with ``uniform_runs``)
        leaves with the rest of its run, in one slice; ties and single victims go block by block.
        Returns a list for a single victim, else an array.
        """
        if n > self.size:
            raise IndexError(f"{n} victims asked for, {self.size} evictable")
        if n <= 0:
            return []
        if self._crowded:  # more dead entries than live ones: compacting beats scanning past them
            self._relocate(sorted(self._crowded), self.width)
        runs = self.runs
        heap = [(key(cls, block, runs[cls][run_index][2], now), cls, run_index, at, block)
                for cls, run_index, at, block in self._heads()]
        heapq.heapify(heap)
        chunks = []
        stop_at = {}  # class -> (run index, position after its last victim)
        taken = {}  # class -> how many victims it gave
        need = n
        while need:
            head_key, cls, run_index, at, block = heap[0]
            runner_up = min(heap[1][0], heap[2][0]) if len(heap) > 2 else heap[1][0] if len(heap) == 2 else None
            if need > 1 and (uniform_runs or runner_up is None or head_key[0] < runner_up[0]):
                chunk, after = self._live_from(cls, at, runs[cls][run_index][1], need)
            else:
                chunk, after = [block], at + 1
            chunks.append(chunk)
            need -= len(chunk)
            taken[cls] = taken.get(cls, 0) + len(chunk)
            stop_at[cls] = run_index, after
            if not need:
                break
            following = self._next_live(cls, run_index, after)
            if following is None:
                heapq.heappop(heap)
            else:
                run_index, at, block = following
                heapq.heapreplace(heap, (key(cls, block, runs[cls][run_index][2], now), cls, *following))
        victims = chunks[0] if len(chunks) == 1 and isinstance(chunks[0], list) else np.concatenate(chunks)
        if take:
            self._take(victims, stop_at, taken)
        return victims

    def _heads(self) -> list[tuple[int, int, int, int]]:
        """``(class, run index, position, block)`` of the first live entry of every non-empty row.

        Remembered between calls: a remembered head stays right while its block is still at its
        position (rows only grow at the tail; taking or removing the block moves it), unless
        entries moved (relocation, clear), which forgets them all.
        """
        known, position, found = self._known_heads, self.position, []
        for cls, live in enumerate(self.live):
            if live:
                head = known[cls]
                if head is None or position.item(head[3]) != head[2]:
                    head = known[cls] = (cls, *self._next_live(cls, 0, self.runs[cls][0][0]))
                found.append(head)
        return found

    def _next_live(self, cls: int, run_index: int, at: int):
        """``(run index, position, block)`` of the first live entry of row ``cls`` at or after
        ``at`` in run ``run_index`` or a later one; None if there is none."""
        buffer, position, runs = self.buffer, self.position, self.runs[cls]
        while run_index < len(runs):
            start, end, _ = runs[run_index]
            at = max(at, start)
            while at < end:
                block = buffer.item(at)
                if position.item(block) == at:
                    return run_index, at, block
                at += 1
            run_index += 1
        return None

    def _live_from(self, cls: int, at: int, end: int, limit: int) -> tuple[np.ndarray, int]:
        """Up to ``limit`` live blocks of row ``cls`` from position ``at`` (live) to ``end``, and
        the position after the last of them."""
        if not self.dead[cls]:
            stop = min(end, at + limit)
            return self.buffer[at:stop], stop
        stop = min(end, at + limit + self.dead[cls])  # at most dead[cls] dead entries in between
        entries = self.buffer[at:stop]
        alive = np.flatnonzero(self.position[entries] == np.arange(at, stop))[:limit]
        return entries[alive], at + int(alive[-1]) + 1

    def _take(self, victims, stop_at, taken) -> None:
        """Remove the merge's victims: from each row everything before its stop, live or dead."""
        if isinstance(victims, list):  # one victim: a scalar store beats numpy's fancy indexing
            self.position[victims[0]] = _NOWHERE
        else:
            self.position[victims] = _NOWHERE
        for cls, (run_index, after) in stop_at.items():
            row_start = cls * self.width
            self.dead[cls] -= after - (row_start + self.head[cls]) - taken[cls]  # dead entries passed
            self.head[cls] = after - row_start
            self.live[cls] -= taken[cls]
            runs = self.runs[cls]
            del runs[:run_index]
            if runs[0][1] <= after:
                del runs[0]
            else:
                runs[0][0] = after
        self.size -= sum(taken.values())

    def clear(self) -> None:
        self.position[:] = _NOWHERE
        self.head = [0] * self.n_classes
        self.tail = [0] * self.n_classes
        self.live = [0] * self.n_classes
        self.dead = [0] * self.n_classes
        self.runs = [[] for _ in range(self.n_classes)]
        self.size = 0
        self._known_heads = [None] * self.n_classes
        self._crowded.clear()
