"""Comparison plots from a ``kvprof.results/1`` document: hit ratio and QTTFT against capacity.

Figures are built on matplotlib's object API with the Agg canvas, never pyplot, so plotting has
no global state and needs no display. Every text is plain: a ``$`` in a file or policy name is a
dollar sign, not the start of mathtext that fails to parse, and what a font cannot draw (lone
surrogates, control characters) is written escaped, as the terminal shows it
(:func:`kvprof.cli.output.printable`).
"""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path

# matplotlib's own notes (a temporary cache directory where HOME is read-only) are not kvprof's output
logging.getLogger("matplotlib").setLevel(logging.ERROR)

import matplotlib  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvprof.atomic import StagedFiles, staged  # noqa: E402
from kvprof.cli.output import printable  # noqa: E402

#: (file stem, y label, metric keys plotted, y scale); ``{kind}`` says whether QTTFT was modelled or measured.
PANELS = (
    ("hit_ratio", "token hit ratio (cached / prompt tokens)", ("token_hit_ratio",), "linear"),
    ("qttft", "{kind} queued TTFT (s)\nmean solid, p99 dashed", ("qttft_mean_s", "qttft_p99_s"), "log"),
)
#: Line styles of a panel's metrics, in ``PANELS`` order. Each has a marker: a live replay is one
#: capacity, a single point that a line without markers would not draw at all.
STYLES = ("-o", "--x")
#: Every panel is written in each of these formats.
FORMATS = ("png", "svg")
#: The files :func:`plot_results` writes into its directory.
FILES = tuple(f"{panel[0]}.{suffix}" for panel in PANELS for suffix in FORMATS)


def plot_results(results: dict, out_dir: Path, staging: StagedFiles | None = None) -> list[Path]:
    """Write ``hit_ratio`` and ``qttft`` plots as PNG and SVG into ``out_dir``, all together atomically.

    Parameters
    ----------
    results : dict
        A ``kvprof.results/1`` document (``Results.to_dict()``, ``kvprof replay``'s), or several
        joined by :func:`kvprof.results.merge`. Every run needs a capacity.
    out_dir : Path
    staging : StagedFiles or None
        The other outputs of the run, put in place with the plots (by the caller); None puts the
        plots in place by themselves.

    Returns
    -------
    list of Path
        The files written.
    """
    if staging is None:
        with staged() as group:
            return plot_results(results, out_dir, group)
    with matplotlib.rc_context({"text.parse_math": False}):
        return [path for panel in PANELS for path in _plot_panel(results, out_dir, staging, *panel)]


def _plot_panel(results: dict, out_dir: Path, staging: StagedFiles, stem: str, ylabel: str, keys: tuple[str, ...], scale: str) -> list[Path]:
    """One panel (``PANELS`` entry) as PNG and SVG."""
    runs = results["runs"]
    series = list(dict.fromkeys(_series(run) for run in runs))
    columns = math.ceil(len(series) / LEGEND_ROWS)
    figure = Figure(figsize=(7 + 2.5 * columns, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, color in zip(series, _colors(len(series))):
        points = sorted((r for r in runs if _series(r) == name), key=_capacity)
        for key, style in zip(keys, STYLES):
            values = [(_capacity(r), r[key]) for r in points if r[key] is not None]
            if values:
                axes.plot(*zip(*values), style, color=color, label=printable(name) if style == STYLES[0] else None)
    fleet = any(_in_fleet(run) for run in runs)
    axes.set_xlabel("GPU capacity (usable engine blocks: a vLLM server's num_gpu_blocks - 1"
                    + ("; a fleet's: replicas x per replica)" if fleet else ")"))
    axes.set_ylabel(ylabel.format(kind=_qttft_kind(runs)))
    axes.set_yscale(scale)
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:  # a replay whose every request failed has nothing to label
        figure.legend(title="router, policy" if fleet else "policy", loc="outside right upper", ncols=columns,
                      fontsize="small")
    axes.set_title(_title(results))
    written = []
    for suffix in FORMATS:
        path = out_dir / f"{stem}.{suffix}"
        with staging.open(path) as handle, warnings.catch_warnings():
            # a layout that cannot fit is still a picture; matplotlib's complaint is not kvprof's output
            warnings.filterwarnings("ignore", message="constrained_layout not applied")
            figure.savefig(handle, format=suffix, dpi=120)
        written.append(path)
    return written


#: Legend entries per column, beside the axes: more series add columns (and width), never overflow.
LEGEND_ROWS = 20


def _in_fleet(run: dict) -> bool:
    """Whether ``run`` is a configuration of ``kvprof fleet`` (its router and replica count beside the policy)."""
    return "fleet_policy" in run


def _series(run: dict) -> str:
    """The line ``run`` is a point of: its policy; for a fleet's configuration its policy and router (and hp
    per replica), its replica counts and capacities along the line."""
    if not _in_fleet(run):
        return run["policy"]
    per_replica = run.get("hp", "fleet") != "fleet"
    return f"{run['fleet_policy']}, {run['router']}" + (f", hp {run['hp']}" if per_replica else "")


def _capacity(run: dict) -> int:
    """A run's x: its capacity; a fleet's whole capacity, replicas x per replica."""
    return run["capacity"] * run["replicas"] if _in_fleet(run) else run["capacity"]


def _colors(n: int) -> list:
    """``n`` distinct colours: matplotlib's ten, twenty, or beyond them a continuous map's, evenly spaced."""
    if n <= 10:
        return [f"C{index}" for index in range(n)]
    if n <= 20:
        return [matplotlib.colormaps["tab20"](index) for index in range(n)]
    return [matplotlib.colormaps["turbo"](index / (n - 1)) for index in range(n)]


def _qttft_kind(runs: list[dict]) -> str:
    measured = {bool(run.get("measured")) for run in runs}
    return "measured" if measured == {True} else "modelled" if measured == {False} else "modelled, (live) measured"


def _title(results: dict) -> str:
    trace = results.get("inputs", {}).get("trace", {})
    config = results["config"]
    name = Path(trace.get("source") or "trace").name
    blocks = f", {config['engine_block_size']}-token blocks" if config.get("engine_block_size") else ""
    tiers = f", CPU tier {config['cpu_capacity']} blocks" if config.get("cpu_capacity") else ""
    return printable(f"{name}: {trace.get('n_requests', '?')} requests{blocks}{tiers}")
