"""The recorder behind ``vllm serve --kv-record`` (kvprof.vllm.record) and reading its directory as one trace.

The recorder is driven here with stand-ins for vLLM's ``Request`` (the attributes it reads); the
real server is exercised in tests/vllm/test_record.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvprof.errors import TraceError
from kvprof.profiler.reader import read_trace
from kvprof.recording import CHAT_IDS_PER_START, RecordingError, load_recording, trace_files
from kvprof.vllm import record as record_module
from kvprof.vllm.record import Recorder
from tests.helpers import READY_S

START = {"pid": 1, "model": "tiny", "vllm": "0.32.0", "kvprof": "0.1.0", "num_gpu_blocks": 64, "policy": "lru"}
BS = 4


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def request(arrival, prompt_blocks, *, partial=0, output=3, tags=None, reason="stop"):
    """A finished vLLM request: ``prompt_blocks`` are its full blocks' hashes (bytes)."""
    hashes = [b"h" + bytes(str(tuple(prompt_blocks[: i + 1])), "ascii") for i in range(len(prompt_blocks))]
    return SimpleNamespace(arrival_time=arrival, num_prompt_tokens=BS * len(prompt_blocks) + partial,
                           num_output_tokens=output, get_finished_reason=lambda: reason,
                           sampling_params=SimpleNamespace(extra_args=tags), block_hashes=hashes)


def record(directory, requests, clock=None, **kwargs):
    clock = clock or Clock()
    recorder = Recorder(directory, block_size=BS, start=START, clock=clock, **kwargs).begin()
    for r, scheduled, finished in requests:
        recorder.submit(r, scheduled, 0, finished)
    recorder.close()
    return recorder


def test_a_response_s_blocks_and_when_they_were_taken_are_recorded(tmp_path):
    # a 2-block prompt whose 9 output tokens fill 2 more blocks (10 written), taken while decoding at +0.2 s
    # and +0.3 s; the next turn sends the response back: its third and fourth blocks are those blocks
    t0 = 1_000_000.0
    turn = request(t0 + 1, [1, 2, 3, 4], output=9)
    turn.num_prompt_tokens = 2 * BS
    recorder = Recorder(tmp_path / "rec", block_size=BS, start=START, clock=Clock(t0)).begin()
    recorder.submit(turn, t0 + 1.1, 0, t0 + 2, grown_at=[t0 + 1.3, t0 + 1.4])
    recorder.submit(request(t0 + 5, [1, 2, 3, 4, 5]), t0 + 5.1, 4 * BS, t0 + 6, grown_at=[])
    recorder.submit(request(t0 + 7, [9], output=1), None, 0, t0 + 7.5)  # aborted while waiting: nothing taken
    recorder.close()
    trace, _ = read_trace(tmp_path / "rec")
    outputs, grown = trace.extra["output_hash_ids"], trace.extra["grown"]
    assert outputs[0].tolist() == trace.blocks_of(1)[2:4].tolist() and len(trace.blocks_of(0)) == 2
    assert grown[0].tolist() == pytest.approx([1.3, 1.4]) and grown[1].tolist() == [] and grown[2] is None
    assert outputs[1].tolist() == [] and outputs[2].tolist() == []  # one output token fills nothing


def test_a_recording_reads_as_one_trace(tmp_path):
    t0 = 1_000_000.0
    reqs = [
        (request(t0 + 1, [1, 2, 3], partial=2, tags={"type": "text", "session": "s1", "tenant": "acme"}), t0 + 1.5, t0 + 2),
        (request(t0 + 3, [1, 2, 3, 4], tags={"type": "text", "session": "s1"}), t0 + 3.1, t0 + 4),
        (request(t0 + 2, [7], tags={"type": "api", "turn": 5}, reason="length"), None, t0 + 2.5),
    ]
    recorder = record(tmp_path / "rec", reqs, clock=Clock(t0))
    assert recorder.written == 3 and not any(recorder.dropped.values())
    trace, report = read_trace(tmp_path / "rec")
    assert report.recording.block_size == BS and report.truncated == 0
    assert trace.block_size == BS and trace.n_requests == 3
    assert trace.timestamp.tolist() == pytest.approx([1, 2, 3])  # sorted by arrival, seconds since the origin
    first, api, second = (trace.blocks_of(i).tolist() for i in range(3))
    assert len(first) == 4 and first[:3] == second[:3] and first[3] != second[3]  # the partial block is fresh
    assert not set(api) & set(first)
    assert [trace.types[i] for i in range(3)] == ["text", "api", "text"]
    assert trace.turn.tolist() == [1, 5, 2]  # a session's next request is its next turn; a tag wins
    assert trace.parent_chat_id[2] == trace.chat_id[0] and trace.parent_chat_id[:2].tolist() == [-1, -1]
    assert trace.extra["tenant"].tolist() == ["acme", None, None]
    assert trace.extra["scheduled"].tolist() == [pytest.approx(1.5), None, pytest.approx(3.1)]
    assert trace.extra["finish_reason"].tolist() == ["stop", "length", "stop"]
    assert trace.input_length.tolist() == [3 * BS + 2, BS, 4 * BS]


