"""The twin's numbered entry points (what the vLLM pool calls) decide as its keyed ones do.

The pool passes a hit block's remembered content number (:meth:`CompiledTwin.remembered`) instead of
looking its key up again (and no content at all, -1, to a twin whose decisions read none:
:attr:`CompiledTwin.reads_contents`), and a request's chain as numbers it kept (:meth:`CompiledTwin.numbers`,
``admit_numbered``, ``finish_numbered``); driven that way, the twin must still evict what the
reference policy evicts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.twin import CompiledTwin
from kvprof.policy.base import finished_size, request_sizes
from tests.test_core_policies import WA_VARIANTS, run_side_by_side
from tests.test_policies import OPS, build


class NumberedTwin(CompiledTwin):
    """A twin driven only through the numbered entry points, as :class:`KvprofBlockPool` drives it."""

    def access(self, block, now, workload=0, depth=0, *, hit=False, next_use=np.inf, content=None):
        blocks = np.array([block], dtype=np.int64)
        numbers = self.numbers([content]) if self.reads_contents else np.full(1, -1, dtype=np.int64)  # as the pool
        if hit:
            remembered = self.remembered(blocks)
            assert remembered is not None and remembered.tolist() == numbers.tolist()  # a hit's content is unchanged
            numbers = remembered
        self.access_numbered(blocks, np.array([depth], dtype=np.int64), numbers, now, workload, hit=hit)

    def admit(self, request, contents, now, workload=0, *, n_lookup=None, n_blocks=None):
        n_lookup, n_blocks = request_sizes(contents, n_lookup, n_blocks)
        self.admit_numbered(request, self.numbers(contents), now, workload, n_lookup=n_lookup, n_blocks=n_blocks)

    def finish(self, request, now, contents=None, *, n_blocks=None, n_output=None, finish=None):
        n_blocks = finished_size(contents, n_blocks)
        self.finish_numbered(request, now, self.numbers(() if contents is None else contents), n_blocks=n_blocks,
                             n_output=n_output, finish=finish)


@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc", "finish-reason", "wa+shadows", "wa default orders",
                                  "wa every order"])
@settings(max_examples=25, deadline=None)
@given(ops=OPS, num_blocks=st.integers(4, 24))
def test_the_numbered_twin_evicts_what_the_reference_evicts(name, ops, num_blocks):
    builder = WA_VARIANTS.get(name, lambda: build(name))
    run_side_by_side(builder(), NumberedTwin(builder()), ops, num_blocks)


def test_remembered_is_none_for_a_block_never_accessed():
    twin = CompiledTwin(build("first-turn"), 8)  # reads contents, which the twin (not its core) keeps
    assert twin.reads_contents and not twin._contents_in_core
    twin.access(2, 0.0, content="a")
    assert twin.remembered(np.array([2], dtype=np.int64)).tolist() == twin.numbers(["a"]).tolist()
    assert twin.remembered(np.array([2, 3], dtype=np.int64)) is None
    assert twin.remembered(np.array([100], dtype=np.int64)) is None
    twin.clear()
    assert twin.remembered(np.array([2], dtype=np.int64)) is None


@pytest.mark.parametrize("name, reads", [("lru", False), ("lfu", False), ("sieve", False), ("s3fifo", True),
                                         ("arc", True), ("first-turn", True), ("wa", True)])
def test_a_twin_says_whether_its_decisions_read_contents(name, reads):
    """What the pool relies on to number no content for lru, lfu and sieve (their cores take none)."""
    twin = CompiledTwin(WA_VARIANTS["wa+shadows"]() if name == "wa" else build(name), 8)
    assert twin.reads_contents is reads
    if not reads:
        twin.access(2, 0.0, content="a")
        assert twin.remembered(np.array([2, 5], dtype=np.int64)).tolist() == [-1, -1]
