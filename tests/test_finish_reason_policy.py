"""The finish-reason candidate: the rule it runs, its twin against it (on the cores and through both
engines' finish), the codes the engines tell, and decisions that never read the future."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.copiers import copy_core
from kvprof.core.kinds import KIND
from kvprof.core.policies import (
    core_contains, core_evict_n, core_finish, core_finish_reason, core_free, core_remove, core_size, new_core,
)
from kvprof.models.finish import END_OF_TURN, FINISH_FIELD, OTHER, TOOL_CALL, UNKNOWN
from kvprof.policy.finish_reason import FinishReasonLRU
from kvprof.policy.lru import LRUPolicy
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload
from tests.test_policies import LAM, P, wa_policy
from tests.test_sim_engine import random_replays

#: ``stop`` values of each code (None: absent), as a trace carries them.
STOPS = [None, "", "tool_use", "end_turn", "stop", "tool_calls", "length"]
CODES = st.sampled_from([None, UNKNOWN, TOOL_CALL, END_OF_TURN, OTHER])


@st.composite
def replays_with_stops(draw):
    """random_replays' traces and settings, each request with a ``stop`` value drawn from :data:`STOPS`."""
    trace, capacity, config = draw(random_replays())
    stops = draw(st.lists(st.sampled_from(STOPS), min_size=trace.n_requests, max_size=trace.n_requests))
    return dataclasses.replace(trace, extra={FINISH_FIELD: np.array(stops, dtype=object)}), capacity, config


def outcome(run) -> tuple:
    return run.token_hit_ratio, run.evictions, run.hits_device, run.hits_host


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["finish", "free", "remove", "evict"]), st.integers(0, 11), CODES),
                max_size=80))
def test_each_block_is_in_one_list_and_the_turn_ends_go_first(ops):
    policy, ended, kept = FinishReasonLRU(), [], []
    freeing_ended = False
    for op, block, code in ops:
        if op == "finish":
            policy.finish("r", 0.0, n_output=5, finish=code)
            freeing_ended = code == END_OF_TURN  # a tool call, other, unknown: kept
        elif op == "free" and block not in policy:
            policy.free([block], 0.0)
            (ended if freeing_ended else kept).append(block)
        elif op == "remove" and block in policy:
            policy.remove(block)
            (ended if block in ended else kept).remove(block)
        elif op == "evict" and len(policy):
            assert policy.evict(0.0) == (ended or kept).pop(0)
        assert len(policy) == len(ended) + len(kept)
        assert policy.order(0.0) == ended + kept
        assert not set(ended) & set(kept)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["finish", "told", "free", "remove", "evict"]),
                          st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True), CODES), max_size=80))
def test_the_core_decides_as_the_reference(ops):
    """Op for op on the compiled core: a finish is ``core_finish`` then, where the code is given,
    ``core_finish_reason`` (``told``); a finish without one (``finish``) leaves the ending unknown, as
    ``finish`` without the keyword does on the reference, whatever the finish before it said."""
    reference, core = FinishReasonLRU(), new_core(KIND["finish_reason"], 16, 2, 0)
    out = np.zeros(16, dtype=np.int64)
    for op, blocks, code in ops:
        if op == "finish":
            reference.finish("r", 1.0, n_output=3)
            core_finish(core, 3)
        elif op == "told":
            reference.finish("r", 1.0, n_output=3, finish=code)
            core_finish(core, 3)
            core_finish_reason(core, UNKNOWN if code is None else code)
        elif op == "free":
            fresh = [b for b in blocks if b not in reference]
            reference.free(fresh, 1.0)
            core_free(core, np.array(fresh, dtype=np.int64), len(fresh), 1.0)
        elif op == "remove" and blocks[0] in reference:
            reference.remove(blocks[0])
            core_remove(core, blocks[0])
        elif op == "evict":
            n = min(len(blocks), len(reference))
            core_evict_n(core, n, 1.0, out, 0)
            assert out[:n].tolist() == reference.evict_n(n, 1.0)
        assert core_size(core) == len(reference)
        assert [core_contains(core, b) for b in range(16)] == [b in reference for b in range(16)]
        left = copy_core(core)  # the order left, told without evicting from the core itself
        core_evict_n(left, core_size(left), 1.0, out, 0)
        assert out[:len(reference)].tolist() == reference.order(1.0)


