"""The strict readers of a hyperparameter file's blocks, one function per block.

Each is given the :class:`~kvprof.jsonfile.JsonChecks` of the file being read and the block's JSON
location, and refuses unknown keys, wrong types, NaN and out-of-range values with an error naming
the file and that location (``classes.text_1.p``). :mod:`kvprof.models.hp` reads a whole document
(``kvprof.hp/6`` to ``/1`` or the published format) with them.
"""

from __future__ import annotations

import math
import reprlib

from kvprof.cells import CLASS_FEATURE, PROMPT_FEATURE, TIER_EDGES, TURN_FEATURE, CellRule, field_name_problem
from kvprof.classes import CLASS_KEYS, MAX_TURN_CAP, ClassRule, is_name_text
from kvprof.jsonfile import JsonChecks, member
from kvprof.limits import INT32_MAX, POSITIVE_SECONDS, SECONDS, Bound
from kvprof.models.hp_params import DEFAULT_CLASS, REUSED_SUFFIX, SOURCES, ClassParams, ReuseRow
from kvprof.models.learned import LOG_BINNED, N_LOG_BINS, LearnedModel
from kvprof.models.sessions import MAX_TURNS

_DIAGNOSTIC_COUNTS = ("n_accesses", "n_reuses", "n_censored")
_DIAGNOSTIC_STATS = ("ks", "mean_gap_s", "median_gap_s")
_SESSION_COUNTS = ("n_requests", "n_sessions")
_THINK_TIME_STATS = ("mean", "median", "p90")


def read_cells(checks: JsonChecks, data: dict) -> dict:
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


#: The keys of a tuning entry that hold a candidate's own parameters (:func:`read_tuning`); version 6 adds
#: ``finish_reason`` (true: ``wa`` carries the finish-reason candidate at that capacity).
TUNED_CANDIDATE_KEYS = ("learned", "long_output_tokens")
TUNED_CANDIDATE_KEYS_6 = (*TUNED_CANDIDATE_KEYS, "finish_reason")
#: Bound of the long-output candidate's limit: output tokens, any number a request may generate.
OUTPUT_LIMIT = Bound(0.0, float(INT32_MAX))


def read_tuning(checks: JsonChecks, data, where: str, *, candidates: tuple[str, ...],
                extras: tuple[str, ...] = TUNED_CANDIDATE_KEYS) -> tuple[dict, ...]:
    """Entries of ``capacity`` (blocks, each tuned once), ``horizon_s`` and ``start`` (one of ``candidates``,
    the orders ``wa`` may start on), plus what tuning ``measured`` and those of the candidates' own
    keys the file's version has (``extras``: ``learned``, the predictor, since version 3;
    ``long_output_tokens``, the long-output candidate's limit, since version 4; ``finish_reason``, true
    where ``wa`` carries the finish-reason candidate, since version 6)."""
    entries = []
    for i, entry in enumerate(checks.sequence(data, where)):
        at = f"{where}[{i}]"
        checks.fields(entry, at, required=("capacity", "horizon_s", "start"), optional=("measured", *extras))
        checks.integer(entry["capacity"], member(at, "capacity"), low=1)
        earlier = next((j for j, other in enumerate(entries) if other["capacity"] == entry["capacity"]), None)
        if earlier is not None:
            checks.fail(member(at, "capacity"), f"capacity {entry['capacity']} is tuned twice (also {where}[{earlier}])")
        checks.bounded(entry["horizon_s"], member(at, "horizon_s"), POSITIVE_SECONDS)
        checks.one_of(entry["start"], member(at, "start"), candidates)
        if "measured" in entry:
            _check_measured(checks, entry["measured"], member(at, "measured"), candidates)
        if "learned" in entry:
            entry = {**entry, "learned": _read_learned(checks, entry["learned"], member(at, "learned"))}
        elif entry["start"] == "learned":
            checks.fail(member(at, "start"), "is 'learned' but the entry has no learned predictor")
        if "long_output_tokens" in entry:
            limit = checks.bounded(entry["long_output_tokens"], member(at, "long_output_tokens"), OUTPUT_LIMIT)
            entry = {**entry, "long_output_tokens": float(limit)}
        elif entry["start"] == "long-output":
            checks.fail(member(at, "start"), "is 'long-output' but the entry has no long_output_tokens")
        if "finish_reason" in entry:
            if checks.boolean(entry["finish_reason"], member(at, "finish_reason")) is not True:
                checks.fail(member(at, "finish_reason"), "is false: leave it out where wa does not carry the candidate")
        elif entry["start"] == "finish-reason":
            checks.fail(member(at, "start"), "is 'finish-reason' but the entry has no finish_reason")
        entries.append(entry)
    return tuple(entries)


