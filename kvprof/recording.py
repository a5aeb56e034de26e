"""A vLLM recording: the directory ``vllm serve --kv-record DIR`` writes, read by kvprof as one trace.

Layout::

    DIR/recording.json                                  what was recorded (schema kvprof.recording/1)
    DIR/trace-20261201T103000-r0-4242-c0.jsonl.zst        a finished file: complete, renamed when rotated
    DIR/trace-20261201T113000-r0-4242-c1200.jsonl.zst.part  the file being written
    DIR/.recording.lock                                 serialises the writers of recording.json (ranks, starts)

A file's name holds the data-parallel rank that wrote it (``r0``), the engine core's pid and the
chat id of its first line (``c1200``): files are read in the order of that chat id, which is write
order whatever the clock said. The writer holds an ``flock`` on its ``.part`` file; a ``.part``
nobody holds was left by a stopped server and is finished (:func:`finish_abandoned`) by the
recorder's guard process as soon as the engine core is gone, or else by the next start.

Every trace file is Bailian-style JSONL (``chat_id``, ``parent_chat_id``, ``timestamp``,
``input_length``, ``output_length``, ``type``, ``turn``, ``hash_ids``; see the README) at the
server's block size, one line per request written when it finishes, plus ``scheduled`` and
``finished`` (seconds, the same clock as ``timestamp``: when the scheduler first gave the request
its blocks and when it freed them), ``finish_reason``, ``cached_tokens`` (prompt tokens the server
found in its prefix cache), ``output_hash_ids`` (the ids of the blocks its response filled, keyed as
``hash_ids``), ``grown`` (when it took each block after its first ones) and the client's scalar tags. Timestamps are
seconds since ``origin``, so they keep their precision. ``.part`` files are zstd frames closed
every few seconds: one whose writer died is readable up to its last closed frame, and the reader
says what it could not read at its end.

``recording.json``::

    {"schema": "kvprof.recording/1", "block_size": 16, "origin": 1764585000.0,
     "starts": [{"time": 0.0, "pid": 4242, "model": "...", "vllm": "0.32.0", "kvprof": "0.1.0",
                 "num_gpu_blocks": 8192, "chat_id_base": 0, "policy": "lru", "hp_sha256": null,
                 "written": 1200, "dropped": {"queue_full": 0, "disk": 0, "error": 0},
                 "rank": 0, "in_finished_files": 1000, "recovered": 0, "key_id": null,
                 "reloads": [{"time": 1800.0, "sha256": "9f2c...", "path": "hp.json"}]}]}

One entry per server start and data-parallel rank (``time`` in seconds since ``origin``);
``chat_id_base`` keeps the chat ids of different entries apart. ``written`` counts the lines in
the start's files (saved after every closed frame), ``in_finished_files`` those of its finished
files, ``dropped`` the records a start could not write, by reason, and ``recovered`` its files
finished after it stopped (by its guard or a later start). ``rank``, ``in_finished_files`` and
``recovered`` may be missing (recordings of kvprof before them: 0). ``key_id`` (may be missing: null)
is the fingerprint of the block-id key the start shared with other servers (``--kv-record-key``),
null where the start drew a key of its own: starts of equal ``key_id`` give a prefix the same ids.
``hint_max_fraction`` (may be missing: null) is the share of the cache the start let client retentions
hold (``--kv-hint-max-fraction``; null: no budget), which ``kvprof compare --hints trace`` of the recording
replays by default. ``reloads`` (may be missing: none) lists the hp files that came in force while the start ran, after
the one it began with (``hp_sha256``), each ``{"time": ..., "sha256": ..., "path": ...}`` (``time``
since ``origin``, ``path`` as the server was given it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from kvprof.atomic import atomic_write_text
from kvprof.errors import JsonFileError
from kvprof.jsonfile import INT64_MAX, JsonChecks, member, read_json

SCHEMA = "kvprof.recording/1"
FILE = "recording.json"
#: A finished trace file and one being written (or left behind by a killed server).
FINISHED_SUFFIX = ".jsonl.zst"
OPEN_SUFFIX = ".jsonl.zst.part"
LOCK = ".recording.lock"
_TRACE_NAME = re.compile(r"^trace-[0-9A-Za-z_-]+\.jsonl\.zst(\.part)?$")
#: The first chat id (``-c1200``) in a file's name; names before it (``-001``) have none.
_FIRST_CHAT_ID = re.compile(r"-c([0-9]+)\.jsonl\.zst(\.part)?$")
#: The most GPU blocks a start may report (a bound no real server comes near; beyond it the number is corrupt).
MAX_GPU_BLOCKS = 1 << 40
#: The ``vllm_xargs`` tag of a request the recorder leaves out (any value: vLLM's API turns ``true`` into 1):
#: ``kvprof replay``'s test request.
PROBE_TAG = "kvprof_probe"
#: Why a record was not written.
DROP_REASONS = ("queue_full", "disk", "error")
#: Chat ids of one server start: ``chat_id_base`` of start ``k`` is ``k * CHAT_IDS_PER_START``.
CHAT_IDS_PER_START = 1 << 40


class RecordingError(JsonFileError):
    """A recording directory or its ``recording.json`` that cannot be used; names the file and the JSON path."""


@dataclass(frozen=True)
class Reload:
    """An hp file that came in force while a start ran: when (seconds since the recording's
    ``origin``), the sha256 of its bytes, and its path as the server was given it."""

    time: float
    sha256: str
    path: str

    def to_dict(self) -> dict:
        return {"time": self.time, "sha256": self.sha256, "path": self.path}


@dataclass
class Start:
    """One server start of a recording (an entry of ``starts``)."""

    time: float
    pid: int
    model: str
    vllm: str
    kvprof: str
    num_gpu_blocks: int
    chat_id_base: int
    policy: str
    hp_sha256: str | None = None
    written: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    rank: int = 0
    in_finished_files: int = 0
    recovered: int = 0
    #: Fingerprint of the block-id key the start shared with other servers (``--kv-record-key``);
    #: None: a key of its own, drawn at the start, whose ids match no other start's.
    key_id: str | None = None
    #: The hp files that came in force after the start's (``hp_sha256``), in the order they did.
    reloads: list[Reload] = field(default_factory=list)
    #: The share of the cache the server let client retentions hold (``--kv-hint-max-fraction``); None: no budget.
    hint_max_fraction: float | None = None

    def to_dict(self) -> dict:
        return {"time": self.time, "pid": self.pid, "model": self.model, "vllm": self.vllm, "kvprof": self.kvprof,
                "num_gpu_blocks": self.num_gpu_blocks, "chat_id_base": self.chat_id_base, "policy": self.policy,
                "hp_sha256": self.hp_sha256, "written": self.written, "dropped": dict(self.dropped),
                "rank": self.rank, "in_finished_files": self.in_finished_files, "recovered": self.recovered,
                "key_id": self.key_id, "reloads": [reload.to_dict() for reload in list(self.reloads)],
                "hint_max_fraction": self.hint_max_fraction}


@dataclass
class Recording:
    """``recording.json`` of a recording directory.

    Invariant: ``starts`` are in start order and their ``chat_id_base`` are distinct multiples of
    :data:`CHAT_IDS_PER_START`, so chat ids of different starts never collide.
    """

    block_size: int
    origin: float
    starts: list[Start] = field(default_factory=list)

    @property
    def num_gpu_blocks(self) -> int | None:
        """The cache size of the latest start (the server a refit is for), None before any start."""
        return self.starts[-1].num_gpu_blocks if self.starts else None

    @property
    def dropped(self) -> int:
        return sum(sum(s.dropped.values()) for s in self.starts)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The data-parallel ranks recorded, ascending."""
        return tuple(sorted({s.rank for s in self.starts}))

    def start_of(self, chat_id: int) -> int:
        """The index in ``starts`` of the start that wrote ``chat_id``."""
        return chat_id // CHAT_IDS_PER_START

    def next_chat_id_base(self) -> int:
        return len(self.starts) * CHAT_IDS_PER_START

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "block_size": self.block_size, "origin": self.origin,
                "starts": [s.to_dict() for s in self.starts]}


