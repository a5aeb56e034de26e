"""Every JSON input is read to a bound (kvprof.limits.MAX_JSON_BYTES) and no further: an endless one
(/dev/zero, a FIFO that never ends) fails with a message naming it, exit 1, instead of reading until
memory runs out.

The commands run in a child process whose address space is limited to a few GiB: a reader without a
bound meets MemoryError there (a traceback) rather than taking the machine's memory.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvprof.errors import HpFileError
from kvprof.jsonfile import read_json
from kvprof.limits import MAX_JSON_BYTES
from kvprof.profiler.synth import generate, write_jsonl

KVPROF = Path(sys.executable).with_name("kvprof")
#: The child's address space: room for kvprof and the bound, far less than an endless read takes.
MEMORY_LIMIT = 4 * 2**30


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    write_jsonl(path, generate("bailian-a", 0.02, 0))
    return path


def _endless_fifo(path: Path) -> threading.Thread:
    """A FIFO at ``path`` a thread writes to without end, until its reader goes."""
    os.mkfifo(path)

    def feed():
        chunk = b" " * 65536
        try:
            with open(path, "wb") as out:
                while True:
                    out.write(chunk)
        except (BrokenPipeError, OSError):
            pass

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return thread


#: Each JSON input of the CLI: the command line, with {json} where the endless input goes.
INPUTS = {
    "show": ["show", "{json}"],
    "compare --config": ["compare", "{trace}", "--config", "{json}", "--policies", "lru", "--capacity", "64",
                         "-o", "{out}"],
    "compare --cost": ["compare", "{trace}", "--cost", "{json}", "--policies", "lru", "--capacity", "64",
                       "-o", "{out}"],
    "fleet --config": ["fleet", "{trace}", "--config", "{json}", "--policies", "lru", "--capacity", "64",
                       "--replicas", "2", "--router", "round-robin", "-o", "{out}"],
    "fleet --cost": ["fleet", "{trace}", "--cost", "{json}", "--policies", "lru", "--capacity", "64",
                     "--replicas", "2", "--router", "round-robin", "-o", "{out}"],
}


@pytest.mark.parametrize("endless", ["/dev/zero", "fifo"])
@pytest.mark.parametrize("name", list(INPUTS))
def test_an_endless_json_input_is_refused_at_the_bound(tmp_path, trace, name, endless):
    source = Path(endless) if endless != "fifo" else tmp_path / "endless.json"
    feeder = _endless_fifo(source) if endless == "fifo" else None
    args = [arg.format(json=source, trace=trace, out=tmp_path / "out") for arg in INPUTS[name]]
    done = subprocess.run([str(KVPROF), *args], capture_output=True, text=True, preexec_fn=_limited,
                          env={**os.environ, "COLUMNS": "2000"}, timeout=600)
    assert done.returncode == 1, done.stderr
    assert f"{source}: larger than 64 MiB" in done.stderr and "the most kvprof reads of a JSON file" in done.stderr
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr
    assert not (tmp_path / "out").exists()
    if feeder is not None:
        feeder.join(timeout=60)  # the reader stopped and closed the FIFO: the writer met a broken pipe
        assert not feeder.is_alive()


def test_the_reader_takes_the_bound_and_one_byte_more(tmp_path):
    exactly = tmp_path / "exactly.json"
    exactly.write_bytes(b"{}" + b" " * (MAX_JSON_BYTES - 2))
    assert read_json(exactly, HpFileError) == {}
    one_more = tmp_path / "one-more.json"
    one_more.write_bytes(b"{}" + b" " * (MAX_JSON_BYTES - 1))
    with pytest.raises(HpFileError, match="larger than 64 MiB"):
        read_json(one_more, HpFileError)
