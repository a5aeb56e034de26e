"""Replays on recorded timing (kvprof.sim.timed): a request holds its blocks exactly as long as the server did."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.policy import make_policy
from kvprof.sim.config import SimConfig, SimulationError
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload

from tests.helpers import make_trace
from tests.test_policies import LAM, WA_ORDERS, P, build, wa_policy


def recorded(rows, scheduled, finished, output=None, block_size=16, short=None, grown=None, output_ids=None):
    """A trace of ``rows`` with the recording's ``scheduled``/``finished`` columns; ``short[i]`` tokens
    less than full blocks make request ``i``'s last prompt block a partial one; ``grown`` and
    ``output_ids`` (lists per request, None for none) the recording's list fields."""
    trace = make_trace(rows, block_size=block_size)
    extra = {"scheduled": np.array(scheduled, dtype=object), "finished": np.array(finished, dtype=np.float64)}
    for name, lists, dtype in (("grown", grown, np.float64), ("output_hash_ids", output_ids, np.int64)):
        if lists is not None:
            extra[name] = np.array([None] * len(rows), dtype=object)
            for i, values in enumerate(lists):
                extra[name][i] = None if values is None else np.array(values, dtype=dtype)
    trace = dataclasses.replace(trace, extra=extra)
    if output is not None:
        trace = dataclasses.replace(trace, output_length=np.array(output, dtype=np.int64))
    if short is not None:
        trace = dataclasses.replace(trace, input_length=trace.input_length - np.array(short, dtype=np.int64))
    return trace


def run(trace, policy="lru", capacity=4, engine=None, timing="auto"):
    config = SimConfig(engine_block_size=trace.block_size, timing=timing)
    workload = prepare_workload(trace, engine_block_size=trace.block_size)
    return simulate(workload, make_policy(policy), capacity, config, engine=engine)


def test_pinned_blocks_follow_the_recorded_times():
    # Request 0 holds blocks 1-3 from t=0 to t=100. With the modelled server it would free them
    # at once; recorded, it still pins them when request 1 (blocks 4-6) arrives, so a 4-block
    # cache has room for one of request 1's blocks at most... and request 2 (1-3 again) hits.
    rows = [(0.0, "a", 1, [1, 2, 3, 9]), (1.0, "a", 1, [4, 5, 6, 8]), (200.0, "a", 1, [1, 2, 3, 7])]
    pinned_long = recorded(rows, [0.0, 1.0, 200.0], [100.0, 2.0, 201.0], output=[1, 1, 1])
    m = run(pinned_long, capacity=8)
    assert m.hits_device == 3  # request 2 finds 1-3: request 1 took only empty blocks
    short = recorded(rows, [0.0, 1.0, 200.0], [0.5, 2.0, 201.0], output=[1, 1, 1])
    m = run(short, capacity=4)
    # Freed at 0.5, blocks 1-3 are evictable when request 1 needs 4 blocks: LRU takes them.
    assert m.hits_device == 0


def test_never_scheduled_requests_take_nothing_and_are_not_served():
    rows = [(0.0, "a", 1, [1, 2, 3]), (1.0, "a", 1, [1, 2, 3])]
    trace = recorded(rows, [0.0, None], [1.0, 1.5], output=[1, 1])
    m = run(trace, capacity=8)
    assert (m.n_requests, m.n_rejected, m.hits_device) == (2, 1, 0)


def test_finished_before_scheduled_is_refused():
    rows = [(0.0, "a", 1, [1, 2])]
    with pytest.raises(SimulationError, match="finished before it was scheduled"):
        run(recorded(rows, [5.0], [4.0]))


def test_recorded_timing_asked_of_a_trace_without_it():
    trace = make_trace([(0.0, "a", 1, [1, 2])])
    with pytest.raises(SimulationError, match="no recorded timing"):
        run(trace, timing="recorded")


def test_output_blocks_are_cached_and_evicted_like_the_servers():
    # A 2-block prompt + 40 output tokens of 16-token blocks: 2 more full blocks are cached, so a
    # 4-block cache is full of request 0's blocks when request 1 comes, and LRU evicts the
    # output blocks first (freed tail first) -- request 2 still hits the prompt.
    rows = [(0.0, "a", 1, [1, 2]), (10.0, "a", 1, [5, 6]), (20.0, "a", 1, [1, 2, 3])]
    trace = recorded(rows, [0.0, 10.0, 20.0], [1.0, 11.0, 21.0], output=[41, 1, 1])
    m = run(trace, capacity=4)
    assert m.hits_device == 2


