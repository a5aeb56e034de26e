"""The hyperparameter file: per-class reuse parameters, schema ``kvprof.hp/1``.

The profiler writes it; the simulator and the vLLM plugin read it. The loader is strict (unknown
keys, NaN, out-of-range values are errors naming the file and the JSON location) because a typo
in a hand-edited file would otherwise silently fall back to defaults in production. It also reads
the published profiler's ``{"a": {class: lambda}, "p": {class: p}}`` files unchanged. The layout
is documented field by field in ``docs/hp-schema.md``.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from kvprof.atomic import atomic_write_text
from kvprof.classes import CLASS_KEYS, MAX_TURN_CAP, ClassRule
from kvprof.errors import HpFileError
from kvprof.jsonfile import JsonChecks, member, read_json
from kvprof.models.sessions import MAX_TURNS

SCHEMA = "kvprof.hp/1"

#: Name of the default class in :meth:`HpFile.table`; not a valid class name in a file.
DEFAULT_CLASS = "<default>"
#: Suffix of the entry that holds a class's parameters for blocks an earlier request already used.
REUSED_SUFFIX = "@reused"

SOURCES = ("fit", "shrunk", "pooled", "published")

#: Look-ahead the published policy hard-codes, seconds.
PUBLISHED_HORIZON_S = 5.0
#: The published classes are type x turn with no cap; a cap no int32 turn reaches keeps ``text_7`` as ``text_7``.
PUBLISHED_TURN_CAP = MAX_TURN_CAP
#: The published policy's rule for classes it has no entry for: lambda 0, p 1 (scores 0).
PUBLISHED_DEFAULT_P, PUBLISHED_DEFAULT_LAMBDA = 1.0, 0.0

_DIAGNOSTIC_COUNTS = ("n_accesses", "n_reuses", "n_censored")
_DIAGNOSTIC_STATS = ("ks", "mean_gap_s", "median_gap_s")
_SESSION_COUNTS = ("n_requests", "n_sessions")
_THINK_TIME_STATS = ("mean", "median", "p90")


@dataclass(frozen=True)
class ClassParams:
    """Reuse parameters of one workload class.

    Attributes
    ----------
    p : float
        Probability that an access of the class is ever reused, in [0, 1].
    lam : float
        Reuse rate, 1/s, >= 0 (``"lambda"`` in JSON).
    source : {"fit", "shrunk", "pooled", "published"}
        Where the numbers come from: the class's own censored fit, that fit shrunk toward the
        pooled fit (little data), the pooled fit (no data), or a published-format file.
    naive : dict or None
        The published profiler's estimates on the same data, ``{"p": ..., "lambda": ...}``.
    diagnostics : dict or None
        ``n_accesses``, ``n_reuses``, ``n_censored``, ``ks``, ``mean_gap_s``, ``median_gap_s``
        (see :func:`kvprof.models.exponential.diagnose`).
    """

    p: float
    lam: float
    source: str = "fit"
    naive: dict | None = None
    diagnostics: dict | None = None

    def __post_init__(self):
        if not 0.0 <= self.p <= 1.0:  # NaN fails too
            raise ValueError(f"p must be in [0, 1], got {self.p!r}")
        if not 0.0 <= self.lam < math.inf:
            raise ValueError(f"lambda must be a finite number >= 0, got {self.lam!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source {self.source!r} is not one of {', '.join(SOURCES)}")

    def to_dict(self) -> dict:
        out = {"p": float(self.p), "lambda": float(self.lam), "source": self.source}
        if self.naive is not None:
            out["naive"] = dict(self.naive)
        if self.diagnostics is not None:
            out["diagnostics"] = dict(self.diagnostics)
        return out


def _json_default(value):
    """numpy scalars and arrays (e.g. counts in provenance) as plain JSON values."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


