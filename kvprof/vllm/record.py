"""``vllm serve --kv-record DIR``: the served requests written as a trace kvprof reads.

The scheduler thread hands each finished request to :meth:`Recorder.submit`, which only appends a
tuple of references to a bounded :class:`~kvprof.vllm.handoff.Handoff` (``benchmarks/bench_live.py``)
and never blocks: a full one drops the record and counts it. One writer thread does the rest: block
hashes to ids, JSON, zstd, files, ``recording.json`` (:mod:`kvprof.recording` describes the layout).

What an id reveals. ``hash_ids[i]`` is a keyed BLAKE2b of vLLM's hash of block ``i`` (which chains
the prompt's tokens up to the end of that block with the request's cache salt and extra keys),
63 bits, under a random key that exists only in the server's memory. Two ids are equal when (and,
up to a 2**-63 chance per pair, only when) vLLM's hashes are, so a recording shows which requests
shared how long a prefix, and nothing else of the text: no token, no text and no hash that
could be recomputed from a guessed prompt leaves the server. The key changes with every server
start: ids of different starts never match, exactly as the server's cache never outlives a
restart. The trailing partial block gets a fresh random id.

A fleet's servers may share one key instead (``--kv-record-key FILE``, or the environment's
:data:`RECORD_KEY_ENV`; :func:`shared_key`): the first server creates the file, the others read
it, and the same prefix gets the same id on every server (vLLM's default sha256 block hashes
do not depend on the process), so ``kvprof fleet DIR1 DIR2`` can route the recordings exactly.
``recording.json`` keeps only the key's fingerprint (``key_id``), never the key.

Stops. vLLM's default shutdown (``mode=abort``, ``--shutdown-timeout 0``) sends the engine core
SIGTERM and SIGKILL back to back, so nothing in it can be relied on to finish the open file. The
recorder therefore starts a guard process (``python -m kvprof.vllm.record --guard``) that ignores
signals and waits for the engine core to go; if the recorder did not close itself, the guard
finishes what it left (cut after the last closed frame, renamed, counted in ``recording.json``).
Counts are saved just after every closed frame, so ``written`` holds after any stop, ``kill -9``
included, except that a kill between a frame's sync and the save leaves it one frame short (the
reader then counts nothing missing); a start finishes what a guard could not (killed with the rest
of a container).
"""

from __future__ import annotations

import hashlib
import fcntl
import json
import logging
import math
import os
import re
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import zstandard

import kvprof
from kvprof.recording import (
    DROP_REASONS, FILE, FINISHED_SUFFIX, OPEN_SUFFIX, PROBE_TAG, Recording, RecordingError, Reload, Start,
    complete_frames, finish_abandoned, finished_name, load_recording, locked, save_recording, trace_files,
)
from kvprof.models.finish import FINISH_FIELD, UNKNOWN
from kvprof.models.hints import HINT_FIELDS, SESSION_FIELD, hint_of_args
from kvprof.profiler.records import GROWN, OUTPUT_HASH_IDS
from kvprof.vllm.finish import stop_value
from kvprof.vllm.handoff import Handoff

logger = logging.getLogger("vllm.kvprof")

#: Fields of a trace line that a client tag must not replace (its value is dropped and counted).
RESERVED = frozenset({"chat_id", "parent_chat_id", "timestamp", "input_length", "output_length", "type", "turn",
                      "hash_ids", "scheduled", "finished", "finish_reason", "cached_tokens", "session", "rank",
                      OUTPUT_HASH_IDS, GROWN})
#: Tags that name a conversation, the first given wins: a request's parent is the previous finished request of
#: it. ``hint_session`` is the hint layer's name (docs/hints.md): a client that names its conversations by it
#: alone gets sessions in the recording too, so the fit measures their returns (its ``retention``).
SESSION_TAGS = ("session", SESSION_FIELD)
#: Seconds the writer sleeps when it has nothing to write.
_POLL_S = 0.05
#: The writer's work on one record in slices with a pause between them: a 128k-token prompt's ids,
#: JSON and compression hold the GIL ~8 ms in one piece, and the scheduler thread waiting for it
#: would get it only after Python's switch interval (5 ms). A pause (a real sleep: ``sleep(0)``
#: returns before a waiting thread wakes) hands it over within about a slice, ~0.15 ms.
_IDS_PER_SLICE = 128
_BYTES_PER_SLICE = 1 << 14
_SLICE_PAUSE_S = 5e-5
_SESSIONS_KEPT = 1 << 20


