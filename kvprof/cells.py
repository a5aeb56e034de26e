"""Workload cells: a request's cell, learned from data by a small decision tree.

A cell groups requests whose blocks come back alike. The class rule (:mod:`kvprof.classes`)
names one candidate grouping (``text_1``, ``file_2`` ...); a :class:`CellRule` learned by the
profiler (:mod:`kvprof.profiler.cells`) may split or merge classes on other request features.
Like the class rule it is one pure function of what a request carries when it arrives, applied
by the profiler to every request of a trace and by the live policy (simulator or vLLM plugin)
to every incoming one, so a cell means the same on both sides. Numpy-free, below the models
and the profiler.

Blocks of a cell are further split into reuse tiers by their hit count (:data:`TIER_EDGES`).

Request features (:func:`request_features`): ``class=<name>`` (1 for the request's class),
``turn``, ``log2_prompt_tokens``, and ``<field>=<value>`` (1) for each field the rule names
(values a client tags, e.g. ``model``). A feature a request does not have is 0. Values are
encoded as class names are (:func:`kvprof.classes.name_text`) and field names may not hold the
characters feature and cell names are built with (:func:`field_name_problem`), so two features,
and two cells' names, never read alike.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvprof.classes import name_text

#: Reuse tiers of a block: one hit ``h`` times is in the tier of the last edge ``<= h`` (0, 1,
#: 2-3, 4 or more). The profiler counts earlier requests that used the block; the policy, hits.
TIER_EDGES = (0, 1, 2, 4)

PROMPT_FEATURE = "log2_prompt_tokens"
TURN_FEATURE = "turn"


#: The feature of the request's class; a field may not be named so.
CLASS_FEATURE = "class"
_FIELD_NAME = re.compile(r"[^\s%@<>,=\ud800-\udfff]+")


def field_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a cell field (a feature ``<name>=<value>``), or None if it can."""
    if not _FIELD_NAME.fullmatch(name):
        return f"{name!r} cannot name a cell field: it may not be empty or hold spaces or any of % @ < > , ="
    if name == CLASS_FEATURE:
        return f"{name!r} cannot name a cell field: class=<name> is the request's class"
    return None


def field_feature(name: str, value) -> str | None:
    """The indicator feature of field ``name`` holding ``value`` (``model=m1``), None for no value."""
    text = name_text(value)
    return None if text is None else f"{name}={text}"


def request_features(class_name: str, turn: int | None, prompt_tokens: int, fields: Mapping | None = None) -> dict:
    """The features of one request, by name (absent ones are 0)."""
    features = {f"{CLASS_FEATURE}={class_name}": 1.0, TURN_FEATURE: float(turn or 1),
                PROMPT_FEATURE: math.log2(max(prompt_tokens, 1))}
    for name, value in (fields or {}).items():
        feature = field_feature(name, value)
        if feature is not None:
            features[feature] = 1.0
    return features


@dataclass(frozen=True)
class CellRule:
    """A binary decision tree over request features whose leaves are the cells.

    Node ``i`` tests ``features[feature[i]] <= threshold[i]`` and goes to ``left[i]`` if true,
    else ``right[i]``; a leaf has ``feature[i] == -1`` and names cell ``cell[i]``. Node 0 is the
    root. Invariant (checked on construction): the nodes form one tree (every node but the root
    has exactly one parent, children come after their parent), and the leaves name each cell of
    ``names`` exactly once.

    Parameters
    ----------
    features : tuple of str
        Feature names the nodes test (see :func:`request_features`).
    fields : tuple of str
        Request fields the features read (``model`` for ``model=...``).
    feature, left, right, cell : tuple of int
    threshold : tuple of float
    names : tuple of str
        Cell names, in cell-index order.
    """

    features: tuple[str, ...]
    fields: tuple[str, ...]
    feature: tuple[int, ...]
    threshold: tuple[float, ...]
    left: tuple[int, ...]
    right: tuple[int, ...]
    cell: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self):
        n = len(self.feature)
        if not n or any(len(column) != n for column in (self.threshold, self.left, self.right, self.cell)):
            raise ValueError("a cell tree needs at least one node and one entry per node in every column")
        parents = [0] * n
        leaves = []
        for i in range(n):
            if self.feature[i] == -1:
                if not 0 <= self.cell[i] < len(self.names):
                    raise ValueError(f"leaf {i} names cell {self.cell[i]}, not one of the {len(self.names)} cells")
                leaves.append(self.cell[i])
                continue
            if not 0 <= self.feature[i] < len(self.features):
                raise ValueError(f"node {i} tests feature {self.feature[i]}, not one of the {len(self.features)}")
            if not math.isfinite(self.threshold[i]):
                raise ValueError(f"node {i} has a threshold that is not a finite number")
            for child in (self.left[i], self.right[i]):
                if not i < child < n:
                    raise ValueError(f"node {i} has child {child}; children come after their parent, within the tree")
                parents[child] += 1
        if parents[0] or any(count != 1 for count in parents[1:]):
            raise ValueError("the nodes do not form one tree (a node with no parent or two)")
        if sorted(leaves) != list(range(len(self.names))):
            raise ValueError("the leaves must name every cell exactly once")
        if len(set(self.names)) != len(self.names):
            raise ValueError("two leaves have one name; each cell's name must be its own")

    @classmethod
    def single(cls, name: str) -> CellRule:
        """One cell for every request."""
        return cls((), (), (-1,), (0.0,), (-1,), (-1,), (0,), (name,))

    def cell_of(self, features: Mapping[str, float]) -> int:
        """Cell index of a request with these features (:func:`request_features`)."""
        node = 0
        while self.feature[node] != -1:
            value = features.get(self.features[self.feature[node]], 0.0)
            node = self.left[node] if value <= self.threshold[node] else self.right[node]
        return self.cell[node]

    def to_dict(self) -> dict:
        return {
            "features": list(self.features),
            "fields": list(self.fields),
            "nodes": [
                {"cell": self.names[self.cell[i]]} if self.feature[i] == -1 else
                {"feature": self.features[self.feature[i]], "threshold": self.threshold[i],
                 "left": self.left[i], "right": self.right[i]}
                for i in range(len(self.feature))
            ],
        }
