"""What kvprof prints of its input is the input, whatever it holds; outputs follow one rule; signals unwind.

Swept classes: rich markup, emoji codes and lone surrogates in every kind of user text (paths,
trace values, hp and results files' strings); outputs that would replace an input or cannot be
written (refused before any work, nothing created); a closed stdout; a log instead of a terminal;
SIGTERM and SIGINT during an atomic write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprof.cli.output import printable
from tests.helpers import invoke, one_line

#: Pieces of hostile text: rich markup (tags that parse, tags that do not), emoji codes, format and
#: math syntax, escapes, and the lone surrogates a command line (surrogateescape) or JSON can carry.
MARKUP = ["[bold]", "[/]", "[/bold]", "[red]x[/red]", "[link=http://x]y[/link]", ":smile:", ":red_circle:", "\\[",
          "[", "]", "$x$", "{0}", "%s", "\x1b[31m", "kvprof[replay]"]
ARGV_SURROGATES = st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF, categories=["Cs"])
ANY_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
PLAIN = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters="/"), max_size=3)


def hostile(surrogates=ANY_SURROGATE) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(MARKUP) | surrogates | PLAIN, min_size=1, max_size=4).map("".join).filter(
        lambda s: s.strip() and s not in (".", ".."))


EXHAUSTIVE = os.environ.get("KVPROF_FUZZ_EXHAUSTIVE") == "1"
SWEEP = settings(max_examples=60 if EXHAUSTIVE else 10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


def printed(text: str, output: str) -> bool:
    """Whether ``output`` shows ``text`` as it is (escaped where it must be), line breaks and blanks aside."""
    return one_line(printable(text)) in one_line(output)


def as_read(text: str) -> str:
    """``text`` as a JSON file holding it reads back: JSON joins a high and a low surrogate into one character."""
    return json.loads(json.dumps(text))


def clean_exit(result) -> None:
    """The command ended by its own decision: an exit code, never a traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output


# --- paths ------------------------------------------------------------------------------------------

PATH_COMMANDS = [
    ("inspect", ["{path}"]),
    ("fit", ["{path}", "-o", "{tmp}/hp.json"]),
    ("show", ["{path}"]),
    ("compare", ["{path}", "-o", "{tmp}/out"]),
    ("compare", ["{trace}", "--config", "{path}", "-o", "{tmp}/out", "--eval-window", "0:"]),
    ("compare", ["{trace}", "--cost", "{path}", "-o", "{tmp}/out", "--eval-window", "0:", "--policies", "lru"]),
    ("replay", ["{path}", "--model", "m", "-o", "{tmp}/out"]),
    ("replay", ["{trace}", "--config", "{path}", "--model", "m", "-o", "{tmp}/out"]),
]


@SWEEP
@given(name=hostile(ARGV_SURROGATES))
@pytest.mark.parametrize("command, args", PATH_COMMANDS, ids=[f"{c} {a[-3] if len(a) > 3 else a[0]}" for c, a in PATH_COMMANDS])
def test_a_missing_file_is_named_as_given_whatever_its_name(tmp_path, command, args, name):
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD_LINES)
    path = tmp_path / ("no-such-" + name)
    result = invoke(command, *[a.format(path=path, tmp=tmp_path, trace=trace) for a in args])
    clean_exit(result)
    assert result.exit_code in (1, 2)
    assert printed(str(path), result.output), result.output


@SWEEP
@given(name=hostile(ARGV_SURROGATES))
def test_a_trace_of_any_name_is_read_and_titled_by_it(tmp_path, name):
    path = tmp_path / (name + ".jsonl")
    try:
        path.write_text(GOOD_LINES)
    except (OSError, UnicodeEncodeError):
        return  # a name this file system refuses
    result = invoke("inspect", path)
    clean_exit(result)
    assert result.exit_code == 0 and printed(path.name, result.stdout)


