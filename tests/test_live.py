"""What the vLLM plugin runs beside the scheduler, without vLLM: the live counterfactual, metrics, log
lines and reloads (kvprof.vllm.live, observe, metrics), and the warm-up that compiles it all first.

vLLM's ``Request`` is stood in for by the attributes kvprof reads; the real server runs the same code
in tests/vllm/test_loop.py.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvprof.models.hp import HpFile
from kvprof.policy import make_policy
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.workload import prepare_workload
from kvprof.vllm.live import LiveLoop
from kvprof.vllm.metrics import SnapshotCollector, read_snapshots
from kvprof.vllm.observe import Counterfactual
from kvprof.vllm.spec import PolicySpec

from tests.helpers import READY_S, make_trace

BS = 4
HP = {
    "schema": "kvprof.hp/1", "horizon_s": 60.0, "min_gap_s": 0.3, "block_size": BS,
    "class_rule": {"key": "type_turn", "turn_cap": 5},
    "classes": {"hot_1": {"p": 0.95, "lambda": 0.01}, "cold_1": {"p": 0.01, "lambda": 1.0}},
    "default": {"p": 0.3, "lambda": 0.1, "source": "pooled"},
}


def fake_request(rid, chain, *, partial=0, output=1, tags=None, output_chain=()):
    """A vLLM Request as kvprof reads it; ``chain`` are its prompt's full blocks' hashes."""
    return SimpleNamespace(request_id=rid, arrival_time=0.0, num_prompt_tokens=BS * len(chain) + partial,
                           num_output_tokens=output, block_hashes=list(chain) + list(output_chain),
                           sampling_params=SimpleNamespace(extra_args=tags), get_finished_reason=lambda: "stop")


@st.composite
def traffic(draw):
    """Requests with prefix-chained hashes, scheduled and finished at random times (a recording's worth), and
    a capacity that holds the longest prompt: a server records no request longer than its whole cache
    (the replay of a recording on a smaller cache rejects such a request; the counterfactual runs at the
    server's own capacity)."""
    ids: dict[tuple, int] = {}
    rows, t = [], 0.0
    for r in range(draw(st.integers(1, 60))):  # up to ~360 lookups: wa weighs its shadows every 64
        symbols = draw(st.lists(st.integers(0, 2), min_size=1, max_size=6))
        chain = [ids.setdefault(tuple(symbols[: k + 1]), len(ids)) for k in range(len(symbols))]
        partial = draw(st.integers(0, BS - 1))
        output = draw(st.integers(1, 3 * BS))
        t += draw(st.sampled_from([0.0, 0.1, 1.0]))
        start = t + draw(st.sampled_from([0.0, 0.2]))
        end = start + draw(st.sampled_from([0.05, 0.5, 3.0]))
        rows.append(dict(chain=chain, partial=partial, output=output, arrival=t, scheduled=start, finished=end,
                         kind=draw(st.sampled_from(["hot", "cold"]))))
    longest = max(len(row["chain"]) + (row["partial"] > 0) for row in rows)
    return rows, draw(st.integers(max(2, longest), 12)), draw(st.sampled_from(["lru", "s3fifo", "arc", "wa"]))


def hot_rows(*rows):
    """:func:`traffic`'s rows of "hot" requests from ``(chain, partial, output, arrival, scheduled, finished)``."""
    keys = ("chain", "partial", "output", "arrival", "scheduled", "finished")
    return [dict(zip(keys, row), kind="hot") for row in rows]


#: Partial prompt blocks leave a hole (no content) in the chain a request finishes with; wa's
#: shadows once cached the hole as a content, a different one in the live counterfactual and in
#: the replay (they number contents differently), and wa's safety net followed another candidate.
HOLES_IN_FINISHED_CHAINS = (hot_rows(
    ([0, 1, 2], 0, 1, 0, 0, 0.05), ([3, 4, 5], 1, 5, 0, 0, 0.05), ([3], 2, 3, 0, 0, 0.05),
    ([3, 6, 7, 8, 9, 10], 0, 1, 0, 0, 0.05), ([3, 11, 12, 13], 0, 9, 0, 0, 0.05), ([3], 0, 5, 0, 0, 0.05),
    ([3, 6, 14], 0, 1, 0, 0, 3), ([15], 0, 10, 0, 0, 0.05), ([3, 11, 16, 17], 0, 5, 1, 1, 4),
    ([3, 6], 0, 7, 1, 1, 1.05), ([0, 18, 19], 0, 1, 1, 1, 4), ([3, 6], 3, 12, 1, 1, 1.05),
    ([0, 20, 21], 0, 1, 1, 1.2, 1.25), ([0, 1, 2, 22, 23, 24], 0, 1, 1, 1.2, 1.25), ([3, 6, 14], 0, 1, 1, 1, 1.05),
    ([3, 6, 14, 25, 26, 27], 0, 1, 2, 2, 2.05), ([3, 6], 0, 1, 2, 2.2, 2.25), ([3, 6, 14, 25], 0, 1, 2, 2, 2.05),
    ([3, 6, 14], 0, 6, 2, 2, 5), ([3, 6], 0, 1, 2, 2, 2.05), ([3, 6, 14], 0, 1, 2, 2, 2.05),
    ([0, 1, 2, 22, 23, 24], 0, 1, 2, 2.2, 2.25), ([0, 1, 2], 0, 1, 2, 2.2, 2.25), ([3, 6, 14, 25], 0, 1, 3, 3, 3.05),
    ([0, 1, 2, 22], 0, 1, 4, 4, 4.05), ([3, 6, 14, 25, 26], 0, 1, 5, 5, 5.05), ([3], 0, 1, 5, 5, 5.05),
    ([0, 18, 28, 29, 30, 31], 0, 1, 5, 5, 5.05)), 7, "wa")


@settings(max_examples=60, deadline=None)
@given(traffic())
@example(HOLES_IN_FINISHED_CHAINS)
def test_the_live_counterfactual_computes_what_compare_of_a_recording_does(case):
    """Fed the server's events as they happen, the counterfactual hits what the replay on recorded
    timing of the same traffic hits, request for request."""
    assert_live_hits_as_replayed(*case)


def assert_live_hits_as_replayed(rows, capacity, policy, engine=None, grows=False):
    """The counterfactual fed :func:`traffic`'s ``rows`` at ``capacity`` hits what the replay of them does
    (by ``engine``: :func:`~kvprof.sim.engine.simulate`'s). With ``grows`` each request takes the blocks
    it decodes into one at a time while it runs (the server's block ids told to the counterfactual as they
    are taken, their times and the ids of the blocks its output filled in the recording), as a row's
    ``output_chain`` (where given) names them."""
    hp = HpFile.from_dict(HP)
    spec = PolicySpec(policy=policy, config=None, hp=hp, class_names=tuple(hp.table()[0]),
                      keyed_by=make_policy(policy, hp=hp).keyed_by)
    # live: events in the order vLLM makes them (finishes before admissions at one instant)
    live = Counterfactual({policy: make_policy(policy, hp=hp, capacity=capacity)}, capacity, BS)
    fresh = iter(range(10**6, 10**7))
    output_chains = [r.get("output_chain") or [
        next(fresh) for _ in range(max((r["partial"] + BS * len(r["chain"]) + r["output"] - 1) // BS - len(r["chain"]), 0))]
        for r in rows]
    server_ids = collections.deque(range(1, capacity + 1))  # the server's free block ids, as it hands them out
    grown_at, grown_ids = [[] for _ in rows], [[] for _ in rows]
    events = []
    for i, r in enumerate(rows):
        events.append((r["scheduled"], 1, i, "admit"))
        events.append((r["finished"], 2 if r["finished"] == r["scheduled"] else 0, i, "finish"))
        if grows:
            n_prompt = len(r["chain"]) + (r["partial"] > 0)
            n_decoded = -(-(BS * len(r["chain"]) + r["partial"] + r["output"] - 1) // BS) - n_prompt
            for k in range(n_decoded):
                grown_at[i].append(r["scheduled"] + (k + 1) / (n_decoded + 1) * (r["finished"] - r["scheduled"]))
                events.append((grown_at[i][-1], 0.5, i, "grow"))
    for _, _, i, kind in sorted(events):
        r = rows[i]
        request = fake_request(i, r["chain"], partial=r["partial"], output=r["output"], tags={"type": r["kind"], "turn": 1},
                               output_chain=output_chains[i])
        if kind == "admit":
            index = spec.class_index(request.sampling_params.extra_args, request.num_prompt_tokens)
            live.admit(i, request.block_hashes, request.num_prompt_tokens, (index, index), r["scheduled"])
        elif kind == "grow":
            grown_ids[i].append(server_ids.popleft())
            live.grow(grown_ids[i][-1:], grown_at[i][len(grown_ids[i]) - 1])
        else:
            live.finish(i, request.block_hashes, request.num_prompt_tokens, r["output"], r["finished"],
                        grown=grown_ids[i] if grows else None)
            server_ids.extend(grown_ids[i])
    # batch: the same traffic as a recording, replayed by the simulator
    trace = make_trace([(r["arrival"], r["kind"], 1, r["chain"] + ([10**8 + i] if r["partial"] else []))
                        for i, r in enumerate(rows)], block_size=BS)
    trace = dataclasses.replace(
        trace, input_length=np.array([BS * len(r["chain"]) + r["partial"] for r in rows], dtype=np.int64),
        output_length=np.array([r["output"] for r in rows], dtype=np.int64),
        extra={"scheduled": np.array([r["scheduled"] for r in rows]), "finished": np.array([r["finished"] for r in rows])})
    if grows or any("output_chain" in r for r in rows):
        lists = {"output_hash_ids": [np.array(chain, np.int64) for chain in output_chains]}
        if grows:
            lists["grown"] = [np.array(times) for times in grown_at]
        columns = {name: np.empty(len(rows), dtype=object) for name in lists}
        for name, values in lists.items():
            for i, value in enumerate(values):
                columns[name][i] = value
        trace = dataclasses.replace(trace, extra={**trace.extra, **columns})
    workload = prepare_workload(trace, hp, engine_block_size=BS)
    m = simulate(workload, make_policy(policy, hp=hp, capacity=capacity), capacity, SimConfig(engine_block_size=BS),
                 engine=engine)
    assert live.lookups == m.block_lookups
    assert live.hits[policy] == m.hits_device
    return live


@pytest.mark.parametrize("engine", ["python", "compiled"])
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "wa"])
def test_sessions_whose_next_turns_send_the_responses_back_hit_live_as_replayed(policy, engine):
    """Multi-turn sessions, several at a time: each turn's prompt is the previous one's, the blocks its
    response filled (decoded into blocks taken while it ran) and new blocks. The counterfactual, told the
    blocks as the server takes them, hits what the replay of the recording (its ``grown`` times and
    ``output_hash_ids``) does, request for request; and the next turns hit the responses' blocks."""
    rng = np.random.default_rng(7)
    fresh = iter(range(10**6, 10**7))
    rows = []
    for session in range(10):
        chain, partial, t = [next(fresh) for _ in range(int(rng.integers(1, 3)))], int(rng.integers(0, BS)), 0.3 * session
        for turn in range(4):
            output = int(rng.integers(1, 3 * BS))
            n_filled = (BS * len(chain) + partial + output - 1) // BS - len(chain)
            row = dict(chain=chain, partial=partial, output=output, arrival=t, scheduled=t + 0.01,
                       finished=t + 0.01 + 0.4 * rng.random() + 0.05, kind=("hot", "cold")[session % 2],
                       output_chain=[next(fresh) for _ in range(n_filled)])
            rows.append(row)
            # the next turn: the response back, then new blocks and a partial one
            chain = chain + row["output_chain"] + [next(fresh) for _ in range(int(rng.integers(0, 2)))]
            partial, t = int(rng.integers(0, BS)), row["finished"] + 0.5 * rng.random()
    rows.sort(key=lambda row: row["arrival"])
    longest = max(len(row["chain"]) + 1 + 3 for row in rows)
    live = assert_live_hits_as_replayed(rows, max(longest, 24), policy, engine=engine, grows=True)
    assert live.hits[policy] > sum(len(row["chain"]) for row in rows if row["chain"][0] == rows[0]["chain"][0]) // 4


def _refs(gpu) -> np.ndarray:
    """The tier's pin count per slot (its structref's field, read in compiled code)."""
    from numba import njit

    return njit(lambda device: device.refs.copy())(gpu)


@pytest.mark.parametrize("policy", ["lru", "wa"])
def test_blocks_taken_again_before_their_free_are_given_back_and_claimed_once(policy):
    """A running request's blocks the server takes again before any free claimed them (its request was
    preempted and freed without kvprof hearing) give their old slots back: the tier never holds more slots
    than the server's blocks pending; a free claims its blocks once, and ids the server cannot have are
    passed over."""
    from kvprof.core import tiers

    hp = HpFile.from_dict(HP)
    live = Counterfactual({policy: make_policy(policy, hp=hp, capacity=12)}, 12, BS)
    gpu = live.tiers[policy].gpu
    live.admit("r", [10, 11], 2 * BS + 1, (0, 0), 1.0)  # 3 blocks
    for t in range(20):  # the same 4 block ids taken again and again, never claimed
        live.grow([1, 2, 3, 4], 2.0 + t)
    assert tiers.n_free(gpu) == 12 - 3 - 4
    live.grow([10**6, -5], 30.0)  # no block of this server: nothing taken
    assert tiers.n_free(gpu) == 12 - 3 - 4
    lookups = live.finish("r", [10, 11, 12, 13], 2 * BS + 1, 3 * BS, 40.0, grown=[1, 2, 3, 4, 4])
    assert lookups == 2 and tiers.n_free(gpu) == 12  # all back: the prompt's, the 4 claimed (once each)
    tiers.check_device(gpu)
    assert (_refs(gpu) == 0).all()  # each slot unpinned once
    live.admit("s", [20], BS + 1, (0, 0), 41.0)
    live.finish("s", [20], BS + 1, 1, 42.0, grown=[1, 2])  # claimed already: nothing of theirs is held twice
    assert tiers.n_free(gpu) == 12
    tiers.check_device(gpu)


@pytest.mark.parametrize("policy", ["lru", "wa"])
def test_a_counterfactual_past_its_first_tables_hits_as_the_replay(policy):
    """A tier of more than twice :data:`~kvprof.core.prefix_cache.MIN_SLOTS` starts with tables for part of
    its slots (:func:`~kvprof.core.prefix_cache.first_size`); traffic that uses more of them grows the
    tables, and the hits stay those of the Python replay (:class:`kvprof.policy.prefix_cache.PrefixCache`)."""
    from kvprof.core.prefix_cache import MIN_SLOTS, first_size

    capacity = 2 * MIN_SLOTS + 5
    rng = np.random.default_rng(0)
    rows, next_id = [], 0
    for i in range(120):  # ~7000 distinct blocks, some chains continued: past first_size's, within the capacity
        if rows and rng.random() < 0.3:
            chain = rows[int(rng.integers(len(rows)))]["chain"][: int(rng.integers(1, 40))]
        else:
            chain = []
        n_new = int(rng.integers(20, 100))
        chain = chain + list(range(next_id, next_id + n_new))
        next_id += n_new
        rows.append(dict(chain=chain, partial=int(rng.integers(0, BS)), output=int(rng.integers(1, 3 * BS)),
                         arrival=0.1 * i, scheduled=0.1 * i, finished=0.1 * i + 0.35, kind=("hot", "cold")[i % 2]))
    live = assert_live_hits_as_replayed(rows, capacity, policy, engine="python")
    assert first_size(capacity) < next_id
    assert live.hits[policy] > 0


#: What the plugin tells the recorder about the server.
START = {"pid": 1, "model": "m", "vllm": "0.32.0", "kvprof": "0.1.0", "policy": "lru"}


def run_loop(tmp_path, spec, requests, clock, **kwargs):
    loop = LiveLoop(spec, num_gpu_blocks=9, block_size=BS, start=START, clock=clock, **kwargs).begin()
    assert loop.wait_ready(READY_S)  # the compiled core loaded (compiled first, where not cached)
    for request, hits in requests:
        clock.t += 1
        loop.scheduled(request, clock.t)
        clock.t += 1
        loop.finished(request, clock.t - 1, hits * BS, clock.t)
    time.sleep(0.5)
    return loop


class Clock:
    t = 1_000_000.0

    def __call__(self):
        return self.t


def test_metrics_count_classes_counterfactual_and_records(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVPROF_METRICS_DIR", str(tmp_path))
    hp_path = tmp_path / "hp.json"
    hp_path.write_text(json.dumps(HP))
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(hp_path), "mode": "shadow",
                                                            "record": str(tmp_path / "rec"), "log_interval_s": 1}})
    hot = [f"h{i}".encode() for i in range(3)]
    requests = [(fake_request(f"r{i}", hot, tags={"type": "hot", "turn": 1}), 0 if i == 0 else 3) for i in range(4)]
    requests += [(fake_request("odd", [b"x"], tags={"type": "hot", "turn": "two"}), 0),
                 (fake_request("new", [b"y"], tags={"workload": "nope"}), 0),
                 (fake_request("bare", [b"z"]), 0)]
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="vllm.kvprof"):
        loop = run_loop(tmp_path, spec, requests, clock)
        clock.t += 5
        time.sleep(1.5)  # a snapshot and a log line
        loop.close()
    samples = {(name, tuple(sorted(labels.items()))): value for name, labels, value in read_snapshots(tmp_path)}

    def value(name, **labels):
        return samples[(name, tuple(sorted({**labels, **loop._labels}.items())))]

    assert value("kvprof_prompt_blocks_total", **{"class": "hot_1"}) == 4 * 2  # (12 - 1) // 4 lookups each
    assert value("kvprof_cached_blocks_total", **{"class": "hot_1"}) == 3 * 2
    assert value("kvprof_counterfactual_cached_blocks_total", policy="lru") == 6
    assert value("kvprof_counterfactual_cached_blocks_total", policy="wa") == 6
    assert value("kvprof_unclassified_requests_total", reason="bad_turn") == 1
    assert value("kvprof_unclassified_requests_total", reason="unknown_workload") == 1
    assert value("kvprof_unclassified_requests_total", reason="untagged") == 1
    assert value("kvprof_records_total", result="written") == len(requests)
    assert value("kvprof_info", hp=str(hp_path), hp_sha256=spec.hp_sha256, mode="shadow", policy="wa",
                 recording=str(tmp_path / "rec"), classes="2", cells="2") == 1
    assert sum(name == "kvprof_shadow_cached_blocks_total" for name, _ in samples) == 6  # one per candidate
    families = {f.name: f for f in SnapshotCollector(tmp_path).collect()}
    assert families["kvprof_cached_blocks"].type == "counter"  # prometheus_client adds _total
    text = caplog.text
    assert "would have hit" in text and "vLLM's own eviction hit" in text
    assert text.count("went to the default class (bad_turn)") == 1


def test_a_changed_hp_file_is_reloaded_and_a_broken_one_is_not(tmp_path, caplog):
    hp_path = tmp_path / "hp.json"
    hp_path.write_text(json.dumps(HP))
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(hp_path), "mode": "shadow",
                                                            "reload_interval_s": 0.2}})
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="vllm.kvprof"):
        loop = run_loop(tmp_path, spec, [], clock)
        changed = dict(HP, horizon_s=30.0)
        hp_path.write_text(json.dumps(changed))
        clock.t += 1
        time.sleep(1.0)
        assert loop.spec.hp.horizon == 30.0 and loop.spec.hp_sha256 != spec.hp_sha256
        hp_path.write_text(json.dumps(dict(HP, horizon_s=-1)))
        clock.t += 1
        time.sleep(1.0)
        loop.close()
    assert loop.spec.hp.horizon == 30.0  # the broken file was refused, the reloaded one stays
    assert loop.metrics.get("kvprof_reloads_total", result="ok") == 1
    assert loop.metrics.get("kvprof_reloads_total", result="error") == 1
    assert "not reloading" in caplog.text and "horizon_s" in caplog.text


