"""The hyperparameter file: per-cell reuse models and per-class parameters, schema ``kvprof.hp/3``.

The profiler writes it; the simulator and the vLLM plugin read it. Version 2 adds, for the
``wa`` policy, workload *cells* (the classes, or cells a learned :class:`~kvprof.cells.CellRule`
draws), each with one cure-fraction mixture of exponentials per reuse tier, and the choices a
profile-driven tuning made; ``kvprof.hp/1`` files still load (each class becomes a cell with
one-component rows). Version 3 adds to a tuning entry the ``learned`` candidate's predictor
(:class:`~kvprof.models.learned.LearnedModel`); version 2 files still load. The loader is strict (unknown
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

from kvprof import registry
from kvprof.atomic import atomic_write_text
from kvprof.cells import CLASS_FEATURE, PROMPT_FEATURE, TIER_EDGES, TURN_FEATURE, CellRule, field_name_problem
from kvprof.classes import CLASS_KEYS, MAX_TURN_CAP, ClassRule, is_name_text
from kvprof.errors import HpFileError
from kvprof.jsonfile import JsonChecks, member, read_json
from kvprof.limits import POSITIVE_SECONDS, SECONDS, Bound
from kvprof.models.learned import N_LOG_BINS, LearnedModel
from kvprof.models.sessions import MAX_TURNS

SCHEMA = "kvprof.hp/3"
#: Versions this kvprof reads.
SCHEMAS = ("kvprof.hp/1", "kvprof.hp/2", SCHEMA)
#: :attr:`HpFile.schema` of a file in the published profiler's format (which has no schema).
PUBLISHED_FORMAT = "published"
#: Keys of a published-format file: ``{"a": {class: lambda}, "p": {class: p}}``.
PUBLISHED_KEYS = ("a", "p")

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

#: Candidate orders a tuned file may start the ``wa`` policy on (:mod:`kvprof.policy.wa`): its row
#: orders, then the policies registered as its candidates (:func:`kvprof.registry.candidates`).
CANDIDATES = ("lru", "model", "segmented", "frequency", "strict-frequency", *registry.candidates())

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


@dataclass(frozen=True)
class ReuseRow:
    """The reuse model of one tier of one cell: a cure fraction and a mixture of exponentials.

    Attributes
    ----------
    p : float
        Probability that a block access of the row is ever reused, in [0, 1].
    weights, rates : tuple of float
        Mixture components, fastest first: weights summing to 1 and rates in 1/s, >= 0.
    source : {"fit", "shrunk", "pooled", "published"}
        The row's own fit, one shrunk toward its cell's or the pooled data (few accesses), the
        pooled fit (none), or a published-format class.
    diagnostics : dict or None
        Counts, the KS statistic of the gaps against the mixture, gap mean and median, and the
        score's held-out log-loss and Brier score next to one exponential's
        (:func:`kvprof.profiler.fit.fit_trace`).
    """

    p: float
    weights: tuple[float, ...]
    rates: tuple[float, ...]
    source: str = "fit"
    diagnostics: dict | None = None

    def __post_init__(self):
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {self.p!r}")
        if not self.weights or len(self.weights) != len(self.rates):
            raise ValueError("a reuse row needs at least one component and one rate per weight")
        if not all(w >= 0.0 for w in self.weights) or abs(sum(self.weights) - 1.0) > 1e-6:
            raise ValueError(f"component weights must be >= 0 and sum to 1, got {self.weights}")
        if not all(0.0 <= r < math.inf for r in self.rates):
            raise ValueError(f"component rates must be finite numbers >= 0, got {self.rates}")
        if self.source not in SOURCES:
            raise ValueError(f"source {self.source!r} is not one of {', '.join(SOURCES)}")

    @classmethod
    def exponential(cls, params: ClassParams) -> ReuseRow:
        """A one-component row from a class's cure exponential (``kvprof.hp/1``)."""
        return cls(params.p, (1.0,), (params.lam,), params.source, None)

    def to_dict(self) -> dict:
        out = {"p": float(self.p),
               "components": [{"weight": float(w), "rate": float(r)} for w, r in zip(self.weights, self.rates)],
               "source": self.source}
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
    cells : dict of str to tuple of ReuseRow
        The ``wa`` policy's cells, one row per reuse tier (:data:`~kvprof.cells.TIER_EDGES`).
        Empty in a ``kvprof.hp/1`` or published file: each class is then a cell whose tiers
        are its own cure exponential (tier 0) and its ``@reused`` entry (the others).
    default_cell : tuple of ReuseRow or None
        Rows of requests in no cell (an unknown class); None: the default class's.
    cell_rule : CellRule or None
        How requests map to cells; None: each class is a cell.
    tuning : list of dict
        Choices of ``kvprof fit --capacity``: per capacity (blocks), ``horizon_s`` and the
        candidate order to ``start`` on, and optionally the ``learned`` candidate's predictor
        (a :class:`~kvprof.models.learned.LearnedModel`); a policy takes the entry nearest its capacity.
    """

    classes: dict[str, ClassParams]
    default: ClassParams
    horizon: float
    class_rule: ClassRule
    min_gap: float = 0.3
    block_size: int | None = None
    provenance: dict = field(default_factory=dict)
    sessions: dict = field(default_factory=dict)
    cells: dict[str, tuple[ReuseRow, ...]] = field(default_factory=dict)
    default_cell: tuple[ReuseRow, ...] | None = None
    cell_rule: CellRule | None = None
    tuning: tuple[dict, ...] = ()
    #: The schema of the file this was read from (what ``to_dict`` writes is always :data:`SCHEMA`);
    #: not part of equality, so a v1 file saved again as v2 still equals what was read.
    schema: str = field(default=SCHEMA, compare=False)

    def __post_init__(self):
        rows = [*self.cells.values(), *([self.default_cell] if self.default_cell is not None else [])]
        if any(len(tiers) != len(TIER_EDGES) for tiers in rows):
            raise ValueError(f"every cell needs one reuse row per tier ({len(TIER_EDGES)})")
        if self.cell_rule is not None and set(self.cell_rule.names) != set(self.cells):
            raise ValueError("the cell rule's leaves must name exactly the cells")

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

    def naive_table(self) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        """:meth:`table` with the published profiler's naive estimates where a class has them."""
        names, p, lam = self.table()
        rows = [self.classes.get(name, self.default) for name in names]
        for i, row in enumerate(rows):
            if row.naive is not None:
                p[i], lam[i] = row.naive["p"], row.naive["lambda"]
        return names, p, lam

    @cached_property
    def _cells(self) -> tuple[tuple[str, ...], list[tuple[ReuseRow, ...]]]:
        if self.cells:
            names = tuple(self.cell_rule.names if self.cell_rule is not None else sorted(self.cells))
            default = self.default_cell or self.cells[names[0]]
            return (*names, DEFAULT_CLASS), [self.cells[name] for name in names] + [default]
        # Version 1: each class is a cell, its @reused entry (if any) the tiers of hit blocks.
        names = tuple(name for name in sorted(self.classes) if not name.endswith(REUSED_SUFFIX))

        def tiers_of(params: ClassParams, reused: ClassParams | None) -> tuple[ReuseRow, ...]:
            fresh = ReuseRow.exponential(params)
            return (fresh,) + (ReuseRow.exponential(reused) if reused else fresh,) * (len(TIER_EDGES) - 1)

        tiers = [tiers_of(self.classes[name], self.classes.get(name + REUSED_SUFFIX)) for name in names]
        tiers.append(tiers_of(self.default, None))
        return (*names, DEFAULT_CLASS), tiers

    def cell_names(self) -> tuple[str, ...]:
        """The ``wa`` policy's cells in index order, ``"<default>"`` last."""
        return self._cells[0]

    def cell_models(self) -> list[tuple[ReuseRow, ...]]:
        """Each cell's rows, one per reuse tier, in :meth:`cell_names` order (the default last)."""
        return list(self._cells[1])

    def cell_index(self, name: str) -> int:
        """Index of cell ``name`` in :meth:`cell_names`; the default's (the last) for unknown cells."""
        names = self._cells[0]
        return names.index(name) if name in names[:-1] else len(names) - 1

    def reuse_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cells' models as arrays, in :meth:`cell_names` order.

        Returns
        -------
        p : float64 array, shape (cells, tiers)
        weights, rates : float64 arrays, shape (cells, tiers, k)
            Rows with fewer than ``k`` components are padded with weight 0.
        """
        rows = self._cells[1]
        k = max(len(row.weights) for tiers in rows for row in tiers)
        p = np.array([[row.p for row in tiers] for tiers in rows])
        weights = np.zeros(p.shape + (k,))
        rates = np.zeros(p.shape + (k,))
        for c, tiers in enumerate(rows):
            for t, row in enumerate(tiers):
                weights[c, t, :len(row.weights)] = row.weights
                rates[c, t, :len(row.rates)] = row.rates
        return p, weights, rates

    def tuned(self, capacity: int | None) -> dict:
        """The tuning entry of the tuned capacity nearest ``capacity`` (relative distance), or {}."""
        if not self.tuning or capacity is None:
            return {}
        return min(self.tuning, key=lambda entry: abs(math.log(entry["capacity"] / max(capacity, 1))))

    def to_dict(self) -> dict:
        """The JSON layout of ``docs/hp-schema.md``."""
        out = {
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
        if self.cells:
            out["tier_edges"] = list(TIER_EDGES)
            out["cells"] = {name: [row.to_dict() for row in tiers] for name, tiers in self.cells.items()}
            if self.default_cell is not None:
                out["default_cell"] = [row.to_dict() for row in self.default_cell]
            if self.cell_rule is not None:
                out["cell_rule"] = self.cell_rule.to_dict()
        if self.tuning:
            out["tuning"] = [{key: value.to_dict() if isinstance(value, LearnedModel) else value
                              for key, value in entry.items()} for entry in self.tuning]
        return out

    @classmethod
    def from_dict(cls, data, path: str = "<dict>") -> HpFile:
        """Validate and build from decoded JSON (either layout).

        Raises
        ------
        kvprof.errors.HpFileError
            Naming ``path`` and the JSON location of the first problem found.
        """
        checks = JsonChecks(str(path), HpFileError)
        if type(data) is dict and data and "schema" not in data and set(data) <= set(PUBLISHED_KEYS):
            return _read_published(checks, data)
        return _read_schema(checks, data)

    def save(self, path) -> None:
        """Write the JSON atomically: a temporary file in the same directory, then ``os.replace``.

        A reader never sees a half-written file, and a failure leaves any previous file intact.
        """
        # Serialise first so an unserialisable value fails before anything touches the disk.
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False, default=_json_default) + "\n"
        atomic_write_text(path, text)


def load_hp(path) -> HpFile:
    """Read and validate a hyperparameter file (``kvprof.hp/3``, ``/2``, ``/1`` or the published format).

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


