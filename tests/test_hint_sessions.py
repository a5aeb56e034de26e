"""A release that names a session demotes only that session's private blocks (kvprof.policy.hinted)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.models.hints import Hint, hint_of_args
from kvprof.policy import make_policy
from kvprof.policy.hinted import HintedPolicy
from kvprof.profiler.reader import read_trace

N_BLOCKS = 6
SESSIONS = (None, 0, "chat-a")

operations = st.lists(st.one_of(
    st.tuples(st.just("start"), st.sampled_from(SESSIONS),
              st.lists(st.integers(0, N_BLOCKS - 1), min_size=1, max_size=4, unique=True)),
    st.tuples(st.just("finish"), st.integers(0, 3), st.sampled_from(["release", "none", "retain"])),
    st.tuples(st.just("request"), st.sampled_from(SESSIONS),  # a start and its finish at once
              st.lists(st.integers(0, N_BLOCKS - 1), min_size=1, max_size=4, unique=True),
              st.sampled_from(["release", "none"])),
    st.tuples(st.just("evict")),
    st.tuples(st.just("wait"), st.sampled_from([0.5, 2.0])),
), max_size=60)


class Sessions:
    """Requests of sessions running at once over a :class:`HintedPolicy`, as the simulator drives it:
    a block is held (a reference count), evictable or empty; ``touched[block]`` is every session that
    held its content since it was cached (``NONE`` for a request naming none), the truth the layer
    learns at finishes; ``tracked_since`` the first content cached after a request named a session."""

    NONE = "(none)"

    def __init__(self, tracked: bool = False):
        self.policy = HintedPolicy(make_policy("lru"))
        if tracked:  # as after a request of a session that held nothing
            self.policy.note_held([], "earlier", 0.0)
        self.now = 0.0
        self.refs = [0] * N_BLOCKS
        self.evictable: set[int] = set()
        self.running: list[tuple[object, list[int]]] = []
        self.touched: dict[int, set] = {}
        self.named = tracked
        self.cached_while_tracked: set[int] = set()

    def step(self, op) -> None:
        kind, *args = op
        policy = self.policy
        if kind == "start":
            session, blocks = args
            for block in blocks:
                if block in self.evictable:
                    policy.remove(block)
                    policy.access(block, self.now, hit=True)
                    self.evictable.discard(block)
                elif not self.refs[block]:  # empty: new content
                    policy.access(block, self.now, hit=False)
                    self.touched[block] = set()
                    if self.named:
                        self.cached_while_tracked.add(block)
                    else:
                        self.cached_while_tracked.discard(block)
                else:  # held by another running request: shared while both run
                    policy.access(block, self.now, hit=True)
                self.refs[block] += 1
            self.running.append((session, blocks))
        elif kind == "finish" and self.running:
            self.finish(*self.running.pop(args[0] % len(self.running)), args[1])
        elif kind == "request":
            self.step(("start", *args[:2]))
            self.finish(*self.running.pop(), args[2])
        elif kind == "evict" and self.evictable:
            victim = policy.evict(self.now)
            self.evictable.discard(victim)
            del self.touched[victim]
        elif kind == "wait":
            self.now += args[0]

    def finish(self, session, blocks: list[int], kind: str) -> None:
        policy = self.policy
        hint = {"release": Hint(release=True, session=session), "retain": Hint(retain_s=1.0, session=session),
                "none": None if session is None else Hint(session=session)}[kind]
        self.named |= session is not None
        for block in blocks:
            self.touched[block].add(self.NONE if session is None else session)
        released_before, declined_before = set(policy._released), policy.counters.release_declined
        policy.finish(0, self.now, hint=hint, held=blocks)
        freed = []
        for block in blocks:
            self.refs[block] -= 1
            if not self.refs[block]:
                freed.append(block)
        if freed:
            policy.free(freed[::-1], self.now)
            self.evictable |= set(freed)
        released = set(policy._released) - released_before
        if kind != "release":
            assert not released
        elif session is None:  # a release naming no session: every freed block not under a retention
            assert released == {block for block in freed if block not in policy._retained}
        else:
            # never a block another session (or a request naming none) touched ...
            assert all(self.touched[block] == {session} for block in released)
            # ... and every freed block only this session touched, cached while sessions were tracked
            private = {block for block in freed if self.touched[block] == {session}
                       and block in self.cached_while_tracked}
            declined = policy.counters.release_declined - declined_before  # a release not trusted (hinted.py)
            if declined:
                assert not released and declined == len(private - set(policy._retained))
            else:
                assert private - released <= set(policy._retained)


@settings(max_examples=500, deadline=None)
@given(operations, st.booleans())
def test_a_release_never_demotes_a_block_another_session_touched(ops, tracked):
    driver = Sessions(tracked)
    for op in ops:
        driver.step(op)
        holders = driver.policy._holders
        assert set(holders) <= {b for b in range(N_BLOCKS) if driver.refs[b] or b in driver.evictable}
        assert driver.policy.tracks_sessions == driver.named


class ChosenEvictions(Sessions):
    """:class:`Sessions` whose evictions take the order's first block and evict it with
    ``evict_chosen``, as the CPU tier does (which must skip the chunks a load protects)."""

    def step(self, op) -> None:
        if op[0] != "evict" or not self.evictable:
            return super().step(op)
        (victim,) = self.policy.order(self.now, 1)
        self.policy.evict_chosen([victim], self.now)
        self.evictable.discard(victim)
        del self.touched[victim]


@settings(max_examples=300, deadline=None)
@given(operations, st.booleans())
def test_evicting_chosen_blocks_counts_and_judges_as_evicting_from_the_layer(ops, tracked):
    by_layer, by_caller = Sessions(tracked), ChosenEvictions(tracked)
    for op in ops:
        by_layer.step(op)
        by_caller.step(op)
        ours, theirs = by_caller.policy, by_layer.policy
        assert ours.order(by_caller.now) == theirs.order(by_layer.now) and ours._holders == theirs._holders
        assert ours.counters == theirs.counters and ours.horizon.evicted == theirs.horizon.evicted
        for record in ("released_record", "evicted_record"):
            mine, other = getattr(ours, record), getattr(theirs, record)
            assert (mine.returned, mine.stayed_away, mine._deadline) == (other.returned, other.stayed_away, other._deadline)


def test_the_unnamed_path_keeps_no_holders():
    """Until a request names a session, the layer does no work per block and a release releases all."""
    driver = Sessions()
    for op in [("start", None, [0, 1, 2]), ("finish", 0, "none"), ("start", None, [1, 3]), ("finish", 0, "release")]:
        driver.step(op)
    assert not driver.policy._holders and not driver.policy.tracks_sessions
    assert set(driver.policy._released) == {1, 3}


def test_a_shared_prefix_outlives_the_release_of_one_session():
    """Two sessions read the same system prompt (blocks 0, 1); one ends: only its own turn (2, 3) is demoted."""
    driver = Sessions()
    for op in [("start", "a", [5]), ("finish", 0, "none"),  # the first named session turns tracking on
               ("start", "a", [0, 1, 2, 3]), ("finish", 0, "none"),
               ("start", "b", [0, 1, 4]), ("finish", 0, "none"),
               ("start", "a", [0, 1, 2, 3]), ("finish", 0, "release")]:
        driver.step(op)
    policy = driver.policy
    assert set(policy._released) == {2, 3}
    assert policy.evict_n(2, driver.now) == [3, 2]  # tail first
    assert {0, 1} <= {b for b in range(N_BLOCKS) if b in policy.base}


@pytest.mark.parametrize("value, problem", [
    ("", "1 to 128 characters"), ("x" * 129, "1 to 128 characters"), (1.5, "a string or an integer"),
    (True, "a string or an integer"), (-1, "from 0 to"), (2**63, "from 0 to"), ([1], "a string or an integer"),
])
def test_a_bad_session_is_refused_naming_the_field(value, problem):
    with pytest.raises(ValueError, match=f"hint field 'hint_session' must be {problem}"):
        hint_of_args({"release": 1, "hint_session": value})
    with pytest.raises(ValueError, match="hint_session"):
        Hint(release=True, session=value)


def test_a_session_alone_is_a_hint_and_round_trips_as_fields():
    assert hint_of_args({"hint_session": "chat-1"}) == Hint(session="chat-1")
    assert hint_of_args({"hint_session": 0, "release": 1}).fields() == {
        "retain_s": 0.0, "retain_priority": 50, "release": True, "hint_tag": 0, "hint_session": 0}
    assert "hint_session" not in Hint(release=True).fields()


def test_the_reader_keeps_sessions_of_either_type(tmp_path):
    from kvprof.profiler.synth import write_jsonl
    from tests.test_cli_hints import _records

    records = _records()[:4]
    records[1]["hint_session"] = "chat-7"
    records[2].update(hint_session=7, release=True)
    path = tmp_path / "sessions.jsonl"
    write_jsonl(path, records)
    hints = read_trace(path)[0].hints.hints()
    assert hints[1].session == "chat-7" and hints[2] == Hint(release=True, session=7)


def test_stop_hints_name_each_requests_conversation(tmp_path):
    import numpy as np

    from kvprof.profiler.fit import fit_trace
    from kvprof.sim.hints import stop_hints
    from kvprof.sim.sample import chain_roots
    from tests.test_cli_hints import _stopped

    trace = read_trace(_stopped(tmp_path))[0]
    hints = stop_hints(trace, fit_trace(trace.time_window(0, 360)))
    np.testing.assert_array_equal(hints.session.astype(np.int64), chain_roots(trace))
    assert hints.release.any() and (hints.retain_s > 0).any()
