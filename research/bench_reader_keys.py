"""What the trace reader's repeated-key check costs, as a share of decoding the same lines.

The reader decodes each line with ``orjson.loads`` (``json.loads`` where the two could differ)
and then checks that no key is repeated (``kvprof.profiler.records._may_repeat_a_key``, and the
slow parse where that cannot rule a repeat out). The three are timed side by side, in one
process, on the lines of a synthetic bailian-a trace as written and with a colon in a string
value on every line (the case that needs the second look). CPU seconds, the best of
``--repeat`` runs each.

    python research/bench_reader_keys.py [--hours 0.5] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import time

import orjson

from kvprof.profiler.records import _may_repeat_a_key, _repeated_key
from kvprof.profiler.synth import generate


def best_of(repeat: int, work) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        work()
        times.append(time.process_time() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    records = list(generate("bailian-a", args.hours, 0))
    variants = {"as written": records, "a colon in a value": [dict(r, model="qwen:7b") for r in records]}
    for name, rows in variants.items():
        lines = [json.dumps(r).encode() for r in rows]
        decoded = [json.loads(line) for line in lines]
        loads = best_of(args.repeat, lambda: [json.loads(line) for line in lines])
        fast = best_of(args.repeat, lambda: [orjson.loads(line) for line in lines])
        check = best_of(args.repeat, lambda: [_repeated_key(line) if _may_repeat_a_key(line, len(r)) else None
                                               for line, r in zip(lines, decoded)])
        print(f"{name:20s} {len(lines):,} lines: orjson.loads {fast:.3f} s, json.loads {loads:.3f} s, "
              f"repeated-key check {check:.4f} s = {check / fast:.1%} of orjson.loads, {check / loads:.1%} of json.loads")


if __name__ == "__main__":
    main()
