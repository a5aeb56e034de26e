"""The hint layer (kvprof.policy.hinted): where each block is, what it evicts first, the budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.models.hints import Hint, HintColumns
from kvprof.policy import make_policy
from kvprof.policy.hinted import HintedPolicy

N_BLOCKS = 12

sessions = st.sampled_from([None, 0, "chat-a"])
hints = st.one_of(
    st.none(),
    st.builds(Hint, retain_s=st.sampled_from([0.5, 1.0, 3.0, 10.0]), priority=st.integers(0, 99),
              tag=st.integers(0, 2), session=sessions),
    st.builds(Hint, release=st.just(True), session=sessions),
    st.builds(Hint, session=sessions),
)
operations = st.lists(st.one_of(
    st.tuples(st.just("free"), st.lists(st.integers(0, N_BLOCKS - 1), min_size=1, max_size=4, unique=True), hints),
    st.tuples(st.just("hit"), st.integers(0, N_BLOCKS - 1)),
    st.tuples(st.just("evict")),
    st.tuples(st.just("wait"), st.sampled_from([0.25, 1.0, 4.0])),
), max_size=80)


class Driver:
    """Drives a policy as the simulator does: blocks are held, evictable or empty (never cached)."""

    def __init__(self, policy):
        self.policy = policy
        self.now = 0.0
        self.held: set[int] = set()
        self.evictable: set[int] = set()
        self.victims: list[int] = []

    def step(self, op) -> None:
        kind, *args = op
        policy = self.policy
        if kind == "free":
            blocks, hint = args
            for block in blocks:
                if block not in self.held and block not in self.evictable:  # empty: allocate new content
                    policy.access(block, self.now, hit=False)
                    self.held.add(block)
                elif block in self.evictable:  # a hit takes it back first
                    policy.remove(block)
                    policy.access(block, self.now, hit=True)
                    self.evictable.discard(block)
                    self.held.add(block)
            if hint is None:
                policy.finish(0, self.now)
            else:
                policy.finish(0, self.now, hint=hint, held=blocks)
            policy.free(blocks, self.now)
            self.held -= set(blocks)
            self.evictable |= set(blocks)
        elif kind == "hit" and args[0] in self.evictable:
            policy.remove(args[0])
            policy.access(args[0], self.now, hit=True)
            self.evictable.discard(args[0])
            self.held.add(args[0])
        elif kind == "evict" and self.evictable:
            victim = policy.evict(self.now)
            assert victim in self.evictable
            self.evictable.discard(victim)
            self.victims.append(victim)
        elif kind == "wait":
            self.now += args[0]


def pools(policy: HintedPolicy) -> list[set[int]]:
    return [set(policy._released), set(policy._retained), {b for b in range(N_BLOCKS) if b in policy.base}]


def check_invariants(driver: Driver, budget) -> None:
    policy = driver.policy
    released, retained, base = pools(policy)
    assert not (released & retained) and not (released & base) and not (retained & base)
    assert released | retained | base == driver.evictable
    assert len(policy) == len(driver.evictable)
    assert all((block in policy) == (block in driver.evictable) for block in range(N_BLOCKS))
    for tag, held in policy._by_tag.items():
        assert set(held) <= retained
        if budget is not None:
            assert len(held) <= budget
    assert sum(len(held) for held in policy._by_tag.values()) == len(retained)
    assert set(policy._oldest) == retained
    if budget is not None:  # all tags together too
        assert len(retained) <= budget


@settings(max_examples=200, deadline=None)
@given(operations, st.sampled_from([None, 0, 1, 3]))
def test_every_block_in_exactly_one_pool_and_budget_kept(ops, budget):
    driver = Driver(HintedPolicy(make_policy("lru"), budget_blocks=budget))
    for op in ops:
        if op[0] == "evict" and driver.evictable:
            check_evict_order(driver)
        else:
            driver.step(op)
        check_invariants(driver, budget)


def check_evict_order(driver: Driver) -> None:
    """The victim comes from the released pool while it has blocks, then the base, then the
    retained pool's lowest priority, latest expiry."""
    policy = driver.policy
    policy._lapse(driver.now)
    released, retained, base = pools(policy)
    keys = {block: (policy._retention[block][1], -policy._retention[block][0]) for block in retained}
    oldest_released = next(iter(policy._released), None)
    driver.step(("evict",))
    victim = driver.victims[-1]
    if released:
        assert victim == oldest_released
    elif base:
        assert victim in base
    else:
        assert keys[victim] == min(keys.values())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("free"), st.lists(st.integers(0, N_BLOCKS - 1), min_size=1, max_size=4, unique=True),
              st.none()),
    st.tuples(st.just("hit"), st.integers(0, N_BLOCKS - 1)),
    st.tuples(st.just("evict")),
    st.tuples(st.just("wait"), st.sampled_from([0.25, 1.0])),
), max_size=80), st.sampled_from(["lru", "sieve", "s3fifo", "arc"]), st.sampled_from([None, 0, 2]))
def test_without_hints_it_is_the_base_policy(ops, base, budget):
    hinted = Driver(HintedPolicy(make_policy(base), budget_blocks=budget))
    bare = Driver(make_policy(base))
    for op in ops:
        hinted.step(op)
        bare.step(op)
        assert hinted.victims == bare.victims
        assert hinted.policy.order(hinted.now) == bare.policy.order(bare.now)


