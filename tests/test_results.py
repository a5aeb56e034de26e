"""The results document: one module builds, validates, merges and writes it; ``show`` refuses bad files by place."""

from __future__ import annotations

import json

import pytest

from kvprof import results
from kvprof.errors import ResultsFileError
from tests.helpers import invoke

RUN = {"policy": "lru", "capacity": 16, "n_requests": 3, "token_hit_ratio": 0.5, "qttft_mean_s": 1.0,
       "qttft_p99_s": 2.0}


def document(**changes) -> dict:
    doc = results.build(inputs={"trace": {"source": "t.jsonl", "n_requests": 3}},
                        config={"policies": ["lru"], "engine_block_size": 128}, runs=[RUN], wall_s=0.5)
    doc.update(changes)
    return doc


def show(tmp_path, doc, name="results.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path, invoke("show", path)


#: (name, document, JSON location the error names, words of the message)
BAD = [
    ("no runs", {"schema": "kvprof.results/1", "complete": True, "config": {"policies": ["lru"]}}, "runs", "must be a list"),
    ("runs a number", document(runs=5), "runs", "must be a list, got int 5"),
    ("a run a number", document(runs=[1]), "runs[0]", "must be an object"),
    ("no runs at all", document(runs=[]), "runs", "must not be empty"),
    ("string capacity", document(runs=[dict(RUN, capacity="16")]), "runs[0].capacity", "must be an integer"),
    ("huge capacity", document(runs=[dict(RUN, capacity=2**64)]), "runs[0].capacity", "from 1 to"),
    ("string hit ratio", document(runs=[dict(RUN, token_hit_ratio="high")]), "runs[0].token_hit_ratio", "finite number"),
    ("hit ratio above 1", document(runs=[dict(RUN, token_hit_ratio=1.5)]), "runs[0].token_hit_ratio", "from 0 to 1"),
    ("no config", {k: v for k, v in document().items() if k != "config"}, "config", "is missing"),
    ("config without policies", document(config={}), "config.policies", "is missing"),
    ("a run without a policy", document(runs=[{k: v for k, v in RUN.items() if k != "policy"}]), "runs[0].policy",
     "is missing"),
    ("unfinished", document(complete=False), "complete", "not a finished results file"),
    ("unfinished, not a replay", document(complete=False, config={"policies": ["lru"], "mode": "sweep"}), "complete",
     "not a finished results file"),
    # issue 14, item 16: the rule is > 0, the message said >= 0
    ("rate scale negative", document(config={"policies": ["lru"], "rate_scale": -2}), "config.rate_scale",
     "must be a finite number from 1e-06 to 1e+06, got int -2"),
    ("another version", document(schema="kvprof.results/2"), "schema", "results schema \"kvprof.results/2\" is not supported"),
]


@pytest.mark.parametrize("name, doc, where, words", BAD, ids=[case[0] for case in BAD])
def test_show_refuses_a_bad_results_file_naming_file_and_field(tmp_path, name, doc, where, words):
    path, result = show(tmp_path, doc)
    assert result.exit_code == 1, result.output
    assert f"{path}, at {where}: " in result.stderr and words in result.stderr
    assert "hp" not in result.stderr.replace(str(path), "")  # a message about results, not hp files
    with pytest.raises(ResultsFileError) as caught:
        results.load(path)
    assert caught.value.where == where


@pytest.mark.parametrize("text, words", [
    ('{"schema": "kvprof.results/1", "schema": "kvprof.results/1"}', "appears twice"),
    ('{"schema": "kvprof.results/1", "wall_s": NaN}', "NaN is not a JSON number"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_the_strict_reader_refuses_what_python_json_would_take(tmp_path, text, words):
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(ResultsFileError, match=words):
        results.load(path)


def test_built_documents_round_trip_and_refuse_nan(tmp_path):
    doc = document()
    assert doc["schema"] == results.SCHEMA and doc["complete"] is True
    path = results.write(tmp_path / "results.json", doc)
    assert results.load(path) == doc
    nan_run = results.build(inputs={}, config={"policies": ["lru"]}, runs=[dict(RUN, qttft_mean_s=float("nan"))],
                            wall_s=float("inf"))
    assert nan_run["runs"][0]["qttft_mean_s"] is None and nan_run["wall_s"] is None
    with pytest.raises(ResultsFileError, match="capacity"):
        results.build(inputs={}, config={"policies": ["lru"]}, runs=[dict(RUN, capacity=0)], wall_s=1.0)


def test_merge_labels_live_runs_with_what_the_server_ran():
    live = document(runs=[dict(RUN, policy="wa", measured=True)], config={"policies": ["wa"], "rate_scale": 10.0},
                    inputs={"hp": {"path": "out/hp.json"}})
    merged = results.merge([document(), live, live])
    assert [r["policy"] for r in merged["runs"]] == ["lru", "wa (live)", "wa (live) #2"]  # the second live run
    assert [r["origin"] for r in merged["runs"]] == ["simulated", "live, hp hp.json, rate x10", "live, hp hp.json, rate x10"]
    assert results.merge([document(config={"policies": ["lru"], "rate_scale": 2.5})])["runs"][0]["origin"] == \
        "simulated, rate x2.5"
    assert merged["config"]["policies"] == ["lru", "wa (live)", "wa (live) #2"]


def test_an_interrupted_replay_is_read_and_marked_incomplete(tmp_path):
    """A replay stopped early writes what it measured with complete: false; show reads it and says so."""
    live = document(complete=False, config={"policies": ["lru"], "mode": "replay"},
                    runs=[dict(RUN, measured=True, n_errors=1, n_timeouts=1)])
    path, result = show(tmp_path, live)
    assert result.exit_code == 0 and "incomplete" in result.stdout and "1 failed (1 timeouts)" in result.stdout
    assert results.merge([results.load(path)])["runs"][0]["origin"] == "live, incomplete"


@pytest.mark.parametrize("key, value, words", [
    ("prefill_tokens_per_s", 0, "must be a finite number > 0 and <= 1e+12, got int 0"),
    ("prefill_tokens_per_s", 1e300, "<= 1e+12"),
    ("max_num_seqs", 0, "must be an integer from 1 to 2147483647"),
    ("step_overhead_s", -1, "must be a finite number from 0 to 1e+06"),
    ("decode", 1, "must be true or false"),
])
def test_a_cost_file_value_out_of_range_is_named_by_its_key(tmp_path, key, value, words):
    """cost.json with prefill 0 named no key (the dataclass refused it after the checks)."""
    from kvprof.errors import CostFileError
    from kvprof.sim.config import CostModel

    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"schema": "kvprof.cost/1", key: value}))
    with pytest.raises(CostFileError) as caught:
        CostModel.from_file(path)
    assert caught.value.where == key and words in str(caught.value)
