"""Eviction policies, one module each, behind :class:`kvprof.policy.base.EvictionPolicy`.

``POLICIES`` maps each command-line name to its class; :func:`make_policy` builds one by name.
"""

from __future__ import annotations

from kvprof.policy.arc import ARCPolicy
from kvprof.policy.base import EvictionPolicy
from kvprof.policy.belady import BeladyPolicy
from kvprof.policy.lfu import LFUPolicy
from kvprof.policy.lru import LRUPolicy
from kvprof.policy.s3fifo import S3FIFOPolicy
from kvprof.policy.wa import WorkloadAwarePolicy
from kvprof.policy.wa_paper import PublishedWorkloadAwarePolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (
        LRUPolicy, WorkloadAwarePolicy, PublishedWorkloadAwarePolicy, LFUPolicy, S3FIFOPolicy, ARCPolicy, BeladyPolicy
    )
}


def make_policy(name: str, hp=None, capacity: int | None = None, **kwargs) -> EvictionPolicy:
    """Build the policy registered as ``name``.

    Parameters
    ----------
    name : str
        A key of :data:`POLICIES`.
    hp : kvprof.models.hp.HpFile or None
        The hyperparameter file; required by the policies that have ``from_hp`` (``wa``,
        ``wa-paper``), ignored by the others.
    capacity : int or None
        Blocks of the cache the policy will order: ``wa`` takes the hp file's tuning for the
        nearest tuned capacity.
    **kwargs
        Passed on to ``from_hp`` or to the constructor (e.g. ``small_ratio`` for ``s3fifo``).

    Raises
    ------
    ValueError
        For an unknown name, or a policy that needs an hp file when none is given.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None
    if hasattr(cls, "from_hp"):
        if hp is None:
            raise ValueError(f"policy {name!r} needs an hp file (write one with `kvprof fit`)")
        return cls.from_hp(hp, capacity=capacity, **kwargs) if getattr(cls, "tunable", False) else cls.from_hp(hp, **kwargs)
    return cls(**kwargs)


__all__ = [
    "POLICIES",
    "ARCPolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PublishedWorkloadAwarePolicy",
    "S3FIFOPolicy",
    "WorkloadAwarePolicy",
    "make_policy",
]
