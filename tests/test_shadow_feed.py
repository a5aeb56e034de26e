"""wa's shadows fed a slice at a time: whoever drains them, and when, wa decides the same.

The compiled shadows (:mod:`kvprof.core.shadow`) queue each admission and finish and work
through them :data:`~kvprof.policy.shadow.SHADOW_SLICE` blocks at a time in whichever calls drain
them; ``wa`` reads them :data:`~kvprof.policy.shadow.SHADOW_LAG` operations late. The reference
(:mod:`kvprof.policy.wa`) feeds its shadows at once and reads them as late. Long chains (several
slices) are where the two could part.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.core.twin import CompiledTwin
from kvprof.core.wa import leader
from kvprof.policy.shadow import SHADOW_LAG, SHADOW_SLICE
from kvprof.policy.wa import ORDER_NAMES
from tests.test_policies import LAM, P, wa_policy

CAPACITY = 700


def safety_net():
    return wa_policy(P, LAM, orders=tuple(name for name in ORDER_NAMES if name != "learned"), safety_net=True,
                     capacity=CAPACITY)


#: A request: which of four shared chains its prompt starts with, how long that prefix is, how
#: many blocks of its own follow, and its class.
REQUEST = st.tuples(st.integers(0, 3), st.integers(0, 2 * SHADOW_SLICE + 40), st.integers(1, SHADOW_SLICE + 30),
                    st.integers(0, 3))


def traffic(requests, seed):
    """(kind, request, chain, class) operations: every request admitted, and finished a few
    admissions later with one output block more, in a seeded interleaving."""
    rng = random.Random(seed)
    ops, running, own = [], [], 10_000
    for r, (base, prefix, n_own, cls) in enumerate(requests):
        chain = [base * 5_000 + depth for depth in range(prefix)] + list(range(own, own + n_own))
        own += n_own + 1
        ops.append(("admit", r, chain, cls))
        running.append((r, chain + [own - 1]))
        while running and (len(running) > 3 or rng.random() < 0.4):
            done, full = running.pop(rng.randrange(len(running)))
            ops.append(("finish", done, full, 0))
    ops += [("finish", done, full, 0) for done, full in running]
    return ops


@settings(max_examples=25, deadline=None)
@given(requests=st.lists(REQUEST, min_size=1, max_size=2 * SHADOW_LAG + 10), seed=st.integers(0, 2**16),
       budgets=st.lists(st.integers(0, 3 * SHADOW_SLICE), min_size=1, max_size=8))
def test_sliced_shadows_read_and_end_as_the_reference(requests, seed, budgets):
    """Leader after every operation and shadow hits at the end (all drained): the reference, the
    twin drained only as far as ``wa`` reads, and the twin drained by random budgets in between."""
    reference, lazy, eager = safety_net(), CompiledTwin(safety_net()), CompiledTwin(safety_net())
    for k, (kind, request, chain, cls) in enumerate(traffic(requests, seed)):
        now = float(k)
        for policy in (reference, lazy, eager):
            if kind == "admit":
                policy.admit(request, chain, now, cls, n_lookup=len(chain) - 1, n_blocks=len(chain))
            else:
                policy.finish(request, now, chain, n_blocks=len(chain))
        eager.drain_shadows(budgets[k % len(budgets)])
        assert lazy.reference.order_names[leader(lazy.handle)] == reference.order_name
        assert leader(eager.handle) == leader(lazy.handle)
    hits = reference.shadow_hits()
    for twin in (lazy, eager):
        assert dict(zip(twin.reference.order_names, twin.safety_net()[1].tolist())) == hits


def test_a_long_admission_is_left_for_later_calls():
    """One drain of one slice does not admit a 600-block chain into six shadows; later drains
    finish it, and then the shadows hold the chain (a second request hits all of it but the
    last block, which it computes)."""
    twin = CompiledTwin(safety_net())
    chain = list(range(CAPACITY - 100))
    twin.admit("a", chain, 0.0, 0, n_lookup=len(chain) - 1, n_blocks=len(chain))
    twin.drain_shadows(SHADOW_SLICE)
    assert twin._shadow_work, "a whole 600-block admission in one drain of one slice"
    for _ in range(2 * len(chain) * 6 // SHADOW_SLICE):
        twin.drain_shadows(SHADOW_SLICE)
    assert not twin._shadow_work
    twin.finish("a", 1.0, chain, n_blocks=len(chain))
    twin.admit("b", chain, 2.0, 0, n_lookup=len(chain) - 1, n_blocks=len(chain))
    assert set(twin.safety_net()[1].tolist()) == {len(chain) - 1}