@settings(max_examples=60, deadline=None)
@given(replays_with_stops())
def test_both_engines_tell_the_codes_and_run_the_twin_as_the_reference(case):
    """End to end through each engine's finish: the Python engine drives the reference, the compiled one
    the twin (its cores hear ``core_finish_reason``); the same hits, evictions and victims."""
    trace, capacity, config = case
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    assert workload.finish.tolist() == trace.finish.tolist()
    host = (lambda: LRUPolicy()) if config.cpu_capacity else (lambda: None)
    python = simulate(workload, FinishReasonLRU(), capacity, config, host_policy=host(), engine="python")
    compiled = simulate(workload, FinishReasonLRU(), capacity, config, host_policy=host(), engine="compiled")
    assert outcome(python) == outcome(compiled)


class Told(FinishReasonLRU):
    """The candidate, logging what it is told and what it evicts: ``(event, when, what)``."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def finish(self, request, now, contents=None, *, n_blocks=None, n_output=None, finish=None) -> None:
        self.log.append(("finish", now, request, finish))
        super().finish(request, now, contents, n_blocks=n_blocks, n_output=n_output, finish=finish)

    def evict_n(self, n: int, now: float) -> list[int]:
        victims = super().evict_n(n, now)
        self.log.append(("evict", now, victims))
        return victims


@settings(max_examples=60, deadline=None)
@given(replays_with_stops())
def test_the_engine_tells_each_finish_its_code_and_without_codes_the_order_is_lru(case):
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0)
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    policy = Told()
    simulate(workload, policy, capacity, config, engine="python")
    for _, _, request, code in (entry for entry in policy.log if entry[0] == "finish"):
        assert code == (int(workload.finish[request]) or None)  # unknown: not told (finish's default)
    unknown = dataclasses.replace(trace, extra={})
    workload = prepare_workload(unknown, engine_block_size=config.engine_block_size)
    for engine in ("python", "compiled"):
        assert outcome(simulate(workload, FinishReasonLRU(), capacity, config, engine=engine)) == \
            outcome(simulate(workload, LRUPolicy(), capacity, config, engine=engine))


class Untold(LRUPolicy):
    """LRU whose ``finish`` predates the ``finish`` keyword."""

    def finish(self, request, now, contents=None, *, n_blocks=None, n_output=None) -> None:
        pass


@settings(max_examples=30, deadline=None)
@given(replays_with_stops())
def test_a_policy_whose_finish_predates_the_codes_is_told_none(case):
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0)
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    assert outcome(simulate(workload, Untold(), capacity, config, engine="python")) == \
        outcome(simulate(workload, LRUPolicy(), capacity, config, engine="python"))


@settings(max_examples=60, deadline=None)
@given(replays_with_stops(), st.floats(0.0, 1.0))
def test_decisions_never_read_the_future(case, cut):
    """Online only: with the requests arriving from ``T`` on removed, the candidate evicts the same blocks
    before ``T``; and with the codes of some requests changed, it decides the same until the first of
    them finishes (a code is read at its request's finish, never before)."""
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0)
    cut_at = float(trace.timestamp[0] + cut * (trace.timestamp[-1] - trace.timestamp[0]))

    def log(part):
        policy = Told()
        simulate(prepare_workload(part, engine_block_size=config.engine_block_size), policy, capacity, config,
                 engine="python")
        return policy.log

    def evictions_before_the_cut(part):
        return [entry for entry in log(part) if entry[0] == "evict" and entry[1] < cut_at]

    earlier = trace.time_window(None, cut_at)
    if earlier.n_requests:
        assert evictions_before_the_cut(earlier) == evictions_before_the_cut(trace)

    stops = trace.extra[FINISH_FIELD]
    changed = np.arange(trace.n_requests) >= int(cut * trace.n_requests)  # the later requests' codes swapped
    swapped = np.where(changed, np.where(trace.finish == END_OF_TURN, "tool_use", "end_turn"), stops)
    before, after = log(trace), log(dataclasses.replace(trace, extra={FINISH_FIELD: swapped}))
    first = next((i for i, entry in enumerate(before) if entry[0] == "finish" and changed[entry[2]]), len(before))
    assert after[:first] == before[:first]


@settings(deadline=None)
@given(replays_with_stops(), st.sampled_from([("finish-reason", "lru"), ("lru", "finish-reason", "segmented")]))
def test_wa_following_the_candidate_runs_its_twin_as_the_reference(case, orders):
    """``wa`` carrying the candidate (a followed core, a shadow each): both engines tell every core and
    shadow each finish's code, and the leader, shadow hits, hits and evictions agree."""
    trace, capacity, config = case
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    host = (lambda: LRUPolicy()) if config.cpu_capacity else (lambda: None)
    runs = []
    for engine in ("python", "compiled"):
        policy = wa_policy(P, LAM, orders=orders, safety_net=True, capacity=capacity)
        run = simulate(workload, policy, capacity, config, host_policy=host(), engine=engine)
        runs.append((outcome(run), policy.order_name, policy.shadow_hits()))
    assert runs[0] == runs[1]