_V2_KEYS = ("tier_edges", "cells", "default_cell", "cell_rule", "tuning")


def _read_schema(checks: JsonChecks, data) -> HpFile:
    """A ``kvprof.hp/1``, ``/2`` or ``/3`` document (version 2: version 1 plus cells and tuning; version 3:
    tuning entries may hold a ``learned`` predictor)."""
    version = _check_schema(checks, data)  # before the keys: a newer file's new keys are not typos
    checks.fields(data, None, required=("schema", "horizon_s", "class_rule", "classes", "default"),
                  optional=("provenance", "min_gap_s", "block_size", "sessions",
                            *(_V2_KEYS if version != "kvprof.hp/1" else ())))
    horizon = float(checks.bounded(data["horizon_s"], "horizon_s", POSITIVE_SECONDS))
    cells = _read_cells(checks, data)
    hp = HpFile(
        classes=_read_classes(checks, data["classes"], "classes"),
        default=_read_class_params(checks, data["default"], "default"),
        horizon=horizon,
        class_rule=_read_class_rule(checks, data["class_rule"], "class_rule"),
        min_gap=float(checks.bounded(data.get("min_gap_s", HpFile.min_gap), "min_gap_s", SECONDS)),
        block_size=checks.integer(data.get("block_size"), "block_size", low=1, null=True),
        provenance=checks.mapping(data.get("provenance", {}), "provenance"),
        sessions=_read_sessions(checks, data.get("sessions", {}), "sessions"),
        **cells,
        tuning=_read_tuning(checks, data.get("tuning", []), "tuning", learned=version == SCHEMA),
        schema=version,
    )
    n_cells = len(hp.cell_names())
    for i, entry in enumerate(hp.tuning):
        if "learned" in entry and len(entry["learned"].cell) != n_cells:
            checks.fail(f"tuning[{i}].learned.cell", f"has {len(entry['learned'].cell)} weights; the file has "
                                                     f"{n_cells} cells (the default included)")
    return hp


