"""Simulator throughput beside libCacheSim, its growth with trace length, and the demo sweep's wall time.

    python benchmarks/bench_sim.py [--hours 1] [--capacity 65536] [--scale-hours 1 4 8] [--bench-python PATH] [--skip-demo]
        [-o sim.json]

1. A synthetic bailian-a trace is replayed with 16-token engine blocks (engine block = trace block)
   under kvprof's ``lru`` and the fitted policy ``wa`` by ``simulate``'s compiled engine (the
   default); throughput is full-block accesses per second. Each policy runs once on the first
   minute first, so compiling or loading the compiled code from numba's cache is not timed.
2. The same block-access sequence (request order, one object per block, size 1) goes through
   libCacheSim's LRU ``process_trace``, side by side in the same run; the ratios are printed with
   their targets (``lru`` >= 1.0x, ``wa`` >= 0.5x). libCacheSim is GPL-licensed: kvprof never
   imports it; it runs in a child interpreter, this one when it has the package::

       pip install 'kvprof[bench]'        # or: pip install libcachesim

   or the one ``--bench-python`` names. Without it that column is skipped, saying so. The
   comparison flatters libCacheSim: it replays a flat object sequence with no prefix-chain
   lookups, pinning, timing model or policy protocol.
3. For each of ``--scale-hours`` (default 1, 4, 8 h of bailian-a) and each of ``lru`` and ``wa``, a
   child process reads the trace, fits its first hour, prepares it and replays it: accesses/s and
   the child's peak RSS (and its peak after reading and fitting, before any replay). Cost grows
   linearly with length when accesses/s stays flat; the targets: at the longest length, seconds
   per access within 1.2x and peak RSS within 1.5x of the shortest's.
4. ``kvprof demo``'s work (generate, read, fit, 8 capacities x 4 policies, ``-j 2``) is timed.

Numbers come from one run each; the machine's load changes them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvprof.atomic import atomic_write_text
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


def bailian_a(hours: float):
    """A synthetic bailian-a trace of ``hours`` (seed 0), the hp file fitted on all of it, and a
    config whose engine blocks are the trace's blocks."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.jsonl"
        write_jsonl(path, generate("bailian-a", hours, 0))
        trace, _ = read_trace(path)
    return trace, fit_trace(trace), SimConfig(engine_block_size=trace.block_size)


def kvprof_throughput(trace, hp: HpFile, policy: str, capacity: int, config: SimConfig,
                      clock=time.perf_counter) -> dict:
    """``simulate``'s compiled engine over ``trace``, after a warm-up run on its first minute, timed by ``clock``."""
    warm = prepare_workload(trace.time_window(None, trace.window[0] + 60.0), hp, config.engine_block_size)
    simulate(warm, make_policy(policy, hp, capacity), capacity, config)
    workload = prepare_workload(trace, hp, config.engine_block_size)
    start = clock()
    metrics = simulate(workload, make_policy(policy, hp, capacity), capacity, config)  # as compare builds it
    seconds = clock() - start
    return {"seconds": seconds, "per_s": workload.n_accesses / seconds, "block_hit_ratio": metrics.block_hit_ratio,
            "accesses": workload.n_accesses}


def bench_python(given: Path | None) -> Path | None:
    """The interpreter that runs libCacheSim: ``given``, else this one if it has the package."""
    if given is not None:
        return given
    return Path(sys.executable) if importlib.util.find_spec("libcachesim") else None


def libcachesim_lru(workload, capacity: int, python: Path | None) -> dict | None:
    """LRU over the same access sequence in libCacheSim, or None (with a note) if it is unavailable."""
    if python is None or not python.exists():
        print("libCacheSim column skipped: libcachesim is not installed here "
              f"{'' if python is None else f'(nor is {python}) '}. Get it with\n"
              "  pip install 'kvprof[bench]'   (or: pip install libcachesim; GPL, never a kvprof dependency)\n"
              "or name an interpreter that has it with --bench-python.")
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


SCALE_CHILD = r"""
import json, sys
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.sim.config import SimConfig
sys.path.insert(0, sys.argv[3])
from bench_sim import kvprof_throughput

trace, _ = read_trace(sys.argv[1])
hp = fit_trace(trace.time_window(None, trace.window[0] + 3600.0))
config = SimConfig(engine_block_size=trace.block_size)
def rss():  # this process's peak RSS in MB (VmHWM; ru_maxrss would carry the parent's over from fork)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
out = {"requests": trace.n_requests, "before_mb": rss()}
out.update(kvprof_throughput(trace, hp, sys.argv[4], int(sys.argv[2]), config))
out["peak_mb"] = rss()
print(json.dumps(out))
"""


