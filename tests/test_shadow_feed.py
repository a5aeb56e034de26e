"""wa's shadows fed on a thread of their own decide exactly as the synchronous feed does.

:class:`kvprof.core.shadow_feed.ShadowFeed` runs the shadows' part of every admission and finish
(and the follow checkpoints) on a worker thread; an eviction waits only for what it reads. Driven
through the same requests, with the worker slowed down at random so that it lags, a twin fed that
way must evict what the reference evicts, see the same leader at every eviction as the synchronous
twin, and end with the same shadow hits; an error in the worker is logged and the rest goes on.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprof.core import handle
from kvprof.core.twin import CompiledTwin
from kvprof.core.wa import outcome
from kvprof.policy import make_policy
from kvprof.policy.wa import DEFAULT_ORDERS
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload
from tests.test_core_policies import WA_VARIANTS, run_side_by_side
from tests.test_policies import LAM, OPS, P, wa_policy
from tests.test_wa_safety import upside_down

#: wa's variants with shadows: row orders and followed cores as candidates, a sample of chains.
FED = ["wa default orders", "wa every order", "wa sampled shadows", "wa+shadows"]


class LeaderAtEvictions(CompiledTwin):
    """A twin that notes the leader each eviction took its victims under (read without waiting)."""

    def __init__(self, reference, threaded: bool) -> None:
        super().__init__(reference)
        self.leaders: list[int] = []
        if threaded:
            self.feed_shadows_in_background()

    def _evict_into(self, out, n, now):
        out = super()._evict_into(out, n, now)
        self.leaders.append(int(outcome(self.handle)[0]))
        return out


def sized_wa():
    """``wa`` with its safety net over a cache of 8 blocks (shadows of that size from the start)."""
    return wa_policy(P, LAM, safety_net=True, orders=DEFAULT_ORDERS, capacity=8)


@pytest.fixture
def lagging_worker(monkeypatch):
    """The worker sleeps up to 2 ms before each batch, so that admissions and finishes pile up."""
    feed_n, pace = handle.feed_n, random.Random(0)

    def slow(*args):
        time.sleep(pace.random() * 0.002)
        feed_n(*args)

    monkeypatch.setattr(handle, "feed_n", slow)


@pytest.mark.parametrize("name", FED)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, num_blocks=st.integers(4, 24))
def test_the_threaded_feed_decides_as_the_synchronous_one(name, ops, num_blocks, lagging_worker):
    threaded, synchronous = LeaderAtEvictions(WA_VARIANTS[name](), True), LeaderAtEvictions(WA_VARIANTS[name](), False)
    try:
        run_side_by_side(WA_VARIANTS[name](), threaded, ops, num_blocks)
        run_side_by_side(WA_VARIANTS[name](), synchronous, ops, num_blocks)
        assert threaded.leaders == synchronous.leaders
        leader, hits = threaded.safety_net()
        expected_leader, expected_hits = synchronous.safety_net()
        assert leader == expected_leader and hits.tolist() == expected_hits.tolist()
        assert threaded.shadow_feed.errors == 0
    finally:
        threaded.close()


@pytest.fixture(scope="module")
def misled(tmp_path_factory):
    """Synthetic bailian-a and an hp file fitted on its first 3 minutes, turned upside down (rows that
    come back look never reused): the model loses, so wa's leader switches among its candidates."""
    path = tmp_path_factory.mktemp("misled") / "trace.jsonl"
    write_jsonl(path, generate("bailian-a", 0.1, 3))
    trace, _ = read_trace(path)
    bad = upside_down(fit_trace(trace.time_window(0, 180), max_cells=0))
    return prepare_workload(trace.time_window(180, None), bad, 128), bad


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(capacity=st.integers(32, 400))
def test_on_a_trace_the_threaded_feed_switches_leaders_as_the_synchronous_one(misled, capacity, lagging_worker):
    """The simulator's Python engine drives both twins through whole requests: hits, the leader at every
    eviction and the shadows' hits are the same, while the worker lagged (evictions waited for it)."""
    workload, hp = misled
    threaded = LeaderAtEvictions(make_policy("wa", hp, capacity), True)
    synchronous = LeaderAtEvictions(make_policy("wa", hp, capacity), False)
    try:
        metrics = simulate(workload, threaded, capacity, SimConfig(), engine="python")
        expected = simulate(workload, synchronous, capacity, SimConfig(), engine="python")
        assert threaded.leaders == synchronous.leaders
        assert metrics.hits_device == expected.hits_device
        leader, hits = threaded.safety_net()
        assert (leader, hits.tolist()) == (synchronous.safety_net()[0], synchronous.safety_net()[1].tolist())
        assert sum(threaded.shadow_feed.waits.get(reason, [0])[0] for reason in ("checkpoint", "beta")) > 0
    finally:
        threaded.close()


