"""Learned workload cells, held-out score quality, tuning on the fit window, and cells in vLLM's spec."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvprof.cells import CellRule, request_features
from kvprof.classes import ClassRule
from kvprof.models.mixture import CureMixture
from kvprof.profiler.cells import cells_of_trace
from kvprof.profiler.classes import classify_trace
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.quality import score_quality
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.config import SimConfig
from kvprof.sim.tune import HORIZON_FACTORS, tune
from kvprof.vllm.spec import PolicySpec
from tests.helpers import invoke


def split_by_length_trace(path, n=3000, seed=0):
    """One type; short prompts come back within seconds, long ones never: only the length tells."""
    rng = np.random.default_rng(seed)
    rows, next_id, t = [], 0, 0.0
    pending = []  # (time, hash ids) of short prompts to send again
    for i in range(n):
        t += rng.exponential(0.5)
        if pending and pending[0][0] <= t:
            _, ids = pending.pop(0)
        else:
            long = rng.random() < 0.5
            blocks = 40 if long else 4
            ids = list(range(next_id, next_id + blocks))
            next_id += blocks
            if not long:
                pending.append((t + rng.exponential(3.0), ids))
                pending.sort()
        rows.append({"chat_id": i, "parent_chat_id": -1, "timestamp": round(t, 6), "input_length": 16 * len(ids),
                     "output_length": 8, "type": "text", "turn": 1, "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_trace(path)[0]


def test_the_tree_finds_the_feature_that_tells_reuse_apart(tmp_path):
    trace = split_by_length_trace(tmp_path / "t.jsonl")
    hp = fit_trace(trace, max_cells=8, min_samples=50)
    rule = hp.cell_rule
    assert rule is not None and len(rule.names) >= 2
    assert any(feature == "log2_prompt_tokens" for feature in rule.features)
    short, long = (rule.cell_of(request_features("text_1", 1, tokens)) for tokens in (64, 640))
    assert short != long
    p, _, _ = hp.reuse_rows()
    assert p[short, 0] > 0.5 > p[long, 0]


def test_cells_of_a_trace_are_the_rule_applied_request_by_request(tmp_path):
    trace = split_by_length_trace(tmp_path / "t.jsonl", n=800)
    rule = fit_trace(trace, max_cells=4, min_samples=50).cell_rule
    codes, names = classify_trace(trace, ClassRule())
    cells = cells_of_trace(rule, trace, codes, names)
    expected = [rule.cell_of(request_features(names[c], int(turn), int(tokens)))
                for c, turn, tokens in zip(codes, trace.turn, trace.input_length)]
    assert cells.tolist() == expected


@pytest.mark.parametrize("min_samples", [50, 400, 10**6])
def test_weighted_growing_learns_the_tree_of_the_accesses_one_by_one(small_bailian, min_samples):
    """Accesses merged per (features, label) grow the tree the accesses grow one by one (what
    scikit-learn does with min_samples_leaf), at every size tried; 10**6 accesses cannot split."""
    from sklearn.tree import DecisionTreeClassifier

    from kvprof.profiler.cells import _grow, _to_rule, _weighted, distinct_requests, feature_matrix, known_outcomes
    from kvprof.profiler.reuse import extract_reuse

    _, trace = small_bailian
    codes, names = classify_trace(trace, ClassRule())
    request, reused = known_outcomes(extract_reuse(trace, codes), 60.0)
    first, group = distinct_requests(trace, codes)
    X, features = feature_matrix(trace.select(first), codes[first], names)
    leaf = max(min_samples, int(0.02 * request.size))
    for leaves in (2, 4, 16):
        one_by_one = DecisionTreeClassifier(max_leaf_nodes=leaves, min_samples_leaf=leaf, random_state=0)
        one_by_one.fit(X[group[request]], reused)
        weighted = _grow(X, _weighted(group[request], reused, len(first)), leaves, leaf)
        assert _to_rule(weighted, features, ()) == _to_rule(one_by_one, features, ())
        assert np.allclose(weighted.predict_proba(X), one_by_one.predict_proba(X))


def test_cells_of_a_trace_read_tagged_fields_as_the_tree_learned_them(tmp_path):
    """A field that tells reuse apart splits the cells; every request's cell is the rule applied
    to its features one by one (a request without the field reads its missing value, as learned)."""
    rng = np.random.default_rng(4)
    rows, t = [], 0.0
    for i in range(3000):
        t += rng.exponential(0.5)
        model = ["a", "b", None][i % 3]
        ids = [0, 1, 2, 3] if model == "a" else list(range(10 + 4 * i, 14 + 4 * i))  # only "a" comes back
        row = {"chat_id": i, "parent_chat_id": -1, "timestamp": round(t, 6), "input_length": 64, "output_length": 8,
               "type": "text", "turn": 1, "hash_ids": ids}
        rows.append(row if model is None else {**row, "model": model})
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = read_trace(tmp_path / "t.jsonl")[0]
    rule = fit_trace(trace, max_cells=4, min_samples=50, cell_fields=("model",)).cell_rule
    assert rule.fields == ("model",) and len(rule.names) >= 2
    codes, names = classify_trace(trace, ClassRule())
    models = np.asarray(trace.extra["model"]).astype(str)
    expected = [rule.cell_of(request_features(names[c], int(turn), int(tokens), {"model": m}))
                for c, turn, tokens, m in zip(codes, trace.turn, trace.input_length, models)]
    assert cells_of_trace(rule, trace, codes, names).tolist() == expected


def test_a_cell_rule_must_be_one_tree_naming_every_cell():
    with pytest.raises(ValueError, match="one tree"):
        CellRule(("turn",), (), (0, -1, -1, -1), (1.5, 0, 0, 0), (1, -1, -1, -1), (2, -1, -1, -1), (-1, 0, 1, 0),
                 ("a", "b"))
    with pytest.raises(ValueError, match="every cell exactly once"):
        CellRule(("turn",), (), (0, -1, -1), (1.5, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 0), ("a", "b"))
    single = CellRule.single("all")
    assert single.cell_of({}) == 0 and single.to_dict()["nodes"] == [{"cell": "all"}]


def test_held_out_quality_prefers_the_model_that_matches_the_traffic():
    rng = np.random.default_rng(1)
    n = 20000
    gap = np.where(rng.random(n) < 0.7, rng.exponential(2.0, n), rng.exponential(400.0, n))
    exposure = rng.uniform(0, 3600, n)
    seen = gap < exposure
    time, censored = np.where(seen, gap, exposure), ~seen
    half = n // 2
    right = CureMixture().fit(time[:half], censored[:half])
    wrong = CureMixture(max_components=1).fit(time[:half], censored[:half])
    samples = type("Samples", (), {"time": time[half:], "censored": censored[half:]})()
    models = {name: (np.array([m.p_]), m.weights_[None, :], m.rates_[None, :]) for name, m in
              (("mixture", right), ("single", wrong))}
    quality = score_quality(samples, np.zeros(n - half, dtype=int), models, horizon=10.0)
    assert quality["all"]["mixture"]["log_loss"] < quality["all"]["single"]["log_loss"]
    assert quality["all"]["mixture"]["brier"] < quality["all"]["single"]["brier"]
    assert quality["rows"][0]["mixture"]["n"] == quality["all"]["mixture"]["n"] > 0


@pytest.fixture(scope="module")
def small_bailian(tmp_path_factory):
    path = tmp_path_factory.mktemp("tune") / "trace.jsonl"
    write_jsonl(path, generate("bailian-a", 0.2, 2))
    return path, read_trace(path)[0]


def test_tuning_records_a_horizon_of_the_grid_and_a_candidate_per_capacity(small_bailian):
    _, trace = small_bailian
    hp = fit_trace(trace, max_cells=2, horizon=40.0)
    tuned = tune(hp, trace, (64, 256), SimConfig(), learn=True)
    assert [entry["capacity"] for entry in tuned.tuning] == [64, 256]
    for entry in tuned.tuning:
        assert entry["horizon_s"] in [40.0 * f for f in HORIZON_FACTORS]
        hits = entry["measured"]["shadow_hits"]
        assert entry["start"] == max(hits, key=hits.get)
        ratios = entry["measured"]["hit_ratio_by_horizon_s"]
        assert ratios[f"{entry['horizon_s']:g}"] == max(ratios.values())
        # The learned candidate took part: a predictor over the cells, its shadow counted.
        assert len(entry["learned"].cell) == len(hp.cell_names()) and "learned" in hits
        quality = entry["learned"].quality
        assert quality["holdout_log_loss"] < quality["holdout_base_log_loss"]


def test_fit_cli_reports_cells_holdout_and_tuning(small_bailian, tmp_path):
    path, _ = small_bailian
    out = tmp_path / "hp.json"
    result = invoke("fit", path, "-o", out, "--window", "0:360", "--capacity", "128", "--max-cells", "4", "-j", "1")
    assert result.exit_code == 0, result.output
    assert "cells x reuse tiers" in result.stdout and "tuned on the fit window" in result.stdout
    data = json.loads(out.read_text())
    assert data["schema"] == "kvprof.hp/6" and data["tuning"][0]["capacity"] == 128
    assert "learned" not in data["tuning"][0]  # opt-in: --learned
    # the long-output candidate's tuning, on or off, with what it measured
    limit = data["tuning"][0].get("long_output_tokens")
    shown = " ".join(result.stdout.split())
    assert ("off (" if limit is None else f"{limit:g} tokens (") in shown
    result = invoke("fit", path, "-o", out, "--window", "0:360", "--capacity", "128", "--max-cells", "4", "-j", "1",
                    "--learned")
    assert result.exit_code == 0, result.output
    assert "kept; log-loss" in " ".join(result.stdout.split())  # the predictor's held-out quality, printed
    assert "learned" in json.loads(out.read_text())["tuning"][0]
    result = invoke("fit", path, "-o", out, "--learned")
    assert result.exit_code == 2 and "--capacity" in result.output
    rows = [row for tiers in data["cells"].values() for row in tiers]
    assert any("holdout" in (row.get("diagnostics") or {}) for row in rows)
    result = invoke("fit", path, "-o", out, "--window", "0:360", "--max-cells", "0")
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert "cell_rule" not in data and set(data["cells"]) == {n for n in data["classes"] if "@" not in n}
    result = invoke("inspect", path, "--window", "0:720")
    assert result.exit_code == 0 and "reuse models per class" in result.stdout


def test_vllm_spec_places_a_request_in_the_cell_the_profiler_gave_it(small_bailian):
    _, trace = small_bailian
    hp = fit_trace(trace, max_cells=8)
    spec = PolicySpec(policy="wa", config=None, hp=hp, class_names=tuple(hp.table()[0]), keyed_by="cell")
    codes, names = classify_trace(trace, hp.class_rule)
    cells = cells_of_trace(hp.cell_rule, trace, codes, names)
    for i in range(0, trace.n_requests, 97):
        xargs = {"type": trace.type_names[trace.type_code[i]], "turn": int(trace.turn[i])}
        expected = hp.cell_index(hp.cell_rule.names[cells[i]])
        assert spec.class_index(xargs, int(trace.input_length[i])) == expected
    assert spec.class_index({"workload": hp.cell_names()[0]}, 10) == 0  # a tag may name a cell
    untagged = spec.class_index(None, 100)
    assert 0 <= untagged < len(hp.cell_names())
