"""Where numba keeps kvprof's compiled code when neither of its own places is writable.

kvprof's compiled functions are declared ``cache=True``; numba keeps them beside the source
(``__pycache__``) or in the user's cache (``~/.cache``), and with neither writable (a read-only
package and HOME) it refuses the declaration itself: ``cannot cache function ...: no locator
available``. :class:`ThisRunOnly`, numba's last resort (:func:`register`, done on importing
kvprof), compiles into a temporary directory of this run instead, removed when it ends: the code is
compiled anew in each run, and a one-line note says so and how to keep it.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile

#: numba's own locators, tried first and in its order (numba.core.caching.CacheImpl._locator_classes).
_NUMBA_LOCATORS = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator", "IPythonCacheLocator",
                   "ZipCacheLocator")
_SETTING = "NUMBA_CACHE_LOCATOR_CLASSES"


def register() -> None:
    """Make :class:`ThisRunOnly` numba's last locator, unless the locators are chosen already."""
    os.environ.setdefault(_SETTING, ",".join((*_NUMBA_LOCATORS, f"{__name__}.ThisRunOnly")))
    config = sys.modules.get("numba.core.config")
    if config is not None and not getattr(config, "CACHE_LOCATOR_CLASSES", None):  # numba read its settings already
        config.CACHE_LOCATOR_CLASSES = os.environ[_SETTING]


_run_directory: str | None = None


def _this_run_directory() -> str:
    """A temporary directory for this run's compiled code, made on first use and removed at exit; child
    processes (parallel replays) share it through ``NUMBA_CACHE_DIR`` and say nothing more."""
    global _run_directory
    if _run_directory is None:
        _run_directory = tempfile.mkdtemp(prefix="kvprof-numba-")
        atexit.register(shutil.rmtree, _run_directory, ignore_errors=True)
        os.environ["NUMBA_CACHE_DIR"] = _run_directory
        sys.stderr.write("note: no writable numba cache (the package's __pycache__, ~/.cache): kvprof's compiled code "
                         "is compiled anew in each run; set NUMBA_CACHE_DIR to a writable directory to keep it\n")
    return _run_directory


@functools.cache
def _locator_class():
    from numba.core.caching import UserProvidedCacheLocator

    class ThisRunOnly(UserProvidedCacheLocator):
        """numba's locator of ``NUMBA_CACHE_DIR``, pointed at this run's temporary directory."""

        def __init__(self, py_func, py_file):
            super().__init__(py_func, py_file)
            self._cache_path = os.path.join(_this_run_directory(), self.get_suitable_cache_subpath(py_file))

        @classmethod
        def from_function(cls, py_func, py_file):
            return super(UserProvidedCacheLocator, cls).from_function(py_func, py_file)

    return ThisRunOnly


def __getattr__(name: str):
    # numba imports the locator by name only when its own have all failed: numba is loaded by then
    if name == "ThisRunOnly":
        return _locator_class()
    raise AttributeError(name)