def test_ids_reveal_no_hash_and_change_with_every_start(tmp_path):
    reqs = [(request(1e6 + 1, [1, 2]), 1e6 + 1, 1e6 + 2)]
    record(tmp_path / "a", reqs)
    record(tmp_path / "a", reqs)  # a second start of the same recording
    trace, report = read_trace(tmp_path / "a")
    assert len(report.recording.starts) == 2
    assert trace.chat_id.tolist() == [0, CHAT_IDS_PER_START]  # chat ids of the starts stay apart
    assert not set(trace.blocks_of(0).tolist()) & set(trace.blocks_of(1).tolist())  # a fresh key each start
    text = b"".join(Path(p).read_bytes() for p, _ in trace_files(tmp_path / "a"))
    assert b"h(1," not in text


def test_a_long_prompt_is_written_in_slices_and_keeps_every_id(tmp_path):
    """The writer computes ids and compresses a slice at a time (the GIL handed over between slices):
    a 2,000-block prompt takes several of each, and the line is whole."""
    n = 2000
    assert n > 4 * record_module._IDS_PER_SLICE and 20 * n > 1.2 * record_module._BYTES_PER_SLICE
    hashes = [os.urandom(32) for _ in range(n)]

    def long_request(arrival, count):
        return SimpleNamespace(arrival_time=arrival, num_prompt_tokens=BS * count + 1, num_output_tokens=1,
                               get_finished_reason=lambda: "stop", sampling_params=None,
                               block_hashes=hashes[:count])

    t0 = 1_000_000.0
    record(tmp_path / "l", [(long_request(t0 + 1, n), t0 + 1, t0 + 2), (long_request(t0 + 3, 700), t0 + 3, t0 + 4)],
           clock=Clock(t0))
    trace, report = read_trace(tmp_path / "l")
    assert report.truncated == 0 and trace.n_requests == 2
    full, part = trace.blocks_of(0).tolist(), trace.blocks_of(1).tolist()
    assert len(full) == n + 1 and len(set(full)) == n + 1  # every block an id of its own, the partial one fresh
    assert len(part) == 701 and part[:700] == full[:700] and part[700] not in full


def test_files_rotate_and_parents_cross_them(tmp_path):
    clock = Clock()
    recorder = Recorder(tmp_path / "r", block_size=BS, start=START, clock=clock, rotate_s=10, flush_s=0.05).begin()
    for i in range(6):
        clock.t += 4
        recorder.submit(request(clock.t, [1, 2, i + 10], tags={"session": 7}), clock.t, 0, clock.t + 0.5)
        time.sleep(0.1)
    recorder.close()
    files = trace_files(tmp_path / "r")
    assert len(files) >= 2 and not any(still_open for _, still_open in files)
    trace, _ = read_trace(tmp_path / "r")
    assert trace.n_requests == 6
    assert trace.parent_chat_id[1:].tolist() == trace.chat_id[:-1].tolist()
    assert trace.turn.tolist() == [1, 2, 3, 4, 5, 6]


def test_a_conversation_named_by_its_hint_session_is_a_session_of_the_recording(tmp_path):
    # a client that names its conversations only as docs/hints.md tells it to: hint_session
    t0 = 1_000_000.0
    reqs = [(request(t0 + i, [1, 2, i + 10], tags={"hint_session": f"c{i % 2}", "retain_s": 30}), t0 + i, t0 + i + 0.5)
            for i in range(6)]
    reqs.append((request(t0 + 7, [1, 2, 99], tags={"hint_session": "c9", "session": "s1"}), t0 + 7, t0 + 7.5))
    record(tmp_path / "h", reqs, clock=Clock(t0))
    trace, _ = read_trace(tmp_path / "h")
    assert trace.parent_chat_id.tolist() == [-1, -1] + trace.chat_id[:4].tolist() + [-1]
    assert trace.turn.tolist() == [1, 1, 2, 2, 3, 3, 1]
    assert trace.extra["session"].tolist() == ["c0", "c1"] * 3 + ["s1"]  # a session tag, where given, wins
    assert trace.extra["hint_session"].tolist() == ["c0", "c1"] * 3 + ["c9"]


def test_windows_count_back_from_the_end(tmp_path):
    t0 = 1_000_000.0
    reqs = [(request(t0 + t, [t]), t0 + t, t0 + t + 1) for t in range(0, 7200, 600)]
    record(tmp_path / "w", reqs, clock=Clock(t0))
    trace, _ = read_trace(tmp_path / "w", window=(-3600, None))
    assert trace.timestamp.tolist() == [3000.0 + 600 * k for k in range(7)]  # [6600 - 3600, inf)


def test_a_killed_servers_open_file_reads_up_to_its_last_frame(tmp_path):
    # Frames are closed every 0.05 s; the process is killed with SIGKILL while writing.
    script = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from tests.test_recording import request, START, BS
