"""Profiler speed on a two-hour bailian-a synthetic trace: load time, peak memory, fit time.

Targets (one core): loading >= 1M block ids per second; fitting the first hour <= 5 s.
Each measurement runs in a fresh child process so peak RSS is that step's alone.

    python benchmarks/bench_profiler.py [--hours 2] [--seed 0] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
from kvprof.profiler.reader import read_trace
from kvprof.profiler.fit import fit_trace

path, step = sys.argv[1], sys.argv[2]
start = time.perf_counter()
trace, _ = read_trace(path)
load_s = time.perf_counter() - start
out = {"requests": trace.n_requests, "block_ids": trace.n_blocks, "load_s": load_s}
if step == "fit":
    first_hour = trace.time_window(0, 3600)
    start = time.perf_counter()
    hp = fit_trace(first_hour)
    out["fit_s"] = time.perf_counter() - start
    out["classes"] = len(hp.classes)
    out["fit_block_ids"] = first_hour.n_blocks
# VmHWM, this process's own peak: ru_maxrss keeps the forking parent's across exec
with open("/proc/self/status") as status:
    out["peak_rss_mb"] = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
print(json.dumps(out))
"""


def run_child(path: str, step: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CHILD, path, step], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from kvprof.profiler.synth import generate, write_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bailian-a.jsonl")
        start = time.perf_counter()
        write_jsonl(path, generate("bailian-a", args.hours, args.seed))
        synth_s = time.perf_counter() - start
        size_mb = os.path.getsize(path) / 1e6
        loads = [run_child(path, "load") for _ in range(args.repeat)]
        fits = [run_child(path, "fit") for _ in range(args.repeat)]

    best_load = min(loads, key=lambda r: r["load_s"])
    best_fit = min(fits, key=lambda r: r["fit_s"])
    ids_per_s = best_load["block_ids"] / best_load["load_s"]
    print(f"trace: {args.hours:g} h bailian-a seed {args.seed}: {best_load['requests']:,} requests, "
          f"{best_load['block_ids']:,} block ids, {size_mb:.1f} MB JSONL (synthesised in {synth_s:.1f} s)")
    print(f"load:  {best_load['load_s']:.2f} s (best of {args.repeat}), {ids_per_s / 1e6:.2f} M block ids/s "
          f"[target >= 1.0: {'met' if ids_per_s >= 1e6 else 'MISSED'}], peak RSS {best_load['peak_rss_mb']:.0f} MB")
    print(f"fit:   {best_fit['fit_s']:.2f} s on the first hour ({best_fit['fit_block_ids']:,} block ids, "
          f"{best_fit['classes']} classes) [target <= 5 s: {'met' if best_fit['fit_s'] <= 5 else 'MISSED'}], "
          f"peak RSS {best_fit['peak_rss_mb']:.0f} MB incl. load")


if __name__ == "__main__":
    main()
