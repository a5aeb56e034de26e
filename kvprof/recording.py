"""A vLLM recording: the directory ``vllm serve --kv-record DIR`` writes, read by kvprof as one trace.

Layout::

    DIR/recording.json                          what was recorded (schema kvprof.recording/1)
    DIR/trace-20261201T103000-4242-001.jsonl.zst        a finished file: complete, renamed when rotated
    DIR/trace-20261201T113000-4242-001.jsonl.zst.part   the file being written (or left by a killed server)

Every trace file is Bailian-style JSONL (``chat_id``, ``parent_chat_id``, ``timestamp``,
``input_length``, ``output_length``, ``type``, ``turn``, ``hash_ids``; see the README) at the
server's block size, one line per request written when it finishes, plus ``scheduled`` and
``finished`` (seconds, the same clock as ``timestamp``: when the scheduler first gave the request
its blocks and when it freed them), ``finish_reason``, ``cached_tokens`` (prompt tokens the server
found in its prefix cache) and the client's scalar tags. Timestamps are
seconds since ``origin``, so they keep their precision. ``.part`` files are zstd frames closed
every few seconds: after ``kill -9`` one is readable up to its last closed frame, and the reader
counts the lines it had to skip at its end.

``recording.json``::

    {"schema": "kvprof.recording/1", "block_size": 16, "origin": 1764585000.0,
     "starts": [{"time": 0.0, "pid": 4242, "model": "...", "vllm": "0.32.0", "kvprof": "0.1.0",
                 "num_gpu_blocks": 8192, "chat_id_base": 0, "policy": "lru", "hp_sha256": null,
                 "written": 1200, "dropped": {"queue_full": 0, "disk": 0, "error": 0}}]}

One entry per server start (``time`` in seconds since ``origin``); ``chat_id_base`` keeps the
chat ids of different starts apart. ``dropped`` counts the records a start could not write, by
reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.errors import JsonFileError
from kvprof.jsonfile import INT64_MAX, JsonChecks, member, read_json

SCHEMA = "kvprof.recording/1"
FILE = "recording.json"
#: A finished trace file and one being written (or left behind by a killed server).
FINISHED_SUFFIX = ".jsonl.zst"
OPEN_SUFFIX = ".jsonl.zst.part"
_TRACE_NAME = re.compile(r"^trace-[0-9A-Za-z_-]+\.jsonl\.zst(\.part)?$")
#: Why a record was not written.
DROP_REASONS = ("queue_full", "disk", "error")
#: Chat ids of one server start: ``chat_id_base`` of start ``k`` is ``k * CHAT_IDS_PER_START``.
CHAT_IDS_PER_START = 1 << 40


class RecordingError(JsonFileError):
    """A recording directory or its ``recording.json`` that cannot be used; names the file and the JSON path."""


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

    def to_dict(self) -> dict:
        return {"time": self.time, "pid": self.pid, "model": self.model, "vllm": self.vllm, "kvprof": self.kvprof,
                "num_gpu_blocks": self.num_gpu_blocks, "chat_id_base": self.chat_id_base, "policy": self.policy,
                "hp_sha256": self.hp_sha256, "written": self.written, "dropped": dict(self.dropped)}


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
    if document["schema"] != SCHEMA:
        check.fail("schema", f"must be {SCHEMA!r}, got {document['schema']!r:.60}")
    block_size = check.integer(document["block_size"], "block_size", low=1, high=1 << 20)
    origin = check.number(document["origin"], "origin")
    starts = []
    for i, entry in enumerate(check.sequence(document["starts"], "starts")):
        where = f"starts[{i}]"
        check.fields(entry, where, required=("time", "pid", "model", "vllm", "kvprof", "num_gpu_blocks",
                                              "chat_id_base", "policy", "hp_sha256", "written", "dropped"))
        dropped = check.fields(entry["dropped"], member(where, "dropped"), required=DROP_REASONS)
        base = check.integer(entry["chat_id_base"], member(where, "chat_id_base"))
        if base != i * CHAT_IDS_PER_START:
            check.fail(member(where, "chat_id_base"), f"must be {i * CHAT_IDS_PER_START} (start {i}), got {base}")
        hp_sha = entry["hp_sha256"]
        starts.append(Start(
            time=check.number(entry["time"], member(where, "time"), low=0.0),
            pid=check.integer(entry["pid"], member(where, "pid")),
            model=_text(check, entry["model"], member(where, "model")),
            vllm=_text(check, entry["vllm"], member(where, "vllm")),
            kvprof=_text(check, entry["kvprof"], member(where, "kvprof")),
            num_gpu_blocks=check.integer(entry["num_gpu_blocks"], member(where, "num_gpu_blocks"), low=1),
            chat_id_base=base,
            policy=_text(check, entry["policy"], member(where, "policy")),
            hp_sha256=None if hp_sha is None else _text(check, hp_sha, member(where, "hp_sha256")),
            written=check.integer(entry["written"], member(where, "written")),
            dropped={k: check.integer(dropped[k], member(member(where, "dropped"), k), high=INT64_MAX)
                     for k in DROP_REASONS},
        ))
    return Recording(block_size=block_size, origin=origin, starts=starts)


def _text(check: JsonChecks, value, where: str) -> str:
    if type(value) is not str:
        check.fail(where, f"must be a string, got {type(value).__name__}")
    return value


def trace_files(directory: str | Path) -> list[tuple[Path, bool]]:
    """The recording's trace files in the order they were written, each with whether it is still
    open (``.part``: written by a running server, or left by a killed one).

    Names carry the start time of the file, so name order is write order.
    """
    out = []
    for path in sorted(Path(directory).iterdir(), key=lambda p: p.name):
        if path.is_file() and _TRACE_NAME.match(path.name):
            out.append((path, path.name.endswith(".part")))
    return out
