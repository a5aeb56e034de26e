"""The ``kvprof`` command: one verb per step of the workflow.

Exit codes: 0 success, 1 bad data (trace, hp file), 2 bad usage (options), 130 interrupted
(SIGINT), 143 terminated (SIGTERM, SIGHUP: 129). Messages go to stderr.
"""

from __future__ import annotations

import signal

import typer

from kvprof.cli import compare_cmd, fit_cmd, fleet_cmd, inspect_cmd, replay_cmd, show_cmd, synth_cmd, warm_cmd
from kvprof.cli.output import escape_unencodable_streams

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

app.command("fit")(fit_cmd.fit)
app.command("inspect")(inspect_cmd.inspect)
app.command("show")(show_cmd.show)
app.command("synth")(synth_cmd.synth)
app.command("compare")(compare_cmd.compare)
app.command("demo")(compare_cmd.demo)
app.command("replay")(replay_cmd.replay)
app.command("fleet")(fleet_cmd.fleet)
app.command("warm")(warm_cmd.warm)


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