#: Bound of a learned log-odds weight: far beyond any fit (a probability of 1 - e^-1000), finite.
LOG_ODDS = Bound(-1e3, 1e3)
#: Bound of a bucket edge: a probability strictly between 0 and 1.
OPEN_PROBABILITY = Bound(0.0, 1.0 - 1e-12, low_open=True)


def _read_learned(checks: JsonChecks, data, where: str) -> LearnedModel:
    """A :class:`~kvprof.models.learned.LearnedModel`: ``bias``, per-bin weights, bucket ``edges``, ``quality``.

    The chain features' weights (``turn``, ``gap``, ``fanout``) are optional: a file written before
    they were fitted has none, which weighs them zero (the predictor it was written with)."""
    checks.fields(data, where, required=("bias", "cell", "tier", "depth", "tail", "edges"),
                  optional=("turn", "gap", "fanout", "credit_s", "quality"))
    bias = float(checks.bounded(data["bias"], member(where, "bias"), LOG_ODDS))
    weights = {}
    for name, size in (("cell", None), ("tier", len(TIER_EDGES)), *((name, N_LOG_BINS) for name in LOG_BINNED)):
        if name not in data:
            continue  # an optional chain feature (the required ones are checked above)
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


def _check_measured(checks: JsonChecks, data, where: str, candidates: tuple[str, ...]) -> None:
    """What tuning measured: ``hit_ratio_by_horizon_s`` (horizon -> hit ratio in [0, 1]),
    ``shadow_hits`` (one of ``candidates`` -> hits), ``hit_ratio_by_output_limit`` (the long-output
    candidate's limit in tokens -> its hit ratio alone), ``lru_hit_ratio`` and ``finish_reason_hit_ratio``
    (the finish-reason candidate's alone), each optional."""
    checks.fields(data, where, optional=("hit_ratio_by_horizon_s", "shadow_hits", "hit_ratio_by_output_limit",
                                         "lru_hit_ratio", "finish_reason_hit_ratio"))
    for key in ("hit_ratio_by_horizon_s", "hit_ratio_by_output_limit"):
        ratios = member(where, key)
        for name, ratio in checks.mapping(data.get(key, {}), ratios).items():
            checks.number(ratio, member(ratios, name), high=1.0)
    for key in ("lru_hit_ratio", "finish_reason_hit_ratio"):
        if key in data:
            checks.number(data[key], member(where, key), high=1.0)
    hits = member(where, "shadow_hits")
    for order, count in checks.mapping(data.get("shadow_hits", {}), hits).items():
        checks.one_of(order, member(hits, order), candidates)
        checks.integer(count, member(hits, order))


def read_classes(checks: JsonChecks, data, where: str) -> dict[str, ClassParams]:
    """Class name -> entry; the names are usable as classes."""
    return {
        class_name(checks, name, where): read_class_params(checks, entry, member(where, name))
        for name, entry in checks.mapping(data, where).items()
    }


def class_name(checks: JsonChecks, name: str, where: str) -> str:
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


def read_class_params(checks: JsonChecks, data, where: str) -> ClassParams:
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


def read_class_rule(checks: JsonChecks, data, where: str) -> ClassRule:
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


def read_sessions(checks: JsonChecks, data, where: str) -> dict:
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