def _check_schema(checks: JsonChecks, data) -> str:
    """The version of an object whose ``schema`` is one of :data:`SCHEMAS`; refuse anything else."""
    checks.mapping(data, None)
    readable = f"{', '.join(SCHEMAS[:-1])} and {SCHEMAS[-1]}"
    if "schema" not in data:
        checks.fail("schema", f'is missing: this kvprof reads {readable}, and the published format (an object of '
                              f'only "a" and "p")')
    if data["schema"] not in SCHEMAS:
        checks.fail("schema", f"schema {reprlib.repr(data['schema'])} is not supported; this kvprof reads {readable}")
    return data["schema"]


def _read_cells(checks: JsonChecks, data: dict) -> dict:
    """``cells``, ``default_cell`` and ``cell_rule`` as HpFile keywords (all empty in version 1)."""
    if "cells" not in data:
        for key in ("tier_edges", "default_cell", "cell_rule"):
            if key in data:
                checks.fail(key, "needs a 'cells' block beside it")
        return {}
    edges = checks.sequence(data.get("tier_edges", list(TIER_EDGES)), "tier_edges")
    if edges != list(TIER_EDGES):
        checks.fail("tier_edges", f"this kvprof keeps the reuse tiers {list(TIER_EDGES)}, got {reprlib.repr(edges)}")
    cells = {
        _cell_name(checks, name, "cells"): _read_tiers(checks, tiers, member("cells", name))
        for name, tiers in checks.mapping(data["cells"], "cells").items()
    }
    if not cells:
        checks.fail("cells", "must name at least one cell")
    default = _read_tiers(checks, data["default_cell"], "default_cell") if "default_cell" in data else None
    rule = _read_cell_rule(checks, data["cell_rule"], "cell_rule") if "cell_rule" in data else None
    if rule is not None and set(rule.names) != set(cells):
        missing = sorted(set(cells) ^ set(rule.names))[0]
        checks.fail("cell_rule", f"its leaves and the cells block must name the same cells ({missing!r} is in one only)")
    return {"cells": cells, "default_cell": default, "cell_rule": rule}


