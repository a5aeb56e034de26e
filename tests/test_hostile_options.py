"""Every option value, swept: numbers are read one way (ASCII digits, inside their bounds), usage errors exit 2
before any work (no input read, nothing created), options that contradict each other are refused.

The sweeps find the options by walking the typer app, so an option added later is swept too.
"""

from __future__ import annotations

import math
import os
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.main import get_command

from kvprof.cli.app import app
from kvprof.cli.common import bounded_parser
from kvprof.limits import INT64_MAX, Bound
from tests.helpers import invoke, one_line

COMMANDS = get_command(app).commands
EXHAUSTIVE = os.environ.get("KVPROF_FUZZ_EXHAUSTIVE") == "1"


def required_args(command: str, tmp_path) -> list:
    """The least a command needs beside the option under test: a trace that does not exist (so reading it
    would fail with exit 1, not 2) and an output inside ``tmp_path/out`` (so creating it shows)."""
    missing, out = tmp_path / "no-such-trace.jsonl", tmp_path / "out"
    return {
        "fit": [missing, "-o", tmp_path / "hp.json"],
        "inspect": [missing],
        "show": [tmp_path / "no-such.json"],
        "synth": ["-o", tmp_path / "t.jsonl"],
        "compare": [missing, "-o", out],
        "demo": ["-o", out],
        "replay": [missing, "--model", "m", "-o", out],
        "fleet": [missing, "-o", out],
    }[command]


def _is_number(param) -> bool:
    """Whether a parameter's annotation is int or float (or Optional of one); flags are bool, not int."""
    annotation = param.type_descriptor.annotation
    return any(kind in (int, float) for kind in typing.get_args(annotation) or (annotation,))


NUMBER_OPTIONS = [(name, param) for name, command in COMMANDS.items() for param in command.params if _is_number(param)]


def test_every_number_option_is_read_by_the_one_rule():
    """No option is parsed by int() or float() (which take 6_4, Arabic-Indic digits, nan, inf)."""
    assert len(NUMBER_OPTIONS) >= 35
    loose = [f"{name} {param.opts[0]}" for name, param in NUMBER_OPTIONS if bounded_parser(param) is None]
    assert loose == []


def _bad_texts(bound: Bound) -> list[str]:
    """Texts the option must refuse: not ASCII digits, one past each bound (or beyond any float).

    By default a few per option (the rule itself is property-tested below); every one of them with
    ``KVPROF_FUZZ_EXHAUSTIVE=1``.
    """
    if bound.whole:
        edges = [str(int(bound.high) + 1), str(int(bound.low) - 1)]
    else:
        edges = [repr(bound.high * 10 if bound.high > 0 else 1.0) if math.isfinite(bound.high) else "1e999",
                 (repr(bound.low) if bound.low_open else repr(bound.low - max(1.0, abs(bound.low))))
                 if math.isfinite(bound.low) else "-1e999"]
    texts = ["\u0666\u0664", *edges]
    if EXHAUSTIVE:
        texts += ["6_4", "\u00b2", " 64", "0x10", "", "+", "nan", "inf", "-inf", "1e999", "9" * 5000, "\uff11"]
        texts += ["1e3", "2.0"] if bound.whole else ["1.5.0"]
    return texts


@pytest.mark.parametrize("command, param", NUMBER_OPTIONS, ids=[f"{c} {p.opts[0]}" for c, p in NUMBER_OPTIONS])
def test_a_number_option_refuses_what_is_not_a_number_inside_its_bounds_before_any_work(tmp_path, command, param):
    bound = bounded_parser(param).bound
    for text in _bad_texts(bound):
        result = invoke(command, *required_args(command, tmp_path), param.opts[0], text)
        assert result.exit_code == 2, (text, result.output)
        assert param.opts[0] in result.output and "must be" in one_line(result.output), (text, result.output)
        assert "Traceback" not in result.output and result.exception.__class__ is SystemExit
        assert sorted(p.name for p in tmp_path.iterdir()) == [], (text, "created something")


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=12) | st.from_regex(r"[+-]?[0-9]{1,25}(\.[0-9]*)?([eE][+-]?[0-9]{1,4})?", fullmatch=True),
       whole=st.booleans(), low=st.sampled_from([-math.inf, -5, 0, 1, 1e-6]),
       high=st.sampled_from([math.inf, 0, 7, 2**31 - 1, INT64_MAX, 1e6]), low_open=st.booleans())
def test_bound_parse_takes_ascii_numbers_inside_the_bounds_and_nothing_else(text, whole, low, high, low_open):
    """The rule itself: a text is a number iff it is ASCII digits (a sign, for floats a point and an
    exponent) whose value is finite and inside the bounds; never another exception."""
    import re

    if whole and (not isinstance(low, int) and math.isfinite(low) or not isinstance(high, int) and math.isfinite(high)):
        return
    bound = Bound(low, high, whole=whole, low_open=low_open)
    pattern = r"[+-]?[0-9]+" if whole else r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    try:
        value = bound.parse(text)
    except ValueError as exc:
        assert "must be" in str(exc)
        if re.fullmatch(pattern, text, re.ASCII) and len(text) < 400:
            number = int(text) if whole else float(text)
            assert not bound.accepts(number)
        return
    assert re.fullmatch(pattern, text, re.ASCII)
    assert type(value) is (int if whole else float) and bound.accepts(value)
    assert (low < value if low_open else low <= value) and value <= high and math.isfinite(value)