@pytest.mark.parametrize("output,new_blocks,hits,evictions", [(1, 0, 2, 0), (2, 0, 2, 1), (3, 1, 1, 2)])
@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_an_output_that_fills_the_prompts_partial_block_fills_it_in_place(output, new_blocks, hits, evictions,
                                                                          engine):
    """vLLM's allocate_slots: ``ceil((prompt + output - 1) / block)`` blocks in all (the last sampled
    token's KV is never computed). A 63-token prompt (3 full blocks and 15 tokens) with 2 output
    tokens fills its partial block in place: no new block, so nothing is evicted for it (issue 40
    A1), and caches it (the last request evicts it for its own third block); with 3 output tokens
    vLLM takes a fifth block, and LRU evicts one of an earlier prefix for it."""
    rows = [(0.0, "a", 1, [7, 8]), (2.0, "a", 1, [1, 2, 3, 4]), (10.0, "a", 1, [7, 8, 9])]
    trace = recorded(rows, [0.0, 2.0, 10.0], [1.0, 3.0, 11.0], output=[1, output, 1], short=[0, 1, 0])
    timing = prepare_workload(trace, engine_block_size=16).timing
    assert timing.n_new.tolist() == [0, new_blocks, 0]
    second = timing.block[timing.offsets[1]:timing.offsets[2]]
    # its 3 prompt blocks, then at the partial block's depth a content of its own once the output
    # filled it (none while partial); the fifth block (3 outputs) stays partial, so has no content
    assert len(second) == 4 and (second[:3] >= 0).all() and (second[3] == -1) == (output == 1)
    m = run(trace, capacity=6, engine=engine)  # 2 blocks of request 0 kept, 4 empty ones for request 1
    assert (m.hits_device, m.evictions) == (hits, evictions)


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_a_next_turn_hits_the_blocks_the_response_filled_where_the_recording_names_them(engine):
    # A 2-block prompt with 40 output tokens fills 2 more blocks (71 written tokens), cached as vLLM caches
    # them. The next turn sends the response back: its prompt's blocks 3 and 4 are those blocks, and the
    # recording's output_hash_ids say so; without them the replay takes them for contents nobody names.
    rows = [(0.0, "a", 1, [1, 2]), (10.0, "a", 1, [1, 2, 3, 4, 5])]
    named = recorded(rows, [0.0, 10.0], [1.0, 11.0], output=[40, 1], output_ids=[[3, 4], None])
    assert run(named, capacity=8, engine=engine).hits_device == 4
    unnamed = recorded(rows, [0.0, 10.0], [1.0, 11.0], output=[40, 1])
    assert run(unnamed, capacity=8, engine=engine).hits_device == 2
    timing = prepare_workload(named, engine_block_size=16).timing
    first, second = (timing.block[timing.offsets[i]:timing.offsets[i + 1]] for i in range(2))
    assert first.tolist() == second[:4].tolist()


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_blocks_taken_while_decoding_evict_when_the_server_took_them(engine):
    # 4 blocks. Request 0 leaves block 9 cached at 0.5; request 1 takes 2 blocks at 1 and, decoding 33
    # tokens, one more at 2 and at 3 (the recording's grown): the second evicts 9, so request 2 (at 4)
    # misses it, as on the server. Without the grow times both are taken at request 1's finish (10),
    # after request 2 hit 9.
    rows = [(0.0, "a", 1, [9]), (1.0, "a", 1, [1, 2]), (4.0, "a", 1, [9, 10])]
    scheduled, finished, output = [0.0, 1.0, 4.0], [0.5, 10.0, 5.0], [1, 33, 1]
    timed = recorded(rows, scheduled, finished, output=output, grown=[None, [2.0, 3.0], None])
    timing = prepare_workload(timed, engine_block_size=16).timing
    assert (timing.n_first.tolist(), timing.n_last.tolist(), timing.n_new.tolist()) == ([1, 2, 2], [0, 0, 0], [0, 2, 0])
    assert run(timed, capacity=4, engine=engine).hits_device == 0
    assert run(recorded(rows, scheduled, finished, output=output), capacity=4, engine=engine).hits_device == 1