def test_released_then_base_then_retained_by_priority_then_latest_expiry():
    policy = HintedPolicy(make_policy("lru"))
    policy.finish(1, 0.0, hint=Hint(retain_s=10.0, priority=50))
    policy.free([1, 2], 0.0)
    policy.finish(2, 0.0, hint=Hint(retain_s=5.0, priority=50))
    policy.free([3], 0.0)
    policy.finish(3, 0.0, hint=Hint(retain_s=20.0, priority=10))
    policy.free([4], 0.0)
    policy.finish(4, 0.0)
    policy.free([5, 6], 0.0)
    policy.finish(5, 0.0, hint=Hint(release=True))
    policy.free([7], 0.0)
    assert policy.order(1.0) == [7, 5, 6, 4, 1, 2, 3]
    assert policy.evict_n(7, 1.0) == [7, 5, 6, 4, 1, 2, 3]
    assert policy.counters.released_evicted == 1


def test_expiry_returns_blocks_to_the_base_order_in_expiry_order():
    policy = HintedPolicy(make_policy("lru"))
    policy.finish(1, 0.0, hint=Hint(retain_s=2.0))
    policy.free([1], 0.0)
    policy.finish(2, 0.0, hint=Hint(retain_s=1.0))
    policy.free([2], 0.0)
    policy.finish(3, 0.5)
    policy.free([3], 0.5)
    assert policy.order(0.9) == [3, 1, 2]  # retained, out of the base, latest expiry first
    assert policy.n_retained == 2
    policy.finish(4, 3.0)
    policy.free([4], 3.0)  # the lapses come first: 2 (at 1 s), then 1 (at 2 s), then the new free
    assert policy.n_retained == 0 and policy.counters.lapsed == 2
    assert policy.order(3.0) == [3, 2, 1, 4]


def test_a_hinted_free_refreshes_to_the_later_expiry_and_a_hit_is_honoured():
    policy = HintedPolicy(make_policy("lru"))
    policy.finish(1, 0.0, hint=Hint(retain_s=10.0))
    policy.free([1], 0.0)
    policy.remove(1)  # hit at 1 s
    assert policy.counters.retained_hits == 1
    policy.finish(2, 1.0, hint=Hint(retain_s=2.0))
    policy.free([1], 1.0)
    assert policy._retention[1][0] == 10.0  # max(10, 1 + 2)
    policy.remove(1)
    policy.finish(3, 2.0)
    policy.free([1], 2.0)  # an unhinted free keeps the live retention
    assert policy.n_retained == 1
    policy.remove(1)
    policy.finish(4, 11.0)
    policy.free([1], 11.0)  # ran out while held: the base order again
    assert policy.n_retained == 0 and 1 not in policy._retention and 1 in policy.base


