"""The parameter records of a hyperparameter file (:mod:`kvprof.models.hp`): one class's cure
exponential (:class:`ClassParams`) and one tier's mixture of exponentials (:class:`ReuseRow`), each
valid by construction, and the names a file gives its classes."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Name of the default class in :meth:`HpFile.table`; not a valid class name in a file.
DEFAULT_CLASS = "<default>"
#: Suffix of the entry that holds a class's parameters for blocks an earlier request already used.
REUSED_SUFFIX = "@reused"

#: Where a record's numbers come from.
SOURCES = ("fit", "shrunk", "pooled", "published")


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
