"""The prepared GPU check (driver of scripts/gpu_check.sh; run with the vLLM venv's python).

Stages, each timed; the first four need no GPU and run anywhere:

1. build the tiny local model (tests/vllm/tiny_model.py: no hub, no internet);
2. synthesise a trace (``kvprof synth``, bailian-a, 300 requests that fit the model's context,
   outputs capped at 16 tokens as the replay sends them) and fit an hp file on it;
3. simulate it (``kvprof compare``: ``wa`` and ``lru`` with a CPU offload tier, at the sizes the
   servers get), which also compiles kvprof's core into this run's numba cache for the servers;
4. the scheduler's step time with and without kvprof (``benchmarks/bench_scheduler.py``, vLLM's real
   ``Scheduler`` in process, ``native`` against ``wa+record``), where the checkout has it;
5. GPU: stop here, exit 3, saying so, when there is none;
6. serve the model twice with vLLM's GPU build and the offload connector: vLLM's own LRU in both
   tiers, then ``wa`` (``--kv-policy-config``, ``--kv-record``, ``KvprofCachePolicy`` in the CPU
   tier); each time greedy completions of fixed prompts, then ``kvprof replay`` of the trace, then
   the server's cached tokens by source (device: GPU prefix cache, host: the offload tier);
7. ``kvprof compare`` of the recording (the live requests on their live timing);
8. the report: live against simulated cached tokens, the offload tier's hits, the replays'
   throughput and TTFT without and with kvprof, greedy-output identity. Exit 0 only when every
   stage ran and the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "vllm"))
os.environ.setdefault("KVPROF_VLLM_STARTUP_TIMEOUT", "240")

from vllm_support import completion, vllm_server  # noqa: E402

BLOCK = 16
GPU_BLOCKS = 1024
CPU_BLOCKS = 2048
REQUESTS = 300
MAX_PROMPT = 3000  # the tiny model's context is 4,096 tokens
MAX_OUTPUT = 16
RATE_SCALE = 4.0
VOCAB = 500
NO_GPU = 3


def stage(title: str):
    print(f"\n== {title} ({time.strftime('%H:%M:%S')})", flush=True)


def run(cmd: list, timeout: float, **kwargs) -> str:
    """Run a command, echo it and its output's tail; raise when it fails."""
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    t = time.monotonic()
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    out = proc.stdout + proc.stderr
    print("\n".join(out.strip().splitlines()[-12:]), f"\n[{time.monotonic() - t:.1f} s, exit {proc.returncode}]",
          flush=True)
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} failed (exit {proc.returncode})")
    return out


def kvprof(*args, timeout: float = 300) -> str:
    """The kvprof CLI of this checkout, in this interpreter (kvprof.cli.app has no ``__main__``)."""
    return run([sys.executable, "-c", "from kvprof.cli.app import main; main()", *args], timeout)


def make_trace(work: Path) -> Path:
    full = work / "synth.jsonl"
    kvprof("synth", "-o", full, "--hours", "0.05", "--seed", "7", timeout=120)
    rows = [json.loads(line) for line in full.read_text().splitlines()]
    rows = [dict(r, output_length=min(r["output_length"], MAX_OUTPUT)) for r in rows if r["input_length"] <= MAX_PROMPT]
    trace = work / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows[:REQUESTS]))
    return trace


def simulate(source: Path, hp: Path, out: Path) -> dict:
    # a trace at the replay's speed; a recording (a folder) knows its block size and live timing. The
    # capacity is the server's usable blocks: vLLM keeps one of them as its null block.
    as_trace = ["--trace-block-tokens", BLOCK, "--rate-scale", RATE_SCALE] if source.is_file() else []
    kvprof("compare", source, "--config", hp, "--policies", "wa,lru", "--capacity", GPU_BLOCKS - 1,
           "--cpu-capacity", CPU_BLOCKS, "--block-size", BLOCK, *as_trace, "--eval-window", "0:", "-o", out,
           timeout=900)  # the first run compiles kvprof's core: minutes on a small shared machine
    runs = json.loads((out / "results.json").read_text())["runs"]
    return {r["policy"]: {"cached_tokens": r["cached_tokens"], "device_blocks": r["hits_device"],
                          "host_blocks": r["hits_host"]} for r in runs}


def scheduler_step_times(model: Path) -> bool:
    bench = REPO / "benchmarks" / "bench_scheduler.py"
    if not bench.exists():
        print("benchmarks/bench_scheduler.py is not in this checkout: no step-time figure")
        return False
    run([sys.executable, bench, "--configs", "native", "wa+record", "--requests", "200", "--pools", "4096",
         "--no-call-pass", "--model", model], 240)
    return True


def gpu_present() -> str | None:
    """The GPU's name, or None when there is none vLLM's GPU build could use."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip()
    try:
        import torch

        usable = torch.cuda.is_available()
    except Exception as err:  # a torch that cannot load its CUDA libraries
        print(f"torch: {err!r}")
        usable = False
    return listed if listed and usable else None


def kv_bytes_per_block(model: Path) -> int:
    """Bytes of K and V for one block of every layer in float16, from the model's config."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * BLOCK * 2


