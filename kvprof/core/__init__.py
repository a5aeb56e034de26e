"""kvprof's compiled core: every policy's compiled twin, the simulator's tiers and replay loop.

The pure-Python policies of :mod:`kvprof.policy` are the reference; each has a twin here that
keeps its state in numpy arrays inside numba structrefs and makes the same decisions
(differential tests hold them to it). The simulator replays a whole trace in compiled code
(:mod:`kvprof.core.engine`); :class:`kvprof.core.twin.CompiledTwin` puts a twin behind the
:class:`~kvprof.policy.base.EvictionPolicy` interface.

Layout: :mod:`~kvprof.core.structs` (linked lists, heap), :mod:`~kvprof.core.kinds` (one module
per twin: its state and rules), :mod:`~kvprof.core.policies` (the core struct of every kind and
its protocol), :mod:`~kvprof.core.dispatch` (each operation by kind, generated from the registry),
:mod:`~kvprof.core.wa` (``wa``'s followed cores, shadows and leader around a core),
:mod:`~kvprof.core.build` (twins from reference instances), :mod:`~kvprof.core.tiers` (GPU and
CPU tiers), :mod:`~kvprof.core.engine` (the replay loop).

Compiled code is cached on disk beside these modules (numba's ``cache=True``): the first use
after installing compiles it once (about a minute on two cores), later processes load it.
numba checks a cached function against its own file only, while these functions share struct
types across files, so importing this package drops every cached function older than the
newest of its sources and of the registry that numbers the kinds (:func:`drop_stale_caches`).
This module imports no numba, so asking :func:`has_twin` costs nothing.
"""

from __future__ import annotations

from pathlib import Path

from kvprof.policy import REGISTERED

#: Reference classes that have a compiled twin: every registered class (:data:`kvprof.registry.REGISTERED`).
TWIN_CLASSES = tuple(dict.fromkeys(REGISTERED.values()))
#: Sources whose change makes every cached function stale besides the package's own: the registry
#: numbers the kinds the dispatch compares with.
REGISTRY_SOURCE = Path(__file__).parent.parent / "registry.py"


def has_twin(policy) -> bool:
    """Whether ``policy`` (an instance) can run compiled."""
    return type(policy) in TWIN_CLASSES


def drop_stale_caches(package: Path = Path(__file__).parent, also: tuple[Path, ...] = ()) -> None:
    """Delete numba's cache files of ``package`` and its subpackages older than the newest of
    their ``*.py`` files and of ``also``.

    After an edit or a ``git pull`` that changes one module (a struct's fields, say), functions
    of the other modules cached against the old layout would otherwise load and misbehave. The
    cache is next to the sources (``__pycache__``), or where numba puts it when that cannot be
    written or ``NUMBA_CACHE_DIR`` says so (:func:`cache_directories`). A cache directory that
    cannot be written is left alone.
    """
    packages = [package, *(init.parent for init in sorted(package.glob("*/__init__.py")))]
    sources = [source for directory in packages for source in directory.glob("*.py")]
    newest = max((source.stat().st_mtime for source in [*sources, *also] if source.exists()), default=0.0)
    for directory in (cache for directory in packages for cache in cache_directories(directory)):
        for cached in directory.glob("*.nb[ic]"):
            try:
                if cached.stat().st_mtime < newest:
                    cached.unlink()
            except OSError:
                pass  # gone already (another process), or read-only


def cache_directories(package: Path) -> list[Path]:
    """Where numba may cache the functions of ``package``: its ``__pycache__``, and the directory
    numba derives from the package's path under ``NUMBA_CACHE_DIR`` and under the per-user cache."""
    import hashlib
    import os

    source_dir = os.path.abspath(package)
    subpath = f"{os.path.basename(source_dir)}_{hashlib.sha1(source_dir.encode()).hexdigest()}"
    roots = [os.environ.get("NUMBA_CACHE_DIR"),
             os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "numba")]
    return [package / "__pycache__", *(Path(root) / subpath for root in roots if root)]


drop_stale_caches(also=(REGISTRY_SOURCE,))
