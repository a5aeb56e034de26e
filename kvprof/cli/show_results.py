"""``kvprof show`` of results files: one table of every run and, with ``-o``, compare's plots of them together."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from kvprof.cli.common import console, err_console, output_dir, print_json, qttft_cell


def show_results(paths: list[Path], documents: list[dict], output: Path | None, json_out: bool) -> None:
    """Tabulate (or print as JSON) the merged runs of ``documents``; plot them into ``output`` if given.

    Live runs are marked ``(live)`` and say what the server ran (hp file, rate scale); a modelled
    QTTFT of an overloaded server is marked so.
    """
    from kvprof.cli.plots import plot_results
    from kvprof.results import merge

    merged = merge(documents)
    plots = plot_results(merged, output_dir(output)) if output is not None else []
    if json_out:
        print_json(merged)
        return
    table = Table(title=", ".join(map(str, paths)))
    for column in ("policy", "run", "capacity", "requests", "hit ratio", "QTTFT mean (s)", "QTTFT p99 (s)"):
        table.add_column(column, justify="left" if column in ("policy", "run") else "right")
    for run in merged["runs"]:
        hit = run["token_hit_ratio"]
        overloaded = run.get("qttft_overloaded", False)
        table.add_row(run["policy"], run["origin"], f"{run['capacity']:,}", f"{run['n_requests']:,}",
                      "-" if hit is None else f"{hit:.4f}",
                      qttft_cell(run["qttft_mean_s"], overloaded), qttft_cell(run["qttft_p99_s"], overloaded))
    console.print(table)
    if plots:
        err_console.print(f"wrote {len(plots)} plots to {output}")
