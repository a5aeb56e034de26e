"""Hostile inputs and the operator's walk, round 4: read-only caches, streams, long sweeps, rejected requests,
full disks, lists and windows, options a command would ignore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers import invoke

ROOT = Path(__file__).resolve().parents[1]


def test_compiled_code_without_a_writable_cache_compiles_anew_with_a_note(tmp_path):
    """A read-only package directory and HOME: numba's cache=True finds no locator and refused the declaration."""
    module = tmp_path / "compiled.py"
    module.write_text("import kvprof\nfrom numba import njit\n\n\n@njit(cache=True)\ndef plus_one(x):\n"
                      "    return x + 1\n\n\nprint(plus_one(1))\n")
    (tmp_path / "__pycache__").write_text("")  # not a directory: numba cannot cache beside the source
    (tmp_path / "no-cache-home").write_text("")  # nor in the user's cache
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "no-cache-home")}
    for name in ("NUMBA_CACHE_DIR", "NUMBA_CACHE_LOCATOR_CLASSES"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(module)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "2\n"
    assert done.stderr.count("\n") == 1 and "compiled anew in each run" in done.stderr
    assert "NUMBA_CACHE_DIR" in done.stderr


def test_replay_without_its_extra_says_what_to_install_before_any_option_needs_it(tmp_path, monkeypatch):
    """pip install -e . has no httpx: --too-long's check imported the replay modules and crashed there."""
    monkeypatch.setitem(sys.modules, "httpx", None)  # import httpx raises ImportError
    for name in [name for name in sys.modules if name == "kvprof.replay" or name.startswith("kvprof.replay.")]:
        monkeypatch.delitem(sys.modules, name)
    result = invoke("replay", tmp_path / "t.jsonl", "--model", "m", "--url", "http://127.0.0.1:9", "-o",
                    tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "pip install 'kvprof[replay]'" in result.stderr and "httpx" in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not (tmp_path / "out").exists()


def _fed_once(path: Path, data: bytes) -> threading.Thread:
    """A FIFO at ``path`` whose writer gives ``data`` once (a second open of it would wait forever)."""
    os.mkfifo(path)

    def feed():
        with open(path, "wb") as fifo:
            fifo.write(data)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    return writer


@pytest.mark.timeout(120)
def test_show_reads_an_hp_file_from_a_fifo_once(tmp_path):
    """show read the file as a results file and again as an hp file: the second open of a FIFO blocked."""
    from kvprof.profiler.fit import fit_trace
    from tests.helpers import synthetic

    _, trace = synthetic(tmp_path, hours=0.05)
    hp_path = tmp_path / "hp.json"
    fit_trace(trace).save(hp_path)
    fifo = tmp_path / "hp.fifo"
    writer = _fed_once(fifo, hp_path.read_bytes())
    result = invoke("show", fifo)
    writer.join(timeout=10)
    assert result.exit_code == 0, result.output
    assert "schema kvprof.hp/" in result.stdout and "class rule" in result.stdout


def test_a_window_bound_with_a_minus_sign_counts_back_minus_zero_too():
    """-3600:-0 read -0 as the absolute 0 while -1 counted back."""
    from kvprof.profiler.trace import parse_window
    from tests.helpers import make_trace

    trace = make_trace([(float(t), "text", 1, [t]) for t in range(10)])  # arrivals 0..9
    assert trace.time_window(*parse_window("-0:")).n_requests == 1  # the last arrival
    assert trace.time_window(*parse_window("-3:-0")).n_requests == 3  # 6, 7, 8
    assert trace.time_window(*parse_window("0:-0")).n_requests == 9  # all but the last
    assert trace.time_window(*parse_window("-3:-0")).window == (6.0, 9.0)  # no -0.0 to record
    for refused in ("-0:-3", "-5:-5", "5:5", "0 :3", "0: 3"):
        with pytest.raises(ValueError):
            parse_window(refused)


@pytest.mark.parametrize("args, words", [
    (["--policies", "belady", "--router", "session,least-loaded"], "belady cannot run behind least-loaded"),
    (["--policies", "belady", "--router", "prefix-approx"], "belady cannot run behind prefix-approx"),
    (["--policies", "lru", "--hp-per-replica"], "none of lru does"),
    (["--router", "session", "--index-blocks", "64"], "it is not in --router"),
    (["--router", "round-robin,session", "--load-weight", "0"], "none is in --router"),
    (["--replicas", ",".join(map(str, range(1, 1100))), "--router", "round-robin"], "more than the 1,024"),
])
def test_fleet_options_no_configuration_can_use_exit_2_before_any_work(tmp_path, args, words):
    """fleet ran belady behind a live router for seconds, then exit 1; it ignored knobs of routers not run."""
    from tests.helpers import one_line

    result = invoke("fleet", tmp_path / "no-such-trace.jsonl", "-o", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert words in one_line(result.output)
    assert list(tmp_path.iterdir()) == []


def test_fleet_help_says_what_json_prints():
    from tests.helpers import one_line

    result = invoke("fleet", "--help")
    assert "results document" not in one_line(result.output)
    assert "JSON list" in one_line(result.output)


def test_a_long_sweep_off_a_terminal_says_how_far_it_is(tmp_path):
    """fleet --replicas 1,2,...,3000 printed nothing for minutes."""
    from tests.helpers import synthetic

    path, _ = synthetic(tmp_path, hours=0.02)
    result = invoke("fleet", path, "--replicas", ",".join(map(str, range(1, 11))), "--router", "round-robin",
                    "--capacity", "64", "--eval-window", "0:", "-j", "1", "--json", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    told = [line for line in result.stderr.splitlines() if "routing and replaying 10 configurations:" in line]
    assert told[-1].endswith("10 of 10 done") and len(told) == 10
    assert len(json.loads(result.stdout)) == 10


def _recording_of_blocks(directory: Path, num_gpu_blocks: int) -> Path:
    """A small vLLM recording whose server had ``num_gpu_blocks`` (recording.json's starts[0])."""
    from tests.test_fleet import _server

    recording = _server(directory, 1_000_000.0, 6, system=[b"sys"])
    document = json.loads((recording / "recording.json").read_text())
    document["starts"][0]["num_gpu_blocks"] = num_gpu_blocks
    (recording / "recording.json").write_text(json.dumps(document))
    return recording


@pytest.mark.parametrize("command", ["compare", "fleet", "fit"])
@pytest.mark.parametrize("num_gpu_blocks", [2**40, 1])
def test_a_recordings_cache_outside_the_simulators_bound_is_named_by_file_and_field(tmp_path, command, num_gpu_blocks):
    """2^40 blocks were reported as an invalid --capacity (not given); one block (the null block) became 1."""
    from tests.helpers import one_line

    recording = _recording_of_blocks(tmp_path / "rec", num_gpu_blocks)
    output = ["-o", tmp_path / ("hp.json" if command == "fit" else "out")]
    result = invoke(command, recording, *output)
    text = one_line(result.output)
    assert result.exit_code == 1, text
    assert f"{recording / 'recording.json'}, at starts[0].num_gpu_blocks: {num_gpu_blocks:,} blocks, " \
           f"{num_gpu_blocks - 1:,} usable" in text
    assert "give --capacity" in text and "Invalid value for --capacity" not in text
    assert not (tmp_path / "out").exists() and not (tmp_path / "hp.json").exists()


class _FullDisk:
    """A file opened for writing on a full disk: every write fails, as the kernel says it (no file name)."""

    def __init__(self, handle):
        self._handle = handle

    def write(self, data):
        import errno

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()

    def __getattr__(self, name):
        return getattr(self._handle, name)


def _fill_the_disk(monkeypatch) -> None:
    import builtins

    def open_on_full_disk(file, mode="r", *args, **kwargs):
        handle = builtins.open(file, mode, *args, **kwargs)
        return _FullDisk(handle) if "w" in mode else handle

    monkeypatch.setattr("kvprof.atomic.open", open_on_full_disk, raising=False)


@pytest.mark.parametrize("command", ["fit", "synth", "compare", "fleet", "demo"])
def test_a_full_disk_names_the_file_and_leaves_no_directory_the_command_made(tmp_path, monkeypatch, command):
    """A full disk said 'error: : No space left on device', and compare left the empty directory it had made."""
    from tests.helpers import one_line, synthetic

    trace, _ = synthetic(tmp_path, hours=0.02)
    _fill_the_disk(monkeypatch)
    new = tmp_path / "new"
    args = {
        "fit": ["fit", trace, "--window", "0:", "-o", tmp_path / "hp.json"],
        "synth": ["synth", "--hours", "0.01", "-o", tmp_path / "s.jsonl"],
        "compare": ["compare", trace, "--policies", "lru", "--capacity", "64", "--eval-window", "0:", "-j", "1",
                    "-o", new / "out"],
        "fleet": ["fleet", trace, "--policies", "lru", "--router", "round-robin", "--replicas", "2", "--capacity", "64",
                  "--eval-window", "0:", "-j", "1", "-o", new / "out"],
        "demo": ["demo", "-o", new / "out"],
    }[command]
    before = sorted(tmp_path.iterdir())
    result = invoke(*args)
    text = one_line(result.output)
    assert result.exit_code == 1, text
    written = {"fit": tmp_path / "hp.json", "synth": tmp_path / "s.jsonl"}.get(command, new / "out")
    assert f"error: {written}" in text and "No space left on device" in text
    assert sorted(tmp_path.iterdir()) == before  # no directory, file or temporary left


def test_a_spill_directory_fit_made_is_removed_with_its_parents(tmp_path):
    """fit --sharded --spill-dir /nonexistent/x created the parents and left them."""
    from tests.helpers import synthetic

    trace, _ = synthetic(tmp_path, hours=0.02)
    result = invoke("fit", trace, "--sharded", "--window", "0:", "--spill-dir", tmp_path / "a" / "b" / "spill", "-o",
                    tmp_path / "hp.json")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "a").exists() and (tmp_path / "hp.json").is_file()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert invoke("fit", trace, "--sharded", "--window", "0:", "--spill-dir", kept, "-o", tmp_path / "hp.json"
                  ).exit_code == 0
    assert kept.is_dir() and list(kept.iterdir()) == []  # one that was there stays


@pytest.mark.parametrize("command", ["compare", "fleet"])
def test_rejected_requests_are_in_the_table(tmp_path, command):
    """At capacity 2 almost every request was rejected, and the tables showed only a tiny hit ratio and QTTFT."""
    from tests.helpers import one_line, synthetic

    trace, _ = synthetic(tmp_path, hours=0.02)
    extra = ["--router", "round-robin", "--replicas", "2"] if command == "fleet" else []
    result = invoke(command, trace, "--policies", "lru", "--capacity", "2", "--eval-window", "0:", "-j", "1", *extra,
                    "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    run = json.loads((tmp_path / "out" / "results.json").read_text())["runs"][0]
    assert run["n_rejected"] > 0
    text = one_line(result.stdout)
    assert f"{run['n_rejected']:,} ({run['n_rejected'] / run['n_requests']:.1%})" in text
    assert "rejected: requests longer than the whole cache" in text


def test_a_fit_window_overlapping_the_evaluation_window_is_said_on_screen(tmp_path):
    """compare without --config on a trace shorter than an hour fitted on all of it, then scored part of it,
    silently."""
    from tests.helpers import one_line, synthetic

    trace, read = synthetic(tmp_path, hours=0.02)
    middle = float(read.timestamp[read.n_requests // 2])
    result = invoke("compare", trace, "--policies", "lru,wa", "--capacity", "64", "--eval-window", f"{middle}:",
                    "-j", "1", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    evaluated = int((read.timestamp >= middle).sum())
    assert f"holds {evaluated:,} of the {evaluated:,} requests of the evaluation window" in one_line(result.stderr)
    apart = invoke("compare", trace, "--policies", "lru,wa", "--capacity", "64", "--fit-window", f":{middle}",
                   "--eval-window", f"{middle}:", "-j", "1", "-o", tmp_path / "apart")
    assert apart.exit_code == 0 and "evaluation window" not in apart.stderr


def test_fit_says_why_it_has_no_held_out_quality(tmp_path):
    from tests.helpers import one_line, synthetic

    trace, read = synthetic(tmp_path, hours=0.02)
    result = invoke("fit", trace, "-o", tmp_path / "hp.json")  # the default 0:3600 holds the whole trace
    assert result.exit_code == 0, result.output
    assert "held-out quality -: the window after the fit window, [3600, 7200) s, holds no requests" in one_line(
        result.stderr)
    result = invoke("fit", trace, "--window", "0:", "-o", tmp_path / "hp.json")
    assert "held-out quality -: the fit window is open-ended" in one_line(result.stderr)


@pytest.mark.parametrize("began_followed, continued_followed, favours", [
    (0, 1, False),  # ratio inf on one event: no evidence
    (0, 500, False),  # none followed after a first request: a ratio of nothing
    (2, 500, False),
    (3, 500, True),
    (5, 30, True),  # Mooncake's fit windows (0:200 counts 5 of 598 and 3 of 22)
])
def test_the_next_turn_ratio_needs_followed_requests_on_both_sides(began_followed, continued_followed, favours):
    """1,000 began / 0 followed against 1,000 continued / 1 followed switched wa to first-turn (and cost 19 %)."""
    from kvprof.models.next_turn import NextTurnRates

    assert NextTurnRates(30.0, 1000, began_followed, 1000, continued_followed).favours_first_turn() is favours


def test_mooncakes_shortest_fit_window_still_favours_first_turn():
    from kvprof.models.next_turn import NextTurnRates

    assert NextTurnRates(30.0, 598, 5, 22, 3).favours_first_turn()


@pytest.mark.parametrize("args, hint", [
    ([], "--eval-window 0:"),  # lru fits nothing: replay it all
    (["--policies", "lru,wa"], "--fit-window 0:"),
])
def test_fleets_default_windows_on_a_short_trace_say_which_to_pass(tmp_path, args, hint):
    """fleet DIR1 DIR2 DIR3 on recordings shorter than an hour exited 1, as if the data were bad."""
    from tests.helpers import one_line, synthetic

    trace, _ = synthetic(tmp_path, hours=0.02)
    result = invoke("fleet", trace, *args, "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    text = one_line(result.output)
    assert "the window 3600: holds no requests" in text and f"for a trace this short pass e.g. {hint}" in text
    assert not (tmp_path / "out").exists()


def test_fleet_plots_run_along_the_fleets_capacity_one_line_per_router_and_policy(tmp_path):
    """Fleet plots had capacity per replica on x and one legend entry per configuration (overflowing, colours
    repeating past ten), and matplotlib's layout warning reached stderr."""
    from kvprof.cli.plots import _capacity, _colors, _series
    from tests.helpers import synthetic

    trace, _ = synthetic(tmp_path, hours=0.02)
    result = invoke("fleet", trace, "--replicas", ",".join(map(str, range(1, 13))), "--router", "round-robin,session",
                    "--capacity", "64", "--eval-window", "0:", "-j", "1", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "constrained_layout" not in result.stderr and "Matplotlib" not in result.stderr
    assert "; routing and replaying took " in result.stderr
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert sorted({_series(run) for run in runs}) == ["lru, round-robin", "lru, session"]
    assert sorted({_capacity(run) for run in runs}) == [64 * n for n in range(1, 13)]
    svg = (tmp_path / "out" / "hit_ratio.svg").read_text()
    assert "a fleet's: replicas x per replica" in svg and "lru, session" in svg
    assert len(set(map(str, _colors(25)))) == 25


def test_tuning_counts_its_capacities_in_words(tmp_path):
    from tests.helpers import synthetic

    trace, _ = synthetic(tmp_path, hours=0.02)
    result = invoke("fit", trace, "--window", "0:", "--capacity", "64", "-o", tmp_path / "hp.json")
    assert result.exit_code == 0, result.output
    assert "tuning wa for 1 capacity on the fit window" in result.stderr


@pytest.mark.parametrize("args, words", [
    (["fit", "{missing}", "-o", "{tmp}/hp.json", "--capacity", "64", "--router", "session", "--replica", "0",
      "--index-blocks", "64"], "sizes prefix-approx's index"),
    (["fit", "{missing}", "-o", "{tmp}/hp.json", "--capacity", "64", "--router", "round-robin", "--replica", "0",
      "--load-weight", "0"], "weighs load in the prefix routers"),
    (["replay", "{missing}", "--model", "m", "-o", "{tmp}/out", "--index-blocks", "64"],
     "sizes prefix-approx's index"),
    (["replay", "{missing}", "--model", "m", "-o", "{tmp}/out", "--url", "http://127.0.0.1:9", "--url",
      "http://127.0.0.1:10", "--router", "session", "--load-weight", "2"], "weighs load in the prefix routers"),
])
def test_router_knobs_no_router_reads_are_refused_everywhere(tmp_path, args, words):
    from tests.helpers import one_line

    filled = [a.format(missing=tmp_path / "no-such-trace.jsonl", tmp=tmp_path) for a in args]
    result = invoke(*filled)
    assert result.exit_code == 2, result.output
    assert words in one_line(result.output) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("engine", ["compiled", "python"])
def test_recorded_timing_rejects_requests_longer_than_the_whole_cache(tmp_path, engine):
    """At capacity 1 recorded timing served every request (0 rejected, hit ratio .0332); model timing rejected all."""
    from kvprof.policy import POLICIES
    from kvprof.profiler.reader import read_trace
    from kvprof.sim.config import SimConfig
    from kvprof.sim.engine import simulate
    from kvprof.sim.workload import prepare_workload

    recording = _recording_of_blocks(tmp_path / "rec", 64)
    trace = read_trace(recording)[0]
    workload = prepare_workload(trace, None, trace.block_size)
    for capacity in (1, 63):
        run = simulate(workload, POLICIES["lru"](), capacity, SimConfig(engine_block_size=trace.block_size,
                                                                        timing="recorded"), engine=engine)
        shortest = int(workload.timing.n_prompt.min())
        assert run.n_rejected == int((workload.timing.n_prompt > capacity).sum())
        assert (run.n_rejected == run.n_requests) is (capacity < shortest)


def test_matplotlibs_notes_about_its_own_cache_do_not_reach_stderr(tmp_path):
    (tmp_path / "not-a-directory").write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLCONFIGDIR": str(tmp_path / "not-a-directory")}
    done = subprocess.run([sys.executable, "-c", "import kvprof.cli.plots"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stderr == ""


def test_the_per_interval_log_leaves_replays_test_request_out(caplog):
    """Issue 40 A6: kvprof replay's probe (two tokens, tagged kvprof_probe) is no request of the traffic:
    the server's interval lines sum to the requests replayed."""
    import logging

    from kvprof.recording import PROBE_TAG
    from kvprof.vllm.live import LiveLoop
    from kvprof.vllm.spec import PolicySpec
    from tests.test_live import BS, fake_request

    spec = PolicySpec.from_additional_config({"kv_policy": {"policy": "lru", "mode": "shadow"}})
    loop = LiveLoop(spec, num_gpu_blocks=64, block_size=BS, start={})  # not begun: events handled here
    probe = fake_request("probe", [], partial=2, tags={PROBE_TAG: 1})
    traffic = fake_request("r0", [b"a", b"b", b"c"], tags={"type": "chat"})
    with caplog.at_level(logging.INFO, logger="vllm.kvprof"):
        for request in (probe, traffic):
            loop._handle(("admit", 1.0, request, None))
            loop._handle(("finish", 2.0, request, True, 0, 0, ()))
        loop._log_interval(3.0)
    (line,) = [r.getMessage() for r in caplog.records if "requests" in r.getMessage()]
    assert "1 requests, 2 prompt blocks" in line, line
    assert not [labels for _, labels, _ in loop.metrics.samples() if labels.get("class") == "<probe>"]


def test_modelled_decoding_holds_the_blocks_vllm_holds():
    """Issue 40 A1 on model timing: with --decode a request holds ceil((prompt + output - 1) / block)
    blocks (the last output token's KV is never computed), not one more when that count fills a block."""
    import dataclasses

    import numpy as np

    from kvprof.sim.workload import prepare_workload
    from tests.helpers import make_trace

    trace = dataclasses.replace(make_trace([(0.0, "a", 1, [1, 2, 3, 4])] * 4, block_size=16),
                                input_length=np.full(4, 63), output_length=np.array([0, 1, 2, 3]))
    workload = prepare_workload(trace, engine_block_size=16)
    assert workload.blocks_needed(decode=True).tolist() == [4, 4, 4, 5]
    assert workload.blocks_needed(decode=False).tolist() == [4, 4, 4, 4]


def test_the_mixed_key_warning_counts_the_keys_not_the_servers(tmp_path):
    """Issue 40 item 20: of 3 servers, 2 share a key: a prefix all 3 received has 2 different ids, not 3."""
    from tests.helpers import one_line
    from tests.test_fleet import _server

    key = str(tmp_path / "fleet.key")
    dirs = [_server(tmp_path / name, 1_000_000.0 + 50 * i, 10, system=[b"sys-a"], key_file=key_file)
            for i, (name, key_file) in enumerate((("a", key), ("b", key), ("c", str(tmp_path / "other.key"))))]
    result = invoke("fleet", *dirs, "--router", "round-robin", "--replicas", "1", "--policies", "lru",
                    "--capacity", "6", "--eval-window", "0:", "-j", "1", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "a prefix 3 servers all received counts as up to 2 different contents" in one_line(result.stderr)


def test_the_session_row_of_a_fleet_of_recordings_says_it_is_not_the_live_routers_placement(tmp_path):
    """Issue 40 A4: recordings renumber chat ids, so the session row over them routes conversations
    otherwise than the live session router did: the note under the table says so, and only there."""
    from tests.helpers import one_line
    from tests.test_fleet import _server

    key = str(tmp_path / "fleet.key")
    dirs = [_server(tmp_path / name, 1_000_000.0 + 50 * i, 10, system=[b"sys-a"], key_file=key)
            for i, name in enumerate("ab")]
    common = ("--policies", "lru", "--capacity", "6", "--eval-window", "0:", "-j", "1")
    shown = {}
    for routers in ("recorded,session", "recorded,round-robin"):
        result = invoke("fleet", *dirs, "--router", routers, *common, "-o", tmp_path / routers)
        assert result.exit_code == 0, result.output
        shown[routers] = one_line(result.stdout)
    assert "session: hashes the chat ids the recorder numbered" in shown["recorded,session"]
    assert "not where the live fleet's session router placed them" in shown["recorded,session"]
    assert "chat ids the recorder numbered" not in shown["recorded,round-robin"]


# Client hints, stop and the hint options (docs/hints.md): what a hostile trace or client sends.

def _hinted_lines(tmp_path, fragment: str, line: int = 5, name: str = "hinted.jsonl") -> Path:
    """Eight synthetic Bailian lines, ``fragment`` (raw JSON text, e.g. ``"retain_s": 5``) added to ``line``."""
    from kvprof.profiler.synth import generate

    lines = [json.dumps(record) for record in list(generate("bailian-a", 0.2, 5))[:8]]
    lines[line - 1] = f"{lines[line - 1][:-1]}, {fragment}}}"
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


_HINT_RUN = ("--policies", "lru", "--capacity", "4096", "--eval-window", "0:", "-j", "1")


@pytest.mark.parametrize("fragment, field", [
    ('"retain_s": 1' + "0" * 400, "retain_s"),  # json reads an int past any float: comparing it raised OverflowError
    ('"retain_s": -1' + "0" * 400, "retain_s"),
    ('"hint_tag": 1' + "0" * 400, "hint_tag"),
])
def test_a_hint_number_past_a_floats_range_is_an_error_naming_line_and_field(tmp_path, fragment, field):
    from tests.helpers import one_line

    path = _hinted_lines(tmp_path, fragment)
    result = invoke("compare", path, *_HINT_RUN, "-o", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    shown = one_line(result.output)
    assert f"hinted.jsonl, line 5, field '{field}': must be from 0 to" in shown
    assert len(shown) < 400  # the number is cut, not printed whole
    assert not (tmp_path / "out").exists()


def test_a_clients_hint_number_past_a_floats_range_is_a_value_error_naming_the_field():
    """vLLM turns a ValueError from the request check into a 400; an OverflowError was a server error."""
    from kvprof.models.hints import hint_of_args

    with pytest.raises(ValueError, match="hint field 'retain_s' must be from 0 to"):
        hint_of_args({"retain_s": 10**400})


def test_synth_refuses_a_retention_its_own_trace_reader_would_refuse(tmp_path):
    """--hint-retain-s took up to 1e9 s and wrote a trace every command refused at line 1 (past a year)."""
    from tests.helpers import one_line

    from kvprof.models.hints import MAX_RETAIN_S

    out = tmp_path / "s.jsonl"
    result = invoke("synth", "-o", out, "--hours", "0.01", "--hints", "retain-all", "--hint-retain-s",
                    repr(MAX_RETAIN_S + 1))
    assert result.exit_code == 2, result.output
    assert "'--hint-retain-s'" in one_line(result.output) and f"<= {MAX_RETAIN_S:g}" in one_line(result.output)
    assert not out.exists()
    result = invoke("synth", "-o", out, "--hours", "0.01", "--hints", "retain-all", "--hint-retain-s",
                    repr(MAX_RETAIN_S))
    assert result.exit_code == 0, result.output
    assert invoke("inspect", out).exit_code == 0


@pytest.mark.parametrize("args, named, words", [
    (("--hint-share", "0.5"), "--hint-share", "applies to --hints stop only"),
    (("--hint-end-turn", "retain"), "--hint-end-turn", "applies to --hints stop only"),
    (("--hints", "trace", "--hint-share", "0.9", "--hint-end-turn", "release"), "--hint-share/--hint-end-turn",
     "applies to --hints stop only"),
    (("--ignore-hints", "--hint-max-fraction", "0.5"), "--ignore-hints", "--hint-max-fraction would do nothing"),
    (("--ignore-hints", "--hints", "stop"), "--ignore-hints", "--hints stop would do nothing"),
])
def test_compare_refuses_a_hint_option_its_hint_source_would_ignore(tmp_path, args, named, words):
    """A stop-hint option with the trace's own hints, or a budget with none replayed, ran as if not given."""
    from tests.helpers import one_line

    path = _hinted_lines(tmp_path, '"retain_s": 5')
    result = invoke("compare", path, *_HINT_RUN, "-o", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {named}: " in one_line(result.output) and words in one_line(result.output)
    assert not (tmp_path / "out").exists()


def test_stop_hints_that_give_no_hint_are_said_not_silently_left_out(tmp_path):
    """Every response cut at its length: --hints stop replayed no P+hints row and said nothing of why."""
    from tests.helpers import one_line

    from kvprof.profiler.synth import generate, write_jsonl

    records = list(generate("bailian-a", 0.2, 5))
    for record in records:
        record["stop"] = "length"
    path = tmp_path / "cut.jsonl"
    write_jsonl(path, records)
    result = invoke("compare", path, "--policies", "lru", "--capacity", "4096", "--fit-window", "0:360",
                    "--eval-window", "360:", "--hints", "stop", "-o", tmp_path / "out", "-j", "1")
    assert result.exit_code == 0, result.output
    assert "--hints stop: no evaluated request ended in a tool call or an end of turn" in one_line(result.stderr)
    assert json.loads((tmp_path / "out" / "results.json").read_text())["config"]["policies"] == ["lru"]


@pytest.mark.parametrize("entry, says", [
    ({"policy": "lru", "hint_max_fraction": 0.3}, "client hints honoured, retaining at most 0.3 of the cache (4 "
                                                  "blocks), per hint tag and in all"),
    ({"policy": "lru", "hint_max_fraction": 0.01}, "at most 0.01 of the cache (0 blocks), per hint tag and in all"),
    ({"policy": "lru"}, "client hints honoured, no budget"),
    ({"record": "rec"}, "client hints are checked and recorded, not honoured by the GPU tier (vLLM's own "
                          "eviction takes none)"),
    ({"policy": "lru", "mode": "shadow"}, "client hints are checked, not honoured by the GPU tier (vLLM's own "
                          "eviction takes none)"),
])
def test_the_servers_startup_line_says_what_it_does_with_client_hints(entry, says):
    """A server took hints in shadow and record-only mode and said nowhere that it does not honour them,
    nor what budget --kv-hint-max-fraction came to in blocks."""
    from kvprof.vllm.spec import PolicySpec

    line = PolicySpec.from_additional_config({"kv_policy": entry}).describe(16)  # 15 usable blocks
    assert line.endswith(says), line


def test_a_budget_over_an_evaluation_window_without_hints_says_the_window_has_none(tmp_path):
    """Hints only before the evaluation window: the warning said the trace carries none."""
    from tests.helpers import one_line

    from kvprof.profiler.synth import generate, write_jsonl

    records = list(generate("bailian-a", 0.2, 5))
    for record in records:
        if record["timestamp"] < 300:
            record["retain_s"] = 30.0
    path = tmp_path / "early.jsonl"
    write_jsonl(path, records)
    result = invoke("compare", path, "--policies", "lru", "--capacity", "4096", "--fit-window", "0:360",
                    "--eval-window", "360:", "--hint-max-fraction", "0.5", "-o", tmp_path / "out", "-j", "1")
    assert result.exit_code == 0, result.output
    assert "--hint-max-fraction: no evaluated request carries a hint" in one_line(result.stderr)


def test_tool_call_tokens_beyond_the_models_vocabulary_are_refused_naming_the_flag():
    """Qwen's 151657 given to a model of 32,000 ids: every response read as an end of turn, unsaid."""
    from kvprof.vllm.spec import KvPolicyConfigError, check_tool_call_tokens

    with pytest.raises(KvPolicyConfigError, match=r"tool_call_tokens \(--kv-tool-call-tokens\) 32000, 151657 "
                                                  r"beyond the model's vocabulary of 32000 token ids"):
        check_tool_call_tokens(frozenset({5, 32000, 151657}), 32000)
    check_tool_call_tokens(frozenset({5, 31999}), 32000)
    check_tool_call_tokens(frozenset({151657}), None)


def test_inspect_says_how_responses_ended_and_what_hints_the_trace_carries(tmp_path):
    """A recording made with --kv-tool-call-tokens, or a hinted trace, looked like any other in inspect: an
    operator could not see that no response was a tool call (the ids of another tokenizer) or that no hint came."""
    from tests.helpers import one_line

    path = _hinted_lines(tmp_path, '"retain_s": 5, "hint_tag": 3, "stop": "tool_use"')
    result = invoke("inspect", path)
    assert result.exit_code == 0, result.output
    shown = one_line(result.stdout)
    assert ("how responses ended (stop) not recorded 7, tool call 1, end of turn 0, other (length, abort, ...) 0"
            in shown)
    assert "client hints retain 1, release 0 (1 hint tag)" in shown
    summary = json.loads(invoke("inspect", path, "--json").stdout)
    assert summary["stops"] == {"unknown": 7, "tool_call": 1, "end_turn": 0, "other": 0}
    assert summary["hints"] == {"retain": 1, "release": 0, "tags": 1}
    plain = _hinted_lines(tmp_path, '"turn_note": 1', name="plain.jsonl")
    result = invoke("inspect", plain)
    assert "how responses ended" not in result.stdout and "client hints" not in result.stdout
    assert json.loads(invoke("inspect", plain, "--json").stdout)["hints"] is None


def test_a_hint_budget_below_one_block_is_warned_of_per_capacity(tmp_path):
    """--hint-max-fraction 1e-4 of 4,096 blocks is 0 blocks: every retention lapsed over budget, unsaid."""
    from tests.helpers import one_line

    path = _hinted_lines(tmp_path, '"retain_s": 5')
    result = invoke("compare", path, "--policies", "lru", "--capacity", "512,4096,20000", "--eval-window", "0:",
                    "-j", "1", "--hint-max-fraction", "1e-4", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert ("--hint-max-fraction 0.0001 holds no whole block at capacity 512, 4,096: no hint tag retains anything "
            "there") in one_line(result.stderr)
    result = invoke("compare", path, "--policies", "lru", "--capacity", "20000", "--eval-window", "0:",
                    "-j", "1", "--hint-max-fraction", "1e-4", "-o", tmp_path / "out2")
    assert result.exit_code == 0 and "holds no whole block" not in result.stderr


def test_a_hint_share_the_hp_file_lacks_is_shown_as_given():
    """--hint-share 0.90000000001 was refused as "not 0.9", a share the file lists."""
    from types import SimpleNamespace

    import numpy as np

    from kvprof.sim.config import SimulationError
    from kvprof.sim.hints import stop_hints

    trace = SimpleNamespace(finish=np.array([1, 2], dtype=np.int8))  # all stop_hints reads before the share
    hp = SimpleNamespace(retention=SimpleNamespace(shares=(0.5, 0.9, 0.99)))
    with pytest.raises(SimulationError, match=r"shares 0\.5, 0\.9, 0\.99, not 0\.90000000001$"):
        stop_hints(trace, hp, 0.90000000001)


@pytest.mark.parametrize("stop", [5, True, 1.5])
def test_a_clients_stop_tag_that_is_no_string_leaves_the_recording_readable(tmp_path, stop):
    """A client's vllm_xargs {"stop": 5} became the recording's stop field, which the reader refuses: one
    client's tag made every kvprof command on the server's recording stop at that line."""
    from kvprof.profiler.reader import read_trace
    from tests.test_recording import Clock, record, request

    t0 = 1_000_000.0
    reqs = [(request(t0 + 1, [1, 2], tags={"type": "text", "stop": stop}), t0 + 1.1, t0 + 2),
            (request(t0 + 3, [1, 2, 3], tags={"type": "text", "stop": "tool_use"}), t0 + 3.1, t0 + 4)]
    record(tmp_path / "rec", reqs, clock=Clock(t0))
    trace, _ = read_trace(tmp_path / "rec")
    assert trace.n_requests == 2
    assert trace.extra["stop"].tolist() == [None, "tool_use"]  # a string tag is still the client's word