def _in_slices(sequence, size: int):
    """``sequence`` a slice of ``size`` at a time, with a pause (:data:`_SLICE_PAUSE_S`) between slices."""
    for start in range(0, len(sequence), size):
        if start:
            time.sleep(_SLICE_PAUSE_S)
        yield sequence[start:start + size]


class Recorder:
    """Writes finished requests to ``directory`` from one background thread.

    Invariants: :meth:`submit` never blocks and never raises (a record it cannot queue is counted
    under ``dropped["queue_full"]``); only the writer thread touches files, ids and sessions;
    every record handed to the thread is either written, counted as dropped or a replay's test
    request (tagged :data:`~kvprof.recording.PROBE_TAG`, left out); a finished file
    (``.jsonl.zst``) is complete, the open one (``.part``, held locked) ends with a closed zstd
    frame at most ``flush_s`` seconds old, and ``recording.json`` counts what the closed frames hold.

    Parameters
    ----------
    directory : path
        The recording directory (created if missing; a ``recording.json`` there is continued).
    block_size : int
        The server's KV-cache block size: tokens per hash id.
    start : dict
        This server start's fields of :class:`kvprof.recording.Start` other than ``time``,
        ``chat_id_base``, ``written`` and ``dropped`` (model, versions, num_gpu_blocks, policy, ...).
    rotate_s : float
        Seconds per file; a file is closed and renamed when it is that old.
    flush_s : float
        Seconds between closed zstd frames (what a ``kill -9`` can lose).
    queue_size : int
        Records waiting for the writer at most.
    guard : bool
        Start the guard process that finishes the open file if the engine core dies unclosed.
    clock : callable
        Seconds since the epoch; the same clock as vLLM's ``Request.arrival_time``.

    Raises
    ------
    RecordingError
        ``directory`` cannot be used: not creatable or writable, a corrupt ``recording.json``, or one
        recorded at another block size.
    """

    def __init__(self, directory, *, block_size: int, start: dict, rotate_s: float = 3600.0, flush_s: float = 2.0,
                 queue_size: int = 65536, guard: bool = True, clock=time.time,
                 key_file: str | None = None) -> None:
        self.directory = Path(directory)
        self.block_size = block_size
        self.rotate_s = rotate_s
        self.flush_s = flush_s
        self._clock = clock
        self._queue = Handoff(queue_size)
        key_file = key_file or os.environ.get(RECORD_KEY_ENV) or None
        # A fresh secret key per start unless the fleet shares one; copying a keyed hasher is a quarter
        # cheaper than keying one per block.
        key = secrets.token_bytes(KEY_BYTES) if key_file is None else shared_key(key_file)
        self._keyed = hashlib.blake2b(digest_size=8, key=key)
        self._sessions: OrderedDict = OrderedDict()  # session tag -> (chat_id, turn) of its last record
        self._index = 0  # this start's entry in recording.json
        self.recording = self._open_recording({**start, "key_id": None if key_file is None else key_id(key)})
        self.start = self.recording.starts[self._index]
        self._next_chat_id = self.start.chat_id_base
        self._use_guard = guard
        self._guard: subprocess.Popen | None = None
        self._saved = None  # the counts recording.json holds
        self._reloads_unsaved = False  # a reload not yet in recording.json
        self._file_lines = 0  # lines in the closed frames of the open file
        self._file = None
        self._writer = None
        self._path: Path | None = None
        self._file_started = 0.0
        self._last_flush = 0.0
        self._unflushed = 0  # records in the current, unclosed frame
        self._disk_failed_at = -math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvprof-recorder", daemon=True)

    # -- scheduler thread -----------------------------------------------------------------
    def submit(self, request, scheduled: float | None, cached_tokens: int, finished: float, code: int = UNKNOWN,
               grown_at: list[float] = ()) -> None:
        """Queue a finished vLLM ``Request`` that found ``cached_tokens`` of its prompt in the
        prefix cache, ended as finish ``code`` says (:mod:`kvprof.vllm.finish`) and took blocks after
        its first ones at the times ``grown_at`` (references only; never blocks, never raises)."""
        try:
            params = request.sampling_params
            taken = self._queue.put((
                request.arrival_time, scheduled, finished, request.num_prompt_tokens, request.num_output_tokens,
                request.get_finished_reason(), params.extra_args if params is not None else None,
                request.block_hashes, cached_tokens, code, grown_at,
            ))
        except Exception:  # noqa: BLE001 - a record must never disturb serving
            self.start.dropped["error"] += 1
            return
        if not taken:
            self.start.dropped["queue_full"] += 1

    def reloaded(self, sha256: str, path: str) -> None:
        """The hp file ``path`` (as the server was given it), of bytes ``sha256``, is in force from
        now on: a reload, which ``recording.json`` lists with its time (never raises)."""
        self.start.reloads.append(Reload(time=round(self._clock() - self.recording.origin, 6), sha256=sha256,
                                         path=path))
        self._reloads_unsaved = True  # saved by the writer thread, the one that writes recording.json

    # -- lifecycle ------------------------------------------------------------------------
    def begin(self) -> Recorder:
        if self._use_guard:
            self._guard = _start_guard(self.directory)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, close and rename the open file, update ``recording.json``."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout)
        guard, self._guard = self._guard, None
        if guard is not None:
            try:  # "closed": the guard has nothing to finish (unless the writer is stuck: then it finds the file held)
                guard.communicate(b"" if self._thread.is_alive() else b"closed\n", timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass

    @property
    def written(self) -> int:
        return self.start.written

    @property
    def dropped(self) -> dict[str, int]:
        return dict(self.start.dropped)

    # -- writer thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.take()
            if item is None:
                time.sleep(min(self.flush_s / 4, _POLL_S))
            if item is not None:
                try:
                    line = self._line(item)
                    if line is None:
                        continue
                except Exception:  # noqa: BLE001 - the writer thread must outlive any one record
                    self.start.dropped["error"] += 1
                    logger.exception("kvprof --kv-record: could not write a record (counted as dropped)")
                else:
                    try:
                        self._write(line)  # counted in _unflushed once the compressor took it
                    except OSError as exc:
                        self._disk_error(exc, lost=1)
            try:
                self._maybe_flush()
            except OSError as exc:
                self._disk_error(exc, lost=0)
            if self._reloads_unsaved:
                self._reloads_unsaved = False
                self._save_recording()
            time.sleep(0)  # hand the GIL to the scheduler thread if it waits for it
            if self._stop.is_set() and not len(self._queue):
                break
        try:
            self._close_file()
        except OSError as exc:
            self._disk_error(exc, lost=0)
        self._save_recording()

    def _line(self, item) -> bytes | None:
        """The record's trace line, None for a replay's test request."""
        arrival, scheduled, finished, n_prompt, n_output, reason, tags, hashes, cached_tokens, code, grown_at = item
        if tags and PROBE_TAG in tags:
            return None
        origin, size = self.recording.origin, self.block_size
        n_full = min(n_prompt // size, len(hashes))
        chat_id = self._next_chat_id
        self._next_chat_id += 1
        record = {"chat_id": chat_id, "parent_chat_id": -1, "timestamp": round(arrival - origin, 6),
                  "input_length": n_prompt, "output_length": n_output, "type": "", "turn": 1,
                  "scheduled": None if scheduled is None else round(scheduled - origin, 6),
                  "finished": round(finished - origin, 6),
                  "finish_reason": "" if reason is None else str(reason), "cached_tokens": cached_tokens}
        if code != UNKNOWN:  # the engine told a tool call from an end of turn; a client's own tag still wins
            record[FINISH_FIELD] = stop_value(code, reason)
        if tags:
            self._tag(record, tags)
        if scheduled is not None:  # when it took its blocks past its first ones (decode steps, later prefill chunks)
            record[GROWN] = [round(t - origin, 6) for t in grown_at]
        fields = json.dumps(record, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        ids = self._id_texts(hashes[:n_full])
        ids.extend(str(secrets.randbits(63)) for _ in range(-(-n_prompt // size) - n_full))
        # the blocks its output filled, as vLLM cached them: a next turn that sends the response back names them
        n_written = n_prompt + max(n_output, 1) - 1
        output_ids = self._id_texts(hashes[n_full:min(n_written // size, len(hashes))])
        return f'{fields[:-1]},"output_hash_ids":[{",".join(output_ids)}],"hash_ids":[{",".join(ids)}]}}\n'.encode()

    def _id_texts(self, hashes) -> list[str]:
        """The ids of full blocks' hashes as JSON numbers, computed a slice at a time."""
        return [",".join([str(self._id(h)) for h in part]) for part in _in_slices(hashes, _IDS_PER_SLICE)]

    def _tag(self, record: dict, tags: dict) -> None:
        """The client's scalar tags as fields; ``type``, ``turn`` and the session set the Bailian fields."""
        kind = tags.get("type")
        if isinstance(kind, (str, int)) and not isinstance(kind, bool):
            record["type"] = str(kind)
        session = next((tags[k] for k in SESSION_TAGS if _scalar(tags.get(k))), None)
        turn = tags.get("turn")
        turn = turn if type(turn) is int and 1 <= turn < 2**31 else None
        if session is not None:
            record["session"] = session
            key = (type(session), session)  # true, 1 and 1.0 are equal in Python, distinct tags in JSON
            previous = self._sessions.pop(key, None)
            if previous is not None:
                record["parent_chat_id"], last_turn = previous
                turn = turn or last_turn + 1
            self._sessions[key] = (record["chat_id"], turn or 1)
            if len(self._sessions) > _SESSIONS_KEPT:
                self._sessions.popitem(last=False)
        record["turn"] = turn or 1
        for name, value in tags.items():
            # a stop that is no string would make the reader refuse the line (and every command the recording)
            if name not in RESERVED and name not in HINT_FIELDS and _scalar(value) and (
                    name != FINISH_FIELD or type(value) is str):
                record[name] = value
        self._hint(record, tags)

    @staticmethod
    def _hint(record: dict, tags: dict) -> None:
        """The request's client hint as the trace's hint fields (the four, and ``hint_session`` where it names one, as the pool honoured it: ``release``
        a boolean where ``vllm_xargs`` made it 1); none where it has none or a malformed one (which the API
        server refused, and the pool ignored)."""
        try:
            hint = hint_of_args(tags)
        except ValueError:
            return
        if hint is not None:
            record.update(hint.fields())

    def _id(self, block_hash) -> int:
        data = block_hash if isinstance(block_hash, bytes) else repr(block_hash).encode()
        hasher = self._keyed.copy()
        hasher.update(data)
        return int.from_bytes(hasher.digest(), "big") >> 1

    def _write(self, line: bytes) -> None:
        now = self._clock()
        if self._file is None:
            if now - self._disk_failed_at < 10 * self.flush_s:  # the disk failed a moment ago
                self.start.dropped["disk"] += 1
                return
            self._open_file(now, self._next_chat_id - 1)
        elif abs(now - self._file_started) >= self.rotate_s:  # a clock stepped back rotates too
            self._close_file()
            self._open_file(now, self._next_chat_id - 1)
        for part in _in_slices(memoryview(line), _BYTES_PER_SLICE):  # compressing holds the GIL too
            self._writer.write(part)
        self._unflushed += 1

    def _maybe_flush(self) -> None:
        if self._file is None or not self._unflushed:
            return
        if self._clock() - self._last_flush < self.flush_s:  # (a stopping writer flushes once, at its close)
            return
        self._writer.flush(zstandard.FLUSH_FRAME)
        self._file.flush()
        os.fsync(self._file.fileno())
        self.start.written += self._unflushed
        self._file_lines += self._unflushed
        self._unflushed = 0
        self._last_flush = self._clock()
        self._save_recording()  # counts true whatever stops the server next

    def _open_file(self, now: float, first_chat_id: int) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
        # The first chat id orders the files (and makes the name unique); the time is for people.
        path = self.directory / f"trace-{stamp}-r{self.start.rank}-{os.getpid()}-c{first_chat_id}{OPEN_SUFFIX}"
        with locked(self.directory):  # no finisher takes the new file for an abandoned one before it is held
            handle = open(path, "xb")  # noqa: SIM115 - closed by _close_file
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._file = handle
        self._writer = zstandard.ZstdCompressor(level=3).stream_writer(self._file, closefd=False)
        self._path = path
        self._file_lines = 0
        self._file_started = self._last_flush = now

    def _close_file(self) -> None:
        if self._file is None:
            return
        self._maybe_flush_all()
        os.replace(self._path, finished_name(self._path))  # renamed while still held: no finisher takes it
        self._file.close()
        self._file = self._writer = None
        self.start.in_finished_files += self._file_lines
        self._file_lines = 0
        self._save_recording()

    def _maybe_flush_all(self) -> None:
        if self._unflushed:
            self._last_flush = -math.inf
            self._maybe_flush()

    def _disk_error(self, exc: OSError, lost: int) -> None:
        """A write failed (full or failing disk): count what is lost, abandon the open file, retry later.

        The abandoned ``.part`` file stays readable up to its last closed frame.
        """
        self.start.dropped["disk"] += lost + self._unflushed
        self._unflushed = 0
        if self._file is not None:
            try:  # finish it as far as it is readable: its lines are counted already
                self._file.truncate(complete_frames(self._file)[0])
                os.replace(self._path, finished_name(self._path))
                self.start.in_finished_files += self._file_lines
            except OSError:
                pass  # left as .part: a later start finishes it
            try:
                self._file.close()
            except OSError:
                pass
            self._file = self._writer = None
        if self._clock() - self._disk_failed_at > 60:
            logger.error("kvprof --kv-record %s: cannot write (%s); records are dropped and counted until "
                         "it works again, serving goes on", self.directory, exc)
        self._disk_failed_at = self._clock()

    # -- recording.json -------------------------------------------------------------------
    def _open_recording(self, start: dict) -> Recording:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RecordingError(str(self.directory), f"cannot create the recording directory: "
                                                      f"{exc.strerror or exc}") from None
        try:
            with locked(self.directory):
                return self._add_start(start)
        except OSError as exc:
            raise RecordingError(str(self.directory), f"cannot write there: {exc.strerror or exc}") from None

    def _add_start(self, start: dict) -> Recording:
        now = self._clock()
        if (self.directory / FILE).exists():
            recording = load_recording(self.directory)
            if recording.block_size != self.block_size:
                raise RecordingError(str(self.directory / FILE), f"recorded at {recording.block_size}-token "
                                     f"blocks, this server uses {self.block_size}: record into another directory",
                                     "block_size")
            _log_finished(self.directory, finish_abandoned(self.directory, recording), "a stopped server left")
        else:
            recording = Recording(block_size=self.block_size, origin=now)
        recording.starts.append(Start(time=round(now - recording.origin, 6), chat_id_base=recording.next_chat_id_base(),
                                      dropped=dict.fromkeys(DROP_REASONS, 0), **start))
        self._index = len(recording.starts) - 1
        save_recording(self.directory, recording)
        return recording

    def _save_recording(self) -> bool:
        """This start's entry written into ``recording.json`` (the other ranks' and starts' kept as they are)."""
        try:
            with locked(self.directory):
                recording = load_recording(self.directory)
                recording.starts[self._index] = self.start
                save_recording(self.directory, recording)
            self.recording = recording
            return True
        except (OSError, RecordingError, IndexError) as exc:
            logger.error("kvprof --kv-record: cannot update %s (%s)", self.directory / FILE, exc)
            return False


#: The environment variable naming a shared key file (what ``--kv-record-key`` sets for the engine cores).
RECORD_KEY_ENV = "KVPROF_RECORD_KEY"
#: Bytes of a block-id key (BLAKE2b's largest).
KEY_BYTES = 32
_KEY_TEXT = re.compile(r"[0-9a-f]{64}")


def shared_key(path: str) -> bytes:
    """The block-id key a fleet's servers share: read from ``path``, or created there if it does not
    exist (32 random bytes as 64 hex digits, mode 0600, put in place whole by a hard link, so that
    servers starting together all read the one that won).

    Raises
    ------
    RecordingError
        The file cannot be created or read, or does not hold exactly 64 lowercase hex digits.
    """
    try:
        if not os.path.lexists(path):
            _create_key(Path(path))
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO is refused, not waited on
        with os.fdopen(descriptor, "rb") as handle:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                raise RecordingError(path, "is not a regular file: the recording key (--kv-record-key) is a file "
                                           "of 64 hex digits")
            data = handle.read(4 * KEY_BYTES)
    except OSError as exc:
        raise RecordingError(path, f"cannot use it as the recording key (--kv-record-key): "
                                   f"{exc.strerror or exc}") from None
    text = data.decode("ascii", "replace").strip()
    if not _KEY_TEXT.fullmatch(text):
        raise RecordingError(path, "is not a recording key (--kv-record-key): it must hold 64 lowercase hex "
                                   "digits (32 random bytes, e.g. `openssl rand -hex 32`); a missing file is created")
    return bytes.fromhex(text)


def _create_key(path: Path) -> None:
    """Write a fresh key to ``path`` unless another process got there first (then keep that one)."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_hex(KEY_BYTES) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(staging, path)  # atomic: fails if it exists, never shows a half-written key
        except FileExistsError:
            pass
    finally:
        os.unlink(staging)


def key_id(key: bytes) -> str:
    """The fingerprint of a shared key in ``recording.json``: equal for equal keys, and says nothing of the key."""
    return hashlib.blake2b(b"kvprof recording key id", digest_size=8, key=key).hexdigest()


def _log_finished(directory: Path, finished: list, who: str) -> None:
    """Say what was finished: a warning where an unfinished frame was cut (its requests are lost), a
    note where every line was kept (vLLM's default stop kills the engine core before it can close
    its file, so its guard finishes it at every ordinary stop)."""
    if finished:
        lines = sum(f.lines for f in finished)
        cut = sum(f.cut_bytes for f in finished)
        if cut:
            logger.warning("kvprof --kv-record %s: finished %d file(s) %s open (%d lines kept; %d bytes of an "
                           "unfinished zstd frame dropped, its requests lost)", directory, len(finished), who, lines,
                           cut)
        else:
            logger.info("kvprof --kv-record %s: finished %d file(s) %s open (%d lines, none lost)", directory,
                        len(finished), who, lines)


def _start_guard(directory: Path) -> subprocess.Popen | None:
    """The guard of this process's recording (see the module); None when it cannot start (logged)."""
    root = str(Path(kvprof.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, "-m", "kvprof.vllm.record", "--guard", str(directory), str(os.getpid())]
    # util-linux's setsid -f forks at once: the guard leaves the engine core's tree before vLLM's shutdown can
    # SIGKILL it (a Python start takes seconds on a busy machine); without it the guard forks itself
    detach = shutil.which("setsid")
    try:
        launcher = subprocess.Popen([detach, "-f", *command] if detach else command, stdin=subprocess.PIPE, env=env)
    except OSError as exc:
        logger.error("kvprof --kv-record: cannot start the guard that finishes the recording after a stop (%s); "
                     "the next start finishes what a stop leaves", exc)
        return None
    # The launcher exits once the guard has left the tree (setsid -f at once, the guard's own fork after its
    # start): reaped then, so that no exited child is left in the engine core's tree for vLLM's shutdown to
    # force-kill (and log) at every stop.
    threading.Thread(target=launcher.wait, name="kvprof-guard-reaper", daemon=True).start()
    return launcher


def guard(directory: str, parent: int) -> None:
    """Wait for ``parent`` (the engine core) to go; finish what it left open unless it said ``closed``.

    It first leaves the engine core's process tree (a second fork: vLLM's shutdown SIGKILLs every
    descendant of the engine core) and is deaf to SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C
    and systemd's stop reach the whole group): it must outlive the engine core to do its work (a
    second or less). The engine core is gone when its end of the stdin pipe closes (the kernel
    closes a dead process's files) or its ``/proc`` entry is gone or a zombie.
    """
    if os.getppid() == parent:  # not detached by setsid -f: leave the tree now
        if os.fork():
            os._exit(0)
        os.setsid()
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
    said = b""
    while _alive(parent):
        ready, _, _ = select.select([0], [], [], 0.2)
        if ready:
            data = os.read(0, 64)
            said += data
            if not data or b"closed" in said:
                break
    if b"closed" in said:
        return
    logging.basicConfig(format="(kvprof guard) %(levelname)s %(message)s", level=logging.INFO)
    mine = f"-{parent}-c"  # its files' names (another rank's open file is its own writer's)
    deadline = time.monotonic() + 10.0
    finished: list = []
    while True:  # until the kernel has let go of the dead writer's lock (it closes a dead process's files one by one)
        with locked(directory):
            recording = load_recording(directory)
            done = finish_abandoned(directory, recording)
            if done:
                save_recording(directory, recording)
        finished += done
        left = [path.name for path, still_open in trace_files(directory) if still_open and mine in path.name]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    _log_finished(Path(directory), finished, f"the stopped engine core (pid {parent}) left")
    if left:
        logger.error("kvprof --kv-record %s: %s still held after the engine core (pid %d) stopped; the next start "
                     "finishes it", directory, ", ".join(left), parent)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie); True where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True


def _scalar(value) -> bool:
    """A tag value a trace field can hold: a string, a bool, an int within 64 bits, a finite float."""
    if isinstance(value, (str, bool)):
        return True
    if isinstance(value, int):
        return -(2**63) <= value < 2**63
    return isinstance(value, float) and math.isfinite(value)


__all__ = ["FINISHED_SUFFIX", "RECORD_KEY_ENV", "Recorder", "key_id", "shared_key"]

if __name__ == "__main__" and sys.argv[1:2] == ["--guard"]:
    guard(sys.argv[2], int(sys.argv[3]))