def test_warm_up_leaves_nothing_to_compile_for_serving(tmp_path):
    """After warm_up, the calls the pool (its content numbering too) and the live loop make compile nothing more."""
    from numba.core.registry import CPUDispatcher

    import kvprof.core as core_package
    from kvprof.vllm.numbering import ContentNumbers
    from kvprof.vllm.warmup import _drive_counterfactual, _drive_twin, warm_up

    hp_path = tmp_path / "hp.json"
    hp_path.write_text(json.dumps(HP))
    for mode in ("enforce", "shadow"):
        spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(hp_path), "mode": mode}})
        warm_up(spec, object() if mode == "enforce" else None, BS)

    def signatures():
        import sys

        out = {}
        for name, module in list(sys.modules.items()):
            if (name.startswith(core_package.__name__ + ".") or name == ContentNumbers.__module__) and module is not None:
                for attr, value in vars(module).items():
                    if isinstance(value, CPUDispatcher):
                        out[f"{name}.{attr}"] = len(value.signatures)
        return out

    before = signatures()
    twin = spec.make_policy(capacity=64, n_blocks=64)
    twin.feed_shadows_in_background()  # as the pool runs it
    _drive_twin(twin, 1)
    twin.close()
    policies = {"lru": make_policy("lru"), "wa": spec.reference_policy(64)}
    _drive_counterfactual(Counterfactual(policies, 32, BS), BS)
    numbers = ContentNumbers(100)
    numbers.numbers([b"%d" % i for i in range(300)])  # grows and recycles
    numbers.number(b"one")
    assert signatures() == before


