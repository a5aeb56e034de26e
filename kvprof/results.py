"""The results document, schema ``kvprof.results/1``: built, validated, merged and written here only.

``compare`` and ``demo`` (:mod:`kvprof.sim.sweep`), ``replay`` (:mod:`kvprof.replay`) and ``show``
all go through this module, so the schema has one definition; docs/results-schema.md describes
it field by field. A document is a plain JSON-ready dict; :func:`validate` is the reader's
contract (what ``show`` and the plots rely on), and every document built here passes it.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvprof import __version__
from kvprof.atomic import atomic_write_text
from kvprof.errors import ResultsFileError
from kvprof.jsonfile import JsonChecks, json_safe, parse_json, read_json
from kvprof.limits import RATE_SCALE

SCHEMA = "kvprof.results/1"
#: The document's file name in an output directory.
FILE = "results.json"
#: Every version of the schema starts so; a file of another version is a results file all the same.
FAMILY = "kvprof.results/"
#: Appended to the policy name of a measured run when documents are merged.
LIVE = " (live)"


def build(*, inputs: dict, config: dict, runs: Sequence[dict], wall_s: float, complete: bool = True) -> dict:
    """A ``kvprof.results/1`` document: the parts plus schema, version and creation time.

    ``complete`` is False for a replay stopped before its end (its runs hold the requests answered
    until then). Non-finite numbers become ``null`` (JSON has none). The document is validated, so
    a producer cannot write what :func:`load` would refuse.
    """
    document = json_safe({
        "schema": SCHEMA,
        "kvprof_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "inputs": inputs,
        "config": config,
        "wall_s": wall_s,
        "runs": list(runs),
        "complete": complete,
    })
    return validate(document, "<results being written>")


def write(path: str | os.PathLike, document: dict) -> Path:
    """Write ``document`` to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(document, indent=2, allow_nan=False) + "\n")


def claims(data: object) -> bool:
    """Whether decoded JSON says it is a results document (of any schema version)."""
    return type(data) is dict and type(data.get("schema")) is str and data["schema"].startswith(FAMILY)


def load(path: str | os.PathLike) -> dict:
    """The validated document in ``path``.

    Raises
    ------
    ResultsFileError
        Not JSON, another schema version, unfinished, or a field of the wrong type or range; the
        message names the file and the field (``runs[2].capacity``).
    """
    return validate(read_json(path, ResultsFileError), str(path))


def load_if_results(path: str | os.PathLike, raw: bytes | None = None) -> dict | None:
    """The validated document in ``path`` (or in ``raw``, its bytes already read: a stream is read
    once) when the file says it is one (any schema version), else None.

    A file that is not JSON at all also gives None: it is left to the caller's other reader
    (``show`` tries the hp loader), whose message then says what is wrong.
    """
    try:
        data = read_json(path, ResultsFileError) if raw is None else parse_json(raw, path, ResultsFileError)
    except ResultsFileError:
        return None
    return validate(data, str(path)) if claims(data) else None


def validate(document: object, source: str) -> dict:
    """``document`` if it is a ``kvprof.results/1`` document that show and the plots can read: finished,
    or a replay's stopped before its end (``"complete": false``, the requests answered until then).

    Fields beyond those checked are allowed (later ``/1`` files may add some).
    """
    checks = JsonChecks(source, ResultsFileError)
    checks.mapping(document, None)
    schema = document.get("schema")
    if schema != SCHEMA:
        checks.fail("schema", f"results schema {json.dumps(schema)} is not supported; this kvprof reads {SCHEMA}")
    if document.get("complete") is not True and not (document.get("complete") is False and is_replay(document)):
        checks.fail("complete", 'not a finished results file (no "complete": true)')
    _check_fields(checks, document, "", _TOP_FIELDS)
    runs = checks.sequence(document.get("runs"), "runs", empty=False)
    for index, run in enumerate(runs):
        where = f"runs[{index}]"
        checks.mapping(run, where)
        if "capacity" in run and run["capacity"] is None:
            checks.fail(f"{where}.capacity", "the run has no capacity (a replay without one); replay again with --capacity")
        _check_fields(checks, run, f"{where}.", _RUN_FIELDS)
    return document


def is_replay(document: dict) -> bool:
    """Whether a (decoded) document is ``kvprof replay``'s."""
    return type(document.get("config")) is dict and document["config"].get("mode") == "replay"


