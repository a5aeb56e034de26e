"""Simulator throughput beside libCacheSim, and the demo sweep's wall time.

    .venv/bin/python benchmarks/bench_sim.py [--hours 1] [--capacity 65536] [--bench-python PATH] [--skip-demo]

1. A synthetic bailian-a trace is replayed with 16-token engine blocks (engine block = trace block)
   under kvprof's ``lru`` and ``wa``; throughput is full-block accesses per second of ``simulate``.
2. The same block-access sequence (request order, one object per block, size 1) goes through
   libCacheSim's LRU ``process_trace``. libCacheSim is GPL-licensed: it is never imported here or
   by kvprof; it runs in a separate interpreter (``--bench-python``, default ``.venv-bench``) that a
   developer creates with::

       python3 -m venv .venv-bench && .venv-bench/bin/pip install libcachesim numpy

   Without it that column is skipped. The comparison flatters libCacheSim: it replays a flat
   object sequence with no prefix-chain lookups, pinning, timing model or policy protocol.
3. ``kvprof demo``'s work (generate, read, fit, 8 capacities x 4 policies, ``-j 2``) is timed.

Numbers come from one run each; the machine's load changes them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvprof.models.hp import HpFile
from kvprof.policy import make_policy
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.sweep import run_sweep
from kvprof.sim.workload import prepare_workload

ROOT = Path(__file__).resolve().parents[1]

#: libCacheSim's oracleGeneral binary record (packed, little-endian).
ORACLE_GENERAL = np.dtype([("time", "<u4"), ("obj_id", "<u8"), ("size", "<u4"), ("next_access_vtime", "<i8")])

LIBCACHESIM_LRU = """
import json, sys, time
import libcachesim as lcs
reader = lcs.TraceReader(sys.argv[1], lcs.TraceType.ORACLE_GENERAL_TRACE)
cache = lcs.LRU(int(sys.argv[2]))
start = time.perf_counter()
miss_ratio, _ = cache.process_trace(reader)
print(json.dumps({"seconds": time.perf_counter() - start, "miss_ratio": miss_ratio}))
"""


def kvprof_throughput(workload, hp: HpFile, policy: str, capacity: int, config: SimConfig) -> dict:
    start = time.perf_counter()
    metrics = simulate(workload, make_policy(policy, hp), capacity, config)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "per_s": workload.n_accesses / seconds, "block_hit_ratio": metrics.block_hit_ratio}


def libcachesim_lru(workload, capacity: int, python: Path) -> dict | None:
    """LRU over the same access sequence in libCacheSim, or None (with a note) if it is unavailable."""
    if not python.exists():
        print(f"libCacheSim column skipped: {python} not found. Install it into a separate venv:\n"
              f"  python3 -m venv {ROOT / '.venv-bench'} && {ROOT / '.venv-bench/bin/pip'} install libcachesim numpy")
        return None
    records = np.zeros(workload.n_accesses, dtype=ORACLE_GENERAL)
    owner = np.repeat(np.arange(workload.n_requests), np.diff(workload.offsets))
    records["time"] = workload.arrival[owner].astype(np.uint32)
    records["obj_id"] = workload.block + 1  # 0 is not a valid object id in some readers
    records["size"] = 1
    records["next_access_vtime"] = -1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "blocks.oracleGeneral"
        records.tofile(path)
        done = subprocess.run([python, "-c", LIBCACHESIM_LRU, path, str(capacity)], capture_output=True, text=True)
    if done.returncode:
        print(f"libCacheSim column skipped: it failed:\n{done.stderr.strip()}")
        return None
    result = json.loads(done.stdout)
    result["per_s"] = workload.n_accesses / result["seconds"]
    return result


def demo_sweep(n_jobs: int) -> dict:
    """What ``kvprof demo`` does, timed in parts."""
    times = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.jsonl"
        write_jsonl(path, generate("bailian-a", 2.0, 0))
        trace, _ = read_trace(path)
    times["generate_and_read_s"] = time.perf_counter() - start
    hp = fit_trace(trace.time_window(0.0, 3600.0))
    times["fit_s"] = time.perf_counter() - start - times["generate_and_read_s"]
    results = run_sweep(trace.time_window(3600.0, None), hp, ["lru", "wa-paper", "wa", "belady"],
                        range(1024, 8193, 1024), n_jobs=n_jobs)
    times["sweep_s"] = results.wall_s
    times["total_s"] = time.perf_counter() - start
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=1.0, help="length of the synthetic bailian-a trace")
    parser.add_argument("--capacity", type=int, default=65536, help="cache size in 16-token blocks")
    parser.add_argument("--bench-python", type=Path, default=ROOT / ".venv-bench/bin/python",
                        help="interpreter with libcachesim installed")
    parser.add_argument("--skip-demo", action="store_true", help="do not time the demo sweep")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="joblib workers for the demo sweep")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.jsonl"
        write_jsonl(path, generate("bailian-a", args.hours, 0))
        trace, _ = read_trace(path)
    hp = fit_trace(trace)
    config = SimConfig(engine_block_size=trace.block_size)
    start = time.perf_counter()
    workload = prepare_workload(trace, hp, config.engine_block_size)
    prepare_s = time.perf_counter() - start
    print(f"trace: {trace.n_requests:,} requests, {workload.n_accesses:,} block accesses "
          f"({config.engine_block_size}-token blocks), capacity {args.capacity:,} blocks; "
          f"workload prepared in {prepare_s:.2f} s")
    rows = {name: kvprof_throughput(workload, hp, name, args.capacity, config) for name in ("lru", "wa")}
    reference = libcachesim_lru(workload, args.capacity, args.bench_python)
    for name, row in rows.items():
        line = (f"kvprof {name:3s}: {row['per_s'] / 1e6:6.3f} M accesses/s ({row['seconds']:.2f} s), "
                f"block hit ratio {row['block_hit_ratio']:.4f}")
        if reference:
            line += f"; {row['per_s'] / reference['per_s']:.3f} x libCacheSim LRU"
        print(line)
    if reference:
        print(f"libCacheSim LRU process_trace: {reference['per_s'] / 1e6:6.3f} M accesses/s "
              f"({reference['seconds']:.2f} s), object hit ratio {1 - reference['miss_ratio']:.4f}")
    if not args.skip_demo:
        times = demo_sweep(args.jobs)
        print("demo (2 h bailian-a, 8 capacities x lru, wa-paper, wa, belady, -j {}): ".format(args.jobs)
              + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    sys.exit(main())
