"""Comparison plots from a ``kvprof.results/1`` document: hit ratio and QTTFT against capacity.

Figures are built on matplotlib's object API with the Agg canvas, never pyplot, so plotting has
no global state and needs no display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvprof.atomic import atomic_open

#: (file stem, y label, metric keys plotted, y scale); ``{kind}`` says whether QTTFT was modelled or measured.
PANELS = (
    ("hit_ratio", "token hit ratio (cached / prompt tokens)", ("token_hit_ratio",), "linear"),
    ("qttft", "{kind} queued TTFT (s)\nmean solid, p99 dashed", ("qttft_mean_s", "qttft_p99_s"), "log"),
)
#: Line styles of a panel's metrics, in ``PANELS`` order. Each has a marker: a live replay is one
#: capacity, a single point that a line without markers would not draw at all.
STYLES = ("-o", "--x")
#: Appended to the policy name of a measured run when documents are merged.
LIVE = " (live)"


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Write ``hit_ratio`` and ``qttft`` plots as PNG and SVG into ``out_dir``, each atomically.

    Parameters
    ----------
    results : dict
        A ``kvprof.results/1`` document (``Results.to_dict()``, ``kvprof replay``'s), or several
        joined by :func:`merge_results`. Every run needs a capacity.
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
            for key, style in zip(keys, STYLES):
                values = [(c, r[key]) for c, r in points if r[key] is not None]
                if values:
                    axes.plot(*zip(*values), style, color=color, label=policy if style == STYLES[0] else None)
        axes.set_xlabel("GPU capacity (engine blocks)")
        axes.set_ylabel(ylabel.format(kind=_qttft_kind(runs)))
        axes.set_yscale(scale)
        axes.grid(True, alpha=0.3)
        if axes.lines:  # a replay whose every request failed has nothing to label
            axes.legend(title="policy")
        axes.set_title(_title(results))
        for suffix in ("png", "svg"):
            path = out_dir / f"{stem}.{suffix}"
            with atomic_open(path, "wb") as handle:
                figure.savefig(handle, format=suffix, dpi=120)
            written.append(path)
    return written


def merge_results(documents: Sequence[dict]) -> dict:
    """The runs of several results documents in one, so a simulated sweep and a live replay share a plot.

    A measured run's policy gets ``" (live)"`` appended; a policy name an earlier document already
    used gets ``" #k"`` (``k``: the document's position, from 1), so each line is one document's.
    The title's trace and block size are the first document's.

    Returns
    -------
    dict
        ``inputs``, ``config`` and ``runs``, what :func:`plot_results` reads; not a results file.
    """
    runs: list[dict] = []
    for position, document in enumerate(documents, start=1):
        taken = {run["policy"] for run in runs}
        for run in document["runs"]:
            label = run["policy"] + (LIVE if run.get("measured") else "")
            runs.append({**run, "policy": label if label not in taken else f"{label} #{position}"})
    first = documents[0]
    return {
        "inputs": first.get("inputs", {}),
        "config": {**first["config"], "policies": list(dict.fromkeys(run["policy"] for run in runs)),
                   "capacities": sorted({run["capacity"] for run in runs})},
        "runs": runs,
    }


def _qttft_kind(runs: list[dict]) -> str:
    measured = {bool(run.get("measured")) for run in runs}
    return "measured" if measured == {True} else "modelled" if measured == {False} else "modelled, (live) measured"


def _title(results: dict) -> str:
    trace = results.get("inputs", {}).get("trace", {})
    config = results["config"]
    name = Path(trace.get("source") or "trace").name
    blocks = f", {config['engine_block_size']}-token blocks" if config.get("engine_block_size") else ""
    tiers = f", CPU tier {config['cpu_capacity']} blocks" if config.get("cpu_capacity") else ""
    return f"{name}: {trace.get('n_requests', '?')} requests{blocks}{tiers}"