@pytest.mark.parametrize("atomic", [True, False])
def test_a_reload_racing_a_write_never_serves_half_a_file(tmp_path, atomic):
    """Two valid hp files written over each other while the loop re-reads every 10 ms: what serves is
    always one of them whole. Written atomically (as kvprof fit does) no reload ever fails; written in
    place, a half-written file is refused and read again once it changes."""
    import hashlib
    import threading

    from kvprof.atomic import atomic_write_text

    hp_path = tmp_path / "hp.json"
    texts = [json.dumps(dict(HP, horizon_s=h), indent=2) for h in (30.0, 90.0)]
    sha = {hashlib.sha256(text.encode()).hexdigest() for text in texts}
    hp_path.write_text(texts[0])
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(hp_path), "mode": "shadow",
                                                            "reload_interval_s": 0.01}})
    loop = LiveLoop(spec, num_gpu_blocks=9, block_size=BS, start={}).begin()
    assert loop.wait_ready(READY_S)  # the compiled core loaded (compiled first, where not cached)
    stop, seen = threading.Event(), set()

    def write():
        k = 0
        while not stop.is_set():
            k += 1
            text = texts[k % 2]
            if atomic:
                atomic_write_text(hp_path, text)
            else:
                with open(hp_path, "w") as handle:
                    for start in range(0, len(text), 64):
                        handle.write(text[start:start + 64])
                        handle.flush()
                        time.sleep(0.001)
            time.sleep(0.02)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            seen.add(loop.spec.hp_sha256)
            time.sleep(0.005)
    finally:
        stop.set()
        writer.join()
        loop.close()
    assert seen <= sha  # never half a file
    assert loop.metrics.get("kvprof_reloads_total", result="ok") >= 2
    if atomic:
        assert loop.metrics.get("kvprof_reloads_total", result="error") == 0


