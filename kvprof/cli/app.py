"""The ``kvprof`` command: one verb per step of the workflow.

Exit codes: 0 success, 1 bad data (trace, hp file), 2 bad usage (options; a single-valued option
given twice, :class:`OnceCommand`), 130 interrupted
(SIGINT), 143 terminated (SIGTERM, SIGHUP: 129). Messages go to stderr.
"""

from __future__ import annotations

import signal

import typer
from typer.core import TyperCommand

from kvprof.cli import compare_cmd, fit_cmd, fleet_cmd, inspect_cmd, replay_cmd, show_cmd, synth_cmd, warm_cmd
from kvprof.cli.output import escape_unencodable_streams


class OnceCommand(TyperCommand):
    """A command whose single-valued options may each be given once: ``--capacity 256 --capacity 512``
    (or ``--decode --no-decode``) is a usage error naming the option, not the last one silently winning.

    Options declared to repeat (``multiple``: ``replay --url``, ``--kv-events``) repeat as before. Checked
    on the command line as given, before click reads any value, so every command follows the one rule.
    """

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not ctx.resilient_parsing:
            repeated = repeated_option(self, args, ctx.help_option_names)
            if repeated is not None:
                ctx.fail(repeated)
        return super().parse_args(ctx, args)


def repeated_option(command, args: list[str], help_names=()) -> str | None:
    """Why ``args`` give one of ``command``'s single-valued options twice, or None.

    The arguments are walked as click reads them: ``--name value``, ``--name=value``, ``-o value``,
    ``-ovalue``, short flags run together, a value taken as it comes (``--hint-accuracy -0``), nothing
    read after ``--``. A help option anywhere leaves the check to the help (it is shown instead).
    """
    options = {name: param for param in command.params if param.param_type_name == "option"
               for name in (*param.opts, *param.secondary_opts)}
    seen: dict[object, str] = {}
    i = 0

    def given(param, shown: str) -> str | None:
        if param.multiple or param.count:
            return None
        if param in seen:
            names = "/".join((*param.opts, *param.secondary_opts))
            return f"{names} given twice ({seen[param]}, then {shown}); give it once"
        seen[param] = shown
        return None

    def values(param) -> int:
        return 0 if param.is_flag or param.count else max(param.nargs, 1)

    problem = None
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            break
        if token in help_names:
            return None
        if token.startswith("--"):
            name, equals, value = token.partition("=")
            param = options.get(name)
            if param is None:
                continue
            n = values(param)
            if n and not equals:
                value, i = " ".join(args[i:i + n]), i + n
            problem = problem or given(param, ascii(f"{name} {value}" if n else name))
        elif token.startswith("-") and len(token) > 1:
            for k in range(1, len(token)):  # -o value, -ovalue, or flags run together
                param = options.get("-" + token[k])
                if param is None:
                    break
                n = values(param)
                value = token[k + 1:]
                if n and not value:
                    value, i = " ".join(args[i:i + n]), i + n
                problem = problem or given(param, ascii(f"-{token[k]} {value}" if n else f"-{token[k]}"))
                if n:
                    break
    return problem

app = typer.Typer(
    name="kvprof",
    help=(
        "Profile-driven KV-cache eviction for LLM serving: fit per-workload reuse models from a "
        "serving trace, compare eviction policies on it, serve the fitted policy in vLLM."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

for _name, _command in (("fit", fit_cmd.fit), ("inspect", inspect_cmd.inspect), ("show", show_cmd.show),
                        ("synth", synth_cmd.synth), ("compare", compare_cmd.compare), ("demo", compare_cmd.demo),
                        ("replay", replay_cmd.replay), ("fleet", fleet_cmd.fleet), ("warm", warm_cmd.warm)):
    app.command(_name, cls=OnceCommand)(_command)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, unwound as an interrupt is: temporary files removed, what ``replay`` measured
    written; the command exits ``128 + signal``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def _terminate(signum, frame) -> None:
    raise Terminated(signum)


def main() -> None:
    escape_unencodable_streams()
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)
    app()


if __name__ == "__main__":  # python -m kvprof.cli.app
    main()
