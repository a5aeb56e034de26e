"""Atomic file writes: a reader sees the old file or the complete new one, never half of one.

Only regular files (or new paths) are replaced. A device, a FIFO or a pipe (``-o /dev/null``, a
named pipe, ``-o /dev/stdout | head``, ``/dev/fd/N``) is written through, as a user naming one
means; anything else that exists and is not a regular file (a directory, a socket) is refused. A symbolic link is followed: its target is
replaced, the link stays. Errors name the path the caller gave, never the hidden temporary file
nor the resolved one. The temporary file is removed on any exception, an interrupt included
(the CLI turns SIGTERM into one, :mod:`kvprof.cli.app`).

The outputs of one run (``results.json`` and its plots) are written as one :func:`staged` group:
each to its temporary file, then all renamed into place together once every one is complete, with
the interrupting signals held back during the renames; an interrupt before then leaves every old
file as it was, one after finds every new one in place.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import signal
import tempfile
import threading
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
    with staged() as group, group.open(path, mode, **kwargs) as handle:
        yield handle


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically; returns the path."""
    with atomic_open(path) as handle:
        handle.write(text)
    return Path(path)


#: The signals that end a CLI command (:mod:`kvprof.cli.app`): held back while a group is renamed.
_INTERRUPTS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class StagedFiles:
    """Files written to temporaries beside their paths, put in place together by :meth:`commit`.

    Invariant: until :meth:`commit` none of the staged paths has changed; :meth:`discard` (any
    exception in :func:`staged`) removes every temporary file.
    """

    def __init__(self, final: bool = False):
        self._pending: list[tuple[str, Path, Path]] = []  # (temporary, target, path as given)
        self._final = final  # a command's last outputs: committed, they are its result whatever comes after

    def stage(self, path: str | os.PathLike) -> Path:
        """A new empty temporary file (0666 less the umask) that becomes ``path`` on commit; write it
        by any means. A device, FIFO or pipe at ``path`` is returned itself, written through."""
        path = Path(path)
        with _naming(path):
            # Asked of the path as given, links followed by the system: /dev/stdout and /dev/fd/N lead to
            # the descriptor's file, a pipe included, which no resolved name (``pipe:[...]``) reaches.
            if _existing_kind(path) == "stream":
                return path
        target = Path(os.path.realpath(path))
        with _naming(path):
            kind = _existing_kind(target)
        if kind == "stream":
            return target
        if kind == "other":
            code = errno.EISDIR if target.is_dir() else errno.EINVAL
            raise OSError(code, "exists and is not a regular file; refusing to replace it", str(path))
        with _naming(path):
            # A name near the file system's limit would make the temporary one too long: keep its start.
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:64]}.", suffix=".tmp")
            self._pending.append((tmp, target, path))
            try:
                os.fchmod(fd, 0o666 & ~_umask())
            finally:
                os.close(fd)
        return Path(tmp)

    @contextlib.contextmanager
    def open(self, path: str | os.PathLike, mode: str = "wb", **kwargs) -> Iterator[IO]:
        """:meth:`stage` ``path`` and open its temporary file for the block; an error of the block's
        writes (a full disk, often met only when the file is closed) names ``path``."""
        path = Path(path)
        with _naming(path), open(self.stage(path), mode, **kwargs) as handle:
            yield handle
            handle.flush()

    def commit(self) -> None:
        """Sync every staged file, then rename all of them into place, interrupts held back meanwhile."""
        for tmp, _, path in self._pending:
            with _naming(path):
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        with _interrupts_held():
            while self._pending:
                tmp, target, path = self._pending[0]
                with _naming(path):
                    os.replace(tmp, target)
                self._pending.pop(0)
            if self._final:  # before an interrupt held back meanwhile is let through
                global final_outputs_written
                final_outputs_written = True

    def discard(self) -> None:
        """Remove the temporary files not yet renamed."""
        for tmp, _, _ in self._pending:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._pending.clear()


#: Whether a command's final outputs (``staged(final=True)``) were all put in place; its driver
#: (:func:`kvprof.cli.common.guarded`) clears it at the start and reads it at an interrupt.
final_outputs_written = False


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Interrupts (SIGINT, SIGTERM, SIGHUP) noted, not acted on, for the block; then acted on as they would have
    been. Python runs its signal handlers in the main thread whichever thread the signal reached (blocking it
    there would not do: a process-directed signal goes to any thread that does not block it), so the block's
    handlers only note; outside the main thread nothing is held (no handler runs there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in _INTERRUPTS}
    held = {sig: handler for sig, handler in previous.items() if handler is not None}  # None: not Python's to set
    for sig in held:
        signal.signal(sig, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        if noted:
            signal.raise_signal(noted[0])  # handled now as it would have been then


@contextlib.contextmanager
def staged(final: bool = False) -> Iterator[StagedFiles]:
    """A :class:`StagedFiles` committed when the block ends cleanly, discarded on any exception;
    ``final``: the command's last outputs (an interrupt once they are in place ends it with success)."""
    group = StagedFiles(final)
    try:
        yield group
        group.commit()
    except OSError as exc:
        given = {tmp: path for tmp, _, path in group._pending}.get(exc.filename)
        group.discard()
        if given is None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(given)) from None  # a write to a temporary: name its file
    except BaseException:
        group.discard()
        raise


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