from kvprof.vllm import record as record_module
from kvprof.vllm.record import Recorder
from tests.helpers import READY_S
rec = Recorder({str(tmp_path / 'k')!r}, block_size=BS, start=START, flush_s=0.05, guard=False).begin()
t0 = time.time()
for i in range(100000):
    rec.submit(request(t0 + i, [1, 2, i]), t0 + i, 0, t0 + i + 0.5)
    if i % 200 == 0:
        time.sleep(0.01)
"""
    proc = subprocess.Popen([sys.executable, "-c", script])
    time.sleep(3)
    proc.kill()
    proc.wait()
    (part, still_open), = trace_files(tmp_path / "k")
    assert still_open and part.name.endswith(".part")
    # Cut inside the last frame, as a dying writer would leave it.
    data = part.read_bytes()
    part.write_bytes(data[: len(data) - 7])
    trace, report = read_trace(tmp_path / "k")
    written = load_recording(tmp_path / "k").starts[0].written  # saved with every closed frame
    # a frame longer than one zstd block decodes up to the cut, which can end inside a line: at most one
    # unfinished line per cut frame (a loaded machine writes such frames; a quiet one rarely does)
    assert trace.n_requests > 100 and report.cut_frames == 1 and report.truncated <= report.cut_frames
    # The counts are saved just after each frame is synced: a kill between the two leaves them one frame
    # behind the file, and the reader then counts nothing missing rather than a negative number.
    assert written > 0 and report.missing == max(written - trace.n_requests, 0)
    ts = trace.timestamp
    assert np.allclose(np.diff(ts), 1.0)  # nothing lost before the cut
    with pytest.raises(TraceError, match="cannot decompress"):  # a finished file is held to the letter
        os.replace(part, part.with_name(part.name[: -len(".part")]))
        read_trace(tmp_path / "k")


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path):
    recorder = Recorder(tmp_path / "q", block_size=BS, start=START, queue_size=2)  # writer not started
    # With no writer a blocking submit would never return: the submits run on a thread that must end
    # (the bound only keeps a regression from hanging the suite; nothing here is timed).
    submitting = threading.Thread(target=lambda: [recorder.submit(request(1e6 + 1, [1]), 1e6 + 1, 0, 1e6 + 2)
                                                  for _ in range(50)], daemon=True)
    submitting.start()
    submitting.join(timeout=120)
    assert not submitting.is_alive(), "submit blocked on a full queue"
    assert recorder.dropped["queue_full"] == 48
    recorder.submit(object(), 1.0, 0, 2.0)  # whatever it is handed, it never raises
    recorder.begin().close()
    assert recorder.written == 2
    assert load_recording(tmp_path / "q").starts[0].dropped["queue_full"] == 48


def test_a_full_disk_drops_and_counts_and_recording_goes_on(tmp_path):
    # RLIMIT_FSIZE makes writes past 20 kB fail with EFBIG, as a full disk fails them.
    script = f"""
import resource, signal, sys, time
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from tests.test_recording import request, START, BS
from kvprof.vllm import record as record_module
from kvprof.vllm.record import Recorder
from tests.helpers import READY_S
rec = Recorder({str(tmp_path / 'f')!r}, block_size=BS, start=START, flush_s=0.01).begin()
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
t0 = time.time()
for i in range(3000):
    rec.submit(request(t0 + i, [i, i + 1, i + 2]), t0 + i, 0, t0 + i + 0.5)
    if i % 100 == 0:
        time.sleep(0.02)
rec.close()
print(rec.written, rec.dropped["disk"], rec.dropped["queue_full"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    written, disk, queue_full = map(int, out.stdout.split())
    assert disk > 0 and written > 0 and written + disk + queue_full == 3000
    assert "cannot write" in out.stderr
    trace, report = read_trace(tmp_path / "f")  # what was written is readable
    assert trace.n_requests >= written


def test_unusable_directories_are_refused_with_the_reason(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecordingError, match="cannot create the recording directory"):
        Recorder(tmp_path / "file" / "rec", block_size=BS, start=START)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "recording.json").write_text('{"schema": "kvprof.recording/1", "block_size": 0}')
    with pytest.raises(RecordingError, match=r"recording\.json, at"):
        Recorder(bad, block_size=BS, start=START)
    record(tmp_path / "other", [(request(1e6 + 1, [1]), 1e6 + 1, 1e6 + 2)])
    with pytest.raises(RecordingError, match="recorded at 4-token blocks, this server uses 16"):
        Recorder(tmp_path / "other", block_size=16, start=START)


def test_reading_a_directory_that_is_no_recording(tmp_path):
    with pytest.raises(TraceError, match="not a kvprof recording"):
        read_trace(tmp_path)
    record(tmp_path / "r", [(request(1e6 + 1, [1]), 1e6 + 1, 1e6 + 2)])
    with pytest.raises(TraceError, match="4-token blocks"):
        read_trace(tmp_path / "r", block_size=16)
    doc = json.loads((tmp_path / "r" / "recording.json").read_text())
    doc["starts"][0]["chat_id_base"] = 5
    (tmp_path / "r" / "recording.json").write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"starts\[0\]\.chat_id_base"):
        read_trace(tmp_path / "r")