LISTS = [
    ("fit", "--capacity"), ("compare", "--capacity"), ("compare", "--capacity-schedule"),
    ("fit", "--window"), ("inspect", "--window"), ("replay", "--window"), ("compare", "--fit-window"),
    ("compare", "--eval-window"), ("compare", "--policies"), ("fleet", "--router"), ("fleet", "--replicas"),
    ("fleet", "--capacity"), ("fit", "--cell-fields"),
]
#: Every list refuses an empty item, an empty list and spaces around an item (read as every number is).
EMPTY_ITEMS = ["a,,b", "", "a,", ",a"]
LIST_TEXTS = {
    "--capacity": ["6_4", "64,\u0666\u0664", "64,,128", "64, 9223372036854775808", "0", "-64", "64,nan", "1e3",
                   " 64", "64 ", "64, 128", "64,", ""],
    "--replicas": ["4,,8", "4, 8", " 4", "", "4,"],
    "--policies": EMPTY_ITEMS, "--router": EMPTY_ITEMS, "--cell-fields": EMPTY_ITEMS,
    "--capacity-schedule": ["0:64,0:16", "0:64,10:16,5:8", "0:6_4", "0:64,inf:16", "0:64,1e999:8", "5:64", "0:0",
                            "0:64,nan:16", "0:\u0666\u0664", "0:64;1:2", "0:64,,10:32", " 0:64", "0: 64", "0:64,"],
    "window": ["0:nan", "inf:", ":1e999", "0:\u0666", "1_0:", "5:1", "0:0", "abc", "0:1:2", "0 :100", " 0:100",
               "0: 100", "-5:-5", "-0:-10"],
}


@pytest.mark.parametrize("command, option", LISTS, ids=[f"{c} {o}" for c, o in LISTS])
def test_list_and_window_options_follow_the_same_rule(tmp_path, command, option):
    for text in LIST_TEXTS.get(option, LIST_TEXTS["window"]):
        result = invoke(command, *required_args(command, tmp_path), option, text)
        assert result.exit_code == 2, (text, result.output)
        assert option in result.output and result.exception.__class__ is SystemExit, (text, result.output)
        assert list(tmp_path.iterdir()) == [], text


@pytest.mark.parametrize("args, words", [
    (["fit", "{missing}", "-o", "{tmp}/hp.json", "--engine-block-size", "128"], "give it with --capacity"),
    (["fit", "{missing}", "-o", "{tmp}/hp.json", "-j", "0"], "must not be 0"),
    (["compare", "{missing}", "-o", "{tmp}/out", "-j", "0"], "must not be 0"),
    (["demo", "-o", "{tmp}/out", "-j", "0"], "must not be 0"),
    (["fit", "{missing}", "-o", "{tmp}/hp.json", "--capacity", "100000000000"], "this machine's"),
    (["fit", "{missing}", "-o", "{tmp}/hp.json", "--capacity", "64,64"], "given twice"),
    (["compare", "{missing}", "-o", "{tmp}/out", "--capacity", "64", "--capacity-schedule", "0:64"], "not both"),
    (["compare", "{missing}", "-o", "{tmp}/out", "--decode-time", "0.1"], "give --decode too"),
    (["compare", "{missing}", "-o", "{tmp}/out", "--no-decode", "--decode-time", "0.1"], "give --decode too"),
    (["fit", "{missing}", "-o", "{tmp}/hp.json", "--cell-fields", "class"], "class=<name> is the request's class"),
    (["fit", "{missing}", "-o", "{tmp}/hp.json", "--cell-fields", "a=b"], "cannot name a cell field"),
    (["fit", "{missing}", "-o", "{tmp}/hp.json", "--cell-fields", "model,model"], "named twice"),
    (["replay", "{missing}", "--model", "m", "-o", "{tmp}/out", "--policy", "belady"], "needs the future"),
    (["replay", "{missing}", "--model", "m", "-o", "{tmp}/out", "--too-long", "drop"], "not one of skip, clip"),
    (["replay", "{missing}", "--model", "m", "-o", "{tmp}/out", "--url", "http://h:port"], "is not an http"),
    (["replay", "{missing}", "--model", "m", "-o", "{tmp}/out", "--url", "http://a..b/"], "is not an http"),
    (["replay", "{missing}", "--model", "m", "-o", "{tmp}/out", "--url", "http://\udcff/"], "is not an http"),
    (["replay", "{missing}", "--model", "m", "-o", "{tmp}/out", "--url", "http://127.0.0.1:99999"], "is not an http"),
])
def test_contradicting_or_impossible_options_exit_2_before_any_work(tmp_path, args, words):
    filled = [a.format(missing=tmp_path / "no-such-trace.jsonl", tmp=tmp_path) for a in args]
    result = invoke(*filled)
    assert result.exit_code == 2, result.output
    assert words in one_line(result.output) and list(tmp_path.iterdir()) == []


