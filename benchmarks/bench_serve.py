"""End to end: ``vllm serve`` without kvprof, with ``lru``, with ``wa`` and with ``wa --kv-record``, at saturation.

Run with the vLLM venv's python (it starts real servers of the CPU build on the tests' tiny model)::

    .venv-vllm/bin/python benchmarks/bench_serve.py [--seconds 60] [--rounds 1] [--concurrency 16] [--json]

Each configuration serves the same request stream on a server of its own (``--blocks`` GPU blocks of
32 tokens, prefix caching on), started afresh, warmed for ``--warmup`` seconds, then driven by
``--concurrency`` clients in a closed loop (each sends its next request as soon as its last one is
answered: the server is never idle) for ``--seconds``. The stream is seeded and the same for every
configuration: chat sessions whose prompt grows by its last output and a new message each turn, and
API calls that share one of 32 system prompts, so that the cache fills, hits and evicts. Rounds take the
configurations in turns (the order reversed every other round) and each figure is the best of the
rounds (the others are the shared machine's noise).

Per configuration: requests/s and output tokens/s completed within the measured window, the time to
first token (p50, p99) of those requests, as a client measures it (the stream's first token), and their
prompt tokens' hit ratio (a policy that hits more has less to prefill: throughput is its price and its gain
together).
Target: every kvprof configuration within 2 % of native throughput and p99 TTFT. With ``--json`` one
object: ``{"configs": {name: {"requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms"}},
...}`` and the ratios against native.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "vllm"))
# What serves (tests/vllm's vllm_support, kvprof's client) is imported where it is used, so that --help and a
# refused argument need neither vLLM nor its helpers.

from bench_args import bounded  # noqa: E402

from kvprof.limits import COUNT, Bound  # noqa: E402

CONFIGS = ("native", "lru", "wa", "wa+record")
BLOCK = 32
VOCAB = 500
MAX_MODEL_LEN = 1024


def flags(config: str, work: Path, round_: int) -> list[str]:
    """The kvprof flags of ``config`` (none for native)."""
    if config == "native":
        return []
    if config == "lru":
        return ["--kv-policy", "lru"]
    out = ["--kv-policy-config", str(work / "hp.json")]
    if config == "wa+record":
        out += ["--kv-record", str(work / f"record-{round_}")]
    return out


def request_stream(seed: int, output_tokens: int):
    """Endless prompts (token ids), the same for every configuration: a chat turn (a session's prompt,
    its last output stood in by ``output_tokens`` ids, and a new message) 40 % of the time, else an API
    call (one of 32 system prompts of 4-8 blocks and a question of 1-4 blocks)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, VOCAB, int(rng.integers(4, 9)) * BLOCK).tolist() for _ in range(32)]
    sessions: list[list[int]] = []
    while True:
        if rng.random() < 0.4:
            if sessions and rng.random() < 0.75:
                i = int(rng.integers(len(sessions)))
                grown = sessions[i] + rng.integers(1, VOCAB, output_tokens + int(rng.integers(32, 129))).tolist()
                if len(grown) + output_tokens > MAX_MODEL_LEN:
                    sessions.pop(i)
                    continue
                sessions[i] = grown
                yield grown
            else:
                sessions.append(rng.integers(1, VOCAB, int(rng.integers(64, 257))).tolist())
                if len(sessions) > 200:
                    sessions.pop(0)
                yield sessions[-1]
        else:
            system = systems[int(rng.integers(len(systems)))]
            yield system + rng.integers(1, VOCAB, int(rng.integers(1, 5)) * BLOCK).tolist()


def drive(url: str, args) -> dict:
    """Warm the server, then keep ``args.concurrency`` requests in flight for ``args.seconds``; the figures of
    the requests that finished within the measured window."""
    from kvprof.replay.server import RequestFailed, Server

    stream = request_stream(args.seed, args.output_tokens)
    lock = threading.Lock()
    done: list[tuple[float, float, int, int]] = []  # (finished at, TTFT s, prompt, cached tokens) of each answer
    errors = [0]

    def worker(until: float) -> None:
        with Server(url, "tiny", timeout_s=120, max_connections=1) as server:
            while time.monotonic() < until:
                with lock:
                    prompt = next(stream)
                try:
                    answer = server.complete(prompt, max_tokens=args.output_tokens, workload={})
                except RequestFailed:
                    errors[0] += 1
                    continue
                with lock:
                    done.append((time.monotonic(), answer.ttft_s, answer.prompt_tokens, answer.cached_tokens))

    warm_until = time.monotonic() + args.warmup
    start = warm_until
    end = start + args.seconds
    threads = [threading.Thread(target=worker, args=(end,)) for _ in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    measured = [(ttft, prompt, cached) for finished, ttft, prompt, cached in done if start <= finished < end]
    ttft = np.array([row[0] for row in measured]) * 1e3
    prompt_tokens = sum(row[1] for row in measured)
    return {"requests_per_s": len(measured) / args.seconds,
            "output_tokens_per_s": len(measured) * args.output_tokens / args.seconds,
            "ttft_p50_ms": float(np.percentile(ttft, 50)) if len(ttft) else None,
            "ttft_p99_ms": float(np.percentile(ttft, 99)) if len(ttft) else None,
            "token_hit_ratio": sum(row[2] for row in measured) / prompt_tokens if prompt_tokens else None,
            "requests": len(measured), "errors": errors[0]}


def serve_and_drive(config: str, args, work: Path, model: Path, round_: int) -> dict:
    from vllm_support import VENV, _kill_group, free_port, serve_command, server_env, wait_until_up

    port = free_port()
    cmd = serve_command(VENV, model, port, *flags(config, work, round_), blocks=args.blocks)
    cmd[cmd.index("--max-model-len") + 1] = str(MAX_MODEL_LEN)
    log = work / f"{config}-{round_}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=server_env(), start_new_session=True,
                                cwd=str(work))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, proc, log)
        return drive(url, args)
    finally:
        _kill_group(proc)