class FakePool:
    """The parts of KvprofBlockPool the live loop uses in enforce mode, with the real compiled twin."""

    def __init__(self, spec, blocks=9):
        self.num_gpu_blocks = blocks
        from kvprof.policy.hinted import HintLayer

        self.policy = spec.make_policy(capacity=blocks, n_blocks=blocks)
        hints = HintLayer(self.policy)  # its hint counts and horizon, as the pool's free queue keeps them
        self.free_block_queue = SimpleNamespace(evictions=0, hints=hints,
                                                hint_horizon=lambda: hints.horizon.seconds(len(hints), time.monotonic()))

    def replace_policy(self, spec, twin):
        self.policy = twin


def wait_for(condition, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def info_sha(loop) -> str:
    (labels,) = [labels for name, labels, _ in loop.metrics.samples() if name == "kvprof_info"]
    return labels["hp_sha256"]


@pytest.mark.parametrize("third", ["another file", "the file in force"])
def test_the_newest_hp_file_wins_over_a_reload_still_pending(tmp_path, third):
    """Enforce mode on an idle server: a reload waits for the scheduler's next step; the file is then
    replaced again (atomically, as kvprof fit does). The newest file is what the next step swaps in,
    and kvprof_info says what is in force, never what waits."""
    import hashlib

    from kvprof.atomic import atomic_write_text

    hp_path = tmp_path / "hp.json"
    texts = {h: json.dumps(dict(HP, horizon_s=h)) for h in (60.0, 30.0, 90.0)}
    sha = {h: hashlib.sha256(t.encode()).hexdigest() for h, t in texts.items()}
    atomic_write_text(hp_path, texts[60.0])
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(hp_path), "reload_interval_s": 0.01}})
    loop = LiveLoop(spec, num_gpu_blocks=9, block_size=BS, start={}, pool=FakePool(spec)).begin()
    assert loop.wait_ready(READY_S)  # the compiled core loaded (compiled first, where not cached)
    try:
        atomic_write_text(hp_path, texts[30.0])
        wait_for(lambda: loop._pending is not None)
        time.sleep(0.1)  # snapshots and periodic work go on; nothing is in force yet
        assert loop.spec.hp_sha256 == info_sha(loop) == sha[60.0]
        newest = 90.0 if third == "another file" else 60.0
        atomic_write_text(hp_path, texts[newest])
        wait_for(lambda: loop.metrics.get("kvprof_reloads_total", result="ok") == 2)
        loop.poll()  # the scheduler's next step
        assert loop.spec.hp_sha256 == sha[newest] and loop.spec.hp.horizon == newest
        wait_for(lambda: info_sha(loop) == sha[newest])
    finally:
        loop.close()
    assert loop.metrics.get("kvprof_reloads_total", result="error") == 0