GOOD = ('{"chat_id": %d, "parent_chat_id": -1, "timestamp": %d, "input_length": 40, "output_length": 5, '
        '"type": "text", "turn": 1, "hash_ids": [%d, 2, 3], "model": "m1"}\n')


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(GOOD % (i, i, i) for i in range(20)))
    return path


@pytest.mark.parametrize("args, words", [
    (["compare", "{trace}", "-o", "{tmp}/out", "--block-size", "24"], "24 tokens is not a multiple of the trace's 16"),
    (["compare", "{trace}", "-o", "{tmp}/out", "--block-size", "100", "--trace-block-tokens", "32"], "not a multiple"),
    (["fit", "{trace}", "-o", "{tmp}/hp.json", "--capacity", "64", "--engine-block-size", "17"], "not a multiple"),
    (["fit", "{trace}", "-o", "{tmp}/hp.json", "--class-field", "tenant"], "'tenant' is not a field of t.jsonl's"),
    (["inspect", "{trace}", "--class-field", "tenant"], "'tenant' is not a field of t.jsonl's"),
    (["fit", "{trace}", "-o", "{tmp}/hp.json", "--cell-fields", "type"], "'type' is a field every bailian record has"),
    (["fit", "{trace}", "-o", "{tmp}/hp.json", "--cell-fields", "tenant"], "fields --cell-fields can name: model"),
])
def test_options_that_do_not_fit_the_trace_exit_2_before_fitting(tmp_path, trace, args, words):
    """Checked on the trace's first line (block sizes) or right after reading it (fields), never after fitting."""
    filled = [a.format(trace=trace, tmp=tmp_path) for a in args]
    result = invoke(*filled)
    assert result.exit_code == 2, result.output
    assert words in one_line(result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


# --- messages that mislead (issue 21, item 19) ------------------------------------------------------


def test_every_help_text_keeps_its_brackets():
    """Help is rich markup: 'pip install kvprof[ray]' printed as 'pip install kvprof' ([ray] read as a tag)."""
    from rich.text import Text

    root = get_command(app)
    for name, command in root.commands.items():
        for text in [command.help or "", *(getattr(param, "help", None) or "" for param in command.params)]:
            shown = Text.from_markup(text).plain
            assert shown == text.replace("\\[", "["), f"{name}: rich reads a bracket of {text!r} as a tag; write \\["
    result = invoke("compare", "--help")
    assert "kvprof[ray]" in result.stdout


def test_a_bound_is_described_by_the_numbers_it_keeps():
    """'must be > 0 and <= 1, got int 1': the limit 1 - 1e-12 printed as 1."""
    from kvprof.models.hp import OPEN_PROBABILITY

    assert OPEN_PROBABILITY.describe() == "a finite number > 0 and <= 0.999999999999"
    assert Bound(0.0, 1e6, low_open=True).describe() == "a finite number > 0 and <= 1e+06"


@settings(max_examples=200, deadline=None)
@given(st.floats(-1e12, 1e12), st.floats(0, 1e12))
def test_the_limits_a_bound_states_are_its_limits(low, width):
    high = low + width
    words = Bound(low, high).describe().split()
    assert float(words[words.index("from") + 1]) == low and float(words[-1]) == high


def _held_blocks() -> int:
    from kvprof.sim.config import BYTES_PER_SLOT

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // BYTES_PER_SLOT


@pytest.mark.parametrize("command, limit", [("fit", 2**40), ("compare", INT64_MAX), ("fleet", INT64_MAX)])
def test_capacities_are_refused_by_the_limit_that_applies(tmp_path, command, limit):
    """The limit a message states is the one that applies: fit's, or what this machine's memory holds (not 2^63 - 1)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 20, '
                     '"output_length": 5, "type": "text", "turn": 1, "hash_ids": [1, 2]}\n')
    high = min(limit, _held_blocks())
    for value in ("0", str(high + 1)):
        result = invoke(command, trace, "--capacity", value, "-o", tmp_path / "out")
        assert result.exit_code == 2
        assert f"must be an integer from 1 to {high}, got '{value}'" in one_line(result.output)
        assert str(INT64_MAX) not in one_line(result.output)


@pytest.mark.parametrize("kind", ["directory", "fifo", "dangling link", "missing"])
def test_a_recording_json_that_is_no_file_is_said_to_be_what_it_is(tmp_path, kind):
    recording = tmp_path / "rec"
    recording.mkdir()
    target = recording / "recording.json"
    if kind == "directory":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "dangling link":
        target.symlink_to(tmp_path / "gone.json")
    result = invoke("inspect", recording)
    assert result.exit_code == 1
    expected = {"directory": "its recording.json is a directory, not a file",
                "fifo": "its recording.json is a FIFO, not a file",
                "dangling link": f"its recording.json is a link to {str(tmp_path / 'gone.json')!r}, which does not exist",
                "missing": "no recording.json"}[kind]
    assert expected in one_line(result.output)