def test_every_command_reads_a_recording(tmp_path):
    """inspect, fit (tuned for the recorded server's size) and compare (on recorded timing) of a recording."""
    from tests.helpers import invoke

    t0 = 1_000_000.0
    system = [b"sys-a", b"sys-b", b"sys-c"]
    reqs = []
    for i in range(120):
        chain = system + [f"q{i}".encode()] if i % 2 else [f"d{i}-{k}".encode() for k in range(3)]
        r = request(t0 + 10 * i, [], tags={"type": "api" if i % 2 else "doc", "turn": 1})
        r.block_hashes, r.num_prompt_tokens = chain, BS * len(chain) + 1
        reqs.append((r, t0 + 10 * i + 0.1, t0 + 10 * i + 2))
    record(tmp_path / "rec", reqs, clock=Clock(t0))
    start = load_recording(tmp_path / "rec").starts[0]
    assert start.num_gpu_blocks == 64

    result = invoke("inspect", tmp_path / "rec")
    assert result.exit_code == 0, result.output
    result = invoke("fit", tmp_path / "rec", "--window", "-600:", "-o", tmp_path / "hp.json", "-j", "1")
    assert result.exit_code == 0, result.output
    hp = json.loads((tmp_path / "hp.json").read_text())
    assert [entry["capacity"] for entry in hp["tuning"]] == [63] and hp["block_size"] == BS

    out = tmp_path / "cmp"
    result = invoke("compare", tmp_path / "rec", "--config", tmp_path / "hp.json", "--eval-window", "0:",
                    "--policies", "lru,wa,belady", "-o", out, "-j", "1")
    assert result.exit_code == 0, result.output
    document = json.loads((out / "results.json").read_text())
    assert document["config"]["timing"] == "recorded" and document["config"]["engine_block_size"] == BS  # what ran
    assert {run["capacity"] for run in document["runs"]} == {63}
    by_policy = {run["policy"]: run for run in document["runs"]}
    assert by_policy["lru"]["cached_tokens"] == 59 * 3 * BS  # every api request after the first hits the system prompt
    assert by_policy["belady"]["cached_tokens"] >= by_policy["wa"]["cached_tokens"]
    result = invoke("compare", tmp_path / "rec", "--eval-window", "0:", "--policies", "lru", "--timing", "model",
                    "-o", tmp_path / "model", "-j", "1")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "model" / "results.json").read_text())["config"]["timing"] == "model"


def test_recorded_timing_needs_a_recording(tmp_path):
    from tests.helpers import invoke

    (tmp_path / "t.jsonl").write_text(json.dumps({"chat_id": 0, "parent_chat_id": -1, "timestamp": 0, "input_length": 32,
                                                  "output_length": 1, "type": "a", "turn": 1, "hash_ids": [1, 2]}) + "\n")
    result = invoke("compare", tmp_path / "t.jsonl", "--eval-window", "0:", "--policies", "lru", "--timing", "recorded",
                    "--block-size", "16", "-o", tmp_path / "o")
    assert result.exit_code == 1 and "no recorded timing" in result.output
    result = invoke("compare", tmp_path / "t.jsonl", "--policies", "lru", "--timing", "soon", "-o", tmp_path / "o")
    assert result.exit_code == 2 and "--timing" in result.output


def _script(directory, *, guard, n=100000, rank=0, flush_s=0.05):
    """A process recording requests until it is killed."""
    return f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from tests.test_recording import request, START, BS
from kvprof.vllm import record as record_module
from kvprof.vllm.record import Recorder
from tests.helpers import READY_S
rec = Recorder({str(directory)!r}, block_size=BS, start={{**START, "rank": {rank}}}, flush_s={flush_s},
               guard={guard}).begin()
