"""The hyperparameter file: per-cell reuse models and per-class parameters, schema ``kvprof.hp/6``.

The profiler writes it; the simulator and the vLLM plugin read it. Version 2 adds, for the
``wa`` policy, workload *cells* (the classes, or cells a learned :class:`~kvprof.cells.CellRule`
draws), each with one cure-fraction mixture of exponentials per reuse tier, and the choices a
profile-driven tuning made; ``kvprof.hp/1`` files still load (each class becomes a cell with
one-component rows). Version 3 adds to a tuning entry the ``learned`` candidate's predictor
(:class:`~kvprof.models.learned.LearnedModel`), version 4 the ``long-output`` candidate's limit
(``long_output_tokens``), version 5 the fit window's next-turn counts (``next_turn``, a
:class:`~kvprof.models.next_turn.NextTurnRates`: where they favour it, ``wa`` runs over the
``first-turn`` candidate and LRU), version 6 the retention a client should ask for (``retention``, a
:class:`~kvprof.models.retention.Retention`: per class and hint kind, the wait that catches a share of a
session's returns); files of versions 2 to 5 still load. The loader is strict (unknown
keys, NaN, out-of-range values are errors naming the file and the JSON location) because a typo
in a hand-edited file would otherwise silently fall back to defaults in production. It also reads
the published profiler's ``{"a": {class: lambda}, "p": {class: p}}`` files unchanged. The layout
is documented field by field in ``docs/hp-schema.md``.

This module holds the file (:class:`HpFile`) and reads whole documents; the per-class and per-tier
records are :mod:`kvprof.models.hp_params`'s, the strict readers of each block
:mod:`kvprof.models.hp_loader`'s (all importable from here).
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
from kvprof.cells import TIER_EDGES, CellRule
from kvprof.classes import MAX_TURN_CAP, ClassRule
from kvprof.errors import HpFileError
from kvprof.jsonfile import JsonChecks, member, read_json
from kvprof.limits import POSITIVE_SECONDS, SECONDS
from kvprof.models.hp_loader import (  # noqa: F401 - LOG_ODDS, OPEN_PROBABILITY: imported from here too
    LOG_ODDS,
    OPEN_PROBABILITY,
    class_name,
    read_cells,
    read_class_params,
    read_class_rule,
    read_classes,
    read_sessions,
    read_tuning,
    TUNED_CANDIDATE_KEYS,
    TUNED_CANDIDATE_KEYS_6,
)
from kvprof.models.hp_params import DEFAULT_CLASS, REUSED_SUFFIX, SOURCES, ClassParams, ReuseRow  # noqa: F401 - imported from here
from kvprof.models.learned import LearnedModel
from kvprof.models.next_turn import NextTurnRates
from kvprof.models.retention import Retention

SCHEMA = "kvprof.hp/6"
#: Versions this kvprof reads, oldest first.
SCHEMAS = ("kvprof.hp/1", "kvprof.hp/2", "kvprof.hp/3", "kvprof.hp/4", "kvprof.hp/5", SCHEMA)
#: The candidates' own keys a tuning entry may hold, by version (:func:`~kvprof.models.hp_loader.read_tuning`).
TUNING_EXTRAS = {"kvprof.hp/2": (), "kvprof.hp/3": ("learned",), "kvprof.hp/4": TUNED_CANDIDATE_KEYS,
                 "kvprof.hp/5": TUNED_CANDIDATE_KEYS, SCHEMA: TUNED_CANDIDATE_KEYS_6}
#: :attr:`HpFile.schema` of a file in the published profiler's format (which has no schema).
PUBLISHED_FORMAT = "published"
#: Keys of a published-format file: ``{"a": {class: lambda}, "p": {class: p}}``.
PUBLISHED_KEYS = ("a", "p")

#: Look-ahead the published policy hard-codes, seconds.
PUBLISHED_HORIZON_S = 5.0
#: The published classes are type x turn with no cap; a cap no int32 turn reaches keeps ``text_7`` as ``text_7``.
PUBLISHED_TURN_CAP = MAX_TURN_CAP
#: The published policy's rule for classes it has no entry for: lambda 0, p 1 (scores 0).
PUBLISHED_DEFAULT_P, PUBLISHED_DEFAULT_LAMBDA = 1.0, 0.0

#: Candidate orders a tuned file may start the ``wa`` policy on (:mod:`kvprof.policy.wa`): its row
#: orders, then the policies registered as its candidates (:func:`kvprof.registry.candidates`).
CANDIDATES = ("lru", "model", "segmented", "frequency", "strict-frequency", *registry.candidates())


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
    next_turn : NextTurnRates or None
        How often the fit window's sessions came back within 30 s after a request that began them and
        after one that continued them (None: not counted, as in a file before version 5).
    retention : Retention or None
        Per class and hint kind, the wait after a request that catches a share of its session's returns
        (None: not measured: a file before version 6, or a trace without sessions).
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
    next_turn: NextTurnRates | None = None
    retention: Retention | None = None
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
        if self.next_turn is not None:
            out["next_turn"] = self.next_turn.to_dict()
        if self.retention is not None:
            out["retention"] = self.retention.to_dict()
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
    """Read and validate a hyperparameter file (``kvprof.hp/6`` to ``/1`` or the published format).

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


# --- reading a document (its blocks: kvprof.models.hp_loader) ------------------------------------


#: Top-level keys each version adds to the one before (version 1's are read by every version).
_ADDED_KEYS = {"kvprof.hp/2": ("tier_edges", "cells", "default_cell", "cell_rule", "tuning"),
               "kvprof.hp/5": ("next_turn",), "kvprof.hp/6": ("retention",)}


def _read_schema(checks: JsonChecks, data) -> HpFile:
    """A ``kvprof.hp/1`` to ``/6`` document (version 2: version 1 plus cells and tuning; version 3:
    tuning entries may hold a ``learned`` predictor; version 4: a ``long_output_tokens`` limit too;
    version 5: ``next_turn``; version 6: ``retention``)."""
    version = _check_schema(checks, data)  # before the keys: a newer file's new keys are not typos
    added = [key for since in SCHEMAS[1:SCHEMAS.index(version) + 1] for key in _ADDED_KEYS.get(since, ())]
    checks.fields(data, None, required=("schema", "horizon_s", "class_rule", "classes", "default"),
                  optional=("provenance", "min_gap_s", "block_size", "sessions", *added))
    horizon = float(checks.bounded(data["horizon_s"], "horizon_s", POSITIVE_SECONDS))
    cells = read_cells(checks, data)
    hp = HpFile(
        classes=read_classes(checks, data["classes"], "classes"),
        default=read_class_params(checks, data["default"], "default"),
        horizon=horizon,
        class_rule=read_class_rule(checks, data["class_rule"], "class_rule"),
        min_gap=float(checks.bounded(data.get("min_gap_s", HpFile.min_gap), "min_gap_s", SECONDS)),
        block_size=checks.integer(data.get("block_size"), "block_size", low=1, null=True),
        provenance=checks.mapping(data.get("provenance", {}), "provenance"),
        sessions=read_sessions(checks, data.get("sessions", {}), "sessions"),
        **cells,
        tuning=read_tuning(checks, data.get("tuning", []), "tuning", candidates=CANDIDATES,
                           extras=TUNING_EXTRAS.get(version, ())),
        next_turn=NextTurnRates.read(checks, data["next_turn"], "next_turn") if "next_turn" in data else None,
        retention=Retention.read(checks, data["retention"], "retention") if "retention" in data else None,
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
        class_name(checks, name, "a"): ClassParams(
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
