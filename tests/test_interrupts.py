"""Interrupts reach compiled replays: chunked calls, the interrupt raised as itself (issue 21, item 16)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.interrupts import compiled_call
from kvprof.policy import make_policy
from kvprof.sim.workload import prepare_workload

from tests.test_timed import recorded_requests, recordings


def _replay(case, chunk):
    from kvprof.core import tiers
    from kvprof.core.build import compile_policy
    from kvprof.core.timed import replay

    trace, capacity, policy = case
    workload = prepare_workload(trace, engine_block_size=trace.block_size)
    timing = workload.timing
    gpu = tiers.new_device(compile_policy(make_policy(policy), capacity), capacity, timing.n_contents)
    hits, held = replay(gpu, recorded_requests(workload), timing.events(), check=True, chunk=chunk)
    return hits.tolist(), held.tolist(), tiers.counts(gpu)


@settings(max_examples=60, deadline=None)
@given(recordings(), st.integers(1, 5))
def test_a_recorded_replay_in_chunks_is_the_replay_in_one(case, chunk):
    assert _replay(case, chunk) == _replay(case, 1 << 30)


def test_an_interrupt_set_beside_a_compiled_result_is_raised_as_itself():
    class Terminated(KeyboardInterrupt):
        pass

    def returns_with_an_exception_set():
        # What CPython makes of a handler that raised while numba boxed a result.
        try:
            raise Terminated("SIGTERM")
        except Terminated as interrupt:
            raise SystemError("CPUDispatcher(<function replay>) returned a result with an exception set") \
                from interrupt

    with pytest.raises(Terminated, match="SIGTERM"):
        compiled_call(returns_with_an_exception_set)


def test_other_system_errors_stay_what_they_are():
    def broken():
        raise SystemError("something else")

    with pytest.raises(SystemError, match="something else"):
        compiled_call(broken)
