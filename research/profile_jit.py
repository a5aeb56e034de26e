"""Where a compiled replay spends its time, by compiled function, with ``perf`` (Linux).

numba's compiled code has no symbols ``perf`` can see, so ``run`` writes them to
``/tmp/perf-PID.map`` (perf's format for JIT code) from the object code numba loads, then
``report`` reads the samples back: time per compiled function, and for the samples in numba's
reference counting (``NRT_incref``/``NRT_decref``), and those of any function named with
``--callers``, the compiled function that called it (the first return address on the sampled
stack that falls in another known function)::

    perf record -F 499 --call-graph dwarf,64 -o wa.perf python research/profile_jit.py run --policy wa
    perf script -i wa.perf -D > wa.dump
    python research/profile_jit.py report wa.dump /tmp/perf-PID.map

The replay runs once on the first minute (loading the compiled code), then on the whole trace;
the samples of the set-up (synthesizing, fitting) are counted too, in other functions. Only code
numba loads from its cache is named: run once first so that the cache holds it.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The object code of every compiled library numba loads (``run`` keeps it to list its symbols).
LOADED: list = []


def keep_object_code() -> None:
    """Have numba's code libraries keep the object code they are loaded from (it drops it)."""
    from numba.core import codegen

    loaded = codegen.CPUCodeLibrary._set_compiled_object

    def keep(library, value):
        LOADED.append((library, value))
        return loaded(library, value)

    codegen.CPUCodeLibrary._set_compiled_object = keep


def short_name(symbol: str) -> str:
    """``kvprof.core.kinds.classed._merge`` from numba's mangled name (others: as they are)."""
    match = re.match(r"_ZN((?:\d+[A-Za-z_]\w*?)+)B\d+v\d+", symbol)
    if not match:
        return symbol[:60]
    parts, rest = [], match.group(1)
    while rest:
        digits = re.match(r"\d+", rest).group(0)
        size = int(digits)
        parts.append(rest[len(digits):len(digits) + size])
        rest = rest[len(digits) + size:]
    return ".".join(parts)


def write_perf_map(path: Path) -> int:
    """Write perf's JIT symbol map of every loaded library's functions; return how many."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for library, code in LOADED:
            objfile = Path(tmp) / "lib.o"
            objfile.write_bytes(code)
            listing = subprocess.run(["nm", "-S", objfile], capture_output=True, text=True, check=True).stdout
            for line in listing.splitlines():
                fields = line.split()
                if len(fields) == 4 and fields[2] in "tTwW":
                    address = library.get_pointer_to_function(fields[3])
                    if address:
                        rows.append((address, int(fields[1], 16), short_name(fields[3])))
    path.write_text("".join(f"{a:x} {size:x} {name}\n" for a, size, name in sorted(rows)))
    return len(rows)


def run(args) -> None:
    keep_object_code()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_sim import bailian_a, kvprof_throughput

    trace, hp, config = bailian_a(args.hours)
    row = kvprof_throughput(trace, hp, args.policy, args.capacity, config, clock=time.thread_time)
    print(f"{args.policy}: {row['seconds']:.2f} s CPU, block hit ratio {row['block_hit_ratio']:.4f}")
    where = Path(f"/tmp/perf-{os.getpid()}.map")
    print(f"{write_perf_map(where)} compiled functions named in {where}")


def report(args) -> None:
    symbols = sorted(tuple(line.split(" ", 2)) for line in Path(args.map).read_text().splitlines())
    starts = [int(a, 16) for a, _, _ in symbols]

    def function(address: int) -> str | None:
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and address < starts[i] + int(symbols[i][1], 16):
            return symbols[i][2]
        return None

    samples = []  # (sampled address, the words on top of its stack)
    raw, stack = b"", None
    lines = Path(args.dump).read_text().splitlines()
    for i, line in enumerate(lines):
        if "... raw event: size" in line:
            raw = bytearray()
            for row in lines[i + 1:]:
                if not row.startswith(".  "):
                    break
                raw += bytes(int(h, 16) for h in row[8:56].split())
        elif found := re.search(r"ustack: size (\d+), offset (0x[0-9a-f]+)", line):
            at, size = int(found.group(2), 16), int(found.group(1))
            stack = [int.from_bytes(raw[k:k + 8], "little") for k in range(at, at + size, 8)]
        elif re.match(r"^\S+\s+\d+\s+[\d.]+:\s+\d+ cpu-clock", line) and stack is not None:
            samples.append((int(lines[i + 1].split()[0], 16), stack))
            stack = None
    own = collections.Counter(function(ip) for ip, _ in samples)
    counting = collections.Counter()
    for ip, stack in samples:
        if (own_name := function(ip)) and (own_name.startswith("NRT_") or own_name in args.callers):
            callers = [name for name in map(function, stack) if name and name != own_name and not name.startswith("NRT_")]
            counting[callers[0] if callers else "?"] += 1
    print(f"{len(samples)} samples; per compiled function (own time):")
    for name, n in own.most_common(args.top):
        print(f"  {100 * n / len(samples):5.1f}%  {name or '(not compiled code, or not named)'}")
    total = sum(counting.values())
    print(f"{total} samples in reference counting{''.join(f' or {name}' for name in args.callers)}, "
          "by the compiled function that called it:")
    for name, n in counting.most_common(args.top):
        print(f"  {100 * n / max(total, 1):5.1f}%  {name}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    replay = verbs.add_parser("run", help="replay bailian-a under perf and name the compiled functions")
    replay.add_argument("--policy", default="wa")
    replay.add_argument("--hours", type=float, default=1.0)
    replay.add_argument("--capacity", type=int, default=65536)
    read = verbs.add_parser("report", help="time per compiled function from `perf script -D` output")
    read.add_argument("dump")
    read.add_argument("map")
    read.add_argument("--top", type=int, default=25)
    read.add_argument("--callers", nargs="*", default=[],
                      help="compiled functions whose samples are counted with reference counting's, by caller")
    args = parser.parse_args(argv)
    run(args) if args.verb == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