@dataclass(frozen=True)
class HpFile:
    """A hyperparameter file in memory.

    Attributes
    ----------
    classes : dict of str to ClassParams
        Parameters per workload class name (as :func:`kvprof.classes.workload_class` names it).
    default : ClassParams
        Used for every class not in ``classes`` (workloads unseen when profiling).
    horizon : float
        Look-ahead ``H`` of the score, s (``"horizon_s"`` in JSON).
    class_rule : ClassRule
        How requests map to classes; the live policy must use the same rule.
    min_gap : float
        Gaps shorter than this were dropped as concurrent when fitting, s (``"min_gap_s"``).
    block_size : int or None
        Tokens per trace block the fit was made on (None: unknown, e.g. published files).
    provenance : dict
        Where the fit came from: trace, sha256, format, window, counts, kvprof_version, created.
    sessions : dict
        :func:`kvprof.models.sessions.session_stats` of the profiled trace.
    """

    classes: dict[str, ClassParams]
    default: ClassParams
    horizon: float
    class_rule: ClassRule
    min_gap: float = 0.3
    block_size: int | None = None
    provenance: dict = field(default_factory=dict)
    sessions: dict = field(default_factory=dict)

    @cached_property
    def _table(self) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        # cached_property writes the instance __dict__ directly, so it works on a frozen dataclass.
        names = tuple(sorted(self.classes))
        rows = [self.classes[name] for name in names] + [self.default]
        p = np.array([row.p for row in rows], dtype=np.float64)
        lam = np.array([row.lam for row in rows], dtype=np.float64)
        return (*names, DEFAULT_CLASS), p, lam

    @cached_property
    def _index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self._table[0][:-1])}

    def table(self) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        """Classes as arrays for vectorised scoring.

        Returns
        -------
        names : tuple of str, length k + 1
            Class names sorted, then ``"<default>"``.
        p, lam : float64 arrays, shape (k + 1,)
            Reuse probability and rate (1/s) per row, the default last.
        """
        names, p, lam = self._table
        return names, p.copy(), lam.copy()

    def reused_rows(self) -> np.ndarray:
        """For each row of :meth:`table`, the row of its ``<class>@reused`` entry (itself if none).

        A policy scores a block whose last access was a prefix hit with its class's reused row.
        """
        names = self.table()[0]
        return np.array([self._index.get(name + REUSED_SUFFIX, row) for row, name in enumerate(names)], dtype=np.int64)

    def index_of(self, name: str) -> int:
        """Row of ``name`` in :meth:`table`; the default's row (the last) for unknown classes."""
        return self._index.get(name, len(self.classes))

    def to_dict(self) -> dict:
        """The JSON layout of ``docs/hp-schema.md``."""
        return {
            "schema": SCHEMA,
            "provenance": dict(self.provenance),
            "horizon_s": float(self.horizon),
            "min_gap_s": float(self.min_gap),
            "block_size": self.block_size,
            "class_rule": self.class_rule.to_dict(),
            "classes": {name: self.classes[name].to_dict() for name in sorted(self.classes)},
            "default": self.default.to_dict(),
            "sessions": dict(self.sessions),
        }

    @classmethod
    def from_dict(cls, data, path: str = "<dict>") -> HpFile:
        """Validate and build from decoded JSON (either layout).

        Raises
        ------
        kvprof.errors.HpFileError
            Naming ``path`` and the JSON location of the first problem found.
        """
        checks = JsonChecks(str(path), HpFileError)
        if type(data) is dict and "schema" not in data and {"a", "p"} & set(data):
            return _read_published(checks, data)
        return _read_v1(checks, data)

    def save(self, path) -> None:
        """Write the JSON atomically: a temporary file in the same directory, then ``os.replace``.

        A reader never sees a half-written file, and a failure leaves any previous file intact.
        """
        # Serialise first so an unserialisable value fails before anything touches the disk.
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False, default=_json_default) + "\n"
        atomic_write_text(path, text)


def load_hp(path) -> HpFile:
    """Read and validate a hyperparameter file (``kvprof.hp/1`` or the published format).

    Raises
    ------
    kvprof.errors.HpFileError
        The file cannot be read, is not strict JSON (:func:`kvprof.jsonfile.read_json`: also a
        duplicate key or absurd nesting), or fails validation; the message names the file and
        the JSON location (``classes.text_1.p``) or the line and column of a syntax error.
    """
    try:
        data = read_json(path, HpFileError)
    except OSError as err:
        raise HpFileError(str(path), f"cannot read the file: {err}") from None
    return HpFile.from_dict(data, path=str(path))