def _read_tiers(checks: JsonChecks, data, where: str) -> tuple[ReuseRow, ...]:
    """One reuse row per tier."""
    checks.sequence(data, where)
    if len(data) != len(TIER_EDGES):
        checks.fail(where, f"must hold one reuse row per tier ({len(TIER_EDGES)}), got {len(data)}")
    return tuple(_read_reuse_row(checks, row, f"{where}[{t}]") for t, row in enumerate(data))


def _read_reuse_row(checks: JsonChecks, data, where: str) -> ReuseRow:
    """``p``, ``components`` (weight, rate), and optionally ``source`` and ``diagnostics``."""
    checks.fields(data, where, required=("p", "components"), optional=("source", "diagnostics"))
    p = float(checks.number(data["p"], member(where, "p"), high=1.0))
    components = checks.sequence(data["components"], member(where, "components"), empty=False)
    weights, rates = [], []
    for i, component in enumerate(components):
        at = f"{member(where, 'components')}[{i}]"
        checks.fields(component, at, required=("weight", "rate"))
        weights.append(float(checks.number(component["weight"], member(at, "weight"), high=1.0)))
        rates.append(float(checks.number(component["rate"], member(at, "rate"))))
    if abs(sum(weights) - 1.0) > 1e-6:
        checks.fail(member(where, "components"), f"weights must sum to 1, got {sum(weights)!r}")
    source = checks.one_of(data.get("source", "fit"), member(where, "source"), SOURCES)
    diagnostics = data.get("diagnostics")
    if diagnostics is not None:
        _check_diagnostics(checks, diagnostics, member(where, "diagnostics"), row=True)
    return ReuseRow(p, tuple(weights), tuple(rates), source, diagnostics)


def _read_cell_rule(checks: JsonChecks, data, where: str) -> CellRule:
    """``features``, ``fields`` and ``nodes`` (a leaf ``{"cell"}`` or a test ``{"feature", "threshold", "left", "right"}``)."""
    checks.fields(data, where, required=("features", "fields", "nodes"))
    fields = [_cell_field(checks, f, f"{where}.fields[{i}]")
              for i, f in enumerate(checks.sequence(data["fields"], member(where, "fields")))]
    features = [_feature(checks, f, f"{where}.features[{i}]", fields)
                for i, f in enumerate(checks.sequence(data["features"], member(where, "features")))]
    nodes = checks.sequence(data["nodes"], member(where, "nodes"), empty=False)
    columns = {"feature": [], "threshold": [], "left": [], "right": [], "cell": []}
    names: list[str] = []
    for i, node in enumerate(nodes):
        at = f"{where}.nodes[{i}]"
        if type(node) is dict and "cell" in node:
            checks.fields(node, at, required=("cell",))
            names.append(checks.string(node["cell"], member(at, "cell")))
            values = (-1, 0.0, -1, -1, len(names) - 1)
        else:
            checks.fields(node, at, required=("feature", "threshold", "left", "right"))
            name = checks.one_of(node["feature"], member(at, "feature"), tuple(features))
            values = (features.index(name), float(checks.number(node["threshold"], member(at, "threshold"), low=-math.inf)),
                      checks.integer(node["left"], member(at, "left")), checks.integer(node["right"], member(at, "right")), -1)
        for column, value in zip(columns.values(), values):
            column.append(value)
    try:
        return CellRule(tuple(features), tuple(fields), *(tuple(columns[c]) for c in ("feature", "threshold", "left", "right", "cell")),
                        tuple(names))
    except ValueError as err:
        checks.fail(where, str(err))