class NativePool(FakePool):
    """A pool serving vLLM's own order until the live loop hands over (the plugin builds it so)."""

    def __init__(self, spec, blocks=9):
        from kvprof.vllm.native import NativeOrder

        super().__init__(spec, blocks)
        self.policy, self.replaced = NativeOrder(blocks), []

    @property
    def serves_natively(self) -> bool:
        return not self.replaced

    def replace_policy(self, spec, twin):
        self.replaced.append((spec, twin))
        self.policy = twin


def test_the_policy_takes_over_from_vllms_order_once_its_core_is_loaded(tmp_path):
    """A pool that starts with vLLM's own order gets the compiled policy of the spec in force at the scheduler's
    first step after the core is loaded, once, and then a reload waiting beside it; /metrics says when."""
    import hashlib

    from kvprof.atomic import atomic_write_text

    hp_path = tmp_path / "hp.json"
    atomic_write_text(hp_path, json.dumps(HP))
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(hp_path), "reload_interval_s": 0.01}})
    pool = NativePool(spec)
    loop = LiveLoop(spec, num_gpu_blocks=9, block_size=BS, start={}, pool=pool)
    assert loop.metrics.get("kvprof_core_ready") == 0 and loop.metrics.get("kvprof_handovers_total") == 0
    loop.begin()
    try:
        assert loop.wait_ready(READY_S)
        assert loop.metrics.get("kvprof_core_ready") == 1 and pool.serves_natively  # until the scheduler's step
        changed = json.dumps(dict(HP, horizon_s=30.0))
        atomic_write_text(hp_path, changed)
        wait_for(lambda: loop._pending is not None)
        loop.poll()
        (handed, first), (reloaded, second) = pool.replaced
        assert handed is spec and first.name == "wa" and reloaded.hp.horizon == 30.0 and second is pool.policy
        assert loop.spec is reloaded and loop.spec.hp_sha256 == hashlib.sha256(changed.encode()).hexdigest()
        assert loop.metrics.get("kvprof_handovers_total") == 1
        loop.poll()
        assert len(pool.replaced) == 2  # once
    finally:
        loop.close()


