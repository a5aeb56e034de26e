"""The checks on values of a trace's parsed rows, vectorised over all of them at once.

Ranges (timestamps, lengths, ids, turns), hash-list lengths, time order, unique chat ids and known
parents; each yields the rows that fail it (:class:`_BadRows`), and only for the earliest one is a
message built, naming its line. :func:`validate` runs them in :data:`kvprof.profiler.reader.SKIP_KINDS`
order after the per-line checks of :mod:`kvprof.profiler.records`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from kvprof.profiler.records import Problem, count_skipped
from kvprof.profiler.stored import StoredFiles

#: Timestamps stop here, in seconds (2**43 s, about 278,000 years): below it a float holds a time to the
#: millisecond (Bailian's seconds, Mooncake's milliseconds once converted); beyond it gaps are quantised.
_TIMESTAMP_END_S = 2.0**43
_INT32_MAX = 2**31 - 1


@dataclass
class _BadRows:
    """Rows failing one check; ``message(i)`` explains row ``i`` (built only when raising)."""

    kind: str
    field: str
    mask: np.ndarray
    message: Callable[[int], str]


def validate(
    stored: StoredFiles,
    columns: dict[str, np.ndarray],
    block_size: int,
    tolerance: float,
    skip_invalid: bool,
    skipped: dict[str, int],
    stopped_at: Problem | None,
    earlier: np.ndarray,
) -> np.ndarray:
    """Run the value checks over all parsed rows; return the mask of rows to keep.

    Without ``skip_invalid`` raise the earliest problem, counting the line parsing stopped at.
    With it, each bad row is counted in ``skipped`` under the first check it fails and later checks see only
    the rows still kept (so a child of a skipped request is an ``unknown_parent``).
    """
    keep = np.ones(columns["line"].shape, dtype=bool)
    first = stopped_at
    for check in (_value_checks, _hash_length_check, _time_order_check, _duplicate_check, _parent_check):
        for bad in check(columns, keep, block_size=block_size, tolerance=tolerance, label=stored.label,
                         earlier=earlier):
            bad_rows = np.flatnonzero(bad.mask & keep)
            if not bad_rows.size:
                continue
            if skip_invalid:
                count_skipped(skipped, bad.kind, bad_rows.size)
                keep[bad_rows] = False
            elif first is None or columns["line"][bad_rows[0]] < first.line:
                row = bad_rows[0]
                first = Problem(bad.kind, int(columns["line"][row]), bad.field, bad.message(row))
    if first is not None:
        raise stored.error(first.line, first.message, first.field)
    return keep


def _value_checks(columns, keep, **_) -> Iterator[_BadRows]:
    """Negative, NaN and infinite values of the required fields."""
    ts, seconds = columns["raw_timestamp"], columns["timestamp"]
    bad = ~(np.isfinite(ts) & (ts >= 0) & (seconds < _TIMESTAMP_END_S))

    def time_message(i):
        raw, converted = ts[i].item(), seconds[i].item()
        shown = repr(raw) if raw == converted or not math.isfinite(raw) else f"{raw!r} ({converted:g} s)"
        return f"must be a finite number >= 0 and below 2**43 s, where a float still holds a millisecond, got {shown}"

    yield _BadRows("bad_value", "timestamp", bad, time_message)
    ranges = (
        ("chat_id", 0, None),
        ("parent_chat_id", -1, None),
        ("input_length", 0, None),
        ("output_length", 0, None),
        ("turn", 1, _INT32_MAX),
    )
    for name, low, high in ranges:
        values = columns[name]
        bad = values < low if high is None else (values < low) | (values > high)
        expected = f">= {low}" if high is None else f"between {low} and {high}"
        yield _BadRows("bad_value", name, bad, _range_message(values, expected))
    hash_ids, offsets = columns["hash_ids"], columns["hash_offsets"]
    bad = np.zeros(keep.shape, dtype=bool)
    bad[np.searchsorted(offsets, np.flatnonzero(hash_ids < 0), side="right") - 1] = True  # owning rows

    def message(i):
        return f"hash ids must be >= 0, got {hash_ids[offsets[i] : offsets[i + 1]].min()}"

    yield _BadRows("bad_value", "hash_ids", bad, message)


def _range_message(values: np.ndarray, expected: str) -> Callable[[int], str]:
    return lambda i: f"must be {expected}, got {values[i].item()!r}"


def _hash_length_check(columns, keep, *, block_size, **_) -> Iterator[_BadRows]:
    """``len(hash_ids) == ceil(input_length / block_size)``."""
    n_ids = np.diff(columns["hash_offsets"])
    expected = -(-columns["input_length"] // block_size)

    def message(i):
        length = columns["input_length"][i]
        return (
            f"holds {n_ids[i]} hash ids, but input_length {length} at {block_size} tokens per block "
            f"needs {expected[i]} (wrong format or block size?)"
        )

    yield _BadRows("hash_length", "hash_ids", n_ids != expected, message)


def _time_order_check(columns, keep, *, tolerance, label, **_) -> Iterator[_BadRows]:
    """No timestamp more than ``tolerance`` seconds below the latest earlier kept one."""
    kept = np.flatnonzero(keep)
    ts = columns["timestamp"][kept]
    latest_before = np.maximum.accumulate(ts)[:-1]
    bad = np.zeros(keep.shape, dtype=bool)
    bad[kept[1:]] = ts[1:] < latest_before - tolerance

    def message(i):
        earlier = kept[kept < i]
        j = earlier[np.argmax(columns["timestamp"][earlier])]
        t_i, t_j = columns["timestamp"][i], columns["timestamp"][j]
        return (
            f"timestamp {t_i:g} s goes back {t_j - t_i:g} s from {label(columns['line'][j])} "
            f"({t_j:g} s); at most {tolerance:g} s of jitter is accepted"
        )

    yield _BadRows("timestamp_backwards", "timestamp", bad, message)


def _duplicate_check(columns, keep, *, label, earlier, **_) -> Iterator[_BadRows]:
    """No kept row repeats the chat_id of an earlier kept row (file order) or of an earlier file."""
    kept = np.flatnonzero(keep)
    chat_id = columns["chat_id"]
    _, first = np.unique(chat_id[kept], return_index=True)
    bad = np.zeros(keep.shape, dtype=bool)
    bad[kept] = True
    bad[kept[first]] = False
    in_earlier = _member(chat_id, earlier)
    bad |= in_earlier

    def message(i):
        if in_earlier[i]:
            return f"chat_id {chat_id[i]} is already the chat_id of a line of an earlier file (the same file twice?)"
        j = kept[np.argmax(chat_id[kept] == chat_id[i])]
        return f"chat_id {chat_id[i]} is already the chat_id of {label(columns['line'][j])}"

    yield _BadRows("duplicate_chat_id", "chat_id", bad, message)


def _member(values: np.ndarray, sorted_ids: np.ndarray) -> np.ndarray:
    """Which of ``values`` are in ``sorted_ids`` (sorted)."""
    if not sorted_ids.size:
        return np.zeros(values.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_ids, values), sorted_ids.size - 1)
    return sorted_ids[pos] == values


def _parent_check(columns, keep, *, earlier, **_) -> Iterator[_BadRows]:
    """Every parent is the chat_id of an earlier kept row.

    Rows whose parent is missing are dropped and the check repeated, so a whole chain behind a
    skipped turn goes (one more round per turn of the longest such chain).
    """
    chat_id, parent = columns["chat_id"], columns["parent_chat_id"]
    bad = np.zeros(keep.shape, dtype=bool)
    while True:
        orphans = _orphans(chat_id, parent, np.flatnonzero(keep & ~bad), earlier)
        if not orphans.size:
            break
        bad[orphans] = True

    def message(i):
        return f"parent_chat_id {parent[i]} is not the chat_id of any earlier valid line{' or file' if earlier.size else ''}"

    yield _BadRows("unknown_parent", "parent_chat_id", bad, message)


def _orphans(chat_id: np.ndarray, parent: np.ndarray, rows: np.ndarray, earlier: np.ndarray) -> np.ndarray:
    """Those of ``rows`` (sorted) whose parent is neither the chat_id of an earlier one of ``rows``
    nor one of ``earlier`` (sorted: earlier files')."""
    children = rows[parent[rows] != -1]
    children = children[~_member(parent[children], earlier)]
    ids, first = np.unique(chat_id[rows], return_index=True)
    if not ids.size:
        return children
    pos = np.minimum(np.searchsorted(ids, parent[children]), ids.size - 1)
    known = (ids[pos] == parent[children]) & (rows[first[pos]] < children)
    return children[~known]
