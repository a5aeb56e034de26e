"""Atomic file writes: a reader sees the old file or the complete new one, never half of one.

Only regular files (or new paths) are replaced. A device or a FIFO (``-o /dev/null``, a named
pipe) is written through, as a user naming one means; anything else that exists and is not a
regular file (a directory, a socket) is refused. A symbolic link is followed: its target is
replaced, the link stays. Errors name the path the caller gave, never the hidden temporary file
nor the resolved one. The temporary file is removed on any exception, an interrupt included
(the CLI turns SIGTERM into one, :mod:`kvprof.cli.app`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside ``path`` that replaces ``path`` when the block ends cleanly.

    On an exception the temporary file is removed and any previous ``path`` stays intact. The
    file gets the usual permissions (0666 less the umask), not mkstemp's private 0600. A
    character device or FIFO at ``path`` is opened and written directly (it cannot be replaced).

    Parameters
    ----------
    path : path-like
    mode : {"w", "wb"}

    Raises
    ------
    OSError
        ``path`` is a directory or another file that is neither regular, a device nor a FIFO, or
        the write failed; ``filename`` is ``path``.
    """
    path = Path(path)
    kwargs = {} if "b" in mode else {"encoding": "utf-8"}
    target = Path(os.path.realpath(path))
    with _naming(path):
        kind = _existing_kind(target)
    if kind == "stream":
        with _naming(path):
            handle = open(target, mode, **kwargs)  # noqa: SIM115 - closed below
        with handle:
            yield handle
        return
    if kind == "other":
        code = errno.EISDIR if target.is_dir() else errno.EINVAL
        raise OSError(code, "exists and is not a regular file; refusing to replace it", str(path))
    tmp = None
    try:
        with _naming(path):
            # A name near the file system's limit would make the temporary one too long: keep its start.
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:64]}.", suffix=".tmp")
            os.fchmod(fd, 0o666 & ~_umask())
        with open(fd, mode, **kwargs) as handle:
            yield handle
            with _naming(path):
                handle.flush()
                os.fsync(handle.fileno())
        with _naming(path):
            os.replace(tmp, target)
    except BaseException:
        if tmp is not None:
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically; returns the path."""
    with atomic_open(path) as handle:
        handle.write(text)
    return Path(path)


def _existing_kind(target: Path) -> str | None:
    """None (no such file), ``"regular"``, ``"stream"`` (character device, FIFO) or ``"other"``."""
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return "regular"
    return "stream" if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) else "other"


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Re-label an operating-system error (about the temporary file, its directory) with the caller's path."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from None
