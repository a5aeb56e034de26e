"""Belady's labels, compiled against Python, side by side on what ``kvprof fit --learned`` labels.

    python research/bench_belady_labels.py [--hours 2] [--seed 0] [--capacities 256,1024,4096,16384]

On `kvprof synth bailian-a` (2 h, seed 0; 128-token blocks) the tuning's workload -- the last third
of the fit window 0:3600, as :func:`kvprof.sim.tune.tune` replays it -- is labelled at each capacity
by: the last round's free labeller (:func:`kvprof.sim.learn.python_free_labels`: Belady on the Python
engine, labels and features at each free), the Python access labeller
(:func:`kvprof.sim.belady_labels.python_access_labels`) and the compiled one
(:func:`kvprof.sim.belady_labels.access_labels`, timed after one warm-up call that loads the
compiled code). The two access labellers must agree label for label; the table gives their
times and the speed-ups.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvprof.cells import TIER_EDGES
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.belady_labels import access_labels, python_access_labels
from kvprof.sim.config import SimConfig
from kvprof.sim.learn import python_free_labels
from kvprof.sim.tune import REPLAYED_SHARE
from kvprof.sim.workload import prepare_workload


def timed(function, *args):
    started = time.perf_counter()
    out = function(*args)
    return out, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacities", default="256,1024,4096,16384")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "bailian-a.jsonl"
        write_jsonl(path, generate("bailian-a", args.hours, args.seed))
        trace = read_trace(path)[0]
    fitted = trace.time_window(0, 3600)
    hp = fit_trace(fitted)
    end = fitted.censor_time
    replayed = fitted.time_window(end - (end - fitted.first_arrival) * REPLAYED_SHARE, None)
    config = SimConfig(engine_block_size=128)
    workload = prepare_workload(replayed, hp, 128)
    n_cells = len(hp.cell_names())
    access_labels(workload, 64, config)  # loads (or compiles) the replay
    print(f"bailian-a {args.hours:g} h seed {args.seed}, fit window 0:3600, tuning replays "
          f"{workload.n_requests:,} requests, {workload.n_accesses:,} block accesses\n")
    print("| capacity | free labeller (Python) s | access labeller (Python) s | compiled s | "
          "speed-up vs free labeller | vs Python access | labels equal | friendly share |")
    print("|---|---|---|---|---|---|---|---|")
    totals = [0.0, 0.0, 0.0]
    for capacity in (int(c) for c in args.capacities.split(",")):
        _, free_s = timed(python_free_labels, workload, capacity, config, n_cells, len(TIER_EDGES))
        python, python_s = timed(python_access_labels, workload, capacity, config)
        compiled, compiled_s = timed(access_labels, workload, capacity, config)
        for i, seconds in enumerate((free_s, python_s, compiled_s)):
            totals[i] += seconds
        equal = bool((python == compiled).all())
        print(f"| {capacity:,} | {free_s:.2f} | {python_s:.2f} | {compiled_s:.2f} | {free_s / compiled_s:.1f}x | "
              f"{python_s / compiled_s:.1f}x | {'yes' if equal else 'NO'} | {compiled.mean():.3f} |")
    print(f"| all | {totals[0]:.2f} | {totals[1]:.2f} | {totals[2]:.2f} | {totals[0] / totals[2]:.1f}x | "
          f"{totals[1] / totals[2]:.1f}x | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