def test_kvprofs_own_hints_keep_their_brackets(tmp_path, monkeypatch):
    """'pip install kvprof[replay]' once printed as 'pip install kvprof': rich read [replay] as a tag."""
    import builtins

    real_import = builtins.__import__

    def no_replay(name, *args, **kwargs):
        if name == "kvprof.replay":
            raise ImportError("No module named 'httpx'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_replay)
    result = invoke("replay", tmp_path / "t.jsonl", "--model", "m", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "pip install 'kvprof[replay]'" in result.stderr


# --- trace values -----------------------------------------------------------------------------------

GOOD_LINES = "".join(json.dumps({"chat_id": i, "parent_chat_id": -1, "timestamp": float(i), "input_length": 40,
                                 "output_length": 5, "type": "text", "turn": 1, "hash_ids": [i % 3, 2, 3]}) + "\n"
                     for i in range(12))


def hostile_trace(path: Path, values: list[str]) -> Path:
    """Sessions whose type and ``model`` field take each value in turn, their blocks shared within a value."""
    rows = []
    for i in range(240):
        value = values[i % len(values)]
        rows.append({"chat_id": i, "parent_chat_id": -1, "timestamp": i * 0.5, "input_length": 48,
                     "output_length": 4, "type": value, "turn": 1, "model": value,
                     "hash_ids": [1000 * (i % len(values)), 1000 * (i % len(values)) + 1, 5000 + i]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


#: Values that once collided with derived names or broke the loader (items 4, 5, 10 of issue 14).
DERIVED = ["text", "text@reused", "<default>", "all", "a,b=c", "50%", "%40", "x<=3"]


#: Value sets that cover the classes at once: markup, emoji codes, lone surrogates (high and low),
#: control characters, and the names kvprof derives.
VALUE_SETS = [DERIVED[:4], DERIVED[4:] + ["[bold]x[/]"], ["\ud800", "\udcff", ":smile:", "\x1b[31m"]]


def _check_classes(tmp_path, values):
    """fit, show and inspect on ``values`` as types and as a field: each value its own class (never another's
    reused tier or the default), the file fit writes loads (the conftest loads every saved file back) and
    prints, and inspect shows each value as the trace holds it."""
    from kvprof.classes import workload_class
    from kvprof.models.hp import load_hp

    trace = hostile_trace(tmp_path / "t.jsonl", values)
    shown = invoke("inspect", trace)
    clean_exit(shown)
    assert shown.exit_code == 0, shown.output
    for value in values:
        assert printed(as_read(value), shown.stdout)
    for key in (["--class-key", "type"], ["--class-field", "model", "--cell-fields", "model"]):
        hp_path = tmp_path / "hp.json"
        fitted = invoke("fit", trace, "-o", hp_path, "--window", "0:", "--min-samples", "1", *key)
        clean_exit(fitted)
        assert fitted.exit_code == 0, fitted.output
        hp = load_hp(hp_path)
        rule = hp.class_rule
        names = {workload_class(rule, as_read(v), 1, as_read(v)) for v in values}
        assert len(names) == len(values) and names <= set(hp.classes)  # each value its own fitted class
        assert all(hp.classes[name].diagnostics["n_accesses"] > 0 for name in names)
        listed = invoke("show", hp_path)
        clean_exit(listed)
        assert listed.exit_code == 0, listed.output


@pytest.mark.parametrize("values", VALUE_SETS, ids=["derived", "syntax", "escapes"])
def test_any_type_or_field_value_is_its_own_class_printed_as_it_is(tmp_path, values):
    _check_classes(tmp_path, values)


@settings(max_examples=30 if EXHAUSTIVE else 3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(values=st.lists(hostile() | st.sampled_from(DERIVED), min_size=2, max_size=4, unique=True))
def test_drawn_type_and_field_values_are_classes_of_their_own(tmp_path, values):
    if len({as_read(v) for v in values}) < len(values):
        return  # two values JSON reads alike
    _check_classes(tmp_path, values)


# --- hp and results files ---------------------------------------------------------------------------


@SWEEP
@given(text=hostile())
def test_strings_of_an_hp_file_print_as_they_are(tmp_path, text):
    document = json.loads(Path("configs/bailian-a-hp-v1.json").read_text())
    document["provenance"] = {"trace": text, "window": [text], "created": text, "kvprof_version": text}
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(document))
    result = invoke("show", path)
    clean_exit(result)
    assert result.exit_code == 0 and printed(as_read(text), result.stdout)


RESULTS = {"schema": "kvprof.results/1", "complete": True, "config": {"policies": ["lru"]},
           "inputs": {"trace": {"source": "t.jsonl"}},
           "runs": [{"policy": "lru", "capacity": 16, "n_requests": 3, "token_hit_ratio": 0.5,
                     "qttft_mean_s": 1.0, "qttft_p99_s": 2.0}]}


@settings(SWEEP, max_examples=25 if EXHAUSTIVE else 6)
@given(text=hostile())
def test_strings_of_a_results_file_print_and_plot_as_they_are(tmp_path, text):
    document = json.loads(json.dumps(RESULTS))
    document["config"]["policies"] = [text]
    document["runs"][0]["policy"] = text
    document["inputs"]["trace"]["source"] = text
    path = tmp_path / "r.json"
    path.write_text(json.dumps(document))
    result = invoke("show", path, "-o", tmp_path / "plots")
    clean_exit(result)
    assert result.exit_code == 0, result.output
    if len(printable(as_read(text))) <= 16:  # longer ones fold in the policy column
        assert printed(as_read(text), result.stdout)
    assert len(list((tmp_path / "plots").iterdir())) == 4


def test_hp_results_and_cost_files_may_start_with_a_byte_order_mark(tmp_path):
    """A trace with a BOM was read; an hp file with one was refused. Now every JSON file is read alike."""
    hp = tmp_path / "hp.json"
    hp.write_bytes(b"\xef\xbb\xbf" + Path("configs/bailian-a-hp-v1.json").read_bytes())
    results_path = tmp_path / "results.json"
    results_path.write_bytes(b"\xef\xbb\xbf" + json.dumps(RESULTS).encode())
    cost = tmp_path / "cost.json"
    cost.write_bytes(b"\xef\xbb\xbf" + b'{"schema": "kvprof.cost/1", "prefill_tokens_per_s": 5000.0}')
    assert invoke("show", hp).exit_code == 0
    assert invoke("show", results_path).exit_code == 0
    from kvprof.sim.config import CostModel

    assert CostModel.from_file(cost).prefill_tokens_per_s == 5000.0


# --- the output rule --------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["fit", "{trace}", "-o", "{trace}"],
    ["fit", "{trace}", "-o", "{link}"],
    ["compare", "{results_trace}", "-o", "{tmp}/r", "--eval-window", "0:"],
    ["compare", "{trace}", "--config", "{tmp}/r/results.json", "-o", "{tmp}/r", "--eval-window", "0:"],
    ["compare", "{trace}", "--cost", "{tmp}/r/hit_ratio.png", "-o", "{tmp}/r", "--eval-window", "0:"],
    ["replay", "{tmp}/r/requests.jsonl", "--model", "m", "-o", "{tmp}/r"],
    ["replay", "{trace}", "--config", "{tmp}/r/results.json", "--model", "m", "-o", "{tmp}/r"],
    ["show", "{tmp}/r/hit_ratio.png", "-o", "{tmp}/r"],
    ["fit", "{tmp}/r", "-o", "{tmp}/r/recording.json"],  # a directory stands for its recording's files
])
def test_an_output_never_replaces_an_input_of_the_same_run(tmp_path, args):
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD_LINES)
    (tmp_path / "link.jsonl").symlink_to(trace)
    run = tmp_path / "r"
    run.mkdir()
    for name in ("results.json", "hp.json", "requests.jsonl", "hit_ratio.png", "recording.json"):
        (run / name).write_text(GOOD_LINES)
    filled = [a.format(trace=trace, link=tmp_path / "link.jsonl", tmp=tmp_path, results_trace=run / "results.json")
              for a in args]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = invoke(*filled)
    clean_exit(result)
    assert result.exit_code == 2 and "is also an input of this run" in one_line(result.output), result.output
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("command", ["fit", "synth", "compare", "replay", "demo", "show"])
@pytest.mark.parametrize("where", ["under a file", "a directory for a file", "unwritable"])
def test_an_output_that_cannot_be_written_is_refused_by_its_given_path_before_any_work(tmp_path, command, where):
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD_LINES)
    results_path = tmp_path / "r.json"
    results_path.write_text(json.dumps(RESULTS))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if where == "unwritable" and os.access(locked, os.W_OK):
        pytest.skip("running as a user who may write anywhere (root)")
    is_file = command in ("fit", "synth")
    if where == "a directory for a file" and not is_file:
        return
    target = {"under a file": trace / ("x.json" if is_file else "out"), "a directory for a file": locked,
              "unwritable": locked / ("x.json" if is_file else "out")}[where]
    args = {"fit": [trace, "-o", target], "synth": ["-o", target], "compare": [trace, "-o", target],
            "replay": [trace, "--model", "m", "-o", target], "demo": ["-o", target],
            "show": [results_path, "-o", target]}[command]
    before = sorted(tmp_path.rglob("*"))
    result = invoke(command, *args)
    clean_exit(result)
    assert result.exit_code == 2 and str(target) in one_line(result.output), result.output
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("command", ["fit", "synth", "compare", "show"])
@pytest.mark.parametrize("target", ["name of 300 bytes", "a loop of links", "under a loop of links", "no such dir"])
def test_odd_output_paths_are_refused_before_any_work(tmp_path, command, target):
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD_LINES)
    results_path = tmp_path / "r.json"
    results_path.write_text(json.dumps(RESULTS))
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    path = {"name of 300 bytes": tmp_path / ("x" * 300), "a loop of links": tmp_path / "loop1",
            "under a loop of links": tmp_path / "loop1" / "x", "no such dir": tmp_path / "nope" / "x"}[target]
    if command in ("compare", "show") and target == "no such dir":
        return  # an output directory is made with its parents
    args = {"fit": [trace, "-o", path], "synth": ["-o", path], "compare": [trace, "-o", path],
            "show": [results_path, "-o", path]}[command]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = invoke(command, *args)
    clean_exit(result)
    assert result.exit_code == 2, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("args", [
    ["compare", "{trace}", "-o", "{out}", "--eval-window", "999:"],
    ["compare", "{bad}", "-o", "{out}"],
    ["compare", "{trace}", "--config", "{bad}", "-o", "{out}"],
    ["compare", "{trace}", "--cost", "{bad}", "-o", "{out}"],
    ["replay", "{bad}", "--model", "m", "-o", "{out}"],
    ["replay", "{trace}", "--config", "{missing}", "--model", "m", "-o", "{out}"],
    ["show", "{bad}", "-o", "{out}"],
    ["fit", "{bad}", "-o", "{out}/hp.json"],
])
def test_a_rejected_run_creates_nothing(tmp_path, args):
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD_LINES)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "nothing kvprof reads"}')
    filled = [a.format(trace=trace, bad=bad, out=tmp_path / "out", missing=tmp_path / "missing.json") for a in args]
    result = invoke(*filled)
    clean_exit(result)
    assert result.exit_code in (1, 2) and not (tmp_path / "out").exists(), result.output


