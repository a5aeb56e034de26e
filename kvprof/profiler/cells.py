"""Learning the workload cells: a decision tree over request features, label "reused within H".

The class a trace names is one guess at which requests' blocks come back alike. Here a
scikit-learn :class:`~sklearn.tree.DecisionTreeClassifier` chooses the cells from the request
features the live policy also has (:func:`kvprof.cells.request_features`: the class, the turn,
the prompt length, fields the client tags), with every block access of the fit window as one
sample labelled by whether the block came back within ``H`` (a uniform sample of them on long
windows). The number of cells is chosen by held-out log-loss: the tree is grown on the window's
first 70 % of accesses and scored on the rest, for 1, 2, 4 ... ``max_cells`` leaves; the best size
is then grown on all of them. Accesses with the same features and label are grown on as one
sample weighted by their count: the same tree, in a tenth of the time.
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


def known_outcomes(samples: ReuseSamples, horizon: float) -> tuple[np.ndarray, np.ndarray]:
    """The accesses whose outcome within ``horizon`` the window shows, in sample order: each one's
    request, and whether it was reused within ``horizon`` (the tree's label)."""
    known = (~samples.censored) | (samples.time >= horizon)
    return samples.request[known], (~samples.censored[known]) & (samples.time[known] < horizon)


def tree_sample(n_known: int, seed: int = 0) -> np.ndarray:
    """Sorted positions, among ``n_known`` accesses of known outcome, of those the tree is grown on:
    all of them, or a uniform sample of :data:`MAX_TREE_SAMPLES` (fixed seed)."""
    if n_known <= MAX_TREE_SAMPLES:
        return np.arange(n_known)
    return np.sort(np.random.default_rng(seed).choice(n_known, MAX_TREE_SAMPLES, replace=False))


def fit_cell_rule(trace: Trace, request: np.ndarray, reused: np.ndarray, class_codes: np.ndarray, class_names, *,
                  fields=(), max_cells: int = 16, min_samples: int = 200) -> CellRule:
    """The cells of a trace window, learned (see the module docstring).

    Parameters
    ----------
    trace : Trace
        The fit window.
    request, reused : arrays, shape (s,)
        The accesses the tree learns from (:func:`known_outcomes` at :func:`tree_sample`), in
        sample order: each one's request and label.
    class_codes : int array, shape (n_requests,)
        Class of each request, indexing ``class_names``.
    fields : sequence of str
        Request fields clients tag that may split cells.
    max_cells : int
        Most cells; 1 gives one cell for everything.
    min_samples : int
        Fewest accesses a cell may hold (at least 2 % of the accesses too).

    Returns
    -------
    CellRule
    """
    first, group = distinct_requests(trace, class_codes, fields)
    X, names = feature_matrix(trace.select(first), class_codes[first], class_names, fields)
    if request.size < 2 * min_samples or reused.all() or not reused.any():
        return CellRule.single("all")
    leaf = max(min_samples, int(0.02 * request.size))
    split = int(0.7 * request.size)  # samples are in (block, request) order: split by request time
    by_time = np.argsort(trace.timestamp[request], kind="stable")
    train, test = (_weighted(group[request[part]], reused[part], len(first)) for part in (by_time[:split], by_time[split:]))
    best_size, best_loss = 1, np.inf
    size = 1
    while size <= max_cells:
        tree = _grow(X, train, size, leaf)
        if tree is None:
            break
        keys, label, weight = test
        loss = log_loss(label, tree.predict_proba(X[keys])[:, -1], sample_weight=weight, labels=[False, True])
        if loss < best_loss - 1e-6:
            best_size, best_loss = size, loss
        size *= 2
    tree = _grow(X, _weighted(group[request], reused, len(first)), best_size, leaf)
    return CellRule.single("all") if tree is None else _to_rule(tree, names, tuple(fields))


def distinct_requests(trace: Trace, class_codes: np.ndarray, fields=()) -> tuple[np.ndarray, np.ndarray]:
    """Requests grouped by what a cell rule reads (class, turn, prompt length, the fields' values).

    Returns
    -------
    first : int64 array, shape (d,)
        The first request of each group, ascending.
    group : int64 array, shape (n_requests,)
        Each request's group, indexing ``first``.
    """
    columns = [np.asarray(class_codes), np.maximum(trace.turn, 1), trace.input_length]
    columns += [field_texts(trace.extra[f]) for f in fields if f in trace.extra]
    group = np.zeros(trace.n_requests, dtype=np.int64)
    for column in columns:  # one column at a time, renumbered densely: the key never overflows
        values, code = np.unique(column, return_inverse=True)
        _, group = np.unique(group * len(values) + code.reshape(-1), return_inverse=True)
    _, first = np.unique(group, return_index=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return first[order], rank[group.reshape(-1)]


def cells_of_trace(rule: CellRule, trace: Trace, codes: np.ndarray, class_names) -> np.ndarray:
    """Cell of every request (int64, shape (n,)): :meth:`CellRule.cell_of` of its features
    (:func:`~kvprof.cells.request_features`, computed once per distinct request), the tree
    walked for all of them at once."""
    fields = [field for field in rule.fields if field in trace.extra]
    first, group = distinct_requests(trace, codes, fields)
    values = np.zeros((len(rule.features), first.size))
    classes = np.asarray(class_names, dtype=object)[np.asarray(codes)[first]]
    turns = np.maximum(trace.turn[first], 1).tolist()
    prompts = trace.input_length[first].tolist()
    for j, name in enumerate(rule.features):
        if name == TURN_FEATURE:
            values[j] = [request_features("", turn, 1)[TURN_FEATURE] for turn in turns]
        elif name == PROMPT_FEATURE:
            values[j] = [request_features("", 1, prompt)[PROMPT_FEATURE] for prompt in prompts]
        elif name.startswith("class="):
            values[j] = [f"class={c}" == name for c in classes.tolist()]
        else:  # <field>=<value>, read as the tree learned it (and as the live policy names it)
            field = next((f for f in fields if name.startswith(f + "=")), None)
            if field is not None:
                column = field_texts(np.asarray(trace.extra[field])[first]).tolist()
                values[j] = [field_feature(field, v) == name for v in column]
    feature, threshold = np.array(rule.feature), np.array(rule.threshold)
    left, right, cell = np.array(rule.left), np.array(rule.right), np.array(rule.cell)
    node = np.zeros(first.size, dtype=np.int64)
    inner = np.flatnonzero(feature[node] != -1)
    while inner.size:
        here = node[inner]
        go_left = values[feature[here], inner] <= threshold[here]
        node[inner] = np.where(go_left, left[here], right[here])
        inner = inner[feature[node[inner]] != -1]
    return cell[node][group]


def _weighted(group: np.ndarray, label: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Accesses as one sample per (feature group, label), weighted by how many there are.

    Returns ``(group, label, weight)``, each of shape (s,): a tree grown on them with
    ``min_weight_fraction_leaf`` is the tree of the accesses one by one (:func:`_grow`).
    """
    weight = np.bincount(group * 2 + label, minlength=2 * n_groups)
    keys = np.flatnonzero(weight)
    return keys // 2, (keys % 2).astype(bool), weight[keys].astype(np.float64)


def _grow(X, samples, leaves: int, min_leaf: int) -> DecisionTreeClassifier | None:
    """A tree of at most ``leaves`` leaves, each of at least ``min_leaf`` accesses, or None if the
    labels are all one value. Samples are weighted by their accesses: the leaf minimum is then a
    weight (half an access below it, as the weights are whole numbers)."""
    keys, label, weight = samples
    if leaves == 1:
        leaves = 2  # sklearn needs two; a stump that cannot split stays one leaf
    if label.all() or not label.any():
        return None
    total = weight.sum()
    splittable = 2 * min_leaf <= total
    tree = DecisionTreeClassifier(max_leaf_nodes=leaves, random_state=0,
                                  min_weight_fraction_leaf=(min_leaf - 0.5) / total if splittable else 0.0,
                                  min_samples_split=2 if splittable else keys.size + 1)
    return tree.fit(X[keys], label, sample_weight=weight)


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