def test_a_client_retaining_everything_cannot_push_another_tenant_out():
    """Tag 1 retains every block it frees; with a budget of 2 it holds at most 2, and tag 0's
    unhinted blocks are evicted in the base order only after tag 1's unretained ones."""
    policy = HintedPolicy(make_policy("lru"), budget_blocks=2)
    policy.finish(1, 0.0)
    policy.free([100, 101], 0.0)  # the other tenant, no hint
    for t, block in enumerate(range(10), start=1):
        policy.finish(block, float(t), hint=Hint(retain_s=1000.0, tag=1))
        policy.free([block], float(t))
        assert policy.retained_of(1) <= 2
    assert policy.counters.over_budget == 8
    # Over-budget retentions lapse into the base order: tag 0's older blocks go first, as LRU would.
    assert policy.evict_n(10, 11.0) == [100, 101, *range(8)]
    assert set(policy._retained) == {8, 9}
    unbounded = HintedPolicy(make_policy("lru"))
    unbounded.finish(1, 0.0)
    unbounded.free([100, 101], 0.0)
    for t, block in enumerate(range(10), start=1):
        unbounded.finish(block, float(t), hint=Hint(retain_s=1000.0, tag=1))
        unbounded.free([block], float(t))
    assert unbounded.evict_n(2, 11.0) == [100, 101]  # without the budget the other tenant goes first


def test_a_fresh_tag_per_request_gets_round_the_budget_of_no_tag():
    """A client that sends another hint_tag with every request still holds at most the budget in all:
    the oldest retention of all lapses, so another tenant's unhinted blocks keep the rest of the cache."""
    policy = HintedPolicy(make_policy("lru"), budget_blocks=2)
    policy.finish(1, 0.0)
    policy.free([100, 101], 0.0)  # the other tenant, no hint
    for t, block in enumerate(range(10), start=1):
        policy.finish(block, float(t), hint=Hint(retain_s=1000.0, tag=1 + block))
        policy.free([block], float(t))
        assert policy.n_retained <= 2
    assert policy.counters.over_budget == 8
    assert policy.evict_n(10, 11.0) == [100, 101, *range(8)]  # the lapsed ones in the base order, as LRU
    assert set(policy._retained) == {8, 9}


def test_a_retention_longer_than_the_caches_horizon_is_not_honoured():
    """Four evictable blocks, evicted one a second: a block lives about 4 s unhinted there, so a retention
    of 1.5 s is honoured and one of 30 s is not (its blocks go to the base order, counted beyond_horizon).
    A retention granted before the first eviction, when the horizon was unbounded, lapses as soon as its
    time left is longer than the horizon."""
    policy = HintedPolicy(make_policy("lru"))
    policy.finish(1, 0.0, hint=Hint(retain_s=1000.0))
    policy.free([0], 0.0)  # no eviction yet: the horizon is unbounded, every retention honoured
    assert policy.n_retained == 1
    policy.finish(2, 0.0)
    policy.free([1, 2, 3, 4, 5], 0.0)
    policy.evict_n(1, 1.0)
    assert policy.n_retained == 1  # the first eviction, at 1 s: no time since it, the horizon still unbounded
    policy.evict_n(1, 2.0)  # 5 evictable, one evicted in the second since: 0's 998 s left are beyond 5 s
    assert policy.n_retained == 0 and policy.counters.beyond_horizon == 1
    for t in range(3, 5):
        policy.evict_n(1, float(t))  # 1, 2, 3 and 4, one a second since 1 s; 0 went to the base at 2 s
    assert policy.horizon.seconds(len(policy), 5.0) == 2 * (5.0 - 1.0) / 4  # 2 evictable: 5 and 0
    policy.finish(3, 5.0, hint=Hint(retain_s=1.5))
    policy.free([6], 5.0)
    assert policy.n_retained == 1 and policy.counters.beyond_horizon == 1
    policy.finish(4, 5.0, hint=Hint(retain_s=30.0))
    policy.free([7, 8], 5.0)
    assert policy.n_retained == 1 and policy.counters.beyond_horizon == 3
    assert policy.order(5.0) == [5, 0, 7, 8, 6]  # 0, 7 and 8 in the base order (LRU), before the retained
    policy.remove(6)  # a hit
    policy.finish(5, 5.0, hint=Hint(retain_s=30.0))
    policy.free([6], 5.0)  # a retention beyond the horizon keeps the live one, no longer
    assert policy._retention[6][0] == 6.5


