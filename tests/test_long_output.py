"""``wa``'s long-output candidate: the rule it runs, the lists it keeps, its twin on both engines, and its tuning."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.models.hp import load_hp
from kvprof.policy.long_output import LongOutputLRU
from kvprof.policy.lru import LRUPolicy
from kvprof.policy.wa import WorkloadAwarePolicy
from kvprof.profiler.fit import fit_trace
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.oracles import AccessIndexed, replay
from kvprof.sim.tune import OUTPUT_PERCENTILES, _best_limit, tune
from kvprof.sim.workload import prepare_workload
from tests.test_sim_engine import random_replays

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "research"))

from bench_online_rules import ShortOutput  # noqa: E402

ONE_ROW = (np.full((1, 1), 0.5), np.ones((1, 1, 1)), np.full((1, 1, 1), 0.1))
#: Limits between, at and beyond the drawn outputs (1, 10 or 100 tokens).
LIMITS = st.sampled_from([0.0, 8.0, 10.0, 64.0, 1000.0])


@st.composite
def replays_with_outputs(draw):
    """random_replays' traces and settings, each request's output 1, 10 or 100 tokens (theirs are all 10)."""
    trace, capacity, config = draw(random_replays())
    outputs = draw(st.lists(st.sampled_from([1, 10, 100]), min_size=trace.n_requests, max_size=trace.n_requests))
    return dataclasses.replace(trace, output_length=np.array(outputs, dtype=np.int64)), capacity, config


def outcome(run) -> tuple:
    return run.token_hit_ratio, run.evictions, run.hits_device


@settings(max_examples=80, deadline=None)
@given(replays_with_outputs(), LIMITS)
def test_the_candidate_is_the_told_rule_over_lru_alone_and_followed_by_wa(case, limit):
    """The engine tells each finish its output; the candidate, alone or as wa's only order, demotes as
    bench_online_rules' told rule over LRU does (which reads the output from the workload by request)."""
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0)
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    indexed = AccessIndexed.of(workload)
    told = outcome(replay(indexed, ShortOutput(LRUPolicy(), workload.output_tokens.tolist(), limit, "out"),
                          capacity, config))
    assert outcome(replay(indexed, LongOutputLRU(limit), capacity, config)) == told
    followed = WorkloadAwarePolicy(*ONE_ROW, 60.0, orders=("long-output",), safety_net=False, output_limit=limit)
    assert outcome(replay(indexed, followed, capacity, config)) == told


@settings(max_examples=60, deadline=None)
@given(replays_with_outputs(), LIMITS)
def test_the_compiled_engines_run_the_candidate_as_the_python_engine(case, limit):
    """End to end through each engine's finish (the modelled server's and recorded timing's share the
    protocol): wa with the candidate among its shadowed orders, and the candidate alone."""
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0)
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)

    def both(build):
        python = simulate(workload, build(), capacity, config, engine="python")
        compiled = simulate(workload, build(), capacity, config, engine="compiled")
        return outcome(python), outcome(compiled)

    python, compiled = both(lambda: LongOutputLRU(limit))
    assert python == compiled
    python, compiled = both(lambda: WorkloadAwarePolicy(*ONE_ROW, 60.0, orders=("lru", "long-output", "segmented"),
                                                        output_limit=limit, capacity=capacity))
    assert python == compiled


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["finish", "free", "remove", "evict"]), st.integers(0, 11),
                          st.sampled_from([None, 5, 50])), max_size=80))
def test_each_block_is_in_one_list_and_the_long_ones_go_first(ops):
    policy, long, kept = LongOutputLRU(20.0), [], []
    freeing_long = False
    for op, block, n_output in ops:
        if op == "finish":
            policy.finish("r", 0.0, n_output=n_output)
            freeing_long = n_output is not None and n_output > 20
        elif op == "free" and block not in policy:
            policy.free([block], 0.0)
            (long if freeing_long else kept).append(block)
        elif op == "remove" and block in policy:
            policy.remove(block)
            (long if block in long else kept).remove(block)
        elif op == "evict" and len(policy):
            assert policy.evict(0.0) == (long or kept).pop(0)
        assert len(policy) == len(long) + len(kept)
        assert policy.order(0.0) == long + kept
        assert not set(long) & set(kept)


