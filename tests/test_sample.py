"""Miniature simulation: a sample of a trace's conversations at caches scaled to it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.sim.config import SimConfig, SimulationError
from kvprof.sim.sample import Miniature, chain_roots, chain_sample, hit_ratio_error, in_sample, MAX_LOST_SHARE
from kvprof.sim.sweep import run_sweep
from kvprof.sim.workload import prepare_workload
from tests.helpers import invoke, one_line, synthetic


@pytest.fixture(scope="module")
def bailian(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("sample"), hours=0.25, seed=3)


def test_a_conversation_is_its_first_request_followed_through_parents(tmp_path):
    rows = [(10, -1), (11, 10), (12, -1), (13, 11), (14, 12), (15, 13)]
    lines = [{"chat_id": c, "parent_chat_id": p, "timestamp": float(i), "input_length": 16, "output_length": 1,
              "type": "text", "turn": 1, "hash_ids": [i]} for i, (c, p) in enumerate(rows)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = read_trace(tmp_path / "t.jsonl")[0]
    assert dict(zip(trace.chat_id.tolist(), chain_roots(trace).tolist())) == {10: 10, 11: 10, 12: 12, 13: 10,
                                                                              14: 12, 15: 10}
    later = trace.time_window(1.0, None)  # 10 began the conversation before the window: 11 begins it here
    assert dict(zip(later.chat_id.tolist(), chain_roots(later).tolist())) == {11: 11, 12: 12, 13: 11, 14: 12, 15: 11}


def test_a_sample_keeps_whole_conversations_at_about_its_rate(bailian):
    _, trace = bailian
    roots = chain_roots(trace)
    sample = chain_sample(trace, 0.2)
    kept = set(chain_roots(sample).tolist())
    assert kept == {r for r in roots.tolist() if in_sample(np.array([r]), 0.2)[0]}
    assert sum(np.isin(roots, list(kept))) == sample.n_requests  # every request of a kept conversation
    assert 0.1 < len(kept) / np.unique(roots).size < 0.3
    assert chain_sample(trace, 1.0) is trace
    with pytest.raises(SimulationError, match="sample more"):
        chain_sample(trace.head(3), 1e-9)


def test_caches_scale_with_the_rate_keeping_room_for_shared_prefixes():
    miniature = Miniature(0.1, shared=30)
    assert miniature.capacity(1000) == round(100 + 0.9 * 30) and miniature.capacity(10) == 10
    assert Miniature().capacity(1234) == 1234
    config = miniature.config(SimConfig(cpu_capacity=500, capacity_schedule=((0.0, 1000), (60.0, 200))))
    assert config.cpu_capacity == miniature.capacity(500)
    assert config.capacity_schedule == ((0.0, miniature.capacity(1000)), (60.0, miniature.capacity(200)))


def test_a_sampled_sweep_is_labelled_with_the_full_capacities_and_says_what_it_sampled(bailian):
    _, trace = bailian
    hp = fit_trace(trace.time_window(None, 450.0))
    evaluated = trace.time_window(450.0, None)
    config = SimConfig(sample_rate=0.25)
    sampled = run_sweep(evaluated, hp, ["lru", "belady"], [128, 512], config)
    assert [run.capacity for run in sampled.runs] == [128, 512, 128, 512]
    facts = sampled.inputs["sample"]
    assert facts["of_requests"] == evaluated.n_requests > facts["requests"] > 0 and facts["chains"] <= facts["of_chains"]
    again = run_sweep(evaluated, hp, ["lru", "belady"], [128, 512], config)
    assert [r.token_hit_ratio for r in again.runs] == [r.token_hit_ratio for r in sampled.runs]
    assert sampled.to_dict()["config"]["sample_rate"] == 0.25


def test_compare_samples_and_says_so(bailian, tmp_path):
    path, _ = bailian
    result = invoke("compare", path, "--policies", "lru,wa", "--capacity", "256", "--sample", "0.3",
                    "--fit-window", "0:450", "--eval-window", "450:", "-j", "1", "-o", tmp_path)
    assert result.exit_code == 0, result.output
    assert "estimated on a sample of 0.3" in result.stdout.replace("\n", " ")
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["config"]["sample_rate"] == 0.3 and document["inputs"]["sample"]["chains"] > 0


def test_a_sample_too_small_for_a_request_the_full_cache_holds_is_refused(bailian, tmp_path):
    """A sample of 0.001 once scaled 256 blocks to 2 and printed 0.0000 for every policy (issue 21)."""
    path, _ = bailian
    result = invoke("compare", path, "--policies", "lru", "--capacity", "256", "--sample", "0.005",
                    "--eval-window", "450:", "-j", "1", "-o", tmp_path / "out")
    assert result.exit_code == 1, result.output
    message = one_line(result.stderr)
    assert "a sample of 0.005 scales the cache of 256 blocks to 9, too small for 3 of the sample's 7 requests" in message
    assert "of its prompt tokens" in message
    assert "Sample at least about" in message and not (tmp_path / "out").exists()


def test_requests_only_the_miniature_rejects_widen_the_bound_or_refuse_the_sample(bailian):
    _, trace = bailian
    evaluated = trace.time_window(450.0, None)
    outcomes = []
    for rate in (0.02, 0.1, 0.3, 0.6):
        config = SimConfig(sample_rate=rate)
        try:
            sampled = run_sweep(evaluated, None, ["lru"], [256], config)
        except SimulationError as exc:
            assert "too small for" in str(exc)
            outcomes.append("refused")
            continue
        sample = chain_sample(evaluated, rate)
        workload = prepare_workload(sample, engine_block_size=config.engine_block_size)
        needs, scaled = workload.blocks_needed(False), Miniature.of(sample, workload, rate).capacity(256)
        lost = (needs > scaled) & (needs <= 256)
        share = sampled.inputs["sample"]["lost_token_share"]["256"]
        assert share == pytest.approx(workload.prompt_tokens[lost].sum() / workload.prompt_tokens.sum())
        assert share <= MAX_LOST_SHARE
        outcomes.append("estimated")
    assert outcomes[0] == "refused" and outcomes[-1] == "estimated"


def test_compare_states_each_sampled_hit_ratios_error_bound(bailian, tmp_path):
    path, _ = bailian
    result = invoke("compare", path, "--policies", "lru", "--capacity", "512", "--sample", "0.3",
                    "--eval-window", "450:", "-j", "1", "-o", tmp_path, "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    facts, run = document["inputs"]["sample"], document["runs"][0]
    assert 0 < facts["effective_chains"] <= facts["chains"]
    table = invoke("compare", path, "--policies", "lru", "--capacity", "512", "--sample", "0.3",
                   "--eval-window", "450:", "-j", "1", "-o", tmp_path)
    bound = hit_ratio_error(run["token_hit_ratio"], 0.3, facts["effective_chains"], facts["lost_token_share"]["512"])
    assert f"{run['token_hit_ratio']:.4f} ± {bound:.4f}" in table.stdout
    assert "2 standard errors of the conversations drawn" in one_line(table.stdout)
    assert bound > 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10_000), st.floats(0, 1)), min_size=1, max_size=50),
       st.floats(0.001, 1.0))
def test_the_bound_covers_two_standard_errors_whatever_each_conversation_hit(conversations, rate):
    """The cluster-sampling standard error of the ratio, with each conversation's hits anywhere in [0, t_c]."""
    tokens = np.array([t for t, _ in conversations], dtype=np.float64)
    hits = np.array([t * share for t, share in conversations])
    ratio = hits.sum() / tokens.sum()
    standard_error = np.sqrt((1 - rate) * np.square(hits - ratio * tokens).sum()) / tokens.sum()
    n_effective = tokens.sum() ** 2 / np.square(tokens).sum()
    assert 2 * standard_error <= hit_ratio_error(ratio, rate, n_effective) + 1e-12
