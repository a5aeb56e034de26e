"""``kvprof warm``: compile kvprof's core ahead of use, into a cache an image can ship."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvprof.cli.common import guarded
from kvprof.cli.output import say, show, status

#: The small synthetic trace every compiled path is driven with: enough requests for a fit with classes.
_TRACE = ("bailian-a", 0.05, 0)
#: GPU and CPU tiers of its replays, in engine blocks (small: what is compiled does not depend on the size).
_CAPACITY = 64
_BLOCK = 16


@guarded
def warm(
    cache_dir: Annotated[
        Optional[Path],
        typer.Option("--cache-dir", help="Compile into this directory (numba's NUMBA_CACHE_DIR; created if "
                                         "missing). Set NUMBA_CACHE_DIR to it wherever kvprof runs from this cache. "
                                         "Default: numba's own place (the package's __pycache__, or NUMBA_CACHE_DIR "
                                         "where set)."),
    ] = None,
    serving_only: Annotated[
        bool, typer.Option("--serving-only", help="Only what `vllm serve` runs (the pool, the CPU tier's policy, "
                                                  "the live counterfactual), not fit, compare and demo."),
    ] = False,
):
    """Compile kvprof's core for every policy (fit, compare, demo, and what `vllm serve` runs), so that no later
    process compiles: for a container image or a read-only install (docs/vllm.md, "Start-up")."""
    if cache_dir is not None:
        if cache_dir.exists() and not cache_dir.is_dir():
            raise typer.BadParameter(f"{cache_dir} is not a directory", param_hint="--cache-dir")
        cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ["NUMBA_CACHE_DIR"] = str(cache_dir.resolve())  # this process and its workers
        from numba.core import config

        config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
    from kvprof import registry
    from kvprof.profiler.synth import generate, write_jsonl
    from kvprof.vllm.spec import CONFIG_KEY, PolicySpec
    from kvprof.vllm.warmup import warm_up

    rows = []

    def timed(what: str, work) -> None:
        started, cpu = time.perf_counter(), time.process_time()
        with status(f"compiling {what}"):
            work()
        rows.append((what, time.perf_counter() - started, time.process_time() - cpu))

    with tempfile.TemporaryDirectory(prefix="kvprof-warm-") as directory:
        trace_path, hp_path = Path(directory) / "trace.jsonl", Path(directory) / "hp.json"
        write_jsonl(trace_path, generate(*_TRACE))
        from kvprof.profiler.fit import fit_trace
        from kvprof.profiler.reader import read_trace

        trace, _ = read_trace(trace_path, block_size=_BLOCK)
        hp = []
        timed("the fit", lambda: hp.append(fit_trace(trace)))
        hp[0].save(hp_path)
        if not serving_only:
            from kvprof.sim.config import SimConfig
            from kvprof.sim.sweep import run_sweep
            from kvprof.sim.tune import tune

            names = [r.name for r in registry.by_name()]
            timed("the fit's tuning replays", lambda: tune(hp[0], trace, [_CAPACITY], SimConfig(_BLOCK)))
            for cpu in (0, _CAPACITY):
                timed(f"replays of {len(names)} policies" + (" with a CPU tier" if cpu else ""),
                      lambda: run_sweep(trace, hp[0], names, [_CAPACITY], SimConfig(_BLOCK, cpu_capacity=cpu)))
        for registration in registry.live():
            config = {"policy": registration.name, "config": str(hp_path)}
            spec = PolicySpec.from_additional_config({CONFIG_KEY: config})
            timed(f"vllm serve under {registration.name}", lambda: warm_up(spec, object(), _BLOCK))
    show(_table(rows))
    where = cache_dir or os.environ.get("NUMBA_CACHE_DIR") or "numba's default place (the package's __pycache__)"
    say(f"compiled into {where}; a process started with the same NUMBA_CACHE_DIR, package path and kvprof, numba "
        "and Python versions loads it instead of compiling")


def _table(rows):
    from rich.table import Table

    table = Table(title="compiled (nothing shown under 0.5 s was compiled: it was in the cache)")
    for column in ("what", "wall s", "CPU s"):
        table.add_column(column, justify="left" if column == "what" else "right")
    for what, wall, cpu in rows:
        table.add_row(what, f"{wall:.1f}", f"{cpu:.1f}")
    return table