def test_a_limit_must_be_a_finite_count():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="limit"):
            LongOutputLRU(bad)
    with pytest.raises(ValueError, match="output_limit"):
        WorkloadAwarePolicy(*ONE_ROW, 60.0, orders=("long-output",))


def test_the_median_limit_is_kept_unless_a_quartile_leads_it_clearly_and_only_where_it_beats_lru():
    limits = [5.0, 50.0, 500.0]
    alone = {(100, None): (0.30, 900), (100, 5.0): (0.33, 990), (100, 50.0): (0.32, 960), (100, 500.0): (0.31, 930),
             (200, None): (0.30, 10**6), (200, 5.0): (0.33, 10**6), (200, 50.0): (0.32, 10**6), (200, 500.0): (0.3, 10**6),
             (300, None): (0.50, 100), (300, 5.0): (0.50, 100), (300, 50.0): (0.50, 100), (300, 500.0): (0.49, 100)}
    assert _best_limit(alone, 100, limits) == 50.0  # a 3 % lead over the median, within 2 / sqrt(960)
    assert _best_limit(alone, 200, limits) == 5.0  # the same lead, far beyond 2 / sqrt(10^6)
    assert _best_limit(alone, 300, limits) is None  # a tie with LRU adds nothing
    assert _best_limit(alone, 100, []) is None


def test_tuning_measures_each_limit_and_writes_the_one_that_wins(tmp_path):
    """On a synthetic trace: every limit tried is a percentile of the window's outputs and measured
    against LRU; an entry's limit beat LRU, and without one the median did not; the file round-trips
    with it."""
    from kvprof.profiler.reader import read_trace
    from kvprof.profiler.synth import generate, write_jsonl

    write_jsonl(tmp_path / "trace.jsonl", generate("bailian-a", 0.1, 7))
    trace, _ = read_trace(tmp_path / "trace.jsonl")
    hp = tune(fit_trace(trace), trace, [64, 512], SimConfig(engine_block_size=16))
    limits = {f"{np.percentile(trace.output_length, q):g}" for q in OUTPUT_PERCENTILES}
    for entry in hp.tuning:
        measured = entry["measured"]
        assert entry["start"] != "long-output"  # (tune.NEVER_START)
        assert set(measured["hit_ratio_by_output_limit"]) == limits
        if "long_output_tokens" in entry:
            chosen = measured["hit_ratio_by_output_limit"][f"{entry['long_output_tokens']:g}"]
            assert chosen > measured["lru_hit_ratio"] and "long-output" in measured["shadow_hits"]
        else:
            assert "long-output" not in measured["shadow_hits"]
            median = measured["hit_ratio_by_output_limit"][sorted(limits, key=float)[1]]
            assert median <= measured["lru_hit_ratio"]  # (a quartile that led it would have hit no more than LRU)
    hp.save(tmp_path / "hp.json")
    assert load_hp(tmp_path / "hp.json").to_dict() == hp.to_dict()


class LoggedWa(WorkloadAwarePolicy):
    """``wa`` that logs each eviction: (now, victims)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[float, list[int]]] = []

    def evict_n(self, n: int, now: float) -> list[int]:
        victims = super().evict_n(n, now)
        self.log.append((now, victims))
        return victims


@settings(max_examples=60, deadline=None)
@given(replays_with_outputs(), LIMITS, st.floats(0.0, 1.0))
def test_decisions_never_read_the_future(case, limit, cut):
    """Online features only: with the requests arriving from ``T`` on removed, ``wa`` with the candidate
    evicts the same blocks before ``T`` (the outputs it reads are of requests that finished, and the
    next uses the driver passes, which it must ignore, change with the cut)."""
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0)
    cut_at = float(trace.timestamp[0] + cut * (trace.timestamp[-1] - trace.timestamp[0]))

    def evictions(part):
        policy = LoggedWa(*ONE_ROW, 60.0, orders=("long-output", "lru", "segmented"), output_limit=limit,
                          capacity=capacity)
        simulate(prepare_workload(part, engine_block_size=config.engine_block_size), policy, capacity, config,
                 engine="python")
        return [entry for entry in policy.log if entry[0] < cut_at]

    earlier = trace.time_window(None, cut_at)
    if earlier.n_requests:
        assert evictions(earlier) == evictions(trace)
