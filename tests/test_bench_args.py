"""The benchmarks refuse what nothing can be measured with before any work, and a run that measures
nothing writes nothing: an argument out of range (nan, a negative share, no rounds, no workers) or a
``--traces`` that names no case exits 2 by argparse; every trace chosen missing exits 1. bench_serve's
``--help`` and argument errors need neither vLLM nor tests/vllm's helpers (their import is refused here).

Each run is pointed at a temporary output where the benchmark takes one, and benchmarks/results/ is
checked unchanged.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

#: Runs a benchmark as ``python benchmarks/NAME.py ARGS`` does, with vLLM's helpers made unimportable.
_RUN = """
import runpy, sys
sys.modules["vllm_support"] = None
sys.modules["vllm"] = None
script = sys.argv[1]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def _results() -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(RESULTS.iterdir())
            if path.is_file()}


def _run(script: str, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN, str(REPO / "benchmarks" / script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("script, args, code, words", [
    ("bench_hints.py", ["--traces", "nosuch", "--json"], 2, "argument --traces: no case is named 'nosuch'"),
    ("bench_hints.py", ["--traces", "weka,", "--json"], 2, "argument --traces: an empty case name"),
    ("bench_hints.py", ["--max-fraction", "nan", "--json"], 2, "argument --max-fraction"),
    ("bench_hints.py", ["--max-fraction", "-1", "--json"], 2, "argument --max-fraction"),
    ("bench_hints.py", ["--max-fraction", "0", "--json"], 2, "argument --max-fraction"),
    ("bench_hints.py", ["-j", "0", "--json"], 2, "argument -j/--jobs"),
    ("bench_hints.py", ["--json", "-o", "{tmp}/no-such-dir/hints.json"], 2, "argument -o/--output"),
    # a case that is named but whose trace is not there: nothing measured, nothing written
    ("bench_hints.py", ["--traces", "weka", "--json"], 1, "nothing measured"),
    ("bench_serve.py", ["--rounds", "0"], 2, "argument --rounds"),
    ("bench_serve.py", ["--seconds", "nan"], 2, "argument --seconds"),
    ("bench_serve.py", ["--seconds", "0"], 2, "argument --seconds"),
    ("bench_serve.py", ["--warmup", "-1"], 2, "argument --warmup"),
    ("bench_serve.py", ["--concurrency", "0"], 2, "argument --concurrency"),
    ("bench_serve.py", ["--blocks", "1"], 2, "argument --blocks"),
    ("bench_serve.py", ["--output-tokens", "0"], 2, "argument --output-tokens"),
    ("bench_serve.py", ["--rounds", "1.5"], 2, "argument --rounds"),
    ("bench_serve.py", ["--help"], 0, "usage: bench_serve.py"),
])
def test_a_benchmark_refuses_what_it_cannot_measure_and_writes_nothing(tmp_path, script, args, code, words):
    before = _results()
    output = tmp_path / "out.json"
    args = [arg.format(tmp=tmp_path) for arg in args]
    if script == "bench_hints.py" and "-o" not in args:
        args += ["-o", str(output)]
    done = _run(script, args, env={"KVPROF_TRACES": str(tmp_path / "no-traces")})
    assert done.returncode == code, done.stderr
    assert words in done.stdout + done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not output.exists() and list(tmp_path.iterdir()) == []
    assert _results() == before