@st.composite
def recordings(draw):
    ids: dict[tuple, int] = {}
    rows, scheduled, finished, t = [], [], [], 0.0
    for _ in range(draw(st.integers(1, 20))):
        symbols = draw(st.lists(st.integers(0, 2), min_size=1, max_size=8))
        chain = [ids.setdefault(tuple(symbols[: k + 1]), len(ids)) for k in range(len(symbols))]
        t += draw(st.sampled_from([0.0, 0.1, 1.0]))
        rows.append((t, draw(st.sampled_from(["a", "b"])), 1, chain))
        start = None if draw(st.integers(0, 9)) == 0 else t + draw(st.sampled_from([0.0, 0.2, 2.0]))
        scheduled.append(start)
        finished.append((t if start is None else start) + draw(st.sampled_from([0.0, 0.3, 5.0])))
    output = [draw(st.integers(0, 40)) for _ in rows]
    short = [draw(st.sampled_from([0, 0, 1, 15])) for _ in rows]  # a partial last prompt block in about half
    # where drawn, the recording's grows (times in the request's run, or a little outside it) and the ids of
    # its output-filled blocks (a prompt's, as a next turn's would be, or ids no prompt has)
    grown = output_ids = None
    if draw(st.booleans()):
        grown = [None if draw(st.integers(0, 4)) == 0 else
                 [(t0 if t0 is not None else end) + draw(st.sampled_from([-0.1, 0.0, 0.1, 0.3, 9.0]))
                  for _ in range(draw(st.integers(0, 3)))] for t0, end in zip(scheduled, finished)]
        output_ids = [None if draw(st.integers(0, 4)) == 0 else
                      draw(st.lists(st.sampled_from(sorted(ids.values()) + [1000, 1001]), max_size=3)) for _ in rows]
    return recorded(rows, scheduled, finished, output=output, short=short, grown=grown, output_ids=output_ids), draw(
        st.integers(1, 12)), draw(st.sampled_from(["lru", "lfu", "s3fifo", "arc", "belady"]))


@settings(max_examples=120, deadline=None)
@given(recordings())
def test_compiled_and_python_replays_agree(case):
    trace, capacity, policy = case
    compiled = run(trace, policy, capacity, engine="compiled")
    python = run(trace, policy, capacity, engine="python")
    assert compiled.to_dict() == pytest.approx(python.to_dict(), nan_ok=True)
    assert compiled.hits_device + compiled.misses == compiled.block_lookups
    timing = prepare_workload(trace, engine_block_size=trace.block_size).timing
    # not scheduled by the server, or longer than the whole cache (rejected, as on modelled timing)
    assert compiled.n_rejected == sum(v is None or blocks > capacity
                                      for v, blocks in zip(trace.extra["scheduled"], timing.n_prompt.tolist()))


def recorded_requests(workload):
    """The workload's requests as :func:`kvprof.core.timed.replay` plays them."""
    from kvprof.core.timed import RecordedRequests

    timing = workload.timing
    return RecordedRequests(blocks=timing.block, offsets=timing.offsets, n_full=timing.n_full,
                            n_prompt=timing.n_prompt, n_lookup=workload.n_lookup, n_new=timing.n_new,
                            classes=workload.workload.astype(np.int64), next_use=timing.next_use,
                            n_output=workload.output_tokens, finish=workload.finish.astype(np.int64),
                            n_first=timing.n_first, n_last=timing.n_last)


@settings(max_examples=60, deadline=None)
@given(recordings())
def test_every_slot_is_in_one_place_at_every_event(case):
    from kvprof.core import tiers
    from kvprof.core.build import compile_policy
    from kvprof.core.timed import replay

    trace, capacity, policy = case
    workload = prepare_workload(trace, engine_block_size=trace.block_size)
    timing = workload.timing
    gpu = tiers.new_device(compile_policy(make_policy(policy), capacity), capacity, timing.n_contents)
    hits, held = replay(gpu, recorded_requests(workload), timing.events(), check=True)
    assert (held <= timing.n_prompt + timing.n_new).all() and (hits <= held).all()



def test_wa_shadows_hear_of_every_scheduled_request():
    rows = [(0.0, "a", 1, [1, 2, 3, 9]), (1.0, "a", 1, [4, 5, 6, 8]), (200.0, "a", 1, [1, 2, 3, 7])]
    trace = recorded(rows, [0.0, 1.0, 200.0], [100.0, 2.0, 201.0], output=[1, 1, 1])
    for engine in ("python", "compiled"):
        policy = build("wa+shadows")
        assert simulate(prepare_workload(trace, engine_block_size=16), policy, 8,
                        SimConfig(engine_block_size=16, timing="auto"), engine=engine).hits_device == 3
        assert set(policy.shadow_hits().values()) == {3}, engine  # request 2 finds 1-3 in every shadow