def test_an_hp_file_fitted_on_other_blocks_than_the_server_caches_is_refused(tmp_path, caplog):
    """At start-up (the plugin's validation) and at a reload (the running policy stays), by the rule `kvprof
    compare` of the server's recording applies: the file's block size is the server's."""
    from kvprof.atomic import atomic_write_text
    from kvprof.vllm.spec import KvPolicyConfigError

    hp_path = tmp_path / "hp.json"
    atomic_write_text(hp_path, json.dumps(HP))
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(hp_path), "reload_interval_s": 0.01}})
    spec.check_block_size(BS)
    with pytest.raises(KvPolicyConfigError, match=f"hp.json: block_size: the hp file was fitted on {BS}-token "
                                                  f"blocks, and this server caches {2 * BS}-token blocks"):
        spec.check_block_size(2 * BS)
    PolicySpec.from_additional_config({"kv_policy": {"policy": "lru"}}).check_block_size(2 * BS)  # no file: no rule
    loop = LiveLoop(spec, num_gpu_blocks=9, block_size=BS, start={}).begin()
    try:
        assert loop.wait_ready(READY_S)
        with caplog.at_level(logging.ERROR, logger="vllm.kvprof"):
            atomic_write_text(hp_path, json.dumps(dict(HP, block_size=2 * BS)))
            wait_for(lambda: loop.metrics.get("kvprof_reloads_total", result="error") == 1)
        assert loop.spec is spec and loop._pending is None
        assert any("the running policy stays" in r.getMessage() and "fitted on 8-token blocks" in r.getMessage()
                   for r in caplog.records)
    finally:
        loop.close()


