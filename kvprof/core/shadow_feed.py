"""``wa``'s shadows fed on a thread of their own, so that a long prompt does not stall vLLM's scheduler.

An admission to ``wa`` (:func:`kvprof.core.wa.policy_admit`) is two parts: what the real cache
knows (:func:`~kvprof.core.wa.count_admit`: the size the shadows take, the lookups since the last
follow checkpoint) and what the shadows do with the request's chain (:func:`~kvprof.core.wa.feed_admit`,
then, at a checkpoint, :func:`~kvprof.core.wa._weigh`, which may switch the leader). A finish is
only the second part. The second part depends only on the ordered stream of admissions and
finishes, and only evictions read what it decides (the leader, the main core's order, a frequency
leader's beta). :class:`ShadowFeed` runs it on a background thread, in compiled code without the
GIL, and makes an eviction wait until the decisions it reads are the ones the synchronous path
would have made: the same leader switches, the same shadow hits, the same evictions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np

from kvprof.core import handle
from kvprof.core.wa import outcome
from kvprof.models.finish import UNKNOWN

logger = logging.getLogger("kvprof")

#: Items (admissions and finishes) waiting at most; a put past it waits until half are done.
FEED_LIMIT = 1024
#: Items done in one compiled call at most (a batch also ends at a follow checkpoint).
BATCH = 256

ADMIT, FINISH = handle.FEED_ADMIT, handle.FEED_FINISH


class ShadowFeed:
    """The shadow side of compiled ``wa`` policy ``policy`` (a :class:`kvprof.core.wa.Policy`), on one thread.

    Invariants: items are done one by one in the order they were put, each exactly once (one that
    raises is logged, counted in ``errors`` and skipped; serving goes on); ``done`` counts the items
    done, ``put`` those put. While ``done < put`` only the worker thread touches the shadow side of
    the policy: its shadows (their limits too), ``never``, the chain sample, the follow scores and,
    at a checkpoint, the leader and the main core's order; the thread that puts reads none of them
    except through :meth:`before_eviction` (which first waits for every checkpoint put, and for
    everything put when a frequency leader's eviction reads its shadow's beta), :meth:`settle`
    (waits for everything) or :meth:`close`. Nothing put is dropped: a put to a full feed waits.
    The arrays handed over are the feed's: the caller never changes them afterwards. Waits are
    counted by reason in ``waits`` (``[count, seconds, longest seconds]``, wall clock). :meth:`latest` is the
    leader and the shadows' hits as they were when the last batch was done, published by the worker, for
    readers that must not wait (the metrics).

    One thread puts (the scheduler thread); :meth:`settle` may also be called from others.
    """

    def __init__(self, policy, limit: int = FEED_LIMIT) -> None:
        self._policy = policy  # keeps the address valid while the worker uses it
        self._address = handle.address_of(policy)
        self.limit = limit
        self._items: deque = deque()
        self.put = 0
        self.done = 0
        self._checkpoint = 0  # items up to the last follow checkpoint put
        self._closed = False
        self._outcome = outcome(policy)  # (leader, shadow hits) after the items done; the worker replaces it
        self.errors = 0
        self.waits: dict[str, list] = {}
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvprof-shadows", daemon=True)
        self._thread.start()

    # -- the putting thread ------------------------------------------------------------------
    def admit(self, seat: int, contents: np.ndarray, n_lookup: int, n_blocks: int, now: float, workload: int) -> None:
        """:func:`~kvprof.core.wa.policy_admit`: counted now, the shadows' part queued."""
        size, workload, lookups, real_hits = handle.count_admit(self._address, n_lookup, workload)
        self._put((ADMIT, seat, n_lookup, n_blocks, workload, size, lookups, real_hits), now, contents)
        if lookups:
            self._checkpoint = self.put

    def finish(self, seat: int, now: float, contents: np.ndarray, n_blocks: int, n_output: int,
               code: int = UNKNOWN) -> None:
        """:func:`~kvprof.core.wa.policy_finish`: the real cache's cores told now, the shadows' part queued."""
        handle.count_finish(self._address, n_output, code)
        self._put((FINISH, seat, n_output, n_blocks, code, 0, 0, 0), now, contents)

    def _put(self, numbers: tuple, now: float, contents: np.ndarray) -> None:
        if len(self._items) >= self.limit:
            self._wait_for(self.put - self.limit // 2, "full")
        self._items.append((numbers, now, contents))
        self.put += 1
        if not self._wake.is_set():
            self._wake.set()

    def before_eviction(self) -> None:
        """Wait until an eviction would read what it reads on the synchronous path."""
        if self.done == self.put:
            return
        if self.done < self._checkpoint:
            self._wait_for(self._checkpoint, "checkpoint")
        if self.done < self.put and handle.eviction_reads_shadows(self._address):
            self._wait_for(self.put, "beta")

    def settle(self) -> None:
        """Wait until everything put so far is done (any thread)."""
        self._wait_for(self.put, "settle")

    def latest(self) -> tuple[int, np.ndarray]:
        """The leader and each shadow's hits after the items done so far, without waiting (any thread): what
        :meth:`settle` then :func:`~kvprof.core.wa.outcome` gives, as of a moment up to a batch ago."""
        return self._outcome

    def close(self) -> None:
        """Stop the worker after the batch it runs; what waits is not done (the policy is dropped)."""
        self._closed = True
        self._wake.set()
        with self._progress:
            self._progress.notify_all()

    def _wait_for(self, n: int, reason: str) -> None:
        if self.done >= n:
            return
        started = time.perf_counter()
        with self._progress:
            while self.done < n and not self._closed:
                self._progress.wait()
        waited = time.perf_counter() - started
        count = self.waits.setdefault(reason, [0, 0.0, 0.0])
        count[0] += 1
        count[1] += waited
        count[2] = max(count[2], waited)

    # -- the worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            while self._items and not self._closed:
                batch = self._take_batch()
                try:
                    self._feed(batch)
                except Exception:  # never leave a waiter hanging; serving goes on
                    self.errors += 1
                    logger.exception("kvprof: wa's shadow feed failed on a batch of %d (serving goes on)", len(batch))
                self._outcome = outcome(self._policy)
                with self._progress:
                    self.done += len(batch)
                    self._progress.notify_all()

    def _take_batch(self) -> list:
        """The oldest items, up to the first follow checkpoint (so a wait for it ends as early as it can)."""
        items, batch = self._items, []
        while items and len(batch) < BATCH:
            item = items.popleft()
            batch.append(item)
            if item[0][0] == ADMIT and item[0][6]:
                break
        return batch

    def _feed(self, batch: list) -> None:
        numbers = np.array([item[0] for item in batch], dtype=np.int64)
        nows = np.array([item[1] for item in batch], dtype=np.float64)
        starts = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum([len(item[2]) for item in batch], out=starts[1:])
        contents = np.concatenate([item[2] for item in batch]).astype(np.int64, copy=False)
        at = np.zeros(1, dtype=np.int64)
        first = 0
        while first < len(batch):
            try:
                handle.feed_n(self._address, numbers, nows, starts, contents, first, at)
                return
            except Exception:  # one item's error must not stop the shadows
                self.errors += 1
                logger.exception("kvprof: wa's shadow feed failed on an item (serving goes on)")
                first = int(at[0]) + 1