@settings(max_examples=40, deadline=None)
@given(recordings())
def test_wa_shadows_agree_in_both_replays(case):
    trace, capacity, _ = case
    config = SimConfig(engine_block_size=trace.block_size, timing="auto")
    workload = prepare_workload(trace, engine_block_size=trace.block_size)
    # with the long-output candidate too, led from the start: each finish tells it the recorded output
    for make in (lambda: build("wa+shadows"), lambda: wa_policy(P, LAM, orders=("long-output", *WA_ORDERS),
                                                                 safety_net=True, output_limit=20.0)):
        python, compiled = make(), make()
        metrics = [simulate(workload, policy, capacity, config, engine=engine)
                   for policy, engine in ((python, "python"), (compiled, "compiled"))]
        assert metrics[0].to_dict() == pytest.approx(metrics[1].to_dict(), nan_ok=True)
        assert compiled.shadow_hits() == python.shadow_hits()
        assert compiled.order_name == python.order_name


def test_bad_recorded_times_matter_only_where_recorded_timing_runs():
    rows = [(0.0, "a", 1, [1, 2]), (1.0, "a", 1, [1, 2])]
    trace = recorded(rows, [0.0, 1.0], [0.5, float("nan")])
    assert run(trace, timing="model").n_requests == 2  # the cost model ignores the recorded times
    for timing in ("recorded", "auto"):
        with pytest.raises(SimulationError, match="request 1 has no finished time.*--timing model"):
            run(trace, timing=timing)


@pytest.mark.parametrize("value,message", [
    (True, "scheduled must be a number of seconds or null, got bool True"),
    ("soon", "scheduled must be a number of seconds or null, got str 'soon'"),
    (float("inf"), "scheduled must be a finite number of seconds or null, got inf"),
    (None, None),
])
def test_recorded_times_that_are_not_seconds_are_refused_by_request(value, message):
    rows = [(0.0, "a", 1, [1, 2]), (1.0, "a", 1, [1, 2])]
    trace = recorded(rows, [0.0, value], [0.5, 2.0])
    if value is None:  # a whole column of booleans, as a reader gives it
        trace = dataclasses.replace(trace, extra={**trace.extra, "scheduled": np.array([True, True])})
        message = "request 0: scheduled must be a number of seconds or null, got bool True"
    with pytest.raises(SimulationError, match=message):
        run(trace, timing="recorded")


def test_a_missing_scheduled_time_is_only_an_aborted_requests():
    rows = [(0.0, "a", 1, [1, 2]), (1.0, "a", 1, [1, 2])]
    trace = recorded(rows, [0.0, None], [0.5, 2.0])
    for reasons, refused in ((["stop", "abort"], False), (["stop", "stop"], True), (["stop", None], True)):
        with_reasons = dataclasses.replace(trace, extra={**trace.extra, "finish_reason": np.array(reasons, object)})
        if refused:
            with pytest.raises(SimulationError, match="request 1 .* no scheduled time .* not aborted"):
                run(with_reasons)
        else:
            assert run(with_reasons).n_rejected == 1


def test_auto_timing_says_what_runs():
    from kvprof.sim.recorded import resolve_timing

    trace = recorded([(0.0, "a", 1, [1, 2])], [0.0], [1.0])
    assert resolve_timing("auto", trace, 16) == "recorded"
    assert resolve_timing("auto", trace, 32) == "model"  # another block size: the recorded times do not apply
    assert resolve_timing("auto", trace, 16, cpu_capacity=8) == "model"
    assert resolve_timing("auto", trace, 16, capacity_schedule=((0.0, 4),)) == "model"
    with pytest.raises(SimulationError, match="at its 16-token blocks; a replay at 32-token blocks"):
        resolve_timing("recorded", trace, 32)
    with pytest.raises(SimulationError, match="no CPU tier"):
        resolve_timing("recorded", trace, 16, cpu_capacity=8)
    workload = prepare_workload(trace, engine_block_size=16)
    config = SimConfig(engine_block_size=16, timing="auto", cpu_capacity=8)
    assert simulate(workload, make_policy("lru"), 4, config, host_policy=make_policy("lru")).n_requests == 1
