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
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from kvprof.atomic import atomic_write_text
from kvprof.classes import ClassRule
from kvprof.errors import HpFileError

SCHEMA = "kvprof.hp/1"

#: Name of the default class in :meth:`HpFile.table`; not a valid class name in a file.
DEFAULT_CLASS = "<default>"
#: Suffix of the entry that holds a class's parameters for blocks an earlier request already used.
REUSED_SUFFIX = "@reused"

SOURCES = ("fit", "shrunk", "pooled", "published")

#: Look-ahead the published policy hard-codes, seconds.
PUBLISHED_HORIZON_S = 5.0
#: The published classes are type x turn with no cap; a cap no int32 turn reaches keeps ``text_7`` as ``text_7``.
PUBLISHED_TURN_CAP = 2**31 - 1
#: The published policy's rule for classes it has no entry for: lambda 0, p 1 (scores 0).
PUBLISHED_DEFAULT_P, PUBLISHED_DEFAULT_LAMBDA = 1.0, 0.0

_DIAGNOSTIC_COUNTS = ("n_accesses", "n_reuses", "n_censored")
_DIAGNOSTIC_STATS = ("ks", "mean_gap_s", "median_gap_s")


class _Invalid(Exception):
    """A validation failure at a JSON location; the loader turns it into an HpFileError."""

    def __init__(self, where: str | None, message: str):
        super().__init__(message)
        self.where = where
        self.message = message


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _number(value, where: str, *, low: float = 0.0, high: float = math.inf) -> float:
    """A finite JSON number in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid(where, f"expected a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise _Invalid(where, f"must be finite, got {value!r}")
    if not low <= value <= high:
        bound = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise _Invalid(where, f"must be {bound}, got {value!r}")
    return float(value)


def _integer(value, where: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(where, f"expected an integer, got {type(value).__name__} {value!r}")
    if value < low:
        raise _Invalid(where, f"must be >= {low}, got {value}")
    return value


def _object(value, where: str, *, required=(), optional=()) -> dict:
    """A JSON object with exactly the given keys (all required ones, any optional ones)."""
    if not isinstance(value, dict):
        raise _Invalid(where or "(top level)", f"expected an object, got {type(value).__name__}")
    if required or optional:
        unknown = sorted(set(value) - set(required) - set(optional))
        if unknown:
            allowed = ", ".join(sorted((*required, *optional)))
            raise _Invalid(_join(where, unknown[0]), f"unknown key {unknown[0]!r} (allowed: {allowed})")
        missing = [key for key in required if key not in value]
        if missing:
            raise _Invalid(_join(where, missing[0]), f"missing required key {missing[0]!r}")
    return value


def _class_name(name, where: str) -> str:
    if not name or name == DEFAULT_CLASS:
        raise _Invalid(_join(where, name), f"{name!r} is not a usable class name")
    return name


def _check_params(p, lam, where: str = "") -> None:
    _number(p, _join(where, "p"), high=1.0)
    _number(lam, _join(where, "lambda"))


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
        try:
            _check_params(self.p, self.lam)
        except _Invalid as err:
            raise ValueError(f"{err.where}: {err.message}") from None
        if self.source not in SOURCES:
            raise ValueError(f"source {self.source!r} is not one of {', '.join(SOURCES)}")

    def to_dict(self) -> dict:
        out = {"p": float(self.p), "lambda": float(self.lam), "source": self.source}
        if self.naive is not None:
            out["naive"] = dict(self.naive)
        if self.diagnostics is not None:
            out["diagnostics"] = dict(self.diagnostics)
        return out

    @classmethod
    def _from_json(cls, data, where: str) -> ClassParams:
        data = _object(data, where, required=("p", "lambda"), optional=("source", "naive", "diagnostics"))
        _check_params(data["p"], data["lambda"], where)
        source = data.get("source", "fit")
        if source not in SOURCES:
            raise _Invalid(_join(where, "source"), f"{source!r} is not one of {', '.join(SOURCES)}")
        naive = data.get("naive")
        if naive is not None:
            _object(naive, _join(where, "naive"), required=("p", "lambda"))
            _check_params(naive["p"], naive["lambda"], _join(where, "naive"))
        diagnostics = data.get("diagnostics")
        if diagnostics is not None:
            diag_where = _join(where, "diagnostics")
            _object(diagnostics, diag_where, required=_DIAGNOSTIC_COUNTS, optional=_DIAGNOSTIC_STATS)
            for key in _DIAGNOSTIC_COUNTS:
                _integer(diagnostics[key], _join(diag_where, key), low=0)
            for key in _DIAGNOSTIC_STATS:
                if diagnostics.get(key) is not None:
                    _number(diagnostics[key], _join(diag_where, key))
        return cls(float(data["p"]), float(data["lambda"]), source, naive, diagnostics)


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
        """Validate and build from parsed JSON (either layout).

        Raises
        ------
        kvprof.errors.HpFileError
            Naming ``path`` and the JSON location of the first problem found.
        """
        try:
            if isinstance(data, dict) and "schema" not in data and {"a", "p"} & set(data):
                return cls._from_published(data)
            return cls._from_schema(data)
        except _Invalid as err:
            raise HpFileError(str(path), err.message, where=err.where) from None

    @classmethod
    def _from_schema(cls, data) -> HpFile:
        # The version is checked before the keys: a newer file's new keys are not typos.
        data = _object(data, "")
        if "schema" not in data:
            raise _Invalid("schema", f"missing: this kvprof reads {SCHEMA} and the published {{\"a\": ..., \"p\": ...}} format")
        if data["schema"] != SCHEMA:
            raise _Invalid("schema", f"schema {data['schema']!r} is not supported; this kvprof reads {SCHEMA}")
        _object(
            data,
            "",
            required=("schema", "horizon_s", "class_rule", "classes", "default"),
            optional=("provenance", "min_gap_s", "block_size", "sessions"),
        )
        horizon = _number(data["horizon_s"], "horizon_s")
        if horizon <= 0:
            raise _Invalid("horizon_s", f"must be > 0, got {horizon!r}")
        block_size = data.get("block_size")
        if block_size is not None:
            _integer(block_size, "block_size", low=1)
        rule = _object(data["class_rule"], "class_rule", required=("key",), optional=("turn_cap", "field"))
        if "turn_cap" in rule:
            _integer(rule["turn_cap"], "class_rule.turn_cap", low=1)
        if not isinstance(rule.get("field", ""), str):
            raise _Invalid("class_rule.field", f"expected a string, got {rule['field']!r}")
        try:
            class_rule = ClassRule.from_dict(rule)
        except ValueError as err:
            raise _Invalid("class_rule", str(err)) from None
        classes = {
            _class_name(name, "classes"): ClassParams._from_json(entry, _join("classes", name))
            for name, entry in _object(data["classes"], "classes").items()
        }
        sessions = _object(data.get("sessions", {}), "sessions")
        for type_name, entry in sessions.items():
            _object(entry, _join("sessions", type_name))
        return cls(
            classes=classes,
            default=ClassParams._from_json(data["default"], "default"),
            horizon=horizon,
            class_rule=class_rule,
            min_gap=_number(data.get("min_gap_s", 0.3), "min_gap_s"),
            block_size=block_size,
            provenance=_object(data.get("provenance", {}), "provenance"),
            sessions=sessions,
        )

    @classmethod
    def _from_published(cls, data: dict) -> HpFile:
        """The published profiler's ``{"a": {class: lambda}, "p": {class: p}}``, taken as it is."""
        data = _object(data, "", required=("a", "p"))
        rates, probabilities = _object(data["a"], "a"), _object(data["p"], "p")
        for name in sorted(set(rates) ^ set(probabilities)):
            present, absent = ("a", "p") if name in rates else ("p", "a")
            raise _Invalid(_join(absent, name), f"class {name!r} is in {present!r} but not in {absent!r}")
        classes = {}
        for name in rates:
            _class_name(name, "a")
            classes[name] = ClassParams(
                p=_number(probabilities[name], _join("p", name), high=1.0),
                lam=_number(rates[name], _join("a", name)),
                source="published",
            )
        return cls(
            classes=classes,
            default=ClassParams(PUBLISHED_DEFAULT_P, PUBLISHED_DEFAULT_LAMBDA, source="published"),
            horizon=PUBLISHED_HORIZON_S,
            class_rule=ClassRule(key="type_turn", turn_cap=PUBLISHED_TURN_CAP),
        )

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
        The file cannot be read, is not JSON, or fails validation; the message names the file
        and the JSON location (``classes.text_1.p``) or the line and column of a syntax error.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise HpFileError(str(path), f"cannot read the file: {err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise HpFileError(str(path), f"not valid JSON: {err.msg}", where=f"line {err.lineno}, column {err.colno}") from None
    return HpFile.from_dict(data, path=str(path))
