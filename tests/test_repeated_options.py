"""A single-valued option given twice is a usage error naming it (exit 2, before any work), in every
command: the last one no longer wins silently. Options declared to repeat (``replay --url``,
``--kv-events``) still repeat.

The sweep finds the options by walking the typer app, so an option added later is swept too.
"""

from __future__ import annotations

import pytest
from typer.main import get_command

from kvprof.cli.app import app
from tests.helpers import invoke, one_line
from tests.test_hostile_options import required_args

COMMANDS = get_command(app).commands
SINGLE = [(name, param) for name, command in COMMANDS.items() for param in command.params
          if param.param_type_name == "option" and not param.multiple and not param.count]
REPEATING = [(name, param) for name, command in COMMANDS.items() for param in command.params
             if param.param_type_name == "option" and param.multiple]


def _required(command: str, tmp_path) -> list:
    return [] if command == "warm" else required_args(command, tmp_path)


def _twice(param, form: str) -> list[str]:
    """The option twice: a flag and then its negation where it has one, else two values, written as ``form``."""
    if param.is_flag:
        return [param.opts[0], (param.secondary_opts or param.opts)[0]]
    first, second = param.opts[-1], param.opts[0]  # the long name and the short one where there is one
    if form == "equals":
        return [f"{first}=1", f"{param.opts[-1]}=2"]
    return [first, "1", second, "2"]


@pytest.mark.parametrize("form", ["separate", "equals"])
@pytest.mark.parametrize("command, param", SINGLE, ids=[f"{c} {p.opts[0]}" for c, p in SINGLE])
def test_a_single_valued_option_given_twice_is_a_usage_error(tmp_path, command, param, form):
    if form == "equals" and param.is_flag:
        pytest.skip("a flag takes no value")
    given = _twice(param, form)
    # the required arguments follow, so that an option they hold (-o) is the third time, not the first
    result = invoke(command, *given, *_required(command, tmp_path))
    assert result.exit_code == 2, result.output
    text = one_line(result.output)
    assert "given twice" in text and param.opts[0] in text, result.output
    assert "Traceback" not in result.output and result.exception.__class__ is SystemExit
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "created something"


@pytest.mark.parametrize("args", [
    ["synth", "--hints", "future", "--hint-accuracy", "-0", "-o", "{tmp}/t.jsonl", "--hours", "0.01"],  # a value like an option
    ["synth", "-o{tmp}/t.jsonl", "--hours=0.01"],
    ["replay", "{tmp}/missing.jsonl", "--model", "m", "--url", "http://127.0.0.1:9", "--url", "http://127.0.0.2:9",
     "--router", "round-robin", "-o", "{tmp}/out"],
    ["replay", "{tmp}/missing.jsonl", "--model", "m", "--url", "http://127.0.0.1:9", "--url", "http://127.0.0.2:9",
     "--router", "prefix-precise", "--kv-events", "tcp://127.0.0.1:9", "--kv-events", "tcp://127.0.0.2:9", "-o",
     "{tmp}/out"],
    ["show", "{tmp}/missing.json", "--", "--json", "--json"],  # after --: arguments, not options
])
def test_options_given_once_or_declared_to_repeat_are_not_refused_as_repeated(tmp_path, args):
    assert {name for name, _ in REPEATING} == {"replay"} and {p.opts[0] for _, p in REPEATING} >= {"--url", "--kv-events"}
    result = invoke(*[arg.format(tmp=tmp_path) for arg in args])
    assert "given twice" not in one_line(result.output), result.output