t0 = time.time()
print("ready", flush=True)
for i in range({n}):
    rec.submit(request(t0 + i, [1, 2, i], tags={{"session": i // 3}}), t0 + i, 0, t0 + i + 0.5)
    if i % 200 == 0:
        time.sleep(0.01)
"""


def _killed(directory, *, guard, seconds=2.0):
    proc = subprocess.Popen([sys.executable, "-c", _script(directory, guard=guard)], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(seconds)
    proc.kill()  # SIGKILL: what vLLM's abort shutdown does to the engine core right after SIGTERM
    proc.wait()


def _wait_finished(directory, timeout=20.0):
    deadline = time.monotonic() + timeout
    while any(still_open for _, still_open in trace_files(directory)) and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_killed_writer_leaves_finished_files_and_true_counts_by_its_guard(tmp_path):
    _killed(tmp_path / "g", guard=True)
    _wait_finished(tmp_path / "g")
    files = trace_files(tmp_path / "g")
    assert files and not any(still_open for _, still_open in files)
    trace, report = read_trace(tmp_path / "g")
    start = load_recording(tmp_path / "g").starts[0]
    assert start.written == start.in_finished_files == trace.n_requests > 100
    assert start.recovered == 1 and report.cut_frames == report.truncated == report.missing == 0
    assert np.allclose(np.diff(trace.timestamp), 1.0)  # nothing lost before the last closed frame


def test_the_next_start_finishes_what_a_killed_one_left_and_says_so(tmp_path, caplog):
    _killed(tmp_path / "n", guard=False)
    assert [still_open for _, still_open in trace_files(tmp_path / "n")] == [True]
    with caplog.at_level("INFO", logger="vllm.kvprof"):  # a warning where a frame was cut, else a note
        record(tmp_path / "n", [(request(2e9, [5]), 2e9, 2e9 + 1)], clock=Clock(2e9))
    assert "finished 1 file(s) a stopped server left open" in caplog.text
    files = trace_files(tmp_path / "n")
    assert len(files) == 2 and not any(still_open for _, still_open in files)
    trace, report = read_trace(tmp_path / "n")
    first, second = load_recording(tmp_path / "n").starts
    assert (first.recovered, second.written) == (1, 1)
    assert first.written + second.written == trace.n_requests and report.missing == 0


def test_two_ranks_write_one_recording_read_as_one_fleet(tmp_path):
    """Two engine cores (data-parallel ranks) recording into one directory at once."""
    procs = [subprocess.Popen([sys.executable, "-c", _script(tmp_path / "dp", guard=True, n=3000, rank=rank) +
                               "rec.close()\n"], stdout=subprocess.PIPE) for rank in (0, 1)]
    for proc in procs:
        proc.communicate(timeout=120)
        assert proc.returncode == 0
    recording = load_recording(tmp_path / "dp")
    assert recording.ranks == (0, 1) and [s.written for s in recording.starts] == [3000, 3000]
    assert {f"-r{s.rank}-" for s in recording.starts} == {
        next(part for part in ("-r0-", "-r1-") if part in path.name) for path, _ in trace_files(tmp_path / "dp")}
    trace, _ = read_trace(tmp_path / "dp")
    assert trace.n_requests == 6000 and np.bincount(trace.extra["rank"]).tolist() == [3000, 3000]
    one, _ = read_trace(tmp_path / "dp", rank=1)
    assert one.n_requests == 3000 and set(one.extra["rank"].tolist()) == {1}
    assert set(one.chat_id // CHAT_IDS_PER_START) == {recording.ranks.index(1) if recording.starts[1].rank == 1 else 0}
    with pytest.raises(TraceError, match=r"no rank 2 \(ranks: 0, 1\)"):
        read_trace(tmp_path / "dp", rank=2)


def test_files_are_read_in_write_order_when_the_clock_steps_back(tmp_path):
    clock = Clock(1e6)
    recorder = Recorder(tmp_path / "c", block_size=BS, start=START, clock=clock, rotate_s=500.0, flush_s=0.01).begin()
    for i in range(6):
        clock.t += 1000 if i != 3 else -2500  # one step back: that file's name sorts before the first's
        recorder.submit(request(clock.t, [1, 2, i + 10], tags={"session": "s"}), clock.t, 0, clock.t + 0.5)
        time.sleep(0.2)
    recorder.close()
    names = [path.name for path, _ in trace_files(tmp_path / "c")]
    assert len(names) == 6 and sorted(names) != names
    trace, report = read_trace(tmp_path / "c")
    assert trace.n_requests == 6 and not report.skipped
    assert trace.turn[np.argsort(trace.chat_id)].tolist() == [1, 2, 3, 4, 5, 6]


def test_session_tags_of_different_json_types_are_different_conversations(tmp_path):
    values = [True, 1, 1.0, False, 0, "1"]
    reqs = [(request(1e6 + k, [k + 1], tags={"session": v}), 1e6 + k, 1e6 + k + 0.5) for k, v in enumerate(values * 2)]
    record(tmp_path / "s", reqs, clock=Clock(1e6))
    trace, _ = read_trace(tmp_path / "s")
    assert trace.turn.tolist() == [1] * 6 + [2] * 6
    assert trace.parent_chat_id[6:].tolist() == trace.chat_id[:6].tolist()


def test_the_replays_test_request_is_not_recorded(tmp_path):
    from kvprof.recording import PROBE_TAG

    reqs = [(request(1e6, [1], tags={PROBE_TAG: 1}), 1e6, 1e6 + 0.1),  # vLLM's API turns true into 1
            (request(1e6 + 1, [2], tags={"type": "a"}), 1e6 + 1, 1e6 + 2)]
    recorder = record(tmp_path / "p", reqs, clock=Clock(1e6))
    assert recorder.written == 1 and not any(recorder.dropped.values())
    trace, _ = read_trace(tmp_path / "p")
    assert trace.types == ("a",) or list(trace.type_names) == ["a"]


def test_a_part_renamed_between_listing_and_reading_is_read_finished(tmp_path, monkeypatch):
    import kvprof.profiler.reader as reader

    record(tmp_path / "r", [(request(1e6 + i, [i + 1]), 1e6 + i, 1e6 + i + 1) for i in range(3)], clock=Clock(1e6))
    (path, _), = trace_files(tmp_path / "r")
    stale = [(path.with_name(path.name + ".part"), True)]  # listed while still open, renamed since
    monkeypatch.setattr(reader, "trace_files", lambda directory: stale)
    trace, report = read_trace(tmp_path / "r")
    assert trace.n_requests == 3 and report.truncated == report.cut_frames == 0


def test_hundreds_of_files_read_under_a_low_open_file_limit(tmp_path):
    # --kv-record-rotate 1e-300: a file per request
    recorder = Recorder(tmp_path / "m", block_size=BS, start=START, rotate_s=1e-300, flush_s=0.0).begin()
    for i in range(400):
        now = time.time()
        recorder.submit(request(now, [i + 1]), now, 0, now + 0.5)
        time.sleep(0.001)
    recorder.close(timeout=600)
    assert len(trace_files(tmp_path / "m")) == 400
    script = f"""
import resource, sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from kvprof.profiler.reader import read_trace
print(read_trace({str(tmp_path / 'm')!r})[0].n_requests)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["400"]


def test_an_empty_finished_file_is_an_error(tmp_path):
    record(tmp_path / "e", [(request(1e6, [1]), 1e6, 1e6 + 1)], clock=Clock(1e6))
    (tmp_path / "e" / "trace-20261201T000000-r0-1-c5.jsonl.zst").write_bytes(b"")
    with pytest.raises(TraceError, match="finished recording file is empty"):
        read_trace(tmp_path / "e")


def test_recording_json_that_cannot_be_a_servers_is_refused(tmp_path):
    record(tmp_path / "j", [(request(1e6, [1]), 1e6, 1e6 + 1)], clock=Clock(1e6))
    path = tmp_path / "j" / "recording.json"
    doc = json.loads(path.read_text())
    for change, where in ((lambda d: d.update(starts=[]), r"at starts: must not be empty"),
                          (lambda d: d["starts"][0].update(num_gpu_blocks=2**63 - 1), r"starts\[0\]\.num_gpu_blocks")):
        broken = json.loads(json.dumps(doc))
        change(broken)
        path.write_text(json.dumps(broken))
        with pytest.raises(RecordingError, match=where):
            load_recording(tmp_path / "j")


def test_options_that_contradict_a_recording_are_usage_errors(tmp_path):
    from tests.helpers import invoke

    record(tmp_path / "o", [(request(1e6, [1]), 1e6, 1e6 + 1)], clock=Clock(1e6))
    for args, option in ((("inspect", tmp_path / "o", "--format", "mooncake"), "--format"),
                         (("compare", tmp_path / "o", "--trace-block-tokens", "32", "-o", tmp_path / "x"),
                          "--trace-block-tokens"),
                         (("inspect", tmp_path / "o", "--rank", "3"), "--rank")):
        result = invoke(*args)
        assert result.exit_code == 2 and option in result.output, result.output


# --- a block-id key shared by a fleet's servers (--kv-record-key) ---------------------------------


def _ids(directory):
    trace, report = read_trace(directory)
    return [trace.blocks_of(i).tolist() for i in range(trace.n_requests)], report.recording


def test_servers_sharing_a_key_file_give_a_prefix_the_same_ids(tmp_path):
    from kvprof.vllm.record import key_id, shared_key

    prefix = [(request(1e6 + 1, [1, 2, 3]), 1e6 + 1, 1e6 + 2)]
    key = tmp_path / "keys" / "fleet.key"
    key.parent.mkdir()
    record(tmp_path / "a", prefix, key_file=str(key))  # the first server creates it
    assert oct(key.stat().st_mode & 0o777) == "0o600" and len(key.read_text().strip()) == 64
    record(tmp_path / "b", prefix, key_file=str(key))  # the second reads it
    record(tmp_path / "c", prefix, key_file=str(tmp_path / "keys" / "other.key"))
    record(tmp_path / "d", prefix)  # no shared key: one of its own
    (a, rec_a), (b, rec_b), (c, rec_c), (d, rec_d) = (_ids(tmp_path / name) for name in "abcd")
    assert a == b  # the same prefix, the same ids on both servers
    assert not set(a[0]) & set(c[0]) and not set(a[0]) & set(d[0])  # other keys: other ids
    assert rec_a.starts[0].key_id == rec_b.starts[0].key_id == key_id(shared_key(str(key)))
    assert rec_c.starts[0].key_id not in (None, rec_a.starts[0].key_id) and rec_d.starts[0].key_id is None
    assert key.read_text().strip() not in (tmp_path / "a" / "recording.json").read_text()  # the fingerprint only


def test_the_key_file_comes_from_the_environment_too(tmp_path, monkeypatch):
    from kvprof.vllm.record import RECORD_KEY_ENV

    prefix = [(request(1e6 + 1, [1, 2]), 1e6 + 1, 1e6 + 2)]
    record(tmp_path / "a", prefix, key_file=str(tmp_path / "k"))
    monkeypatch.setenv(RECORD_KEY_ENV, str(tmp_path / "k"))
    record(tmp_path / "b", prefix)  # what --kv-record-key hands the engine cores vLLM starts
    assert _ids(tmp_path / "a")[0] == _ids(tmp_path / "b")[0]


def test_servers_starting_together_all_read_the_one_key_created(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from kvprof.vllm.record import shared_key

    path = str(tmp_path / "race.key")
    with ThreadPoolExecutor(8) as pool:
        keys = set(pool.map(lambda _: shared_key(path), range(32)))
    assert len(keys) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["race.key"]  # no staging file left


@pytest.mark.parametrize("content,problem", [
    (b"", "must hold 64 lowercase hex digits"),
    (b"zz" * 32, "must hold 64 lowercase hex digits"),
    (b"ab" * 31, "must hold 64 lowercase hex digits"),
    (b"AB" * 32, "must hold 64 lowercase hex digits"),
    (b"ab" * 32 + b"\nab", "must hold 64 lowercase hex digits"),
])
def test_a_malformed_key_file_is_refused_naming_it(tmp_path, content, problem):
    from kvprof.vllm.record import shared_key

    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(RecordingError, match=problem) as caught:
        Recorder(tmp_path / "rec", block_size=BS, start=START, key_file=str(path))
    assert str(path) in str(caught.value) and not (tmp_path / "rec").exists()
    assert shared_key(str(path).replace("bad", "good")) != b""  # a missing one is created instead


def test_an_unusable_key_path_is_refused_at_once(tmp_path):
    from kvprof.vllm.record import shared_key

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, problem in ((fifo, "is not a regular file"), (tmp_path, "Is a directory|not a regular file"),
                          (tmp_path / "missing" / "k", "No such file or directory")):
        with pytest.raises(RecordingError, match=problem) as caught:
            shared_key(str(path))
        assert str(path) in str(caught.value)
    if os.geteuid() != 0:  # root reads any file
        unreadable = tmp_path / "unreadable.key"
        unreadable.write_text("ab" * 32)
        unreadable.chmod(0)
        with pytest.raises(RecordingError, match="Permission denied"):
            shared_key(str(unreadable))


def test_a_recording_json_without_key_id_reads_as_keys_of_their_own(tmp_path):
    record(tmp_path / "old", [(request(1e6 + 1, [1]), 1e6 + 1, 1e6 + 2)])
    path = tmp_path / "old" / "recording.json"
    document = json.loads(path.read_text())
    del document["starts"][0]["key_id"]  # as kvprof wrote it before the option
    path.write_text(json.dumps(document))
    assert load_recording(tmp_path / "old").starts[0].key_id is None
    document["starts"][0]["key_id"] = 7
    path.write_text(json.dumps(document))
    with pytest.raises(RecordingError, match=r"starts\[0\]\.key_id"):
        load_recording(tmp_path / "old")


def test_each_reload_in_force_is_listed_in_recording_json_and_by_show(tmp_path):
    """Issue 40 A5: a start lists the hp file it began with, and recording.json each one reloaded while
    it ran (time since the origin, sha256, path as given); kvprof show of the directory lists them."""
    from tests.helpers import invoke

    clock = Clock(1_000_000.0)
    recorder = Recorder(tmp_path / "r", block_size=BS, start={**START, "hp_sha256": "a" * 64}, clock=clock).begin()
    clock.t += 90.5
    recorder.reloaded("b" * 64, "hp/refit.json")
    deadline = time.monotonic() + 10
    while not load_recording(tmp_path / "r").starts[0].reloads and time.monotonic() < deadline:
        time.sleep(0.05)  # saved by the writer thread without waiting for a request
    assert [r.to_dict() for r in load_recording(tmp_path / "r").starts[0].reloads] == [
        {"time": 90.5, "sha256": "b" * 64, "path": "hp/refit.json"}]
    recorder.submit(request(clock.t, [1]), clock.t, 0, clock.t + 1)
    recorder.close()
    start = load_recording(tmp_path / "r").starts[0]
    assert start.written == 1 and start.hp_sha256 == "a" * 64 and len(start.reloads) == 1
    shown = invoke("show", tmp_path / "r")
    assert shown.exit_code == 0, shown.output
    assert "aaaaaaaaaaaa" in shown.stdout and "90.5" in shown.stdout and "bbbbbbbbbbbb" in shown.stdout
    assert "hp/refit.json" in shown.stdout
    as_json = invoke("show", tmp_path / "r", "--json")
    assert json.loads(as_json.stdout)["starts"][0]["reloads"][0]["path"] == "hp/refit.json"


def test_a_recording_without_reloads_says_so_and_bad_entries_are_named(tmp_path):
    from tests.helpers import invoke

    record(tmp_path / "q", [(request(1e6 + 1, [1]), 1e6 + 1, 1e6 + 2)])
    assert "no hp file was reloaded" in " ".join(invoke("show", tmp_path / "q").stdout.split())
    path = tmp_path / "q" / "recording.json"
    document = json.loads(path.read_text())
    del document["starts"][0]["reloads"]  # as kvprof wrote it before reloads were recorded
    path.write_text(json.dumps(document))
    assert load_recording(tmp_path / "q").starts[0].reloads == []
    for entry, where in (({"time": 1.0, "sha256": 5, "path": "x"}, r"starts\[0\]\.reloads\[0\]\.sha256"),
                         ({"time": 1.0, "sha256": "ab"}, r"starts\[0\]\.reloads\[0\]\.path")):
        document["starts"][0]["reloads"] = [entry]
        path.write_text(json.dumps(document))
        with pytest.raises(RecordingError, match=where):
            load_recording(tmp_path / "q")


def test_a_reload_the_live_loop_puts_in_force_reaches_the_recording(tmp_path):
    import hashlib

    from kvprof.vllm.live import LiveLoop
    from kvprof.vllm.spec import PolicySpec
    from tests.test_live import HP

    hp_path = tmp_path / "hp.json"
    hp_path.write_text(json.dumps(HP))
    spec = PolicySpec.from_additional_config({"kv_policy": {"config": str(hp_path), "mode": "shadow",
                                                            "reload_interval_s": 0.1, "record": str(tmp_path / "r")}})
    loop = LiveLoop(spec, num_gpu_blocks=9, block_size=BS, start=START).begin()
    assert loop.wait_ready(READY_S)  # the compiled core loaded (compiled first, where not cached)
    try:
        refit = json.dumps(dict(HP, horizon_s=30.0))
        hp_path.write_text(refit)
        deadline = time.monotonic() + 10
        while loop.spec.hp.horizon != 30.0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        loop.close()
    (reload,) = load_recording(tmp_path / "r").starts[0].reloads
    assert reload.sha256 == hashlib.sha256(refit.encode()).hexdigest() and reload.path == str(hp_path)


def test_the_guards_launcher_is_reaped_at_once(tmp_path):
    """Issue 40 item 20: no exited launcher is left in the engine core's tree, for vLLM's shutdown to
    force-kill and log at every stop; the guard itself lives on, out of the tree."""
    recorder = Recorder(tmp_path / "g", block_size=BS, start=START).begin()
    try:
        deadline = time.monotonic() + 20
        while recorder._guard.returncode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert recorder._guard.returncode == 0  # waited for by the reaper thread, not by this test
    finally:
        recorder.close()


@pytest.mark.parametrize("cut, level", [(0, "INFO"), (117, "WARNING")])
def test_finishing_a_file_warns_only_where_requests_were_lost(tmp_path, caplog, cut, level):
    """vLLM's default stop kills the engine core before it closes its file, so its guard finishes the
    file at every ordinary stop: a note when every line was kept, a warning when a frame was cut."""
    from kvprof.recording import Finished

    with caplog.at_level("INFO", logger="vllm.kvprof"):
        record_module._log_finished(tmp_path, [Finished(tmp_path / "a.part", tmp_path / "a", 12, cut)], "x left")
    (entry,) = caplog.records
    assert entry.levelname == level and "12 lines" in entry.getMessage()


def test_compare_replays_a_recordings_hints_under_the_servers_budget(tmp_path):
    from tests.helpers import invoke

    t0 = 1_000_000.0
    recorder = Recorder(tmp_path / "rec", block_size=BS, start={**START, "hint_max_fraction": 0.25},
                        clock=Clock(t0)).begin()
    for i in range(40):
        tags = {"retain_s": 30} if i % 3 == 0 else {}
        recorder.submit(request(t0 + i, [i % 5, 100 + i, 200 + i], tags=tags), t0 + i, 0, t0 + i + 0.5, grown_at=[])
    recorder.close()
    assert load_recording(tmp_path / "rec").starts[0].hint_max_fraction == 0.25
    for given, budget in ((), 0.25), (("--hint-max-fraction", "0.5"), 0.5):
        out = tmp_path / f"out-{budget}"
        result = invoke("compare", tmp_path / "rec", "--policies", "lru", "--capacity", "8", "--eval-window", "0:",
                        "-o", out, "-j", "1", *given)
        assert result.exit_code == 0, result.output
        assert json.loads((out / "results.json").read_text())["inputs"]["hints"]["max_fraction"] == budget
        assert ("the recorded servers'" in result.stderr) == (not given)
    fleet = invoke("fleet", tmp_path / "rec", "--policies", "lru", "--eval-window", "0:", "-o", tmp_path / "fleet",
                   "-j", "1")  # the recorded router: what the server received, on its own timing
    assert fleet.exit_code == 0, fleet.output
    assert json.loads((tmp_path / "fleet" / "results.json").read_text())["inputs"]["hints"]["max_fraction"] == 0.25
