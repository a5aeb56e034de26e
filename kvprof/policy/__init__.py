"""Eviction policies, one module each, behind :class:`kvprof.policy.base.EvictionPolicy`."""
