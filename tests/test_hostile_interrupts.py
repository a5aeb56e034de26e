"""Interrupts end a verb promptly, exit 128 + signal, and leave a run's outputs all old or all new (issue 21)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from kvprof.atomic import staged

TRACE = "".join(
    json.dumps({"chat_id": i, "parent_chat_id": -1, "timestamp": i * 0.5, "input_length": 64, "output_length": 4,
                "type": "text", "turn": 1, "hash_ids": [i % 3, 10 + i % 5, 100 + i, 200 + i]}) + "\n"
    for i in range(40))

#: compare, its plotting interrupted by the signal it is given after the first panel is drawn.
INTERRUPTED_WHILE_PLOTTING = """
import os, signal, sys
from kvprof.cli import plots
from kvprof.cli.app import main
draw = plots._plot_panel
def draw_then_signal(*args):
    written = draw(*args)
    os.kill(os.getpid(), int(os.environ["SIGNUM"]))
    return written
plots._plot_panel = draw_then_signal
sys.argv = ["kvprof", *sys.argv[1:]]
main()
"""


def _compare(trace, output, env=None):
    return subprocess.run(
        [sys.executable, "-c", INTERRUPTED_WHILE_PLOTTING if env else "from kvprof.cli.app import main; main()",
         "compare", str(trace), "--policies", "lru,belady", "--capacity", "4,8", "--eval-window", "0:", "-o",
         str(output), "-j", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_while_compare_plots_leaves_every_output_of_the_last_run(tmp_path, signum, code):
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    output = tmp_path / "out"
    done = _compare(trace, output)
    assert done.returncode == 0, done.stderr
    before = {path.name: path.read_bytes() for path in output.iterdir()}
    assert {"results.json", "hit_ratio.png", "qttft.svg"} <= set(before)
    (output / "results.json").write_bytes(b'{"edited": "marks the old results"}')
    before["results.json"] = (output / "results.json").read_bytes()
    done = _compare(trace, output, env={"SIGNUM": str(int(signum))})
    assert done.returncode == code, done.stderr
    assert "interrupted" in done.stderr
    after = {path.name: path.read_bytes() for path in output.iterdir()}
    assert after == before  # nothing replaced, no temporary file left


#: compare, the signal it is given arriving while its outputs are renamed into place (held back until they all are).
INTERRUPTED_WHILE_COMMITTING = """
import os, signal, sys
from kvprof import atomic
from kvprof.cli.app import main
replace = atomic.os.replace
def replace_then_signal(tmp, target):
    replace(tmp, target)
    if str(target).endswith("results.json"):  # the final group's (a plot's own group commits before it)
        os.kill(os.getpid(), int(os.environ["SIGNUM"]))
atomic.os.replace = replace_then_signal
sys.argv = ["kvprof", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_once_the_outputs_are_in_place_ends_compare_with_success(tmp_path, signum):
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    output = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_WHILE_COMMITTING, "compare", str(trace), "--policies", "lru,belady",
         "--capacity", "4,8", "--eval-window", "0:", "-o", str(output), "-j", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "SIGNUM": str(int(signum))},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 0, done.stderr
    assert "interrupted once its outputs were written: they are complete" in done.stderr
    assert json.loads((output / "results.json").read_text())["complete"] is True
    assert not [path for path in output.iterdir() if path.name.endswith(".tmp")]


def test_a_staged_group_is_replaced_whole_or_not_at_all(tmp_path):
    (tmp_path / "a").write_text("old a")
    (tmp_path / "b").write_text("old b")
    with pytest.raises(KeyboardInterrupt), staged() as group:
        group.stage(tmp_path / "a").write_text("new a")
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    assert (tmp_path / "a").read_text() == "old a"
    with staged() as group:
        group.stage(tmp_path / "a").write_text("new a")
        group.stage(tmp_path / "b").write_text("new b")
        assert (tmp_path / "a").read_text() == "old a"  # nothing changes before the group ends
    assert [(tmp_path / name).read_text() for name in "ab"] == ["new a", "new b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_an_interrupt_while_a_group_is_renamed_comes_after_every_file_is_in_place(tmp_path, monkeypatch):
    # sent from another thread, so the process's signal may reach any thread: the group still goes in whole
    import threading

    from kvprof import atomic

    replace = os.replace

    def replace_then_interrupt(tmp, target):
        replace(tmp, target)
        if str(target).endswith("a"):
            sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
            sender.start()
            sender.join()

    monkeypatch.setattr(atomic.os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt), staged() as group:
        for name in "ab":
            group.stage(tmp_path / name).write_text(f"new {name}")
    assert [(tmp_path / name).read_text() for name in "ab"] == ["new a", "new b"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
