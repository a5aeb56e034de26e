"""kvprof's compiled core: every policy's compiled twin, the simulator's tiers and replay loop.

The pure-Python policies of :mod:`kvprof.policy` are the reference; each has a twin here that
keeps its state in numpy arrays inside numba structrefs and makes the same decisions
(differential tests hold them to it). The simulator replays a whole trace in compiled code
(:mod:`kvprof.core.engine`); :class:`kvprof.core.twin.CompiledTwin` puts a twin behind the
:class:`~kvprof.policy.base.EvictionPolicy` interface.

Layout: :mod:`~kvprof.core.structs` (linked lists, heap), :mod:`~kvprof.core.policies` (one
core per single-structure policy), :mod:`~kvprof.core.policy` (``wa``'s followed cores, shadows
and leader around a core), :mod:`~kvprof.core.build` (twins from reference instances),
:mod:`~kvprof.core.tiers` (GPU and CPU tiers), :mod:`~kvprof.core.engine` (the replay loop).

Compiled code is cached on disk beside these modules (numba's ``cache=True``): the first use
after installing compiles it once (about a minute on two cores), later processes load it.
This module imports no numba, so asking :func:`has_twin` costs nothing.
"""

from __future__ import annotations

from kvprof.policy import (
    ARCPolicy, BeladyPolicy, LFUPolicy, LRUPolicy, PublishedWorkloadAwarePolicy, S3FIFOPolicy, WorkloadAwarePolicy,
)

#: Reference classes that have a compiled twin.
TWIN_CLASSES = (LRUPolicy, LFUPolicy, S3FIFOPolicy, ARCPolicy, BeladyPolicy, PublishedWorkloadAwarePolicy,
                WorkloadAwarePolicy)


def has_twin(policy) -> bool:
    """Whether ``policy`` (an instance) can run compiled."""
    return type(policy) in TWIN_CLASSES
