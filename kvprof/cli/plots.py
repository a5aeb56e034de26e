"""Comparison plots from a ``kvprof.results/1`` document: hit ratio and QTTFT against capacity.

Figures are built on matplotlib's object API with the Agg canvas, never pyplot, so plotting has
no global state and needs no display. Every text is plain: a ``$`` in a file or policy name is a
dollar sign, not the start of mathtext that fails to parse, and what a font cannot draw (lone
surrogates, control characters) is written escaped, as the terminal shows it
(:func:`kvprof.cli.output.printable`).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvprof.atomic import StagedFiles, staged
from kvprof.cli.output import printable

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
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for index, policy in enumerate(results["config"]["policies"]):
        points = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["capacity"])
        for key, style in zip(keys, STYLES):
            values = [(r["capacity"], r[key]) for r in points if r[key] is not None]
            if values:
                axes.plot(*zip(*values), style, color=f"C{index}",
                          label=printable(policy) if style == STYLES[0] else None)
    axes.set_xlabel("GPU capacity (usable engine blocks: a vLLM server's num_gpu_blocks - 1)")
    axes.set_ylabel(ylabel.format(kind=_qttft_kind(runs)))
    axes.set_yscale(scale)
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:  # a replay whose every request failed has nothing to label
        axes.legend(title="policy")
    axes.set_title(_title(results))
    written = []
    for suffix in FORMATS:
        path = out_dir / f"{stem}.{suffix}"
        with staging.open(path) as handle:
            figure.savefig(handle, format=suffix, dpi=120)
        written.append(path)
    return written


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
