"""Comparison plots from a ``kvprof.results/1`` document: hit ratio and QTTFT against capacity.

Figures are built on matplotlib's object API with the Agg canvas, never pyplot, so plotting has
no global state and needs no display.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: (file stem, y label, metric keys plotted, y scale)
PANELS = (
    ("hit_ratio", "token hit ratio (cached / prompt tokens)", ("token_hit_ratio",), "linear"),
    ("qttft", "modelled queued TTFT (s): mean solid, p99 dashed", ("qttft_mean_s", "qttft_p99_s"), "log"),
)


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Write ``hit_ratio`` and ``qttft`` plots as PNG and SVG into ``out_dir``.

    Parameters
    ----------
    results : dict
        A ``kvprof.results/1`` document (``Results.to_dict()``).
    out_dir : Path

    Returns
    -------
    list of Path
        The files written.
    """
    runs = results["runs"]
    policies = results["config"]["policies"]
    written = []
    for stem, ylabel, keys, scale in PANELS:
        figure = Figure(figsize=(7, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        for index, policy in enumerate(policies):
            points = sorted((r["capacity"], r) for r in runs if r["policy"] == policy)
            color = f"C{index}"
            for key, style in zip(keys, ("-o", "--")):
                values = [(c, r[key]) for c, r in points if r[key] is not None]
                if values:
                    axes.plot(*zip(*values), style, color=color, label=policy if style == "-o" else None)
        axes.set_xlabel("GPU capacity (engine blocks)")
        axes.set_ylabel(ylabel)
        axes.set_yscale(scale)
        axes.grid(True, alpha=0.3)
        axes.legend(title="policy")
        axes.set_title(_title(results))
        for suffix in ("png", "svg"):
            path = out_dir / f"{stem}.{suffix}"
            figure.savefig(path, dpi=120)
            written.append(path)
    return written


def _title(results: dict) -> str:
    trace = results.get("inputs", {}).get("trace", {})
    config = results["config"]
    name = Path(trace.get("source") or "trace").name
    tiers = f", CPU tier {config['cpu_capacity']} blocks" if config.get("cpu_capacity") else ""
    return f"{name}: {trace.get('n_requests', '?')} requests, {config['engine_block_size']}-token blocks{tiers}"