# --- reading a document: one function per block, each given the checks and the block's location ---


def _read_v1(checks: JsonChecks, data) -> HpFile:
    """A ``kvprof.hp/1`` document."""
    _check_schema(checks, data)  # before the keys: a newer file's new keys are not typos
    checks.fields(data, None, required=("schema", "horizon_s", "class_rule", "classes", "default"),
                  optional=("provenance", "min_gap_s", "block_size", "sessions"))
    horizon = float(checks.number(data["horizon_s"], "horizon_s"))
    if horizon == 0:
        checks.fail("horizon_s", "must be > 0, got 0")
    return HpFile(
        classes=_read_classes(checks, data["classes"], "classes"),
        default=_read_class_params(checks, data["default"], "default"),
        horizon=horizon,
        class_rule=_read_class_rule(checks, data["class_rule"], "class_rule"),
        min_gap=float(checks.number(data.get("min_gap_s", HpFile.min_gap), "min_gap_s")),
        block_size=checks.integer(data.get("block_size"), "block_size", low=1, null=True),
        provenance=checks.mapping(data.get("provenance", {}), "provenance"),
        sessions=_read_sessions(checks, data.get("sessions", {}), "sessions"),
    )


def _check_schema(checks: JsonChecks, data) -> None:
    """Refuse anything but an object whose ``schema`` is :data:`SCHEMA`."""
    checks.mapping(data, None)
    if "schema" not in data:
        checks.fail("schema", f'is missing: this kvprof reads {SCHEMA} and the published {{"a": ..., "p": ...}} format')
    if data["schema"] != SCHEMA:
        checks.fail("schema", f"schema {reprlib.repr(data['schema'])} is not supported; this kvprof reads {SCHEMA}")


def _read_classes(checks: JsonChecks, data, where: str) -> dict[str, ClassParams]:
    """Class name -> entry; the names are usable as classes."""
    return {
        _class_name(checks, name, where): _read_class_params(checks, entry, member(where, name))
        for name, entry in checks.mapping(data, where).items()
    }


def _class_name(checks: JsonChecks, name: str, where: str) -> str:
    """``name``, a key of the object at ``where``, unless it is empty or the default's name."""
    if not name or name == DEFAULT_CLASS:
        checks.fail(member(where, name), f"{name!r} is not a usable class name")
    return name


def _read_class_params(checks: JsonChecks, data, where: str) -> ClassParams:
    """A class entry: ``p``, ``lambda`` and optionally ``source``, ``naive``, ``diagnostics``."""
    checks.fields(data, where, required=("p", "lambda"), optional=("source", "naive", "diagnostics"))
    p, lam = _read_p_and_lambda(checks, data, where)
    source = checks.one_of(data.get("source", "fit"), member(where, "source"), SOURCES)
    naive = data.get("naive")
    if naive is not None:
        _read_p_and_lambda(checks, checks.fields(naive, member(where, "naive"), required=("p", "lambda")),
                           member(where, "naive"))
    diagnostics = data.get("diagnostics")
    if diagnostics is not None:
        _check_diagnostics(checks, diagnostics, member(where, "diagnostics"))
    return ClassParams(p, lam, source, naive, diagnostics)


def _read_p_and_lambda(checks: JsonChecks, data: dict, where: str) -> tuple[float, float]:
    """``p`` in [0, 1] and ``lambda`` >= 0 of an object that has both keys."""
    return (float(checks.number(data["p"], member(where, "p"), high=1.0)),
            float(checks.number(data["lambda"], member(where, "lambda"))))


def _check_diagnostics(checks: JsonChecks, data, where: str) -> None:
    """Counts are integers >= 0; the statistics numbers >= 0 or null."""
    checks.fields(data, where, required=_DIAGNOSTIC_COUNTS, optional=_DIAGNOSTIC_STATS)
    for key in _DIAGNOSTIC_COUNTS:
        checks.integer(data[key], member(where, key))
    for key in _DIAGNOSTIC_STATS:
        checks.number(data.get(key), member(where, key), null=True)