def scaling(hours: list[float], capacity: int) -> list[dict]:
    """Accesses/s and peak RSS of a child process replaying 1 h, 4 h, 8 h ... of bailian-a (Linux)."""
    print(f"scaling (bailian-a, capacity {capacity:,}; one child process per length and policy, its peak RSS):")
    rows = {}
    for h in hours:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "a.jsonl"
            write_jsonl(path, generate("bailian-a", h, 0))
            for name in ("lru", "wa"):
                done = subprocess.run([sys.executable, "-c", SCALE_CHILD, path, str(capacity), Path(__file__).parent,
                                       name], capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
                if done.returncode:
                    print(f"  {h:g} h {name} failed:\n{done.stderr.strip()}")
                    continue
                row = rows[h, name] = json.loads(done.stdout)
                print(f"  {h:4g} h {name:3s}: {row['accesses']:>12,} accesses, {row['per_s'] / 1e6:6.3f} M/s "
                      f"({row['seconds']:7.2f} s, {1e6 / row['per_s']:.3f} us each); peak RSS {row['peak_mb']:,.0f} MB "
                      f"({row['before_mb']:,.0f} MB after reading and fitting)")
    for name in ("lru", "wa"):
        lengths = [h for h in hours if (h, name) in rows]
        if len(lengths) > 1:
            first, last = rows[lengths[0], name], rows[lengths[-1], name]
            per_access = first["per_s"] / last["per_s"]
            memory = last["peak_mb"] / first["peak_mb"]
            print(f"  {name}: {lengths[-1]:g} h vs {lengths[0]:g} h: seconds per access {per_access:.2f}x "
                  f"[target <= 1.2: {'met' if per_access <= 1.2 else 'MISSED'}], peak RSS {memory:.2f}x "
                  f"[target <= 1.5: {'met' if memory <= 1.5 else 'MISSED'}]")
    return [{"hours": h, "policy": name, **row} for (h, name), row in rows.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=1.0, help="length of the synthetic bailian-a trace")
    parser.add_argument("--capacity", type=int, default=65536, help="cache size in 16-token blocks")
    parser.add_argument("--scale-hours", type=float, nargs="*", default=[1.0, 4.0, 8.0],
                        help="trace lengths of the scaling part (none: skip it)")
    parser.add_argument("--bench-python", type=Path, default=None,
                        help="interpreter with libcachesim installed (default: this one, if it has it)")
    parser.add_argument("--skip-demo", action="store_true", help="do not time the demo sweep")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="joblib workers for the demo sweep")
    parser.add_argument("-o", "--output", type=Path, help="also write the figures as JSON (benchmarks/render_results.py "
                                                          "renders them)")
    args = parser.parse_args(argv)
    from provenance import facts  # beside this script

    run = facts(None if argv is None else [__file__, *argv])

    trace, hp, config = bailian_a(args.hours)
    workload = prepare_workload(trace, hp, config.engine_block_size)
    print(f"trace: {trace.n_requests:,} requests, {workload.n_accesses:,} block accesses "
          f"({config.engine_block_size}-token blocks), capacity {args.capacity:,} blocks")
    rows = {name: kvprof_throughput(trace, hp, name, args.capacity, config) for name in ("lru", "wa")}
    reference = libcachesim_lru(workload, args.capacity, bench_python(args.bench_python))
    targets = {"lru": 1.0, "wa": 0.5}
    for name, row in rows.items():
        line = (f"kvprof {name:3s} (compiled): {row['per_s'] / 1e6:6.3f} M accesses/s ({row['seconds']:.2f} s), "
                f"block hit ratio {row['block_hit_ratio']:.4f}")
        if reference:
            ratio = row["per_s"] / reference["per_s"]
            line += (f"; {ratio:.3f}x libCacheSim LRU [target >= {targets[name]}: "
                     f"{'met' if ratio >= targets[name] else 'MISSED'}]")
        print(line)
    if reference:
        print(f"libCacheSim LRU process_trace: {reference['per_s'] / 1e6:6.3f} M accesses/s "
              f"({reference['seconds']:.2f} s), object hit ratio {1 - reference['miss_ratio']:.4f}")
    scaled = scaling(args.scale_hours, args.capacity) if args.scale_hours else []
    times = None
    if not args.skip_demo:
        times = demo_sweep(args.jobs)
        print("demo (2 h bailian-a, 8 capacities x lru, wa-paper, wa, belady, -j {}): ".format(args.jobs)
              + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if args.output:
        document = {"run": run, "trace": {"preset": "bailian-a", "hours": args.hours, "seed": 0,
                                          "requests": trace.n_requests, "accesses": workload.n_accesses,
                                          "engine_block": config.engine_block_size},
                    "capacity": args.capacity, "kvprof": rows, "libcachesim_lru": reference,
                    "targets": {name: {"vs_libcachesim_at_least": t} for name, t in targets.items()},
                    "scaling": scaled, "demo": times, "load_average_at_end": os.getloadavg()[0]}
        atomic_write_text(args.output, json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