def cached_by_source(url: str) -> dict:
    """The server's ``vllm:prompt_tokens_cached_by_source`` counters, by source."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:prompt_tokens_cached_by_source") and sample.name.endswith("_total"):
                source = sample.labels.get("source", "?")
                out[source] = out.get(source, 0) + int(sample.value)
    return out


PROMPTS = [[(7 * p + 13 * i) % (VOCAB - 10) + 4 for i in range(BLOCK * (4 + p))] for p in range(4)]


def serve_and_replay(name: str, work: Path, venv: Path, model: Path, trace: Path, extra: list[str]) -> dict:
    out = work / name
    out.mkdir()
    offload = {"cpu_bytes_to_use": CPU_BLOCKS * kv_bytes_per_block(model)}
    if "--kv-policy-config" in extra:
        offload.update(eviction_policy="KvprofCachePolicy", cache_policy_module_path="kvprof.vllm.offload")
    transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": offload}
    args = [*extra, "--kv-transfer-config", json.dumps(transfer), "--block-size", str(BLOCK),
            "--max-model-len", "4096", "--dtype", "float16", "--gpu-memory-utilization", "0.3"]
    t = time.monotonic()
    with vllm_server(venv, model, *args, log=out / "vllm.log", blocks=GPU_BLOCKS) as url:
        print(f"{name}: ready after {time.monotonic() - t:.0f} s at {url}", flush=True)
        # each prompt twice: the second time from the cache
        greedy = [completion(url, p, max_tokens=24)["choices"][0]["token_ids"] for p in PROMPTS + PROMPTS]
        kvprof("replay", trace, "--url", url, "--model", "tiny", "--rate-scale", RATE_SCALE, "--max-concurrency",
               "16", "--vocab-size", VOCAB, "--max-output-tokens", MAX_OUTPUT, "--trace-block-tokens", BLOCK,
               "--capacity", GPU_BLOCKS, *(["--config", extra[extra.index("--kv-policy-config") + 1]]
                                           if "--kv-policy-config" in extra else []),
               "-o", out / "replay", timeout=300)
        by_source = cached_by_source(url)
    run_ = json.loads((out / "replay" / "results.json").read_text())["runs"][0]
    return {"greedy": greedy, "by_source": by_source, "replay": run_}


def report(sim: dict, sim_rec: dict | None, live: dict) -> bool:
    stage("report")
    print(f"{'policy':<6} {'live cached':>12} {'sim (trace)':>12} {'sim (recording)':>16}  live by source / sim device+host blocks")
    for policy, key in (("lru", "plain"), ("wa", "kvprof")):
        rep = live[key]["replay"]
        rec = (sim_rec or {}).get(policy, {}).get("cached_tokens", "-")
        print(f"{policy:<6} {rep['cached_tokens']:>12,} {sim[policy]['cached_tokens']:>12,} {rec!s:>16}  "
              f"{live[key]['by_source']} / {sim[policy]['device_blocks']:,}+{sim[policy]['host_blocks']:,}")
    print(f"offload tier hits (tokens from source 'host'): lru {live['plain']['by_source'].get('host', 0):,}, "
          f"wa {live['kvprof']['by_source'].get('host', 0):,}")
    for key in ("plain", "kvprof"):
        rep = live[key]["replay"]
        print(f"replay {key:>6}: {rep['n_requests'] / rep['makespan_s'] if rep.get('makespan_s') else float('nan'):.2f} "
              f"requests/s, mean TTFT {1e3 * rep.get('ttft_mean_s', float('nan')):.1f} ms, errors {rep['n_errors']}")
    same = live["plain"]["greedy"] == live["kvprof"]["greedy"]
    print(f"greedy outputs identical (plain vLLM vs kvprof, {len(PROMPTS)} prompts twice each): {same}")
    return same


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--venv", type=Path, required=True)
    args = ap.parse_args()
    work = args.work
    stage(f"environment: python {sys.version.split()[0]}, repo {REPO}")
    import importlib.metadata as md

    print(f"vllm {md.version('vllm')}; kvprof from {REPO}")

    stage("1. tiny local model")
    model = work / "model"
    run([sys.executable, REPO / "tests" / "vllm" / "tiny_model.py", model], 600)
    stage("2. synthetic trace and its hp file")
    trace = make_trace(work)
    hp = work / "hp.json"
    kvprof("fit", trace, "-o", hp, "--window", "0:3600", timeout=300)
    stage("3. simulation (kvprof compare, GPU tier + CPU offload tier)")
    sim = simulate(trace, hp, work / "sim")
    print(json.dumps(sim))
    stage("4. scheduler step time, in process, without and with kvprof")
    timed = scheduler_step_times(model)

    stage("5. GPU")
    gpu = gpu_present()
    if gpu is None:
        print("NO GPU: no NVIDIA GPU usable here (nvidia-smi and torch.cuda). Done: model, trace, hp file, simulation"
              f"{', step times' if timed else ''}. Not done (they need the GPU): serving with vLLM's GPU build, live "
              "cached tokens, offload hits, greedy identity.")
        return NO_GPU
    print(gpu)

    stage("6. vLLM's own LRU, then kvprof's wa, each with the offload connector")
    live = {"plain": serve_and_replay("plain", work, args.venv, model, trace, [])}
    live["kvprof"] = serve_and_replay("kvprof", work, args.venv, model, trace,
                                      ["--kv-policy-config", str(hp), "--kv-policy", "wa",
                                       "--kv-record", str(work / "rec")])
    stage("7. simulation of the recording (live timing)")
    try:
        sim_rec = simulate(work / "rec", hp, work / "sim-rec")
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"no simulation of the recording: {err}")
        sim_rec = None
    return 0 if report(sim, sim_rec, live) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as err:  # a stage failed: its output is above; exit 2, not the 1 of differing outputs
        print(f"stage failed: {err!r}", flush=True)
        sys.exit(2)