def test_every_series_exists_at_zero_from_the_start(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROF_METRICS_DIR", str(tmp_path))
    hp_path = tmp_path / "hp.json"
    hp_path.write_text(json.dumps(HP))
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(hp_path), "mode": "shadow",
                                                            "record": str(tmp_path / "rec")}})
    loop = LiveLoop(spec, num_gpu_blocks=9, block_size=BS, start=START, rank=1).begin()
    assert loop.wait_ready(READY_S)  # the compiled core loaded (compiled first, where not cached)
    try:
        wait_for(lambda: read_snapshots(tmp_path))
    finally:
        loop.close()
    series = {(name, tuple(sorted(labels.items()))): value for name, labels, value in read_snapshots(tmp_path)}
    engine = (("engine", loop._labels["engine"]), ("rank", "1"))
    expected = [("kvprof_reloads_total", (("result", result),)) for result in ("ok", "error")]
    expected += [(name, (("class", c),)) for name in ("kvprof_prompt_blocks_total", "kvprof_cached_blocks_total")
                 for c in ("hot_1", "cold_1", "<default>")]
    expected += [("kvprof_unclassified_requests_total", (("reason", r),))
                 for r in ("untagged", "unknown_workload", "unknown_class", "bad_turn")]
    expected += [("kvprof_records_total", (("result", r),)) for r in ("written", "queue_full", "disk", "error")]
    expected += [("kvprof_counterfactual_cached_blocks_total", (("policy", p),)) for p in ("lru", "wa")]
    expected += [("kvprof_events_dropped_total", ()), ("kvprof_leader_changes_total", ())]
    for name, labels in expected:
        assert series[(name, tuple(sorted(labels + engine)))] == 0, name


def test_a_log_line_counts_the_server_and_lru_over_the_same_requests(caplog):
    """A request admitted in one window and finished in the next counts in the next for both: with
    vLLM's LRU serving, "vLLM's own eviction hit" equals "lru replayed beside it" in every window."""
    spec = PolicySpec.from_additional_config({"kv_policy": {"policy": "lru", "mode": "shadow"}})
    loop = LiveLoop(spec, num_gpu_blocks=64, block_size=BS, start={})  # not begun: events handled here
    chain = [b"a", b"b", b"c"]
    first, second = fake_request("r0", chain), fake_request("r1", chain)
    with caplog.at_level(logging.INFO, logger="vllm.kvprof"):
        loop._handle(("admit", 1.0, first, None))
        loop._handle(("finish", 2.0, first, True, 0, 0, ()))
        loop._handle(("admit", 3.0, second, None))  # will hit 2 blocks (its prompt's last block is never looked up)
        loop._log_interval(4.0)
        loop._handle(("finish", 5.0, second, True, 2 * BS, 0, ()))
        loop._log_interval(6.0)
    lines = [r.getMessage() for r in caplog.records if "last" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "1 requests, 2 prompt blocks: vLLM's own eviction hit 0.0 %" in lines[0]
    assert "(lru replayed beside it: 0.0 %)" in lines[0]
    assert "vLLM's own eviction hit 100.0 %" in lines[1] and "(lru replayed beside it: 100.0 %)" in lines[1]


def test_two_engine_cores_report_by_rank_and_both_take_a_reload(tmp_path, monkeypatch):
    """Data parallelism, in process: each rank's engine core runs a loop of its own (its policy, its
    pool), writing its own snapshot labelled with its rank; one change of the hp file reaches both."""
    import hashlib

    from kvprof.atomic import atomic_write_text

    monkeypatch.setenv("KVPROF_METRICS_DIR", str(tmp_path))
    hp_path = tmp_path / "hp.json"
    atomic_write_text(hp_path, json.dumps(HP))
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(hp_path), "reload_interval_s": 0.01}})
    loops = [LiveLoop(spec, num_gpu_blocks=9, block_size=BS, start={}, pool=FakePool(spec), rank=rank)
             for rank in (0, 1)]
    for rank, loop in enumerate(loops):
        loop._labels["engine"] = f"core{rank}"  # one process here; in vLLM each core has its own pid
        loop.begin()
        assert loop.wait_ready(READY_S)
    changed = json.dumps(dict(HP, horizon_s=30.0))
    try:
        atomic_write_text(hp_path, changed)
        for loop in loops:
            wait_for(lambda: loop._pending is not None)
            loop.poll()
            wait_for(lambda: info_sha(loop) == hashlib.sha256(changed.encode()).hexdigest())
    finally:
        for loop in loops:
            loop.close()
    info = [labels for name, labels, _ in read_snapshots(tmp_path) if name == "kvprof_info"]
    assert sorted((i["rank"], i["engine"]) for i in info) == [("0", "core0"), ("1", "core1")]
    assert {i["hp_sha256"] for i in info} == {hashlib.sha256(changed.encode()).hexdigest()}
    assert all(loop.spec.hp.horizon == 30.0 and loop.pool.policy.reference.horizon == 30.0 for loop in loops)


