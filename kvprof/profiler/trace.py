"""The in-memory trace: one numpy column per field, hash ids as one flat CSR array.

A two-hour Bailian trace has about 43k requests and 6M block ids; a list of dicts would cost
gigabytes, while these columns cost about 8 bytes per block id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from kvprof.limits import WINDOW_SECONDS
from kvprof.models.finish import FINISH_FIELD, finish_codes
from kvprof.models.hints import HintColumns

#: Trace formats kvprof reads, with their native block size in tokens.
FORMAT_BLOCK_SIZE = {"bailian": 16, "mooncake": 512}


@dataclass(frozen=True, eq=False)
class Trace:
    """A serving trace, column-wise.

    Invariants: every column has ``n_requests`` rows; ``timestamp`` is non-decreasing (in
    seconds, starting wherever the file starts); request ``i`` owns
    ``hash_ids[hash_offsets[i]:hash_offsets[i + 1]]``; ``hash_offsets[0] == 0`` and
    ``hash_offsets[-1] == len(hash_ids)``.

    Attributes
    ----------
    timestamp : float64 array, shape (n,)
        Arrival time in seconds (Mooncake's milliseconds are converted on read).
    input_length, output_length : int64 arrays, shape (n,)
        Prompt and output tokens.
    chat_id, parent_chat_id : int64 arrays, shape (n,)
        Request id and the previous turn's id (-1 for a first turn). Formats without
        sessions get ``chat_id = row number`` and ``parent_chat_id = -1``.
    type_code : int32 array, shape (n,)
        Index into ``type_names``; formats without a type have one type, ``""``.
    type_names : tuple of str
        Distinct request types, in order of first appearance.
    turn : int32 array, shape (n,)
        1-based turn number (1 where the format has none).
    hash_offsets : int64 array, shape (n + 1,)
        CSR offsets into ``hash_ids``.
    hash_ids : int64 array, shape (total_blocks,)
        Prefix-chained block hashes of every request, concatenated.
    block_size : int
        Tokens per trace block (16 for Bailian, 512 for Mooncake unless overridden).
    format : str
        ``"bailian"`` or ``"mooncake"``.
    source : str
        File name the trace came from (for provenance).
    sha256 : str
        SHA-256 of the file's bytes as stored (compressed if compressed), "" if unknown.
    window : tuple of (float, float)
        The time window ``[start, end)`` the trace covers; ``end`` is where reuse is censored.
    extra : dict of str to array
        Other scalar fields found in the file, as arrays of shape (n,) (object arrays for
        strings), so ``--class-field`` can key classes on any field.
    """

    timestamp: np.ndarray
    input_length: np.ndarray
    output_length: np.ndarray
    chat_id: np.ndarray
    parent_chat_id: np.ndarray
    type_code: np.ndarray
    type_names: tuple[str, ...]
    turn: np.ndarray
    hash_offsets: np.ndarray
    hash_ids: np.ndarray
    block_size: int
    format: str
    source: str = ""
    sha256: str = ""
    window: tuple[float, float] = (0.0, math.inf)
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def n_requests(self) -> int:
        return int(self.timestamp.shape[0])

    @property
    def n_blocks(self) -> int:
        """Total block accesses (hash ids) over all requests."""
        return int(self.hash_ids.shape[0])

    @property
    def has_types(self) -> bool:
        return self.type_names != ("",)

    @property
    def n_blocks_per_request(self) -> np.ndarray:
        return np.diff(self.hash_offsets)

    @property
    def types(self) -> np.ndarray:
        """Request types as a string array, shape (n,)."""
        return np.asarray(self.type_names, dtype=object)[self.type_code]

    @cached_property
    def finish(self) -> np.ndarray:
        """How each request's response ended (int8, shape (n,)): the codes of :mod:`kvprof.models.finish`
        (1 tool call, 2 end of turn, 3 other, 0 not known), from the ``stop`` field of ``extra``."""
        return finish_codes(self.extra.get(FINISH_FIELD), self.n_requests)

    @cached_property
    def hints(self) -> HintColumns | None:
        """Each request's client hint (retain, release, priority, tag: :mod:`kvprof.models.hints`), from the
        hint fields of ``extra``; None where the trace has none."""
        return HintColumns.of_extra(self.extra, self.n_requests)

    def blocks_of(self, i: int) -> np.ndarray:
        """Hash ids of request ``i``."""
        return self.hash_ids[self.hash_offsets[i] : self.hash_offsets[i + 1]]

    @property
    def duration(self) -> float:
        """Length of the window in seconds (up to the last arrival when open-ended)."""
        end = self.window[1] if math.isfinite(self.window[1]) else self._last_timestamp()
        return max(0.0, end - self.window[0])

    @property
    def censor_time(self) -> float:
        """Where reuse observation stops: the window's end, or the last arrival if open-ended."""
        return self.window[1] if math.isfinite(self.window[1]) else self._last_timestamp()

    @property
    def first_arrival(self) -> float:
        """The first request's arrival, or the window's start when there is none."""
        return float(self.timestamp[0]) if self.n_requests else self.window[0]

    def _last_timestamp(self) -> float:
        return float(self.timestamp[-1]) if self.n_requests else self.window[0]

    def select(self, rows: np.ndarray, window: tuple[float, float] | None = None) -> Trace:
        """A new trace holding the requests at the given sorted row indices (a boolean mask works too)."""
        rows = np.flatnonzero(rows) if rows.dtype == bool else np.asarray(rows, dtype=np.int64)
        starts = self.hash_offsets[rows]
        lengths = self.hash_offsets[rows + 1] - starts
        offsets = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # Gather each selected request's slice without a Python loop.
        flat = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return replace(
            self,
            timestamp=self.timestamp[rows],
            input_length=self.input_length[rows],
            output_length=self.output_length[rows],
            chat_id=self.chat_id[rows],
            parent_chat_id=self.parent_chat_id[rows],
            type_code=self.type_code[rows],
            turn=self.turn[rows],
            hash_offsets=offsets,
            hash_ids=self.hash_ids[flat],
            window=self.window if window is None else window,
            extra={k: v[rows] for k, v in self.extra.items()},
        )

    def head(self, n: int) -> Trace:
        """The first ``n`` requests; the window then ends at the next request's arrival (reuse is censored there)."""
        if n >= self.n_requests:
            return self
        return self.select(np.arange(n), window=(self.window[0], float(self.timestamp[n])))

    def time_window(self, start: float | None, end: float | None) -> Trace:
        """Requests arriving in ``[start, end)``; ``None`` leaves that side open, and a negative
        bound counts back from the last arrival (``(-3600, None)`` is the last hour).

        The result's ``window`` is the intersection with this trace's window, so reuse in it is
        censored at ``end``.
        """
        start, end = (self._from_end(bound) for bound in (start, end))
        lo = self.window[0] if start is None else max(float(start), self.window[0])
        hi = self.window[1] if end is None else min(float(end), self.window[1])
        first, last = np.searchsorted(self.timestamp, [lo, hi], side="left")
        return self.select(np.arange(first, last), window=(lo, hi))


    def _from_end(self, bound: float | None) -> float | None:
        if not counts_back(bound) or not self.n_requests:
            return bound
        return float(self.timestamp[-1]) + bound


def counts_back(bound: float | None) -> bool:
    """Whether a window bound counts back from the last arrival: one written with a minus sign, ``-0``
    (the last arrival itself) included."""
    return bound is not None and math.copysign(1.0, bound) < 0


def parse_window(text: str) -> tuple[float | None, float | None]:
    """Parse ``"START:END"`` (seconds; either side may be empty) into a pair.

    ``"0:3600"`` is the first hour, ``"3600:"`` everything from the second hour on, ``"-3600:"``
    the last hour (a bound with a minus sign, ``-0`` too, counts back from the last arrival:
    :meth:`Trace.time_window`). The numbers are read as every number is (no spaces); END must be
    greater than START when both count the same way (a window that holds no requests once resolved
    is refused when read).
    """
    if text.count(":") != 1:
        raise ValueError(f"window {text!r} must look like START:END, e.g. 0:3600 or 3600:")
    lo_text, hi_text = text.split(":")
    try:
        lo = WINDOW_SECONDS.parse(lo_text, "START") if lo_text else None
        hi = WINDOW_SECONDS.parse(hi_text, "END") if hi_text else None
    except ValueError as exc:
        raise ValueError(f"window {text!r}: {exc}") from None
    check_window_order(lo, hi, f"window {text!r}")
    return lo, hi


def check_window_order(lo: float | None, hi: float | None, what: str) -> None:
    """END greater than START where the two count the same way (from zero, or back from the last arrival);
    ``ValueError`` naming ``what`` otherwise."""
    if lo is not None and hi is not None and counts_back(lo) == counts_back(hi) and hi <= lo:
        raise ValueError(f"{what}: END must be greater than START")