def is_recording(path: str | Path) -> bool:
    """Whether ``path`` is a directory (a recording, or one to become one)."""
    return Path(path).is_dir()


def _not_a_file(path: Path) -> str:
    """Why ``path`` (not a regular file) is no recording.json: missing, a dangling link, or another kind of file."""
    import os
    import stat

    if not os.path.lexists(path):
        return f"no {FILE}"
    if not path.exists():
        return f"its {FILE} is a link to {os.readlink(path)!r}, which does not exist"
    mode = path.stat().st_mode
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device")
    return f"its {FILE} is {kind}, not a file"


def load_recording(directory: str | Path) -> Recording:
    """``DIR/recording.json``, validated.

    Raises
    ------
    RecordingError
        Missing, not JSON, or not a valid recording (the message names the JSON path).
    """
    path = Path(directory) / FILE
    if not path.is_file():
        raise RecordingError(str(path), f"{directory} is a directory but not a kvprof recording "
                                        f"({_not_a_file(path)}; `vllm serve --kv-record DIR` writes one)")
    try:
        document = read_json(path, RecordingError)
    except OSError as exc:
        raise RecordingError(str(path), f"cannot read it: {exc.strerror or exc}") from None
    check = JsonChecks(str(path), RecordingError)
    check.fields(document, None, required=("schema", "block_size", "origin", "starts"))
    check.sequence(document["starts"], "starts", empty=False)  # the recorder writes its start before any file
    if document["schema"] != SCHEMA:
        check.fail("schema", f"must be {SCHEMA!r}, got {document['schema']!r:.60}")
    block_size = check.integer(document["block_size"], "block_size", low=1, high=1 << 20)
    origin = check.number(document["origin"], "origin")
    starts = []
    for i, entry in enumerate(check.sequence(document["starts"], "starts")):
        where = f"starts[{i}]"
        check.fields(entry, where, required=("time", "pid", "model", "vllm", "kvprof", "num_gpu_blocks",
                                              "chat_id_base", "policy", "hp_sha256", "written", "dropped"),
                     optional=("rank", "in_finished_files", "recovered", "key_id", "reloads", "hint_max_fraction"))
        dropped = check.fields(entry["dropped"], member(where, "dropped"), required=DROP_REASONS)
        base = check.integer(entry["chat_id_base"], member(where, "chat_id_base"))
        if base != i * CHAT_IDS_PER_START:
            check.fail(member(where, "chat_id_base"), f"must be {i * CHAT_IDS_PER_START} (start {i}), got {base}")
        hp_sha, key, budget = entry["hp_sha256"], entry.get("key_id"), entry.get("hint_max_fraction")
        starts.append(Start(
            time=check.number(entry["time"], member(where, "time"), low=0.0),
            pid=check.integer(entry["pid"], member(where, "pid")),
            model=_text(check, entry["model"], member(where, "model")),
            vllm=_text(check, entry["vllm"], member(where, "vllm")),
            kvprof=_text(check, entry["kvprof"], member(where, "kvprof")),
            num_gpu_blocks=check.integer(entry["num_gpu_blocks"], member(where, "num_gpu_blocks"), low=1,
                                         high=MAX_GPU_BLOCKS),
            chat_id_base=base,
            policy=_text(check, entry["policy"], member(where, "policy")),
            hp_sha256=None if hp_sha is None else _text(check, hp_sha, member(where, "hp_sha256")),
            key_id=None if key is None else _text(check, key, member(where, "key_id")),
            written=check.integer(entry["written"], member(where, "written")),
            dropped={k: check.integer(dropped[k], member(member(where, "dropped"), k), high=INT64_MAX)
                     for k in DROP_REASONS},
            reloads=_reloads(check, entry.get("reloads", []), member(where, "reloads")),
            hint_max_fraction=None if budget is None else check.number(budget, member(where, "hint_max_fraction"),
                                                                       low=0.0, high=1.0),
            **{key: check.integer(entry[key], member(where, key), high=INT64_MAX)
               for key in ("rank", "in_finished_files", "recovered") if key in entry},
        ))
    return Recording(block_size=block_size, origin=origin, starts=starts)


