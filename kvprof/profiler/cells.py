"""Learning the workload cells: a decision tree over request features, label "reused within H".

The class a trace names is one guess at which requests' blocks come back alike. Here a
scikit-learn :class:`~sklearn.tree.DecisionTreeClassifier` chooses the cells from the request
features the live policy also has (:func:`kvprof.cells.request_features`: the class, the turn,
the prompt length, fields the client tags), with every block access of the fit window as one
sample labelled by whether the block came back within ``H``. The number of cells is chosen by
held-out log-loss: the tree is grown on the window's first 70 % of accesses and scored on the
rest, for 1, 2, 4 ... ``max_cells`` leaves; the best size is then grown on all of them.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import log_loss
from sklearn.tree import DecisionTreeClassifier

from kvprof.cells import PROMPT_FEATURE, TURN_FEATURE, CellRule, field_feature, request_features
from kvprof.profiler.classes import field_texts
from kvprof.profiler.reuse import ReuseSamples
from kvprof.profiler.trace import Trace

#: Trees are grown on at most this many accesses (a uniform sample of them, fixed seed).
MAX_TREE_SAMPLES = 400_000
#: A field with more distinct values than this is not a cell feature (ids, free text).
MAX_FIELD_VALUES = 16


def feature_matrix(trace: Trace, class_codes: np.ndarray, class_names, fields=()) -> tuple[np.ndarray, tuple[str, ...]]:
    """Request features as columns (:func:`kvprof.cells.request_features`), one row per request.

    Raises
    ------
    ValueError
        A field the trace lacks, or one with more than :data:`MAX_FIELD_VALUES` values.
    """
    columns = [(f"class={name}", (class_codes == code).astype(np.float64)) for code, name in enumerate(class_names)]
    columns.append((TURN_FEATURE, np.maximum(trace.turn, 1).astype(np.float64)))
    columns.append((PROMPT_FEATURE, np.log2(np.maximum(trace.input_length, 1)).astype(np.float64)))
    for field in fields:
        if field not in trace.extra:
            raise ValueError(f"cell field {field!r} is not in the trace (its fields: {', '.join(sorted(trace.extra)) or 'none'})")
        values = field_texts(trace.extra[field])
        distinct = [v for v in np.unique(values) if v != ""]
        if len(distinct) > MAX_FIELD_VALUES:
            raise ValueError(f"cell field {field!r} has {len(distinct)} values; a cell feature may have at most {MAX_FIELD_VALUES}")
        columns += [(field_feature(field, value), (values == value).astype(np.float64)) for value in distinct]
    return np.column_stack([c for _, c in columns]), tuple(name for name, _ in columns)


def fit_cell_rule(trace: Trace, samples: ReuseSamples, class_codes: np.ndarray, class_names, horizon: float, *,
                  fields=(), max_cells: int = 16, min_samples: int = 200, seed: int = 0) -> CellRule:
    """The cells of a trace window, learned (see the module docstring).

    Parameters
    ----------
    trace : Trace
        The fit window.
    samples : ReuseSamples
        Its reuse samples (:func:`kvprof.profiler.reuse.extract_reuse`).
    class_codes : int array, shape (n_requests,)
        Class of each request, indexing ``class_names``.
    horizon : float
        H, seconds: the label is "reused within H".
    fields : sequence of str
        Request fields clients tag that may split cells.
    max_cells : int
        Most cells; 1 gives one cell for everything.
    min_samples : int
        Fewest accesses a cell may hold (at least 2 % of the accesses too).
    seed : int
        Of the subsample the tree is grown on.

    Returns
    -------
    CellRule
    """
    matrix, names = feature_matrix(trace, class_codes, class_names, fields)
    known = (~samples.censored) | (samples.time >= horizon)  # the outcome within H is seen
    rows = np.flatnonzero(known)
    if rows.size > MAX_TREE_SAMPLES:
        rows = np.sort(np.random.default_rng(seed).choice(rows, MAX_TREE_SAMPLES, replace=False))
    X = matrix[samples.request[rows]]
    y = (~samples.censored[rows]) & (samples.time[rows] < horizon)
    if rows.size < 2 * min_samples or y.all() or not y.any():
        return CellRule.single("all")
    leaf = max(min_samples, int(0.02 * rows.size))
    split = int(0.7 * rows.size)  # samples are in (block, request) order: split by request time
    by_time = np.argsort(trace.timestamp[samples.request[rows]], kind="stable")
    train, test = by_time[:split], by_time[split:]
    best_size, best_loss = 1, np.inf
    size = 1
    while size <= max_cells:
        tree = _grow(X[train], y[train], size, leaf)
        if tree is None:
            break
        loss = log_loss(y[test], tree.predict_proba(X[test])[:, -1], labels=[False, True])
        if loss < best_loss - 1e-6:
            best_size, best_loss = size, loss
        size *= 2
    tree = _grow(X, y, best_size, leaf)
    return CellRule.single("all") if tree is None else _to_rule(tree, names, tuple(fields))


def cells_of_trace(rule: CellRule, trace: Trace, codes: np.ndarray, class_names) -> np.ndarray:
    """Cell of every request (int64, shape (n,)): the rule applied to each distinct feature set once."""
    fields = {field: field_texts(trace.extra[field]) for field in rule.fields if field in trace.extra}
    keys = list(zip(codes.tolist(), np.maximum(trace.turn, 1).tolist(), trace.input_length.tolist(),
                    *(column.tolist() for column in fields.values())))
    cell_of = {}
    out = np.empty(len(keys), dtype=np.int64)
    for i, key in enumerate(keys):
        cell = cell_of.get(key)
        if cell is None:
            code, turn, prompt, *values = key
            features = request_features(class_names[code], turn, prompt, dict(zip(fields, values)))
            cell = cell_of[key] = rule.cell_of(features)
        out[i] = cell
    return out


def _grow(X, y, leaves: int, min_leaf: int) -> DecisionTreeClassifier | None:
    """A tree of at most ``leaves`` leaves, or None if the labels are all one value."""
    if leaves == 1:
        leaves = 2  # sklearn needs two; a stump that cannot split stays one leaf
    if y.all() or not y.any():
        return None
    return DecisionTreeClassifier(max_leaf_nodes=leaves, min_samples_leaf=min_leaf, random_state=0).fit(X, y)


def _to_rule(tree: DecisionTreeClassifier, names: tuple[str, ...], fields: tuple[str, ...]) -> CellRule:
    """The fitted tree as a :class:`~kvprof.cells.CellRule`, its leaves named by their paths."""
    structure = tree.tree_
    left, right = structure.children_left.tolist(), structure.children_right.tolist()
    feature, threshold = structure.feature.tolist(), structure.threshold.tolist()
    used = sorted({f for f, child in zip(feature, left) if child != -1})
    position = {f: i for i, f in enumerate(used)}
    paths: dict[int, list[tuple[str, float, bool]]] = {0: []}
    leaf_names: list[str] = []
    cell = []
    for node in range(len(left)):  # sklearn numbers children after their parent
        if left[node] == -1:
            name = _leaf_name(paths[node])  # thresholds printed to 3 digits may read alike: keep names apart
            leaf_names.append(name if name not in leaf_names else f"{name}#{len(leaf_names)}")
            cell.append(len(leaf_names) - 1)
            continue
        cell.append(-1)
        test = (names[feature[node]], threshold[node])
        paths[left[node]] = paths[node] + [(*test, True)]
        paths[right[node]] = paths[node] + [(*test, False)]
    is_leaf = [child == -1 for child in left]
    return CellRule(
        features=tuple(names[f] for f in used),
        fields=tuple(f for f in fields if any(names[u].startswith(f + "=") for u in used)),
        feature=tuple(-1 if leaf else position[f] for f, leaf in zip(feature, is_leaf)),
        threshold=tuple(0.0 if leaf else round(t, 6) for t, leaf in zip(threshold, is_leaf)),
        left=tuple(left),
        right=tuple(right),
        cell=tuple(cell),
        names=tuple(leaf_names),
    )


def _leaf_name(path: list[tuple[str, float, bool]]) -> str:
    """A leaf's conditions, compacted: ``class=text_1,10.7<log2_prompt_tokens<=11.8,turn>4.5``.

    Each numeric feature becomes one range; an indicator is named when true, and its negations
    only when no indicator of the same kind (``class=``) is true.
    """
    ranges: dict[str, list[float]] = {}
    true, false = [], []
    for feature, threshold, below in path:
        if "=" in feature:
            (false if below else true).append(feature)
            continue
        low, high = ranges.setdefault(feature, [-np.inf, np.inf])
        ranges[feature] = [low, min(high, threshold)] if below else [max(low, threshold), high]
    kinds = {feature.split("=")[0] for feature in true}
    parts = sorted(true) + sorted(f"not {f}" for f in false if f.split("=")[0] not in kinds)
    for feature, (low, high) in sorted(ranges.items()):
        parts.append((f"{low:.3g}<" if low > -np.inf else "") + feature + (f"<={high:.3g}" if high < np.inf else ""))
    return ",".join(parts) or "all"
