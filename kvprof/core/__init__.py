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
numba checks a cached function against its own file only, while these functions share struct
types across files, so importing this package drops every cached function older than the
newest of its sources (:func:`drop_stale_caches`). This module imports no numba, so asking
:func:`has_twin` costs nothing.
"""

from __future__ import annotations

from pathlib import Path

from kvprof.policy import (
    ARCPolicy, BeladyPolicy, LFUPolicy, LRUPolicy, PublishedWorkloadAwarePolicy, S3FIFOPolicy, WorkloadAwarePolicy,
)

#: Reference classes that have a compiled twin.
TWIN_CLASSES = (LRUPolicy, LFUPolicy, S3FIFOPolicy, ARCPolicy, BeladyPolicy, PublishedWorkloadAwarePolicy,
                WorkloadAwarePolicy)


def has_twin(policy) -> bool:
    """Whether ``policy`` (an instance) can run compiled."""
    return type(policy) in TWIN_CLASSES


def drop_stale_caches(package: Path = Path(__file__).parent) -> None:
    """Delete numba's cache files in ``package/__pycache__`` older than the newest ``package/*.py``.

    After an edit or a ``git pull`` that changes one module (a struct's fields, say), functions
    of the other modules cached against the old layout would otherwise load and misbehave.
    A cache directory that cannot be written is left alone.
    """
    newest = max((source.stat().st_mtime for source in package.glob("*.py")), default=0.0)
    for cached in (package / "__pycache__").glob("*.nb[ic]"):
        try:
            if cached.stat().st_mtime < newest:
                cached.unlink()
        except OSError:
            pass  # gone already (another process), or read-only


drop_stale_caches()
