"""An output file that is a pipe (``-o /dev/stdout | ...``, ``/dev/fd/1``) is written through, as a FIFO
or a device is: it cannot be replaced by a renamed temporary file. Stdout then carries the file alone
(fit's tables go to stderr), so what reads the pipe gets the file whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvprof.models.hp import HpFile
from kvprof.profiler.synth import generate, write_jsonl

KVPROF = Path(sys.executable).with_name("kvprof")


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    write_jsonl(path, generate("bailian-a", 0.1, 3))
    return path


def _synth_records(text: str, trace) -> None:
    records = [json.loads(line) for line in text.splitlines()]
    assert len(records) > 10 and all({"chat_id", "timestamp", "hash_ids"} <= set(r) for r in records)


def _fit_hp(text: str, trace) -> None:
    hp = HpFile.from_dict(json.loads(text), "stdout")
    assert hp.schema == "kvprof.hp/6" and hp.provenance["trace"] == trace.name


COMMANDS = {
    "synth": (["synth", "--hours", "0.01", "-o", "{target}"], _synth_records),
    "fit": (["fit", "{trace}", "--window", "0:360", "--horizon", "30", "-o", "{target}"], _fit_hp),
}


@pytest.mark.parametrize("target", ["/dev/stdout", "/dev/fd/1"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_output_file_that_is_a_pipe_is_written_through(trace, command, target):
    args, check = COMMANDS[command]
    done = subprocess.run([str(KVPROF), *(arg.format(target=target, trace=trace) for arg in args)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert f"wrote {target}" in done.stderr and "No such file" not in done.stderr
    check(done.stdout, trace)
