"""``kvprof show`` of results files: one table of every run and, with ``-o``, compare's plots of them together."""

from __future__ import annotations

from pathlib import Path

from kvprof.cli.common import made_dir, qttft_cell
from kvprof.cli.output import first_rows, print_json, say, show, table

#: What the table's hit ratio is, said under it (docs/results-schema.md, ``token_hit_ratio``).
HIT_RATIO_NOTE = ("hit ratio: cached / prompt tokens of every request replayed, simulated or live; a request not "
                  "served (rejected by a simulated cache, failed or timed out live: the 'not served' column) counts "
                  "all its prompt tokens as uncached")


def show_results(paths: list[Path], documents: list[dict], output: Path | None, json_out: bool) -> None:
    """Tabulate (or print as JSON) the merged runs of ``documents``; plot them into ``output`` if given.

    Live runs are marked ``(live)`` and say what the server ran (hp file, rate scale) and how
    many of their requests failed; a modelled QTTFT of an overloaded server is marked so; an
    interrupted replay's run is marked ``incomplete``.
    """
    from kvprof.cli.plots import plot_results
    from kvprof.results import merge

    merged = merge(documents)
    plots = []
    if output is not None:
        with made_dir(output):
            plots = plot_results(merged, output)
    if json_out:
        print_json(merged)
        return
    runs, more = first_rows(merged["runs"], "runs")
    out = table(", ".join(map(str, paths)), {column: "left" if column in ("policy", "run") else "right" for column in (
        "policy", "run", "capacity (usable blocks)", "requests", "not served", "hit ratio", "QTTFT mean (s)", "QTTFT p99 (s)")},
        caption=HIT_RATIO_NOTE if more is None else f"{more}\n{HIT_RATIO_NOTE}")
    for run in runs:
        hit = run["token_hit_ratio"]
        overloaded = run.get("qttft_overloaded", False)
        out.add_row(run["policy"], run["origin"], f"{run['capacity']:,}", f"{run['n_requests']:,}", _not_served(run),
                    "-" if hit is None else f"{hit:.4f}",
                    qttft_cell(run["qttft_mean_s"], overloaded), qttft_cell(run["qttft_p99_s"], overloaded))
    show(out)
    if plots:
        say(f"wrote {len(plots)} plots to {output}")


def _not_served(run: dict) -> str:
    """Requests not served: a live run's failures (of which timeouts), a simulated run's rejections."""
    if run.get("measured"):
        errors, timeouts = run.get("n_errors"), run.get("n_timeouts")
        if errors is None:
            return "-"
        return f"{errors:,} failed" + (f" ({timeouts:,} timeouts)" if timeouts else "")
    rejected = run.get("n_rejected")
    return "-" if rejected is None else f"{rejected:,} rejected"
