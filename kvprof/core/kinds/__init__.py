"""The compiled twins' kinds: one module per twin, each with its own named state and operations.

A module here is one kind of :class:`kvprof.core.policies.Core`: it declares the struct fields
it owns (``FIELDS``, named after the kind, so no field means two things), how its tables start
(``init``) and grow (``reserve``), its part of the protocol (``access``, ``free``, ``evict``
and, where it needs one, ``remove``), and in plain Python how a core is shaped from a reference
instance (``lists``) and, for a kind with parameters, configured (``configure``).
:mod:`kvprof.core.policies` assembles the struct from every module's ``FIELDS`` and dispatches
each operation with one ``if kind ==`` line per kind (numba compiles calls, it does not look
functions up at run time).

Kind numbers are the twins' order in :data:`kvprof.registry.REGISTERED`; nothing stores them.
"""

from __future__ import annotations

import importlib

from kvprof import registry

#: Twin module names, a kind's number being its index.
NAMES = registry.twins()
KIND = {name: number for number, name in enumerate(NAMES)}


def module(name: str):
    """The module of the kind ``name``."""
    return importlib.import_module(f"kvprof.core.kinds.{name}")
