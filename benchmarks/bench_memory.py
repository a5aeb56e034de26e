"""Peak memory of the simulator's replay against trace length, per policy: is its state bounded by the cache?

    python benchmarks/bench_memory.py [--hours 1 8] [--capacity 65536] [--policies lru,wa,...] [--code DIR ...]
        [-o memory.json]

For each length of synthetic bailian-a (``kvprof synth``, seed 0) and each policy, a fresh child
process reads the trace, fits its first hour, prepares the workload, warms the compiled code on the
first minute, then resets its peak RSS (``/proc/self/clear_refs``) and replays the whole trace at
``--capacity`` blocks. It reports two peaks: the child's over its whole life (reading and fitting
included: the trace is held in memory whole, so this grows with length whatever the policy does;
the trace's own arrays are reported beside it, their growth being the part no policy can bound)
and the replay's own, above the RSS just before it (what the simulator and the policy add: the
state the target bounds; a rise under ``MIN_OWN_MB`` gets no ratio). The target: the
longest length's whole peak within 1.5x of the shortest's, for every policy; the last line names
the policies that missed it.

``--code DIR`` runs the children with ``DIR`` first on ``PYTHONPATH`` (several: side by side,
e.g. checkouts of two commits, each length and policy in turn). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvprof.atomic import atomic_write_text
from kvprof.policy import POLICIES
from kvprof.profiler.synth import generate, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
#: The replay's own rise (MB) below which its ratio means nothing (the allocator's reuse of freed memory).
MIN_OWN_MB = 10.0

CHILD = r"""
import json, sys, time
import numpy as np
from kvprof.policy import make_policy
from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload

def status(field):  # MB
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) for line in lines if line.startswith(field + ":")) / 1024

path, capacity, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
trace, _ = read_trace(path)
trace_mb = sum(a.nbytes for a in vars(trace).values() if isinstance(a, np.ndarray)) / 2**20
hp = fit_trace(trace.time_window(None, trace.window[0] + 3600.0))
config = SimConfig(engine_block_size=trace.block_size)
warm = prepare_workload(trace.time_window(None, trace.window[0] + 60.0), hp, config.engine_block_size)
simulate(warm, make_policy(name, hp, capacity), capacity, config)
workload = prepare_workload(trace, hp, config.engine_block_size)
peak_before = status("VmHWM")
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # reset VmHWM to the RSS now
before = status("VmRSS")
start = time.perf_counter()
metrics = simulate(workload, make_policy(name, hp, capacity), capacity, config)
print(json.dumps({"accesses": workload.n_accesses, "seconds": time.perf_counter() - start,
                  "hit_ratio": metrics.block_hit_ratio, "before_mb": before,
                  "replay_mb": status("VmHWM") - before, "peak_mb": max(peak_before, status("VmHWM")),
                  "trace_mb": trace_mb, "read_fit_mb": peak_before}))
"""


def measure(code: Path, trace: Path, capacity: int, policy: str) -> dict | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, str(trace), str(capacity), policy], check=False,
                          capture_output=True, text=True, env=env, cwd=code)
    if done.returncode:
        print(f"  {policy} on {trace.name} with {code} failed:\n{done.stderr.strip()[-2000:]}")
        return None
    return json.loads(done.stdout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, nargs="+", default=[1.0, 8.0], help="trace lengths (bailian-a)")
    parser.add_argument("--capacity", type=int, default=65536, help="cache size in 16-token blocks")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated (default: every policy offered by name, kvprof.registry)")
    parser.add_argument("--code", type=Path, nargs="+", default=[ROOT], help="checkouts to run (default: this one)")
    parser.add_argument("-o", "--output", type=Path, help="also write the figures as JSON (benchmarks/render_results.py "
                                                          "renders them)")
    args = parser.parse_args(argv)
    from provenance import facts  # beside this script

    run = facts(None if argv is None else [__file__, *argv])
    policies = args.policies.split(",")
    rows: dict[tuple, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for hours in args.hours:
            trace = Path(tmp) / f"a{hours:g}.jsonl.zst"
            write_jsonl(trace, generate("bailian-a", hours, 0))
            if hours == args.hours[0]:
                # compiling kvprof's core into numba's cache (hundreds of MB, once per cache directory) in a
                # child of its own: no measured peak holds it (the first measured child's did: lru 1,093 MB)
                for code in args.code:
                    measure(code.resolve(), trace, args.capacity, policies[0])
            for policy in policies:
                for code in args.code:
                    row = measure(code.resolve(), trace, args.capacity, policy)
                    if row is None:
                        continue
                    rows[code, policy, hours] = row
                    print(f"{code.name:>10s} {policy:8s} {hours:4g} h: {row['accesses']:>11,} accesses "
                          f"{row['seconds']:8.1f} s, hit {row['hit_ratio']:.4f}; peak RSS {row['peak_mb']:7,.0f} MB, "
                          f"(reading and fitting {row['read_fit_mb']:,.0f} MB; the trace's arrays {row['trace_mb']:,.1f} MB), "
                          f"replay {row['replay_mb']:7,.1f} MB above {row['before_mb']:,.0f} MB", flush=True)
    first, last = args.hours[0], args.hours[-1]
    print(f"\n{last:g} h vs {first:g} h at {args.capacity:,} blocks [target: peak within 1.5x]")
    print("| code | policy | whole peak | of which the trace's arrays | replay's own peak |")
    print("|---|---|---|---|---|")
    missed = []
    for code in args.code:
        for policy in policies:
            a, b = rows.get((code, policy, first)), rows.get((code, policy, last))
            if a and b:
                whole = b["peak_mb"] / a["peak_mb"]
                if whole > 1.5:
                    missed.append(f"{policy} ({code.name}, {whole:.2f}x)")
                # a replay that fits in what reading and fitting left free rises by ~0 MB: no ratio to take
                own = (f": {b['replay_mb'] / a['replay_mb']:.2f}x" if a["replay_mb"] >= MIN_OWN_MB else
                       f" (+{b['replay_mb'] - a['replay_mb']:,.1f} MB; under {MIN_OWN_MB:g} MB at {first:g} h)")
                print(f"| {code.name} | {policy} | {a['peak_mb']:,.0f} -> {b['peak_mb']:,.0f} MB: {whole:.2f}x "
                      f"({'met' if whole <= 1.5 else 'MISSED'}) | {a['trace_mb']:,.1f} -> {b['trace_mb']:,.1f} MB "
                      f"| {a['replay_mb']:,.1f} -> {b['replay_mb']:,.1f} MB{own} |")
    print(f"target MISSED by: {', '.join(missed)}" if missed else "target met by every policy measured")
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if args.output:
        several = len(args.code) > 1  # a checkout is named by its folder's name only, and only when several ran
        document = {"run": run, "trace": {"preset": "bailian-a", "seed": 0}, "hours": args.hours,
                    "capacity": args.capacity, "target_whole_peak_ratio": 1.5,
                    "rows": [{**({"code": code.name} if several else {}), "policy": policy, "hours": hours, **row}
                             for (code, policy, hours), row in rows.items()],
                    "missed": missed if several else [m.split(" (")[0] for m in missed],
                    "load_average_at_end": os.getloadavg()[0]}
        atomic_write_text(args.output, json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
