"""Small builders shared by tests: a Trace made directly from Python lists, a CLI runner."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from kvprof.profiler.trace import Trace

#: Seconds a begun LiveLoop may take to load its compiled core: minutes where the cache is empty (a child
#: process compiles it), under a few seconds where it is not. A bound, not a timing the tests judge.
READY_S = 900.0


def make_trace(rows, block_size=16, window=(0.0, float("inf")), type_names=None) -> Trace:
    """Build a Trace from ``(timestamp, type, turn, hash_ids)`` tuples (optionally with chat/parent ids).

    Each row is ``(t, type, turn, hashes)`` or ``(t, type, turn, hashes, chat_id, parent_chat_id)``.
    """
    names = type_names or tuple(dict.fromkeys(r[1] for r in rows)) or ("",)
    lengths = [len(r[3]) for r in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    hashes = np.array([h for r in rows for h in r[3]], dtype=np.int64)
    chat = [r[4] if len(r) > 4 else i for i, r in enumerate(rows)]
    parent = [r[5] if len(r) > 5 else -1 for r in rows]
    return Trace(
        timestamp=np.array([r[0] for r in rows], dtype=np.float64),
        input_length=np.array(lengths, dtype=np.int64) * block_size,
        output_length=np.full(len(rows), 10, dtype=np.int64),
        chat_id=np.array(chat, dtype=np.int64),
        parent_chat_id=np.array(parent, dtype=np.int64),
        type_code=np.array([names.index(r[1]) for r in rows], dtype=np.int32),
        type_names=tuple(names),
        turn=np.array([r[2] for r in rows], dtype=np.int32),
        hash_offsets=offsets,
        hash_ids=hashes,
        block_size=block_size,
        format="bailian",
        window=window,
    )


def synthetic(directory, preset: str = "bailian-a", hours: float = 0.2, seed: int = 0):
    """A synthetic trace written to ``directory`` and read back: ``(path, trace)``."""
    from kvprof.profiler.reader import read_trace
    from kvprof.profiler.synth import generate, write_jsonl

    path = directory / f"{preset}-{hours:g}h-{seed}.jsonl"
    write_jsonl(path, generate(preset, hours, seed))
    return path, read_trace(path)[0]


def invoke(*args):
    """Run the ``kvprof`` app in-process with ``args`` (paths and numbers turned into strings).

    Typer's usage-error panel is as wide as ``COLUMNS``: wide enough here that no path in a
    message is wrapped, so a test can look for it whole.
    """
    from kvprof.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "2000"})


def one_line(text: str) -> str:
    """``text`` with line breaks, runs of spaces and rich's panel borders collapsed, to look for a message in it."""
    import re

    return re.sub(r"[\s│╭╮╰╯─]+", " ", text)