def _reloads(check: JsonChecks, value, where: str) -> list[Reload]:
    reloads = []
    for i, entry in enumerate(check.sequence(value, where)):
        at = f"{where}[{i}]"
        check.fields(entry, at, required=("time", "sha256", "path"))
        reloads.append(Reload(time=check.number(entry["time"], member(at, "time"), low=0.0),
                              sha256=_text(check, entry["sha256"], member(at, "sha256")),
                              path=_text(check, entry["path"], member(at, "path"))))
    return reloads


def _text(check: JsonChecks, value, where: str) -> str:
    if type(value) is not str:
        check.fail(where, f"must be a string, got {type(value).__name__}")
    return value


def trace_files(directory: str | Path) -> list[tuple[Path, bool]]:
    """The recording's trace files in the order they were written, each with whether it is still
    open (``.part``: written by a running server, or left by a stopped one).

    Write order is the order of the first chat id each name holds (chat ids grow as a start
    writes, and from start to start), whatever the clock said; names without one (recordings of
    kvprof before it) come first, by name.
    """
    out = []
    for path in Path(directory).iterdir():
        if _TRACE_NAME.match(path.name) and path.is_file():
            out.append((path, path.name.endswith(".part")))
    return sorted(out, key=lambda item: _write_order(item[0].name))


