"""Seats: the numbers the compiled core knows running requests by, and each one's slot array.

A request takes a seat when it is admitted and gives it back when it finishes. Every driver of the
core keeps its seats the same way, so policies can size per-request tables by seat number:

Invariant: the seats in use are distinct; a seat given back is taken again before a new number
is made, so the numbers stay below the most requests ever running at once.

The compiled loops (:mod:`kvprof.core.engine`, :mod:`kvprof.core.timed`) keep the given-back
seats on a stack (``free[:n_free]``, :func:`take_seat`, :func:`give_seat`) and reuse each seat's
slot array, grown only when a request needs more (:func:`seat_slots`, also what a compiled part
keyed by a seat its driver numbered needs: :mod:`kvprof.core.shadow`); a driver in Python that names requests by key
(:mod:`kvprof.core.twin`, :mod:`kvprof.vllm.observe`) uses :class:`Seats`.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import numpy as np
from numba import njit

from kvprof.core import structs


@njit(cache=True)
def new_free(n: int = 16) -> np.ndarray:
    """An empty stack of given-back seats with room for ``n`` (it grows in :func:`give_seat`)."""
    return np.zeros(n, np.int64)


@njit(cache=True)
def take_seat(seats, free, n_free, need):
    """A seat whose slot array (``seats[seat]``) holds at least ``need`` slots: the seat given back
    last, else a new one (``seats``: a list, typed or native, of int64 arrays, one per seat).

    Returns ``(seat, n_free)``, the count of given-back seats left on ``free``.
    """
    if n_free:
        n_free -= 1
        seat = free[n_free]
    else:
        seat = len(seats)
    seat_slots(seats, seat, need)
    return seat, n_free


@njit(cache=True)
def seat_slots(seats, seat, need):
    """``seats[seat]``, with room for at least ``need`` slots: ``seats`` extended to hold the seat and
    its array replaced by a larger one (at least twice as long) when it is too short."""
    while len(seats) <= seat:
        seats.append(np.zeros(0, np.int64))
    if len(seats[seat]) < need:
        seats[seat] = np.zeros(max(need, 2 * len(seats[seat])), np.int64)
    return seats[seat]


@njit(cache=True)
def give_seat(free, n_free, seat):
    """Put ``seat`` back on the stack; returns ``(free, n_free)`` (``free`` may have grown)."""
    if n_free == len(free):
        free = structs.grown(free, n_free + 1, 0)
    free[n_free] = seat
    return free, n_free + 1


class Seats:
    """Seat numbers for requests named by key, for drivers that run in Python.

    Invariant: the numbers in use are ``_seat``'s values, all distinct; ``_free`` is a heap of
    the numbers handed out before and given back since, so :meth:`take` reuses the lowest free
    number and the numbers stay below the most requests ever running at once (the core sizes
    its per-request tables by them).
    """

    def __init__(self) -> None:
        self._seat: dict[Hashable, int] = {}
        self._free: list[int] = []

    def take(self, request: Hashable) -> int:
        """A number for ``request`` (which must not hold one)."""
        seat = heapq.heappop(self._free) if self._free else len(self._seat)
        self._seat[request] = seat
        return seat

    def give(self, request: Hashable) -> int:
        """Give back ``request``'s number and return it; -1 if it holds none."""
        seat = self._seat.pop(request, -1)
        if seat >= 0:
            heapq.heappush(self._free, seat)
        return seat

    def clear(self) -> None:
        self._seat.clear()
        self._free.clear()

    def __contains__(self, request: Hashable) -> bool:
        return request in self._seat
