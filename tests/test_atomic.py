"""Atomic writes replace regular files only: devices and FIFOs are written through, directories refused."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from kvprof.atomic import atomic_open, atomic_write_text
from tests.helpers import invoke, one_line

GOOD = ('{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 20, "output_length": 5, '
        '"type": "text", "turn": 1, "hash_ids": [1, 2]}\n')


def test_a_device_is_written_through_never_replaced(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD)
    result = invoke("fit", trace, "-o", os.devnull)
    assert result.exit_code == 0, result.output
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_a_fifo_receives_the_text_and_stays_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    atomic_write_text(fifo, "hello\n")
    reader.join(timeout=10)
    assert received == ["hello\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_directory_is_refused_by_its_name(tmp_path):
    target = tmp_path / "dir"
    target.mkdir()
    with pytest.raises(IsADirectoryError, match="not a regular file") as caught:
        atomic_write_text(target, "x")
    assert caught.value.filename == str(target) and target.is_dir() and not list(target.iterdir())


def test_errors_name_the_callers_path_not_the_temporary_file(tmp_path):
    missing = tmp_path / "no-such-dir" / "hp.json"
    with pytest.raises(FileNotFoundError) as caught:
        atomic_write_text(missing, "x")
    assert caught.value.filename == str(missing) and ".tmp" not in str(caught.value)
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD)
    result = invoke("fit", trace, "-o", missing)  # refused before any work
    assert result.exit_code == 2 and str(missing) in one_line(result.output) and ".tmp" not in result.output


def test_a_symlink_keeps_pointing_at_the_replaced_file(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    atomic_write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_an_exception_in_the_block_keeps_the_old_file(tmp_path):
    path = tmp_path / "kept.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_open(path) as handle:
        handle.write("half")
        raise RuntimeError("stop")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["kept.txt"]