def test_the_misled_trace_does_switch_leaders(misled):
    """What the test above relies on: wa's leader switches on this trace."""
    workload, hp = misled
    twin = LeaderAtEvictions(make_policy("wa", hp, 64), False)
    simulate(workload, twin, 64, SimConfig(), engine="python")
    assert sum(a != b for a, b in zip(twin.leaders, twin.leaders[1:])) > 1


def test_an_error_in_the_worker_is_logged_and_the_feed_goes_on(monkeypatch, caplog):
    feed_n, calls = handle.feed_n, []

    def failing_once(address, numbers, nows, starts, contents, first, at):
        calls.append(first)
        if len(calls) == 1:  # the first item raises: it is skipped, the others are done
            at[0] = first
            raise RuntimeError("boom")
        feed_n(address, numbers, nows, starts, contents, first, at)

    monkeypatch.setattr(handle, "feed_n", failing_once)
    twin = CompiledTwin(sized_wa(), 8)
    twin.feed_shadows_in_background()
    with caplog.at_level(logging.ERROR, logger="kvprof"):
        twin.admit("a", ["x", "y"], 0.0)  # skipped: no shadow holds x and y after it
        twin.finish("a", 1.0, ["x", "y"])
        twin.admit("b", ["x", "y"], 2.0)
        twin.finish("b", 3.0, ["x", "y"])
        twin.admit("c", ["x", "y", "z"], 4.0)  # two hits in every shadow: b's chain was cached
        _, hits = twin.safety_net()
    assert twin.shadow_feed.errors == 1
    assert "shadow feed failed" in caplog.text and "boom" in caplog.text
    assert hits.tolist() == [2] * len(hits)
    twin.close()


def test_a_full_feed_waits_instead_of_dropping(lagging_worker):
    twin, synchronous = CompiledTwin(sized_wa(), 8), CompiledTwin(sized_wa(), 8)
    twin.feed_shadows_in_background()
    twin.shadow_feed.limit = 4
    for policy in (twin, synchronous):
        for i in range(40):
            policy.admit(i, [f"c{i % 3}", f"d{i % 5}"], float(i))
            policy.finish(i, float(i) + 0.5, [f"c{i % 3}", f"d{i % 5}"])
    assert twin.shadow_feed.waits["full"][0] > 0
    assert twin.safety_net()[1].tolist() == synchronous.safety_net()[1].tolist()
    assert twin.shadow_feed.done == twin.shadow_feed.put == 80
    twin.close()


def test_clear_starts_a_fresh_feed_on_the_fresh_policy():
    twin = CompiledTwin(sized_wa(), 8)
    twin.feed_shadows_in_background()
    old = twin.shadow_feed
    twin.admit("a", ["x"], 0.0)
    twin.clear()
    assert twin.shadow_feed is not old and old._closed
    twin.admit("a", ["x"], 1.0)
    assert twin.safety_net()[1].tolist() == [0] * len(twin.safety_net()[1])
    twin.close()


def test_a_policy_without_shadows_keeps_the_synchronous_path():
    twin = CompiledTwin(WA_VARIANTS["wa model"](), 8)
    twin.feed_shadows_in_background()
    assert twin.shadow_feed is None
    np.testing.assert_array_equal(twin.numbers(["a"]), [0])


def test_the_metrics_read_of_the_shadows_never_waits_and_catches_up(monkeypatch):
    """``safety_net(wait=False)`` (what the metrics snapshot on the scheduler thread reads) returns what the
    worker published after its last batch, without waiting for the items still queued; once the worker is
    done it equals the settled figures."""
    release, entered = threading.Event(), threading.Event()
    feed_n = handle.feed_n

    def held(*args):
        entered.set()
        release.wait(10)
        feed_n(*args)

    twin = CompiledTwin(sized_wa(), 8)
    twin.feed_shadows_in_background()
    twin.admit("a", ["x", "y"], 0.0)
    twin.finish("a", 1.0, ["x", "y"])
    twin.safety_net()  # settled: a's chain is in every shadow
    settles = twin.shadow_feed.waits.get("settle", [0])[0]
    monkeypatch.setattr(handle, "feed_n", held)
    twin.admit("b", ["x", "y"], 2.0)  # two hits in every shadow once the held worker goes on
    assert entered.wait(10)
    leader, hits = twin.safety_net(wait=False)
    assert hits.tolist() == [0] * len(hits) and twin.shadow_feed.done < twin.shadow_feed.put
    assert twin.shadow_feed.waits.get("settle", [0])[0] == settles
    release.set()
    settled = twin.safety_net()
    assert settled[1].tolist() == [2] * len(hits)
    assert (twin.safety_net(wait=False)[0], twin.safety_net(wait=False)[1].tolist()) == (settled[0], settled[1].tolist())
    twin.close()
