"""One recording server on real vLLM, stopped as an operator stops it (Ctrl-C): the blocks a short
output fills are counted as vLLM counts them, and the stop is quiet.

The server has 8 usable blocks of 32 tokens. Each round sends a 65-token prompt X (2 full blocks and
1 token), then a 191-token prompt (5 full blocks and 31 tokens: one token short of filling its last
block, and with X's 2 cached blocks the whole cache) with 1, 2 or 3 output tokens, then X's 64
tokens again with another last token. vLLM holds ``ceil((prompt + output - 1) / 32)`` blocks: with
2 output tokens the partial block is filled in place and nothing is evicted, so the third prompt
finds X's 2 blocks; with 3 it takes a seventh block, evicting one of X's (issue 40 A1). The recording, ``kvprof compare`` of it and the live counterfactual must say so token
for token.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from test_loop import metrics
from vllm_support import free_port, serve_command, server_env, wait_until_up

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCKS = 9  # 8 usable (block 0 is vLLM's null block): 256 tokens, the tests' --max-model-len
BS = 32


def _complete(url: str, prompt: list[int], output: int) -> int:
    """Send ``prompt`` for exactly ``output`` tokens; the prompt tokens vLLM found cached."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": output, "min_tokens": output, "ignore_eos": True,
            "temperature": 0.0}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        usage = json.load(r)["usage"]
    assert usage["completion_tokens"] == output
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def rounds() -> list[tuple[list[int], int]]:
    """``(prompt, output tokens)`` of the three rounds (see the module), each round's tokens its own."""
    sent = []
    for k, output in enumerate((1, 2, 3)):
        x = [5 + k] + [(7 * i) % 400 + 20 for i in range(64)]
        sent += [(x, 1), ([10 + k] + [(11 * i) % 400 + 20 for i in range(190)], output), (x[:64] + [499], 1)]
    return sent


@pytest.fixture(scope="module")
def stopped_server(vllm_venv, tiny_model, tmp_path_factory):
    """The rounds served by ``vllm serve --kv-record``, its metrics read, then stopped by SIGINT to the API
    server (what Ctrl-C sends it) under vLLM's default shutdown."""
    tmp = tmp_path_factory.mktemp("record-live")
    log, rec, port = tmp / "serve.log", tmp / "rec", free_port()
    with open(log, "w") as fh:
        proc = subprocess.Popen(serve_command(vllm_venv, tiny_model, port, "--kv-record", str(rec),
                                              "--kv-log-interval", "1", blocks=BLOCKS),
                                stdout=fh, stderr=subprocess.STDOUT, env=server_env(), start_new_session=True,
                                cwd=str(tmp))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(url, proc, log)
        cached = [_complete(url, prompt, output) for prompt, output in rounds()]
        time.sleep(4)  # the counterfactual's thread counts the last finishes; the writer closes a frame
        served = metrics(url)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(3)  # the guard finishes the recording after the engine core went
    return {"tmp": tmp, "rec": rec, "cached": cached, "metrics": served, "log": log.read_text(), "venv": vllm_venv}


def test_an_output_filling_the_prompts_last_block_is_counted_as_vllm_counts_it(stopped_server):
    from kvprof.profiler.reader import read_trace

    cached = stopped_server["cached"]
    # vLLM: the third prompt finds X's 2 blocks where the output filled the partial block in place (rounds
    # 1 and 2), and loses one to the seventh block 3 output tokens take (round 3)
    assert cached[2] == cached[5] == 2 * BS and cached[8] < 2 * BS, cached
    trace, _ = read_trace(stopped_server["rec"])
    assert sorted(trace.extra["cached_tokens"].tolist()) == sorted(cached)
    out = stopped_server["tmp"] / "compare"
    proc = subprocess.run([str(stopped_server["venv"] / "bin" / "kvprof"), "compare", str(stopped_server["rec"]),
                           "--policies", "lru", "--eval-window", "0:", "-o", str(out), "-j", "1"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["capacity"] == BLOCKS - 1 and run["cached_tokens"] == sum(cached)
    m = stopped_server["metrics"]
    assert m['kvprof_counterfactual_cached_blocks_total{policy="lru"}'] * BS == sum(cached)


def test_an_ordinary_stop_is_quiet_and_leaves_a_finished_recording(stopped_server):
    from kvprof.recording import load_recording, trace_files

    log = stopped_server["log"]
    assert "force killing sub process setsid" not in log, log[-3000:]
    assert not [line for line in log.splitlines() if "kvprof" in line and ("WARNING" in line or "ERROR" in line)]
    files = trace_files(stopped_server["rec"])
    assert files and not any(still_open for _, still_open in files)
    assert load_recording(stopped_server["rec"]).starts[0].written == len(rounds())
