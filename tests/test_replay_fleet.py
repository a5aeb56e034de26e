"""``kvprof replay --url A --url B --url C --router R``: replay as the router of a fleet, against stub servers
(tests/test_replay_cli.py's), and the KV event index ``prefix-precise`` reads. tests/vllm/test_fleet_live.py
runs it in front of three real vLLM servers."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import invoke, one_line
from tests.test_replay_cli import CACHE_INFO, N_REQUESTS, StubServer, results_of, trace, trace_rows  # noqa: F401

ROUTED = ("round-robin", "session", "least-loaded", "prefix-approx")


@pytest.fixture
def stubs():
    """Three running stub servers: ``(urls, handlers)``."""
    started = []
    for _ in range(3):
        handler = type("Stub", (StubServer,), {"bodies": [], "lock": threading.Lock()})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append((f"http://127.0.0.1:{server.server_address[1]}", handler, server))
    yield [url for url, _, _ in started], [handler for _, handler, _ in started]
    for _, _, server in started:
        server.shutdown()
        server.server_close()


def fleet_replay(trace, urls, out, *args):
    return invoke("replay", trace, *(a for url in urls for a in ("--url", url)), "--model", "m", "--rate-scale", "10",
                  "-o", out, *args)


def records_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("router", ROUTED)
def test_each_request_goes_to_the_server_the_router_picks(stubs, trace, tmp_path, router):
    urls, handlers = stubs
    out = tmp_path / "out"
    result = fleet_replay(trace, urls, out, "--router", router)
    assert result.exit_code == 0, result.output
    records = records_of(out)
    assert len(records) == N_REQUESTS and all(r["error"] is None for r in records)
    # every server got its test request, then exactly the requests recorded as its
    for j, handler in enumerate(handlers):
        sent = [body["vllm_xargs"] for body in handler.bodies[1:]]
        assert len(sent) == sum(r["replica"] == j for r in records)
        share = records_of(out / f"replica-{j}")
        assert [r["chat_id"] for r in share] == [r["chat_id"] for r in records if r["replica"] == j]
        assert all("replica" in r for r in share)
    run = results_of(out)["runs"][0]
    assert run["policy"] == f"lru, {router} x3" and run["fleet_policy"] == "lru" and run["router"] == router
    assert run["replicas"] == 3 and run["capacity"] == 47
    assert sum(run["replica_requests"]) == N_REQUESTS == run["n_requests"]
    assert sum(run["replica_cached_tokens"]) == run["cached_tokens"] == sum(r["cached_tokens"] for r in records)
    for j in range(3):
        alone = results_of(out / f"replica-{j}")
        assert alone["runs"][0]["cached_tokens"] == run["replica_cached_tokens"][j]
        assert alone["inputs"]["server"]["url"] == urls[j]
    assert f"{router} x3: replica 0:" in result.stdout


@pytest.mark.parametrize("router", ["round-robin", "session"])
def test_routers_that_read_the_trace_route_as_kvprof_fleet_does(stubs, tmp_path, router):
    from kvprof.profiler.reader import read_trace
    from kvprof.sim.config import SimConfig
    from kvprof.sim.fleet import RouterSpec, route
    from kvprof.sim.workload import prepare_workload

    rows = trace_rows(30)
    for i, row in enumerate(rows):  # conversations: every third request continues the one before it
        if i % 3:
            row["parent_chat_id"] = i - 1
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    urls, _ = stubs
    result = fleet_replay(path, urls, tmp_path / "out", "--router", router)
    assert result.exit_code == 0, result.output
    loaded, _ = read_trace(path)
    workload = prepare_workload(loaded, None, 32, 1.0)
    expected = route(loaded, workload, None, RouterSpec(router), 3, "lru", 47, SimConfig(engine_block_size=32))
    assert [r["replica"] for r in records_of(tmp_path / "out")] == expected.replica.tolist()
    assert len(set(expected.replica.tolist())) == 3


def test_one_server_writes_what_replay_always_wrote(stubs, trace, tmp_path):
    urls, _ = stubs
    result = fleet_replay(trace, urls[:1], tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert all("replica" not in r for r in records_of(tmp_path / "out"))
    assert not (tmp_path / "out" / "replica-0").exists()
    assert "router" not in results_of(tmp_path / "out")["runs"][0]


def test_prefix_precise_says_how_many_kv_events_each_server_sent_and_warns_of_none(stubs, trace, tmp_path):
    """Stub servers publish no KV events: prefix-precise routes on load alone, and says so."""
    import socket

    endpoints = []
    for _ in stubs[0]:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            endpoints.append(f"tcp://127.0.0.1:{probe.getsockname()[1]}")
    out = tmp_path / "out"
    result = fleet_replay(trace, stubs[0], out, "--router", "prefix-precise",
                          *(a for e in endpoints for a in ("--kv-events", e)))
    assert result.exit_code == 0, result.output
    assert results_of(out)["runs"][0]["replica_kv_events"] == [0, 0, 0]
    assert "KV events received: replica 0: 0, replica 1: 0, replica 2: 0" in result.stdout
    assert "no KV events came from replica(s) 0, 1, 2" in one_line(result.stderr)


# --- options that do not fit ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_urls, args, message", [
    (1, ["--router", "round-robin"], "a router needs at least two servers"),
    (3, [], "3 servers need a router"),
    (3, ["--router", "nearest"], "unknown router 'nearest'; known: round-robin"),
    (3, ["--router", "prefix-precise"], "give --kv-events once per --url"),
    (3, ["--router", "prefix-precise", "--kv-events", "tcp://127.0.0.1:1"], "(3), got 1"),
    (3, ["--router", "session", "--kv-events", "tcp://127.0.0.1:1"], "read by --router prefix-precise only"),
    (1, ["--kv-events", "tcp://127.0.0.1:1"], "read by --router prefix-precise only"),
    (3, ["--router", "prefix-precise", "--kv-events", "http://x:1"], "is not a tcp://HOST:PORT endpoint"),
    (3, ["--router", "prefix-precise", "--kv-events", "tcp://h:1", "--kv-events", "tcp://h:1",
         "--kv-events", "tcp://h:2"], "an endpoint given twice"),
    (3, ["--router", "round-robin", "--load-weight", "-1"], "--load-weight"),
])
def test_options_that_do_not_fit_a_fleet_are_refused_before_anything_is_sent(stubs, trace, tmp_path, n_urls, args,
                                                                               message):
    urls, handlers = stubs
    result = fleet_replay(trace, urls[:n_urls], tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert message in one_line(result.stderr)
    assert all(handler.bodies == [] for handler in handlers) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", ["ftp://x", "http://", "http://h:port"])
def test_a_bad_url_among_several_is_named(stubs, trace, tmp_path, bad):
    urls, handlers = stubs
    result = fleet_replay(trace, [urls[0], bad, urls[2]], tmp_path / "out", "--router", "round-robin")
    assert result.exit_code == 2 and repr(bad) in one_line(result.stderr)
    assert all(handler.bodies == [] for handler in handlers)


def test_a_url_given_twice_is_refused(stubs, trace, tmp_path):
    urls, _ = stubs
    result = fleet_replay(trace, [urls[0], urls[0]], tmp_path / "out", "--router", "round-robin")
    assert result.exit_code == 2 and "given twice" in one_line(result.stderr)


def test_an_unreachable_server_of_the_fleet_stops_it_before_the_first_request(stubs, trace, tmp_path):
    import socket

    urls, handlers = stubs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = fleet_replay(trace, [urls[0], dead], tmp_path / "out", "--router", "round-robin")
    assert result.exit_code == 1 and f"cannot reach the server at {dead}" in one_line(result.stderr)
    assert handlers[0].bodies == [] and not (tmp_path / "out").exists()


def test_servers_with_other_caches_are_not_one_fleet(stubs, trace, tmp_path):
    urls, handlers = stubs
    handlers[1].metrics = StubServer.metrics.replace('num_gpu_blocks="48"', 'num_gpu_blocks="40"')
    result = fleet_replay(trace, urls, tmp_path / "out", "--router", "least-loaded")
    assert result.exit_code == 1, result.output
    assert "the servers differ in capacity" in one_line(result.stderr) and f"{urls[1]}: 39" in one_line(result.stderr)
    assert all(handler.bodies == [] for handler in handlers) and not (tmp_path / "out").exists()


# --- what prefix-precise reads ------------------------------------------------------------------------


def stored(hashes, parent, tokens, block_size=4, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None}


def removed(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def test_the_event_index_follows_stores_and_removals_by_prefix():
    from kvprof.replay.fleet import KvEventIndex, chain_keys

    index = KvEventIndex()
    prompt = list(range(10, 26))  # four blocks of 4
    keys = chain_keys(prompt, 4)
    index.apply([0.0, [stored([b"a", b"b"], None, prompt[:8])]])
    assert index.depth(keys) == 2
    index.apply([0.0, [stored([b"c"], b"b", prompt[8:12]), stored([b"x"], b"unknown", prompt[12:16])]])
    assert index.depth(keys) == 3  # the block whose parent was never announced is not indexed
    assert index.depth(chain_keys(prompt[4:], 4)) == 0  # the same tokens under another prefix are not cached
    index.apply([0.0, [removed([b"b"]), stored([b"z"], None, prompt[:4], medium="CPU")]])
    assert index.depth(keys) == 1
    index.apply([0.0, [{"type": "AllBlocksCleared"}]])
    assert index.depth(keys) == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 3)), max_size=40))
def test_the_index_counts_what_was_stored_and_not_removed(ops):
    """Any sequence of stores and removals of chains: a block is cached exactly while its stores
    outnumber its removals (vLLM may hold one content in two blocks)."""
    from collections import Counter

    from kvprof.replay.fleet import KvEventIndex, chain_keys

    index, live = KvEventIndex(), Counter()
    for store, chain, length in ops:
        tokens = [chain * 100 + t for t in range(4 * length)]
        hashes = [f"{chain}-{k}".encode() for k in range(length)]
        if store:
            index.apply([0.0, [stored(hashes, None, tokens)]])
            live.update(hashes)
        else:
            present = [h for h in hashes if live[h] > 0]
            index.apply([0.0, [removed(present)]])
            live.subtract(present)
        for c in range(6):
            keys = chain_keys([c * 100 + t for t in range(12)], 4)
            expected = 0
            while expected < 3 and live[f"{c}-{expected}".encode()] > 0:
                expected += 1
            assert index.depth(keys) == expected


def test_chain_keys_are_equal_exactly_for_equal_prefixes():
    from kvprof.replay.fleet import chain_keys

    a, b = chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), chain_keys([1, 2, 3, 4, 5, 6, 7, 9], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert chain_keys([5, 6, 7, 8], 4) != chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)[1:]
    assert np.array_equal(chain_keys([], 4), [])