def _cell_field(checks: JsonChecks, name, where: str) -> str:
    """A cell rule's field: a name a feature ``<field>=<value>`` can be built from."""
    problem = field_name_problem(checks.string(name, where))
    if problem:
        checks.fail(where, problem)
    return name


def _feature(checks: JsonChecks, name, where: str, fields: list[str]) -> str:
    """A cell rule's feature: the turn, the prompt's length, ``class=<name>`` or ``<field>=<value>`` of one of ``fields``."""
    checks.string(name, where)
    kind, is_indicator, _ = name.partition("=")
    if name in (TURN_FEATURE, PROMPT_FEATURE) or (is_indicator and kind == CLASS_FEATURE):
        return name
    if not is_indicator or kind not in fields:
        known = ", ".join([TURN_FEATURE, PROMPT_FEATURE, f"{CLASS_FEATURE}=<name>", *(f"{f}=<value>" for f in fields)])
        checks.fail(where, f"{name!r} is no feature this rule can read (it reads {known})")
    return name


def _read_tuning(checks: JsonChecks, data, where: str, *, learned: bool = True) -> tuple[dict, ...]:
    """Entries of ``capacity`` (blocks, each tuned once), ``horizon_s`` and ``start`` (a candidate order),
    plus what tuning ``measured`` and (with ``learned``: version 3) the ``learned`` predictor."""
    entries = []
    for i, entry in enumerate(checks.sequence(data, where)):
        at = f"{where}[{i}]"
        checks.fields(entry, at, required=("capacity", "horizon_s", "start"),
                      optional=("measured", "learned") if learned else ("measured",))
        checks.integer(entry["capacity"], member(at, "capacity"), low=1)
        earlier = next((j for j, other in enumerate(entries) if other["capacity"] == entry["capacity"]), None)
        if earlier is not None:
            checks.fail(member(at, "capacity"), f"capacity {entry['capacity']} is tuned twice (also {where}[{earlier}])")
        checks.bounded(entry["horizon_s"], member(at, "horizon_s"), POSITIVE_SECONDS)
        checks.one_of(entry["start"], member(at, "start"), CANDIDATES)
        if "measured" in entry:
            _check_measured(checks, entry["measured"], member(at, "measured"))
        if "learned" in entry:
            entry = {**entry, "learned": _read_learned(checks, entry["learned"], member(at, "learned"))}
        elif entry["start"] == "learned":
            checks.fail(member(at, "start"), "is 'learned' but the entry has no learned predictor")
        entries.append(entry)
    return tuple(entries)


#: Bound of a learned log-odds weight: far beyond any fit (a probability of 1 - e^-1000), finite.
LOG_ODDS = Bound(-1e3, 1e3)
#: Bound of a bucket edge: a probability strictly between 0 and 1.
OPEN_PROBABILITY = Bound(0.0, 1.0 - 1e-12, low_open=True)