def _read_class_rule(checks: JsonChecks, data, where: str) -> ClassRule:
    """``key``, and ``turn_cap`` (1 to :data:`~kvprof.classes.MAX_TURN_CAP`) and ``field`` where given."""
    checks.fields(data, where, required=("key",), optional=("turn_cap", "field"))
    checks.one_of(data["key"], member(where, "key"), CLASS_KEYS)
    if "turn_cap" in data:
        checks.integer(data["turn_cap"], member(where, "turn_cap"), low=1, high=MAX_TURN_CAP)
    if "field" in data:
        checks.string(data["field"], member(where, "field"))
    try:
        return ClassRule.from_dict(data)
    except ValueError as err:  # a field without key "field", or key "field" without one
        checks.fail(where, str(err))


def _read_sessions(checks: JsonChecks, data, where: str) -> dict:
    """Request type -> :func:`kvprof.models.sessions.session_stats` entry, as that function writes it."""
    for type_name, entry in checks.mapping(data, where).items():
        _check_session(checks, entry, member(where, type_name))
    return data


def _check_session(checks: JsonChecks, data, where: str) -> None:
    """Counts; ``survival`` and ``p_next_turn``, probabilities per turn; ``think_time_s`` or null."""
    checks.fields(data, where, required=(*_SESSION_COUNTS, "survival", "p_next_turn", "think_time_s"))
    for key in _SESSION_COUNTS:
        checks.integer(data[key], member(where, key))
    survival = _check_turn_probabilities(checks, data["survival"], member(where, "survival"))
    p_next_turn = _check_turn_probabilities(checks, data["p_next_turn"], member(where, "p_next_turn"))
    if len(p_next_turn) != len(survival):
        checks.fail(member(where, "p_next_turn"),
                    f"must have one entry per turn of survival ({len(survival)}), got {len(p_next_turn)}")
    think_time = data["think_time_s"]
    if think_time is not None:
        think_where = member(where, "think_time_s")
        checks.fields(think_time, think_where, required=_THINK_TIME_STATS)
        for key in _THINK_TIME_STATS:  # jitter in a trace's timestamps can make them slightly negative
            checks.number(think_time[key], member(think_where, key), low=-math.inf)


def _check_turn_probabilities(checks: JsonChecks, data, where: str) -> list:
    """A list of at most :data:`~kvprof.models.sessions.MAX_TURNS` probabilities."""
    checks.sequence(data, where)
    if len(data) > MAX_TURNS:
        checks.fail(where, f"must have at most {MAX_TURNS} entries (turns), got {len(data)}")
    for index, value in enumerate(data):
        checks.number(value, f"{where}[{index}]", high=1.0)
    return data


def _read_published(checks: JsonChecks, data: dict) -> HpFile:
    """The published profiler's ``{"a": {class: lambda}, "p": {class: p}}``, taken as it is."""
    checks.fields(data, None, required=("a", "p"))
    rates, probabilities = checks.mapping(data["a"], "a"), checks.mapping(data["p"], "p")
    unpaired = sorted(set(rates) ^ set(probabilities))
    if unpaired:
        name = unpaired[0]
        present, absent = ("a", "p") if name in rates else ("p", "a")
        checks.fail(member(absent, name), f"class {name!r} is in {present!r} but not in {absent!r}")
    classes = {
        _class_name(checks, name, "a"): ClassParams(
            p=float(checks.number(probabilities[name], member("p", name), high=1.0)),
            lam=float(checks.number(rate, member("a", name))),
            source="published",
        )
        for name, rate in rates.items()
    }
    return HpFile(
        classes=classes,
        default=ClassParams(PUBLISHED_DEFAULT_P, PUBLISHED_DEFAULT_LAMBDA, source="published"),
        horizon=PUBLISHED_HORIZON_S,
        class_rule=ClassRule(key="type_turn", turn_cap=PUBLISHED_TURN_CAP),
    )