def _write_order(name: str) -> tuple[int, str]:
    found = _FIRST_CHAT_ID.search(name)
    return (-1 if found is None else int(found.group(1)), name)


def finished_name(path: Path) -> Path:
    """A ``.part`` file's name once finished."""
    return path.with_name(path.name.removesuffix(".part"))


@contextlib.contextmanager
def locked(directory: str | Path) -> Iterator[None]:
    """Hold the recording's lock (an ``flock`` of ``DIR/.recording.lock``): the writers of
    ``recording.json`` and the finishers of abandoned files take it, so that ranks and starts
    writing one directory never lose each other's updates."""
    fd = os.open(Path(directory) / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def save_recording(directory: str | Path, recording: Recording) -> None:
    """Write ``recording.json`` atomically (hold :func:`locked` around the read that preceded it)."""
    atomic_write_text(Path(directory) / FILE, json.dumps(recording.to_dict(), indent=1) + "\n")


@dataclass(frozen=True)
class Finished:
    """A ``.part`` file :func:`finish_abandoned` finished: ``path`` its finished name (None: it held
    no complete frame and was removed), ``lines`` the lines it kept, ``cut_bytes`` the bytes of an
    unfinished last frame it dropped (the requests of at most one flush interval)."""

    part: Path
    path: Path | None
    lines: int
    cut_bytes: int


def finish_abandoned(directory: str | Path, recording: Recording) -> list[Finished]:
    """Finish every ``.part`` file of ``directory`` that no writer holds: cut it after its last
    complete zstd frame, rename it (remove it if nothing is left) and count its lines into its
    start's ``written`` and ``in_finished_files`` (``recording`` is updated; the caller saves it,
    holding :func:`locked` around both).
    """
    done = []
    for part, still_open in trace_files(directory):
        if still_open:
            finished = _finish(part)
            if finished is not None:
                done.append(finished)
                _count_finished(recording, finished)
    return done


def _finish(part: Path) -> Finished | None:
    try:
        handle = open(part, "r+b")  # noqa: SIM115 - closed below
    except FileNotFoundError:  # finished by its writer since the listing
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its writer is alive
            return None
        try:
            if os.stat(part).st_ino != os.fstat(handle.fileno()).st_ino:
                return None
        except FileNotFoundError:  # renamed by its writer before it let go of the lock
            return None
        size = os.fstat(handle.fileno()).st_size
        good, lines = complete_frames(handle)
        if good < size:
            handle.truncate(good)
            os.fsync(handle.fileno())
        if not good:
            os.unlink(part)
            return Finished(part, None, 0, size)
        final = finished_name(part)
        os.replace(part, final)
        return Finished(part, final, lines, size - good)


def complete_frames(handle) -> tuple[int, int]:
    """``(bytes, lines)`` of the complete zstd frames at the start of an open binary file (lines:
    the newlines they hold). What follows (a frame its writer did not finish) is not counted."""
    handle.seek(0)
    decompressor = zstandard.ZstdDecompressor()
    frame = decompressor.decompressobj()
    good = position = lines = pending = 0
    try:
        while data := handle.read(1 << 20):
            while data:
                pending += frame.decompress(data).count(b"\n")
                if not frame.eof:
                    position += len(data)
                    break
                unused = frame.unused_data
                position += len(data) - len(unused)
                good, lines, pending = position, lines + pending, 0
                data = unused
                frame = decompressor.decompressobj()
    except zstandard.ZstdError:  # garbage after the last good frame: cut there
        pass
    return good, lines


def _count_finished(recording: Recording, finished: Finished) -> None:
    match = _FIRST_CHAT_ID.search(finished.part.name)
    if match is None:
        return
    index = recording.start_of(int(match.group(1)))
    if index < len(recording.starts):
        start = recording.starts[index]
        start.in_finished_files += finished.lines
        start.written = start.in_finished_files
        start.recovered += 1