def _read_learned(checks: JsonChecks, data, where: str) -> LearnedModel:
    """A :class:`~kvprof.models.learned.LearnedModel`: ``bias``, per-bin weights, bucket ``edges``, ``quality``."""
    checks.fields(data, where, required=("bias", "cell", "tier", "depth", "tail", "edges"),
                  optional=("credit_s", "quality"))
    bias = float(checks.bounded(data["bias"], member(where, "bias"), LOG_ODDS))
    weights = {}
    for name, size in (("cell", None), ("tier", len(TIER_EDGES)), ("depth", N_LOG_BINS), ("tail", N_LOG_BINS)):
        at = member(where, name)
        values = checks.sequence(data[name], at, empty=False)
        if size is not None and len(values) != size:
            checks.fail(at, f"must hold {size} weights, got {len(values)}")
        weights[name] = tuple(float(checks.bounded(v, f"{at}[{j}]", LOG_ODDS)) for j, v in enumerate(values))
    at = member(where, "edges")
    edges = tuple(float(checks.bounded(v, f"{at}[{j}]", OPEN_PROBABILITY))
                  for j, v in enumerate(checks.sequence(data["edges"], at, empty=False)))
    if list(edges) != sorted(set(edges)):
        checks.fail(at, "must be distinct and increasing")
    credit = float(checks.bounded(data.get("credit_s", LearnedModel.credit_s), member(where, "credit_s"), SECONDS))
    quality = checks.mapping(data.get("quality", {}), member(where, "quality"))
    for key, value in quality.items():
        checks.number(value, member(member(where, "quality"), key), low=-math.inf)
    return LearnedModel(bias, edges=edges, credit_s=credit, quality=quality, **weights)


def _check_measured(checks: JsonChecks, data, where: str) -> None:
    """What tuning measured: ``hit_ratio_by_horizon_s`` (horizon -> hit ratio in [0, 1]) and
    ``shadow_hits`` (candidate order -> hits), either optional."""
    checks.fields(data, where, optional=("hit_ratio_by_horizon_s", "shadow_hits"))
    ratios = member(where, "hit_ratio_by_horizon_s")
    for horizon, ratio in checks.mapping(data.get("hit_ratio_by_horizon_s", {}), ratios).items():
        checks.number(ratio, member(ratios, horizon), high=1.0)
    hits = member(where, "shadow_hits")
    for order, count in checks.mapping(data.get("shadow_hits", {}), hits).items():
        checks.one_of(order, member(hits, order), CANDIDATES)
        checks.integer(count, member(hits, order))


def _read_classes(checks: JsonChecks, data, where: str) -> dict[str, ClassParams]:
    """Class name -> entry; the names are usable as classes."""
    return {
        _class_name(checks, name, where): _read_class_params(checks, entry, member(where, name))
        for name, entry in checks.mapping(data, where).items()
    }


def _class_name(checks: JsonChecks, name: str, where: str) -> str:
    """``name``, a key of the object at ``where``, if :func:`kvprof.classes.workload_class` can name a
    class so (its trace text encoded, :func:`kvprof.classes.is_name_text`), or such a name and ``@reused``."""
    if not is_name_text(name.removesuffix(REUSED_SUFFIX)):
        checks.fail(member(where, name), f"{name!r} is not a usable class name (a class's text holds none of "
                                         f"@ < > , = or control characters but as %XX; only a reused entry ends "
                                         f"in {REUSED_SUFFIX})")
    return name


def _cell_name(checks: JsonChecks, name: str, where: str) -> str:
    """A cell's name: any text but empty and the default's (cells of a learned rule are named by their conditions)."""
    if not name or name == DEFAULT_CLASS:
        checks.fail(member(where, name), f"{name!r} is not a usable cell name")
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


def _check_diagnostics(checks: JsonChecks, data, where: str, row: bool = False) -> None:
    """Counts are integers >= 0; the statistics numbers >= 0 or null. A cell's row may also give
    its ``components`` (an integer >= 1) and its ``holdout`` quality (null, or ``log_loss``,
    ``brier``, ``n`` and the same for one exponential under ``single``)."""
    optional = _DIAGNOSTIC_STATS + (("components", "holdout") if row else ())
    checks.fields(data, where, required=_DIAGNOSTIC_COUNTS, optional=optional)
    for key in _DIAGNOSTIC_COUNTS:
        checks.integer(data[key], member(where, key))
    for key in _DIAGNOSTIC_STATS:
        checks.number(data.get(key), member(where, key), null=True)
    if "components" in data:
        checks.integer(data["components"], member(where, "components"), low=1)
    held = data.get("holdout")
    if held is not None:
        at = member(where, "holdout")
        checks.fields(held, at, required=("log_loss", "brier", "n", "single"))
        checks.integer(held["n"], member(at, "n"))
        single = member(at, "single")
        checks.fields(held["single"], single, required=("log_loss", "brier"))
        for scores, place in ((held, at), (held["single"], single)):
            for key in ("log_loss", "brier"):
                checks.number(scores[key], member(place, key), null=True)


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
        schema=PUBLISHED_FORMAT,
    )