def test_kvprof_metrics_join_a_multiprocess_registry(tmp_path):
    """With several API servers vLLM serves, in each, a fresh registry holding prometheus_client's
    MultiProcessCollector (vllm.v1.metrics.prometheus.get_prometheus_registry); kvprof's collector
    joins it. In a child process: the hook changes prometheus_client's module state."""
    import subprocess
    import sys

    engine = tmp_path / "kvprof"
    engine.mkdir()
    (tmp_path / "prom").mkdir()
    code = f"""
import os
os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path / 'prom')!r}
os.environ["KVPROF_METRICS_DIR"] = {str(engine)!r}
from kvprof.vllm.metrics import Metrics, serve_on_vllm_metrics
serve_on_vllm_metrics()
metrics = Metrics()
metrics.inc("kvprof_reloads_total", 0, result="ok")
metrics.write({str(engine)!r}, {{"engine": "7", "rank": "1"}})
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)  # as vLLM's get_prometheus_registry does
print(generate_latest(registry).decode())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr
    assert 'kvprof_reloads_total{engine="7",rank="1",result="ok"} 0.0' in out.stdout


def test_the_compiled_numbering_recycles_as_the_dict_did_so_hits_are_unchanged():
    """Past ``max_contents`` the counterfactual recycles the least recently seen content's number;
    with the compiled table it hits, request for request, what it hit numbering with an OrderedDict."""
    import random

    from tests.test_content_numbers import RecentDictNumbers

    class DictNumbering(RecentDictNumbers):  # the numbering the counterfactual had before
        def renumber(self, contents):
            numbers, recycled = super().renumber(contents)
            return np.array(numbers, np.int64), np.array(recycled, np.int64)

        def __len__(self):
            return len(self.ids)

    hp = HpFile.from_dict(HP)
    rng = random.Random(7)
    compiled, model = ({name: Counterfactual({name: make_policy(name, hp=hp, capacity=10)}, 10, BS, max_contents=24)
                        for name in ("lru", "wa")} for _ in range(2))
    for counterfactual in model.values():
        counterfactual._numbers = DictNumbering(24)
    chains = []
    for i in range(120):  # two requests running at a time, each with one output block
        chains.append([b"p%d" % rng.randrange(4)] + [b"c%d" % rng.randrange(40) for _ in range(rng.randrange(1, 6))])
        for live in (*compiled.values(), *model.values()):
            live.admit(i, chains[i], BS * len(chains[i]) + 3, (0, 0), float(i))
            if i >= 2:
                chain = chains[i - 2]
                live.finish(i - 2, chain + [b"o%d" % i], BS * len(chain) + 3, BS, float(i) + 0.5)
    for name in compiled:
        assert len(compiled[name]._numbers) == 24  # it recycled
        assert (compiled[name].lookups, compiled[name].hits) == (model[name].lookups, model[name].hits)
        assert compiled[name].hits[name] > 0


def test_the_hint_counterfactual_replays_the_policy_in_force_without_hints(tmp_path, caplog):
    """``--kv-hint-counterfactual``: the policy in force is replayed beside the server with no hints (the
    counterfactual takes none), so its cached blocks against the server's are what the hints were worth;
    a spec that cannot use it is refused, naming the flag."""
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(HP))
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(path), "hint_counterfactual": True}})
    assert spec.counterfactual_replays_policy
    loop = LiveLoop(spec, num_gpu_blocks=64, block_size=BS, start={})  # not begun: events handled here
    assert set(loop.counterfactual.tiers) == {"lru", "wa"}
    plain = PolicySpec.from_additional_config({"kv_policy": {"config": str(path)}})
    assert not plain.counterfactual_replays_policy
    assert set(LiveLoop(plain, num_gpu_blocks=64, block_size=BS, start={}).counterfactual.tiers) == {"lru"}
    chain = [b"a", b"b", b"c"]
    first, second = fake_request("r0", chain), fake_request("r1", chain)
    with caplog.at_level(logging.INFO, logger="vllm.kvprof"):
        loop._handle(("admit", 1.0, first, None))
        loop._handle(("finish", 2.0, first, True, 0, 0, ()))
        loop._handle(("admit", 3.0, second, None))
        loop._handle(("finish", 5.0, second, True, 0, 0, ()))  # the server (with hints) found nothing cached
        loop._log_interval(6.0)
    line = next(r.getMessage() for r in caplog.records if "last" in r.getMessage())
    assert "wa hit 0.0 %" in line and "without the clients' hints it would have hit 50.0 %" in line
    for bad, message in (({"policy": "lru", "mode": "shadow", "hint_counterfactual": True}, "needs a policy in enforce"),
                         ({"record": str(tmp_path / "rec"), "hint_counterfactual": True}, "needs a policy in enforce"),
                         ({"policy": "lru", "hint_counterfactual": 1}, "must be true or false, got 1")):
        with pytest.raises(ValueError, match=f"--kv-hint-counterfactual.*{message}|{message}"):
            PolicySpec.from_additional_config({"kv_policy": bad})
