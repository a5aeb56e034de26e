"""What a client tells the server about a request's cache when its response ends: a retention hint.

The anchors agree on the shape (SGLang's ``retention_seconds``, TensorRT-LLM's retention priority and
duration, LMCache's per-request TTL under a byte budget): keep this request's blocks for a while
(soft, lapsing when the time passes), with a priority among retained blocks, or release them (the
session is done), and the session the request belongs to. A trace carries hints per request in five
optional fields (docs/cli.md):

================  =======  ==========================================================================
field             default  meaning
================  =======  ==========================================================================
``retain_s``      0        seconds to retain the request's blocks after it ends (0: no retention)
``retain_priority`` 50     0-99: among retained blocks, the lowest priority is evicted first
``release``       false    the session is done: its blocks are evicted before any other
``hint_tag``      0        the client (tenant) the retention is charged to, for the hint budget
``hint_session``  none     the client's session: a release then demotes only the blocks no other
                           session (and no request without one) touched; an integer or a string
================  =======  ==========================================================================

A request without any of ``retain_s > 0``, ``release`` and ``hint_session`` has no hint: its blocks are
ordered by the policy as always. ``release`` with ``retain_s > 0`` contradicts itself and is refused.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import numpy as np

RETAIN_FIELD, PRIORITY_FIELD, RELEASE_FIELD, TAG_FIELD, SESSION_FIELD = (
    "retain_s", "retain_priority", "release", "hint_tag", "hint_session")
#: The trace fields of a hint, in the order docs list them.
HINT_FIELDS = (RETAIN_FIELD, PRIORITY_FIELD, RELEASE_FIELD, TAG_FIELD, SESSION_FIELD)
DEFAULT_PRIORITY = 50
MAX_PRIORITY = 99
#: The longest retention a hint may ask for (a year: beyond it a number is a mistake, not a retention).
MAX_RETAIN_S = 365 * 86400.0
MAX_TAG = 2**31 - 1
#: A session id: a string of 1 to MAX_SESSION_CHARS characters, or an integer from 0 to MAX_SESSION_INT.
MAX_SESSION_CHARS = 128
MAX_SESSION_INT = 2**63 - 1


@dataclass(frozen=True)
class Hint:
    """One request's hint. Invariant: ``0 <= retain_s <= MAX_RETAIN_S`` (finite),
    ``0 <= priority <= MAX_PRIORITY``, ``0 <= tag <= MAX_TAG``, not both ``release`` and ``retain_s > 0``;
    ``session`` None or a valid session id (:func:`hint_problem`)."""

    retain_s: float = 0.0
    priority: int = DEFAULT_PRIORITY
    release: bool = False
    tag: int = 0
    session: int | str | None = None

    def __post_init__(self):
        for name, value in self.fields().items():
            problem = hint_problem(name, value)
            if problem is not None:
                raise ValueError(f"hint field '{name}' {problem[1]}")
        if self.release and self.retain_s > 0:
            raise ValueError(f"a hint's {CONTRADICTION}")

    @property
    def retains(self) -> bool:
        return self.retain_s > 0

    def fields(self) -> dict:
        """The hint as the trace's hint fields (a recording's line, a replayed request's ``vllm_xargs``):
        the first four always, ``hint_session`` where it names one."""
        values = (self.retain_s, self.priority, self.release, self.tag, self.session)
        return {name: value for name, value in zip(HINT_FIELDS, values) if value is not None}


#: Why a hint that both releases and retains is refused.
CONTRADICTION = f"'{RELEASE_FIELD}' and '{RETAIN_FIELD}' > 0 contradict each other (give one)"


def hint_problem(name: str, value) -> tuple[str, str] | None:
    """Why ``value`` cannot be hint field ``name``: ``(kind, message)``, kind ``wrong_type`` or
    ``bad_value`` (the reader's problem kinds); None where it can (None itself: the field is absent)."""
    if value is None:
        return None
    if name == SESSION_FIELD:
        if type(value) is str:
            return None if 0 < len(value) <= MAX_SESSION_CHARS else \
                ("bad_value", f"must be 1 to {MAX_SESSION_CHARS} characters, got {len(value)}")
        if type(value) is not int:
            return ("wrong_type", f"must be a string or an integer (a session id), got {_describe(value)}")
        if not 0 <= value <= MAX_SESSION_INT:
            return ("bad_value", f"must be from 0 to {MAX_SESSION_INT}, got {value!r:.40}")
        return None
    if name == RELEASE_FIELD:
        return None if type(value) is bool else ("wrong_type", f"must be true or false, got {_describe(value)}")
    if name == RETAIN_FIELD:
        if type(value) not in (int, float):
            return ("wrong_type", f"must be a number of seconds, got {_describe(value)}")
        # compared, not converted to a float (an int past its range would raise); NaN compares false
        if not 0 <= value <= MAX_RETAIN_S:
            return ("bad_value", f"must be from 0 to {MAX_RETAIN_S:g} seconds, got {value!r:.40}")
        return None
    bound = MAX_PRIORITY if name == PRIORITY_FIELD else MAX_TAG
    if type(value) is not int:
        return ("wrong_type", f"must be an integer, got {_describe(value)}")
    if not 0 <= value <= bound:
        return ("bad_value", f"must be from 0 to {bound}, got {value!r:.40}")
    return None


def lookalike_field(name: str) -> str | None:
    """The hint field a request argument ``name`` looks like a misspelling of (another case, a letter or two
    off, ``hint_`` with another ending), None for a hint field itself or any other name: a server refuses
    such an argument rather than take the hint as lost (:func:`kvprof.vllm.hints.refuse_malformed_hint`)."""
    if name in HINT_FIELDS:
        return None
    folded = name.lower()
    if folded in HINT_FIELDS:
        return folded
    close = difflib.get_close_matches(folded, HINT_FIELDS, n=1, cutoff=0.8)
    if close:
        return close[0]
    return "a hint field (" + ", ".join(HINT_FIELDS) + ")" if folded.startswith("hint_") else None


def hint_of_args(args: dict | None) -> Hint | None:
    """The hint a request's arguments carry (vLLM's ``SamplingParams.extra_args``, filled from the OpenAI
    API's ``vllm_xargs``): the trace fields, checked as the trace reader checks them; None where none
    of them is given or the request asks neither to retain nor to release nor names a session.
    ``release`` may be 0 or 1 as well as false or true: ``vllm_xargs`` takes no booleans (a JSON ``true`` arrives as 1).

    Raises
    ------
    ValueError
        A field with a value it cannot take, or ``release`` with ``retain_s > 0``; the message names the field.
    """
    if not args or not any(name in args for name in HINT_FIELDS):
        return None
    values = [args.get(name) for name in HINT_FIELDS]
    release = values[2]
    if type(release) is int and release in (0, 1):
        values[2] = bool(release)
    for name, value in zip(HINT_FIELDS, values):
        problem = hint_problem(name, value)
        if problem is not None:
            shown = "must be true or false (or 1 or 0)" if name == RELEASE_FIELD else problem[1]
            raise ValueError(f"hint field '{name}' {shown}" + (f", got {_describe(value)}" if name == RELEASE_FIELD
                                                                 else ""))
    retain_s, priority, release, tag, session = values
    if release and retain_s:
        raise ValueError(f"hint fields {CONTRADICTION}")
    if not (retain_s or release or session is not None):
        return None
    return Hint(float(retain_s or 0.0), DEFAULT_PRIORITY if priority is None else priority, bool(release), tag or 0,
                session)


def _describe(value) -> str:
    return f"{type(value).__name__} {value!r:.40}"


@dataclass(frozen=True, eq=False)
class HintColumns:
    """Every request's hint, column-wise (shape ``(n,)`` each): what a workload carries.

    Invariant: each row is a valid :class:`Hint` (the defaults where a request has none; ``session``
    None where it names none).
    """

    retain_s: np.ndarray  # float64
    priority: np.ndarray  # int64
    release: np.ndarray  # bool
    tag: np.ndarray  # int64
    session: np.ndarray  # object: int, str or None

    @classmethod
    def empty(cls, n: int) -> HintColumns:
        """``n`` requests without hints."""
        return cls(np.zeros(n), np.full(n, DEFAULT_PRIORITY, dtype=np.int64), np.zeros(n, dtype=bool),
                   np.zeros(n, dtype=np.int64), np.full(n, None, dtype=object))

    @classmethod
    def of_extra(cls, extra: dict[str, np.ndarray], n: int) -> HintColumns | None:
        """The hints of a trace's extra columns (the reader checked each value), None where it has no hint field."""
        if not any(name in extra for name in HINT_FIELDS):
            return None
        empty = cls.empty(n)
        return cls(*(_column(extra.get(name), getattr(empty, attr)) for name, attr in
                     zip(HINT_FIELDS, ("retain_s", "priority", "release", "tag", "session"))))

    def to_extra(self) -> dict[str, np.ndarray]:
        """The trace fields of these hints (what :meth:`of_extra` reads back; no session column where none
        names one)."""
        extra = {RETAIN_FIELD: self.retain_s, PRIORITY_FIELD: self.priority, RELEASE_FIELD: self.release,
                 TAG_FIELD: self.tag}
        if self.names_sessions.any():
            extra[SESSION_FIELD] = self.session
        return extra

    @property
    def names_sessions(self) -> np.ndarray:
        """Whether each request names a session (bool, (n,))."""
        return np.not_equal(self.session, None)

    @property
    def n_hinted(self) -> int:
        return int(((self.retain_s > 0) | self.release).sum())

    def hints(self) -> list[Hint | None]:
        """Each request's :class:`Hint`, None where it has none (what a replay tells the policy)."""
        hinted = (self.retain_s > 0) | self.release | self.names_sessions
        out: list[Hint | None] = [None] * len(hinted)
        cache: dict[tuple, Hint] = {}  # few distinct hints against a row per request
        session = self.session.tolist()
        for i in np.flatnonzero(hinted).tolist():
            key = (float(self.retain_s[i]), int(self.priority[i]), bool(self.release[i]), int(self.tag[i]), session[i])
            out[i] = cache.get(key) or cache.setdefault(key, Hint(*key))
        return out


def _column(column: np.ndarray | None, default: np.ndarray) -> np.ndarray:
    """A hint field's extra column in the default's dtype, the default where a request has no value."""
    if column is None:
        return default
    if column.dtype != object:
        return column.astype(default.dtype)
    present = np.array([v is not None for v in column], dtype=bool)
    out = default.copy()
    out[present] = np.array(column[present].tolist(), dtype=default.dtype)
    return out
