"""A sweep on a two-worker Ray cluster against the same sweep in one process (-j 1).

    python benchmarks/bench_ray.py [--hours 2] [--workers 2] [--address ADDRESS]

The demo's sweep (2 h bailian-a, fit on hour one, lru / wa-paper / wa / belady at 1024 ... 8192
blocks on hour two) runs once locally with ``-j 1`` and once as Ray tasks, side by side in one
run, and the results must be equal, number for number. Without ``--address`` a local cluster of
``--workers`` CPUs is started here (the driver is this process). The ideal split of 32 replays
over 2 workers is 2x; the target is within 1.3x of it (>= 1.54x). Each side is timed after one
warm-up replay in every process, so numba's cached code is loaded before the clock starts.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.config import SimConfig
from kvprof.sim.sweep import run_sweep

POLICIES = ("lru", "wa-paper", "wa", "belady")
CAPACITIES = tuple(range(1024, 8193, 1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    args = parser.parse_args()

    import ray

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.jsonl"
        write_jsonl(path, generate("bailian-a", args.hours, 0))
        trace, _ = read_trace(path)
    split = trace.window[0] + 3600.0 * args.hours / 2
    hp = fit_trace(trace.time_window(None, split))
    evaluated = trace.time_window(split, None)
    if args.address:
        ray.init(address=args.address, logging_level="warning", log_to_driver=False)
    else:
        ray.init(num_cpus=args.workers, include_dashboard=False, logging_level="warning", log_to_driver=False)
    warm = evaluated.head(200)
    run_sweep(warm, hp, POLICIES, [64], SimConfig(), n_jobs=1)
    run_sweep(warm, hp, POLICIES, [64, 128], SimConfig(), ray="auto")  # 8 tasks: every worker warms up

    start = time.perf_counter()
    local = run_sweep(evaluated, hp, POLICIES, CAPACITIES, SimConfig(), n_jobs=1)
    local_s = time.perf_counter() - start
    start = time.perf_counter()
    remote = run_sweep(evaluated, hp, POLICIES, CAPACITIES, SimConfig(), ray="auto")
    ray_s = time.perf_counter() - start
    workers = int(ray.cluster_resources().get("CPU", args.workers))
    speed_up = local_s / ray_s
    print(f"sweep: {len(POLICIES)} policies x {len(CAPACITIES)} capacities on {evaluated.n_requests:,} requests "
          f"({args.hours / 2:g} h of bailian-a)")
    print(f"-j 1: {local_s:.1f} s; Ray, {workers} workers: {ray_s:.1f} s; speed-up {speed_up:.2f}x of an ideal "
          f"{workers}x [target >= {workers / 1.3:.2f}x: {'met' if speed_up >= workers / 1.3 else 'MISSED'}]; "
          f"results {'identical' if remote.runs == local.runs else 'DIFFERENT'}")
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    ray.shutdown()


if __name__ == "__main__":
    main()