def replay_releases(come_back: bool) -> HintedPolicy:
    """Each second an unhinted request of 4 blocks and one of a new session that releases its 4 blocks,
    4 blocks evicted; with ``come_back`` each released session sends another request half a second
    later (4 blocks of its own, no hint), which the base order evicts in its turn."""
    policy = HintedPolicy(make_policy("lru"))
    blocks = iter(range(10_000))

    def request(now: float, hint: Hint | None) -> None:
        held = [next(blocks) for _ in range(4)]
        for block in held:
            policy.access(block, now, hit=False)
        policy.finish(0, now, hint=hint, held=held)
        policy.free(held, now)

    for t in range(1, 40):
        request(float(t), None)
        request(float(t), Hint(release=True, session=t))
        if come_back:
            request(t + 0.5, Hint(session=t))
        policy.evict_n(4 + 4 * come_back, t + 0.75)
    return policy


def test_releases_are_declined_while_their_sessions_come_back_more_often_than_the_base_victims():
    """Releases whose sessions come back at once are judged worse victims than the base order's (sessions
    that never come back): after the first judgements they go to the base order, counted release_declined.
    Releases whose sessions never come back stay honoured."""
    wrong = replay_releases(come_back=True)
    # one release judged just after the first eviction, when the horizon was a fraction of a second
    assert wrong.released_record.share_returned(40.0) > 0.9 and wrong.evicted_record.share_returned(40.0) == 0.0
    assert wrong.counters.release_declined > 30 * 4 and wrong.n_released == 0
    right = replay_releases(come_back=False)
    assert right.released_record.share_returned(40.0) == 0.0
    assert right.counters.release_declined == 0 and right.counters.released_evicted > 30 * 4


def test_hint_checks_and_columns_round_trip():
    with pytest.raises(ValueError, match="contradict"):
        Hint(retain_s=1.0, release=True)
    with pytest.raises(ValueError, match="retain_priority"):
        Hint(priority=100)
    with pytest.raises(ValueError, match="budget"):
        HintedPolicy(make_policy("lru"), budget_blocks=-1)
    import numpy as np

    columns = HintColumns(np.array([0.0, 3.0, 0.0]), np.array([50, 7, 50]), np.array([False, False, True]),
                          np.array([0, 4, 0]), np.array([None, None, None], dtype=object))
    again = HintColumns.of_extra(columns.to_extra(), 3)
    assert "hint_session" not in columns.to_extra()
    assert again.hints() == [None, Hint(3.0, 7, False, 4), Hint(release=True)]
    columns.session[1:] = [0, "chat-9"]  # session 0 is a session; a session alone is a hint
    again = HintColumns.of_extra(columns.to_extra(), 3)
    assert again.hints() == [None, Hint(3.0, 7, False, 4, 0), Hint(release=True, session="chat-9")]
    assert HintColumns.of_extra({"hint_session": np.array([None, 5, None], dtype=object)}, 3).hints() == [
        None, Hint(session=5), None]
    partial = {"retain_s": np.array([None, 2.5, None], dtype=object)}
    assert HintColumns.of_extra(partial, 3).hints() == [None, Hint(2.5), None]
    assert HintColumns.of_extra({"stop": np.array(["a", "b", "c"], dtype=object)}, 3) is None