def test_synth_writes_what_its_suffix_says_or_refuses(tmp_path):
    import gzip

    assert invoke("synth", "--hours", "0.01", "-o", tmp_path / "x.jsonl.GZ").exit_code == 0
    assert gzip.decompress((tmp_path / "x.jsonl.GZ").read_bytes()).startswith(b'{"chat_id"')
    for name in ("x.jsonl.bz2", "x.jsonl.XZ", "x.zip"):
        result = invoke("synth", "--hours", "0.01", "-o", tmp_path / name)
        assert result.exit_code == 2 and "kvprof writes plain JSONL, gzip" in one_line(result.output)
    result = invoke("synth", "--hours", "1e-6", "-o", tmp_path / "empty.jsonl")
    assert result.exit_code == 2 and "holds no request" in one_line(result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl.GZ"]


# --- streams and signals ----------------------------------------------------------------------------

KVPROF = [sys.executable, "-c", "from kvprof.cli.app import main; main()"]


def test_a_closed_stdout_ends_the_command_quietly(tmp_path):
    trace = hostile_trace(tmp_path / "t.jsonl", ["a", "b"])
    for args in (["inspect", str(trace)], ["inspect", str(trace), "--json"]):
        process = subprocess.Popen([*KVPROF, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        process.stdout.readline()
        process.stdout.close()  # as `| head -1` does
        stderr = process.stderr.read()
        assert process.wait(timeout=120) == 0 and stderr == b"", stderr


def test_off_a_terminal_progress_prints_no_blank_lines(tmp_path):
    trace = hostile_trace(tmp_path / "t.jsonl", ["a", "b"])
    done = subprocess.run([*KVPROF, "fit", str(trace), "-o", str(tmp_path / "hp.json"), "--window", "0:", "-j", "1"],
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.decode().splitlines()
    assert lines and all(line.strip() for line in lines), lines


def test_lone_surrogates_reach_a_real_terminal_escaped(tmp_path):
    """Outside the test runner's streams too: stdout and stderr escape what UTF-8 cannot encode."""
    trace = hostile_trace(tmp_path / "t.jsonl", ["\ud800", "x"])
    done = subprocess.run([*KVPROF, "inspect", str(trace)], capture_output=True, timeout=120)
    assert done.returncode == 0 and b"\\ud800" in done.stdout, done.stderr
    missing = tmp_path / "\udcff[bold]x.jsonl"  # a file name that is not UTF-8, as a command line carries it
    done = subprocess.run([*KVPROF, "inspect", str(missing)], capture_output=True, timeout=120)
    assert done.returncode == 1 and b"\\udcff[bold]x.jsonl: No such file" in done.stderr, done.stderr


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_during_a_write_leaves_no_temporary_file(tmp_path, signum, code):
    """synth writes its trace through a hidden temporary file: a signal removes it and exits 128 + signal."""
    process = subprocess.Popen([*KVPROF, "synth", "--hours", "6", "-o", str(tmp_path / "t.jsonl")],
                               stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):  # writing has begun
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    process.send_signal(signum)
    assert process.wait(timeout=60) == code
    assert list(tmp_path.iterdir()) == [], process.stderr.read()


def test_json_output_is_strict_json(capsys):
    """--json output is read by scripts: no NaN or Infinity tokens, no numpy scalars, whatever the data."""
    import numpy as np

    from kvprof.cli.output import print_json

    print_json({"a": float("nan"), "b": [np.float64("inf"), np.int64(3), (1.5, -float("inf"))], "c": "\ud800"})

    def refuse(token):
        raise AssertionError(f"{token} in the output")

    assert json.loads(capsys.readouterr().out, parse_constant=refuse) == {"a": None, "b": [None, 3, [1.5, None]],
                                                                          "c": "\ud800"}
