"""The pool's compiled content numbering gives the numbers the twin's own (a dict) would."""

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.vllm.numbering import ContentNumbers, RecentContentNumbers


class DictNumbers:
    """The rule of :class:`kvprof.core.twin.CompiledTwin`'s numbering, as a plain dict (the model)."""

    def __init__(self, max_contents: int) -> None:
        self.max_contents = max_contents
        self.ids: OrderedDict = OrderedDict()

    def numbers(self, contents) -> list[int]:
        out = []
        for content in contents:
            if content not in self.ids:
                full = len(self.ids) >= self.max_contents
                self.ids[content] = self.ids.popitem(last=False)[1] if full else len(self.ids)
            out.append(self.ids[content])
        return out


keys = st.binary(min_size=1, max_size=2)  # few distinct keys, so chains repeat them (vLLM's keys are bytes)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50), st.lists(st.lists(keys, max_size=30), max_size=30))
def test_numbers_follow_the_twins_rule_with_recycling(max_contents, chains):
    compiled, model = ContentNumbers(max_contents), DictNumbers(max_contents)
    for chain in chains:
        if len(chain) == 1:  # (decode numbers one content a call)
            assert compiled.number(chain[0]) == model.numbers(chain)[0]
        else:
            assert compiled.numbers(chain).tolist() == model.numbers(chain)
    assert len(compiled) == len(model.ids)


def test_a_long_run_recycles_oldest_first_and_keeps_the_table_bounded():
    compiled, model = ContentNumbers(1000), DictNumbers(1000)
    for start in range(0, 20000, 700):
        chain = [b"k%d" % i for i in range(start, start + 900)] + [b"k%d" % (start // 2)]
        assert compiled.numbers(chain).tolist() == model.numbers(chain)
    assert len(compiled) == 1000
    assert compiled.size <= 4096  # at most half full, never more than twice the bound rounded up


def test_clear_restarts_at_zero():
    numbers = ContentNumbers(10)
    numbers.numbers([b"a", b"b"])
    numbers.clear()
    assert numbers.numbers([b"b", b"a", b"b"]).tolist() == [0, 1, 0]


class RecentDictNumbers:
    """The live counterfactual's numbering before it was compiled: an OrderedDict in recency order (the model)."""

    def __init__(self, max_contents: int) -> None:
        self.max_contents = max_contents
        self.ids: OrderedDict = OrderedDict()

    def renumber(self, contents) -> tuple[list[int], list[int]]:
        out, recycled = [], []
        for content in contents:
            if content in self.ids:
                self.ids.move_to_end(content)
            elif len(self.ids) < self.max_contents:
                self.ids[content] = len(self.ids)
            else:
                recycled.append(self.ids.popitem(last=False)[1])
                self.ids[content] = recycled[-1]
            out.append(self.ids[content])
        return out, recycled


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50), st.lists(st.lists(keys, max_size=30), max_size=30))
def test_recent_numbers_recycle_the_least_recently_seen_as_the_dict_did(max_contents, chains):
    compiled, model = RecentContentNumbers(max_contents), RecentDictNumbers(max_contents)
    for chain in chains:
        if len(chain) == 1:
            assert compiled.number(chain[0]) == model.renumber(chain)[0][0]
        else:
            numbers, recycled = compiled.renumber(chain)
            assert (numbers.tolist(), recycled.tolist()) == model.renumber(chain)
    assert len(compiled) == len(model.ids)


def test_recent_numbers_keep_what_is_looked_up_and_stay_bounded():
    compiled, model = RecentContentNumbers(1000), RecentDictNumbers(1000)
    hot = [b"hot%d" % i for i in range(100)]
    for start in range(0, 20000, 700):
        chain = hot + [b"k%d" % i for i in range(start, start + 900)]
        numbers, recycled = compiled.renumber(chain)
        assert (numbers.tolist(), recycled.tolist()) == model.renumber(chain)
        assert numbers[:100].tolist() == list(range(100))  # the hot prefix is never the least recent
    assert len(compiled) == 1000
    assert compiled.size <= 4096 and len(compiled._older) <= 1000
    compiled.clear()
    assert compiled.numbers([b"b", b"a", b"b"]).tolist() == [0, 1, 0]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2), st.lists(st.lists(keys, max_size=40), max_size=40))
def test_numbers_are_the_same_while_a_grown_table_fills(max_contents, move_min, chains):
    """With the outgrown table's slots moved, and the next tables made ready, a few per call, both rules
    still number as their models."""
    for compiled, model in ((ContentNumbers(max_contents), DictNumbers(max_contents)),
                            (RecentContentNumbers(max_contents), RecentDictNumbers(max_contents))):
        compiled.move_min = move_min
        compiled.ready_min = move_min
        for chain in chains:
            got = compiled.renumber(chain) if isinstance(compiled, RecentContentNumbers) else compiled.numbers(chain)
            want = model.renumber(chain) if isinstance(model, RecentDictNumbers) else model.numbers(chain)
            assert (tuple(x.tolist() for x in got) if isinstance(got, tuple) else got.tolist()) == \
                (tuple(want) if isinstance(want, tuple) else want)
        assert len(compiled) == len(model.ids)


@pytest.mark.parametrize("recent", [False, True])
def test_a_grown_table_fills_over_many_calls_and_the_old_one_goes(recent):
    """A table that doubles moves its old entries over several calls (never one rehash), recycles from either
    table meanwhile, and drops the old one once all moved."""
    compiled, model = (RecentContentNumbers(1500), RecentDictNumbers(1500)) if recent else \
        (ContentNumbers(1500), DictNumbers(1500))
    compiled.move_min = 16
    calls_mid_move = 0
    for start in range(0, 12000, 97):
        chain = [b"k%d" % i for i in range(start, start + 120)] + [b"k%d" % (start // 3)]
        got = compiled.numbers(chain).tolist()
        want = model.renumber(chain)[0] if recent else model.numbers(chain)
        assert got == want
        calls_mid_move += len(compiled._old) > 0
    assert calls_mid_move >= 5
    assert compiled.size <= 4096
    for _ in range(200):  # lookups alone finish the move
        compiled.numbers([b"k0"])
    assert len(compiled._old) == 0


@pytest.mark.parametrize("recent", [False, True])
def test_the_next_tables_are_made_ready_over_many_calls_and_stay_exact(recent):
    """The tables that replace the full ones are written a little per call before the table doubles; a number
    relinked (recent) or handed out meanwhile below what was copied reaches the next tables too."""
    compiled, model = (RecentContentNumbers(3000), RecentDictNumbers(3000)) if recent else \
        (ContentNumbers(3000), DictNumbers(3000))
    compiled.ready_min = 0
    calls_mid_way = doublings = 0
    size = compiled.size
    for k in range(9000):
        chain = [b"k%d" % k, b"k%d" % (k * 7 % (k + 1))]  # a new content and one seen before
        got = compiled.numbers(chain).tolist()
        assert got == (model.renumber(chain)[0] if recent else model.numbers(chain))
        ready = len(compiled._next["_number_fp"])
        calls_mid_way += 0 < compiled._copied < ready
        doublings += compiled.size > size
        size = compiled.size
        assert all(len(getattr(compiled, name)) == min(size // 2, 3000) for name, _, _ in compiled.BY_NUMBER)
    assert doublings >= 5 and calls_mid_way >= 50
