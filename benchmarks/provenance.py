"""Where and how a benchmark ran: the facts its JSON carries beside the figures.

``facts()`` gives the commit, the package's files that differed from it, the date, the machine
in words (cores, processor, memory, GPU or none, Python) and the command as run from the
repository root. benchmarks/render_results.py prints them above each table it renders.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.rstrip() if done.returncode == 0 else ""


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _gpu() -> str:
    if not shutil.which("nvidia-smi"):
        return "no GPU"
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "no GPU"
    names = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return ", ".join(names) if names else "no GPU"


def command(argv: list[str] | None = None) -> str:
    """The command line as run from the repository root: ``python benchmarks/NAME.py ARGS``, an absolute
    path outside the repository written PATH (the machine's paths are no part of a result)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    try:
        argv[0] = str(script.relative_to(REPO))
    except ValueError:
        argv[0] = script.name
    return "python " + shlex.join([argv[0], *map(_no_machine_path, argv[1:])])


def _no_machine_path(arg: str) -> str:
    """An absolute path in an argument made relative to the repository, or PATH outside it."""
    option, sep, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
    if value.startswith("/"):
        try:
            value = str(Path(value).resolve().relative_to(REPO))
        except ValueError:
            value = "PATH"
    return option + sep + value


def facts(argv: list[str] | None = None) -> dict:
    """The run's provenance: commit, clean or not, date, machine, load and command (no paths)."""
    changed = [line[3:] for line in _git("status", "--porcelain", "--", "kvprof").splitlines()]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "commit": _git("rev-parse", "--short=7", "HEAD") or None,
        "uncommitted": changed,  # files of the package that differed from the commit
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": {
            "cores": os.cpu_count(),
            "processor": _processor(),
            "memory_gib": _memory_gib(),
            "gpu": _gpu(),
            "python": platform.python_version(),
        },
        "load_average_at_start": None if load is None else round(load, 2),
        "command": command(argv),
    }
