"""Interrupts around compiled code: an interrupt is always a ``KeyboardInterrupt``, never a ``SystemError``.

Compiled (numba) loops never run Python's signal handlers: a SIGINT or SIGTERM that arrives
during one is only flagged, and its handler runs at the first Python code after it, which may be
while numba boxes the call's result. The handler's exception (``KeyboardInterrupt``, or the CLI's
``Terminated``) is then set beside a returned result, and CPython reports ``SystemError:
CPUDispatcher(...) returned a result with an exception set``, the interrupt as its cause.
:func:`compiled_call` gives the interrupt back as itself. Long replays call compiled code in
chunks (:mod:`kvprof.core.timed`, :mod:`kvprof.core.engine`), so that the handler runs within one.
"""

from __future__ import annotations

from collections.abc import Callable


def compiled_call(function: Callable, *args):
    """``function(*args)``; an interrupt that arrived during it is raised as itself."""
    try:
        return function(*args)
    except SystemError as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):
            raise exc.__cause__ from None
        raise
