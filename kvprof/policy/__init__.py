"""Eviction policies, one module each, behind :class:`kvprof.policy.base.EvictionPolicy`.

``POLICIES`` maps each command-line name to its class, in the order of :data:`kvprof.registry.REGISTERED`
(where a policy is registered); :func:`make_policy` builds one by name; :func:`live_policies` are
those a server can run. Every registered class is also exported here under its own name
(``from kvprof.policy import LRUPolicy``), read from the registry, so no policy is named here.
"""

from __future__ import annotations

import importlib

from kvprof import registry
from kvprof.policy.base import EvictionPolicy


def reference_class(registration: registry.Registration) -> type[EvictionPolicy]:
    """The reference class a registration names (``"module:Class"`` under ``kvprof.policy``)."""
    module, _, name = registration.reference.partition(":")
    return getattr(importlib.import_module(f"kvprof.policy.{module}"), name)


#: Every registered class by its name, those built only by another policy (``learned``) included.
REGISTERED: dict[str, type[EvictionPolicy]] = {r.name: reference_class(r) for r in registry.REGISTERED}
POLICIES: dict[str, type[EvictionPolicy]] = {r.name: REGISTERED[r.name] for r in registry.by_name()}
globals().update({cls.__name__: cls for cls in REGISTERED.values()})


def live_policies() -> list[str]:
    """The policies a live server can run: every named one that does not need the future."""
    return [r.name for r in registry.live()]


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
    "REGISTERED",
    "EvictionPolicy",
    "live_policies",
    "make_policy",
    "reference_class",
    *sorted({cls.__name__ for cls in REGISTERED.values()}),
]