def merge(documents: Sequence[dict]) -> dict:
    """The runs of several documents in one, so a simulated sweep and a live replay share a table and plots.

    A measured run's policy gets ``" (live)"`` appended; the ``k``-th document to use a label
    gets ``" #k"`` after it (the second ``wa (live)`` is ``wa (live) #2``), so each line is one
    document's. Each run gets ``origin``: ``simulated``, or ``live`` with the hp file the server
    ran, the rate scale when it is not 1, and ``incomplete`` for a replay stopped before its end.
    The title's trace and block size are the first document's.

    Returns
    -------
    dict
        ``inputs``, ``config`` and ``runs``, what the plots read; not a results file.
    """
    runs: list[dict] = []
    uses: dict[str, int] = {}  # label -> documents that used it so far
    for document in documents:
        labels = {run["policy"] + (LIVE if run.get("measured") else "") for run in document["runs"]}
        for label in labels:
            uses[label] = uses.get(label, 0) + 1
        for run in document["runs"]:
            label = run["policy"] + (LIVE if run.get("measured") else "")
            runs.append({**run, "policy": label if uses[label] == 1 else f"{label} #{uses[label]}",
                         "origin": _origin(document, bool(run.get("measured")))})
    first = documents[0]
    return {
        "inputs": first.get("inputs", {}),
        "config": {**first["config"], "policies": list(dict.fromkeys(run["policy"] for run in runs)),
                   "capacities": sorted({run["capacity"] for run in runs})},
        "runs": runs,
    }


def _origin(document: dict, measured: bool) -> str:
    """``simulated`` or ``live`` (with the hp file the server ran), and the rate scale unless 1."""
    parts = ["live" if measured else "simulated"]
    hp = (document.get("inputs") or {}).get("hp")
    if measured and isinstance(hp, dict) and isinstance(hp.get("path"), str):
        parts.append(f"hp {Path(hp['path']).name}")
    scale = document["config"].get("rate_scale", 1)
    if scale != 1:
        parts.append(f"rate x{scale:g}")
    if document.get("complete") is False:
        parts.append("incomplete")
    return ", ".join(parts)


# --- what a reader relies on ----------------------------------------------------------------------

#: (check, required) per field; ``check(checks, value, where)`` raises on a bad value.
FieldCheck = Callable[[JsonChecks, object, str], object]


def _count(checks, value, where):
    return checks.integer(value, where)


def _blocks(checks, value, where):
    return checks.integer(value, where, low=1)


def _ratio(checks, value, where):
    return checks.number(value, where, high=1.0, null=True)


def _seconds(checks, value, where):
    return checks.number(value, where, null=True)


def _signed(checks, value, where):
    return checks.number(value, where, low=-math.inf, null=True)


def _rate_scale(checks, value, where):
    return checks.bounded(value, where, RATE_SCALE)


def _block_size(checks, value, where):
    return checks.integer(value, where, low=1, null=True)


def _flag(checks, value, where):
    return checks.boolean(value, where)


def _policies(checks, value, where):
    for index, name in enumerate(checks.sequence(value, where, empty=False)):
        checks.string(name, f"{where}[{index}]")


def _config(checks, value, where):
    _check_fields(checks, checks.mapping(value, where), f"{where}.", _CONFIG_FIELDS)


def _inputs(checks, value, where):
    inputs = checks.mapping(value, where)
    if "trace" in inputs:
        _check_fields(checks, checks.mapping(inputs["trace"], f"{where}.trace"), f"{where}.trace.", _TRACE_FIELDS)


def _text(checks, value, where):
    return checks.string(value, where)


_TOP_FIELDS: dict[str, tuple[FieldCheck, bool]] = {
    "config": (_config, True),
    "inputs": (_inputs, False),
    "wall_s": (_seconds, False),
}
_CONFIG_FIELDS = {
    "policies": (_policies, True),
    "engine_block_size": (_block_size, False),
    "cpu_capacity": (_count, False),
    "rate_scale": (_rate_scale, False),
}
_TRACE_FIELDS = {"source": (_text, False), "n_requests": (_count, False)}
_RUN_FIELDS = {
    "policy": (_text, True),
    "capacity": (_blocks, True),
    "n_requests": (_count, True),
    "token_hit_ratio": (_ratio, True),
    "qttft_mean_s": (_seconds, True),
    "qttft_p99_s": (_seconds, True),
    **{name: (_count, False) for name in (
        "n_rejected", "prompt_tokens", "cached_tokens", "block_lookups", "hits_device", "hits_host", "misses",
        "evictions", "dropped", "host_evictions", "n_errors", "n_timeouts", "n_skipped")},
    "block_hit_ratio": (_ratio, False),
    **{name: (_seconds, False) for name in ("qttft_p50_s", "qttft_p90_s", "ttft_mean_s", "makespan_s", "offered_load")},
    **{name: (_signed, False) for name in (
        "hit_gain_over_lru", "hit_gain_over_lru_abs", "qttft_gain_over_lru", "belady_gap_closed")},
    "measured": (_flag, False),
    "qttft_overloaded": (_flag, False),
}


def _check_fields(checks: JsonChecks, data: dict, prefix: str, fields: dict[str, tuple[FieldCheck, bool]]) -> None:
    for name, (check, required) in fields.items():
        if name in data:
            check(checks, data[name], prefix + name)
        elif required:
            checks.fail(prefix + name, "is missing")