def best(runs: list[dict]) -> dict:
    """The best of each figure over the rounds: the most throughput, the least TTFT."""
    out = dict(runs[0])
    for key in ("requests_per_s", "output_tokens_per_s"):
        out[key] = max(run[key] for run in runs)
    for key in ("ttft_p50_ms", "ttft_p99_ms"):
        values = [run[key] for run in runs if run[key] is not None]
        out[key] = min(values) if values else None
    out["rounds"] = runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--seconds", type=bounded(Bound(0.0, 1e6, low_open=True)), default=60.0,
                        help="measured seconds per configuration (> 0)")
    parser.add_argument("--warmup", type=bounded(Bound(0.0, 1e6)), default=10.0,
                        help="unmeasured seconds first (the cache fills)")
    parser.add_argument("--rounds", type=bounded(Bound(1, 1000, whole=True)), default=1, help="at least 1")
    parser.add_argument("--concurrency", type=bounded(Bound(1, 10_000, whole=True)), default=16,
                        help="clients in the closed loop")
    # a server must hold one request of the longest length, and the null block
    parser.add_argument("--blocks", type=bounded(Bound(MAX_MODEL_LEN // BLOCK + 1, 2**31 - 1, whole=True)),
                        default=2048, help="the servers' GPU blocks (32 tokens each)")
    # the longest prompt of the stream (an API call: 384 tokens) and its output fit in MAX_MODEL_LEN
    parser.add_argument("--output-tokens", type=bounded(Bound(1, 512, whole=True)), default=16)
    parser.add_argument("--seed", type=bounded(COUNT), default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from vllm_support import HP_TEST, VENV

    if VENV is None:
        raise SystemExit("bench_serve.py needs the vLLM venv (scripts/install_vllm_cpu.sh .venv-vllm)")
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run([str(VENV / "bin" / "python"), str(REPO / "tests" / "vllm" / "tiny_model.py"), str(model)],
                       check=True, capture_output=True)
        (work / "hp.json").write_text(json.dumps(HP_TEST))
        runs: dict[str, list[dict]] = {config: [] for config in args.configs}
        for round_ in range(args.rounds):
            order = args.configs if round_ % 2 == 0 else args.configs[::-1]
            for config in order:
                runs[config].append(serve_and_drive(config, args, work, model, round_))
                if not args.json:
                    print(f"  round {round_} {config}: {runs[config][-1]}", file=sys.stderr, flush=True)
    configs = {config: best(rows) for config, rows in runs.items()}
    native = configs.get("native")
    if native:
        for config, row in configs.items():
            if config != "native":
                row["throughput_x_native"] = row["requests_per_s"] / native["requests_per_s"]
                row["ttft_p99_x_native"] = (row["ttft_p99_ms"] / native["ttft_p99_ms"]
                                            if row["ttft_p99_ms"] and native["ttft_p99_ms"] else None)
    report = {"configs": configs, "blocks": args.blocks, "block_size": BLOCK, "concurrency": args.concurrency,
              "seconds": args.seconds, "rounds": args.rounds, "output_tokens": args.output_tokens}
    if args.json:
        print(json.dumps(report))
        return
    print(f"vllm serve, tiny model, {args.blocks} blocks of {BLOCK} tokens, {args.concurrency} clients, "
          f"{args.seconds:g} s a run, best of {args.rounds} round(s)")
    print(f"{'config':>10} {'req/s':>8} {'out tok/s':>10} {'TTFT p50 ms':>12} {'p99 ms':>8} {'thr x nat':>10} "
          f"{'p99 x nat':>10}")
    for config, row in configs.items():
        thr, p99 = row.get("throughput_x_native", 1.0), row.get("ttft_p99_x_native", 1.0)
        print(f"{config:>10} {row['requests_per_s']:>8.2f} {row['output_tokens_per_s']:>10.1f} "
              f"{row['ttft_p50_ms'] or 0:>12.1f} {row['ttft_p99_ms'] or 0:>8.1f} {thr:>10.3f} "
              f"{p99 if p99 is not None else float('nan'):>10.3f}")
    for config, row in configs.items():
        if config != "native" and native:
            met = row["throughput_x_native"] >= 0.98 and (row["ttft_p99_x_native"] or 0) <= 1.02
            print(f"{config}: within 2 % of native throughput and p99 TTFT: {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
