"""Live = simulated where responses fill blocks that the next turn sends again, on real vLLM.

Twelve chat sessions of four turns, four at a time: every turn's prompt is the previous prompt, the
previous response's 40 tokens and 10 new ones, so the blocks a response filled come back as prompt
blocks of the next turn, which vLLM finds in its prefix cache. 32 usable blocks of 32 tokens hold
about six sessions, so blocks are evicted while responses decode. Three servers, one after another:

* A records only (``--kv-record``): vLLM's own LRU;
* B enforces kvprof's ``lru`` (``--kv-policy lru``);
* C enforces ``wa`` fitted on A's recording, with ``--kv-hint-counterfactual`` and a client that sends
  no hints: the hints are worth nothing, to the block;
* D enforces it too, and the client sends hints: a retention after each of the first three turns, a
  release after the last, every request naming its conversation (``hint_session``), under a budget
  (``--kv-hint-max-fraction``) that ``kvprof compare`` of the recording takes from recording.json.

On each, ``kvprof compare`` of the recording and the live counterfactual must give what vLLM reported
to the clients, token for token: the recording keeps the ids of the blocks a response filled and when
the server took each block while decoding.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request

import pytest

from test_loop import metrics
from vllm_support import vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCKS = 33  # 32 usable (block 0 is vLLM's null block)
BS = 32
SESSIONS, TURNS, CLIENTS = 12, 4, 4
OUTPUT, NEW_TOKENS = 40, 10


def _turn(url: str, prompt: list[int], session: int, turn: int, hints: bool) -> tuple[list[int], int]:
    """One turn: the response's token ids and the prompt tokens vLLM found cached."""
    xargs = {"session": f"s{session}", "type": "chat", "turn": turn}
    if hints:
        xargs.update({"hint_session": f"s{session}", "release": 1} if turn == TURNS else
                     {"hint_session": f"s{session}", "retain_s": 30, "hint_tag": session % 2})
    body = {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT, "min_tokens": OUTPUT, "ignore_eos": True,
            "temperature": 0.0, "return_token_ids": True, "vllm_xargs": xargs}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.load(r)
    (choice,) = answer["choices"]
    assert len(choice["token_ids"]) == OUTPUT
    return choice["token_ids"], (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _conversations(url: str, hints: bool = False) -> int:
    """The sessions, ``CLIENTS`` at a time; the cached prompt tokens vLLM reported in all."""
    cached: list[int] = []
    errors: list[BaseException] = []

    def client(first: int) -> None:
        try:
            for session in range(first, SESSIONS, CLIENTS):
                prompt = [5 + session] + [(13 * i + 7 * session) % 400 + 20 for i in range(21)]
                for turn in range(1, TURNS + 1):
                    output, hit = _turn(url, prompt, session, turn, hints)
                    cached.append(hit)
                    prompt = prompt + output + [(17 * turn + session + i) % 400 + 20 for i in range(NEW_TOKENS)]
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(cached) == SESSIONS * TURNS
    return sum(cached)


def _kvprof(venv, *args, cwd) -> None:
    proc = subprocess.run([str(venv / "bin" / "kvprof"), *map(str, args)], capture_output=True, text=True,
                          timeout=900, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _served(venv, model, tmp, name: str, *extra: str, hints: bool = False) -> dict:
    rec = tmp / f"rec-{name}"
    with vllm_server(venv, model, "--kv-record", str(rec), "--kv-log-interval", "1", *extra,
                     log=tmp / f"{name}.log", blocks=BLOCKS) as url:
        cached = _conversations(url, hints)
        time.sleep(4)  # the counterfactual's thread counts the last finishes; the writer closes a frame
        served = metrics(url)
    return {"cached": cached, "rec": rec, "metrics": served, "log": (tmp / f"{name}.log").read_text()}


def _compare(venv, tmp, rec, policy: str, hp=None) -> int:
    """The cached tokens ``kvprof compare`` of the recording gives ``policy`` (``P+hints``: with the recording's
    hints, under the server's budget, as compare takes them by default)."""
    out = tmp / f"compare-{rec.name}-{policy}"
    args = ["compare", rec, "--policies", policy.removesuffix("+hints"), "--eval-window", "0:", "-o", out, "-j", "1"]
    if hp is not None:
        args += ["--config", hp]
    _kvprof(venv, *args, cwd=tmp)
    runs = {run["policy"]: run for run in json.loads((out / "results.json").read_text())["runs"]}
    assert runs[policy]["capacity"] == BLOCKS - 1
    return runs[policy]["cached_tokens"]


@pytest.fixture(scope="module")
def servers(vllm_venv, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("outputs-live")
    a = _served(vllm_venv, tiny_model, tmp, "a")
    b = _served(vllm_venv, tiny_model, tmp, "b", "--kv-policy", "lru")
    _kvprof(vllm_venv, "fit", a["rec"], "--window", "0:", "-o", tmp / "hp.json", "-j", "1", cwd=tmp)
    c = _served(vllm_venv, tiny_model, tmp, "c", "--kv-policy-config", str(tmp / "hp.json"), "--kv-hint-counterfactual")
    d = _served(vllm_venv, tiny_model, tmp, "d", "--kv-policy-config", str(tmp / "hp.json"), "--kv-hint-max-fraction",
                "0.25", hints=True)
    return {"tmp": tmp, "venv": vllm_venv, "a": a, "b": b, "c": c, "d": d, "hp": tmp / "hp.json"}


def test_the_next_turns_hit_the_blocks_the_responses_filled(servers):
    from kvprof.profiler.reader import read_trace

    trace, _ = read_trace(servers["a"]["rec"])
    named = trace.extra["output_hash_ids"]
    later = {int(h) for i in range(trace.n_requests) for h in trace.blocks_of(i)}
    # a response's blocks (its first may be its prompt's partial block, filled in place) come back in the next turn
    assert sum(len(ids) for ids in named) >= SESSIONS * (TURNS - 1)
    assert sum(int(h) in later for ids in named for h in ids.tolist()) >= SESSIONS * (TURNS - 1)
    assert all(len(times) >= 1 for times in trace.extra["grown"])  # 40 tokens start a block while decoding
    assert int(trace.extra["cached_tokens"].sum()) == servers["a"]["cached"]


@pytest.mark.parametrize("name, policy", [("a", "lru"), ("b", "lru"), ("c", "wa"), ("d", "wa+hints")])
def test_compare_of_the_recording_gives_what_the_server_hit(servers, name, policy):
    server = servers[name]
    hp = servers["hp"] if name in ("c", "d") else None
    assert _compare(servers["venv"], servers["tmp"], server["rec"], policy, hp) == server["cached"] > 0


@pytest.mark.parametrize("name, policy", [("a", "lru"), ("b", "lru"), ("c", "wa")])
def test_the_live_counterfactual_hits_what_the_server_hit(servers, name, policy):
    m = servers[name]["metrics"]
    assert m[f'kvprof_counterfactual_cached_blocks_total{{policy="{policy}"}}'] * BS == servers[name]["cached"]


def test_with_no_hints_sent_every_log_window_says_the_hints_were_worth_nothing(servers):
    lines = [line for line in servers["c"]["log"].splitlines() if "without the clients' hints" in line]
    assert lines and all("(the hints +0.0 %)" in line for line in lines), lines


def test_the_hinted_server_honoured_the_hints_it_was_sent(servers):
    from kvprof.recording import load_recording

    m = servers["d"]["metrics"]
    assert load_recording(servers["d"]["rec"]).starts[0].hint_max_fraction == 0.25
    assert m['kvprof_hint_blocks_total{outcome="released_evicted",tier="gpu"}'] > 0
    assert m['kvprof_hint_blocks_total{outcome="retained_hits",tier="gpu"}'] > 0
