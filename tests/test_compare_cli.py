"""``kvprof compare`` end to end: outputs, JSON, and exit codes and messages for bad input."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from kvprof.classes import ClassRule
from kvprof.models.hp import load_hp
from kvprof.profiler.synth import generate, write_jsonl
from tests.helpers import invoke, one_line


WINDOWS = ("--fit-window", "0:360", "--eval-window", "360:", "-j", "1")


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "a.jsonl"
    write_jsonl(path, generate("bailian-a", 0.2, 5))
    return path


@pytest.fixture(scope="module")
def fitted(small_trace, tmp_path_factory):
    """A comparison that fitted its own hp file; its output directory."""
    out = tmp_path_factory.mktemp("fitted")
    result = invoke("compare", small_trace, "--policies", "lru,wa,belady", "--capacity", "64,256", "-o", out, *WINDOWS)
    assert result.exit_code == 0, result.output
    return out, result


def test_compare_fits_hour_one_then_writes_table_results_and_plots(fitted):
    out, result = fitted
    for column in ("hit ratio", "vs lru", "belady gap closed", "QTTFT"):
        assert column in result.stdout
    document = json.loads((out / "results.json").read_text())
    assert document["complete"] is True
    assert {(r["policy"], r["capacity"]) for r in document["runs"]} == {
        (p, c) for p in ("lru", "wa", "belady") for c in (64, 256)
    }
    assert load_hp(out / "hp.json").provenance["window"][1] == 360
    assert document["inputs"]["trace"]["window"][0] == 360
    assert {p.name for p in out.glob("*.*")} >= {"hit_ratio.png", "hit_ratio.svg", "qttft.png", "qttft.svg"}


def test_json_output_with_given_hp_and_two_tiers(small_trace, fitted, tmp_path):
    hp_path = fitted[0] / "hp.json"
    result = invoke("compare", small_trace, "--config", hp_path, "--policies", "lru,wa", "--capacity", "64",
                    "--cpu-capacity", "512", "--json", "-o", tmp_path, *WINDOWS)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["config"]["cpu_capacity"] == 512
    assert all(r["hits_host"] > 0 for r in document["runs"])
    assert document["inputs"]["hp"] == {"path": str(hp_path)}


@pytest.mark.parametrize(
    "args, code, message",
    [
        (("--capacity", "0,64"), 2, "got '0' ("),
        (("--capacity", "many"), 2, "written in ASCII digits, got 'many'"),
        (("--policies", "lru,mru"), 2, "unknown policy 'mru'"),
        (("--capacity-schedule", "0:64,soon:32"), 2, "seconds:blocks"),
        (("--eval-window", "99999:"), 2, "holds no requests"),
        (("--block-size", "24"), 2, "24 tokens is not a multiple of the trace's 16-token blocks"),
        (("--fit-window", "5000:6000"), 1, "holds no requests"),
        (("--format", "csv"), 2, "'csv' is not one of"),
        (("--format", "mooncake"), 1, "line 1"),
    ],
)
def test_bad_input_exits_with_a_message(small_trace, tmp_path, args, code, message):
    base = dict(zip(WINDOWS[::2], WINDOWS[1::2]))
    base.update(dict(zip(args[::2], args[1::2])))
    result = invoke("compare", small_trace, "-o", tmp_path, *(x for kv in base.items() for x in kv))
    assert result.exit_code == code, result.output
    assert message in one_line(result.output)
    assert not (tmp_path / "results.json").exists()


def test_a_trace_shorter_than_the_default_windows_gets_windows_that_work(small_trace, tmp_path):
    """The default windows (fit the first hour, replay the rest) leave a short trace nothing to
    replay; the error suggests windows, and they run."""
    result = invoke("compare", small_trace, "--policies", "lru,wa", "--capacity", "64", "-o", tmp_path / "a")
    assert result.exit_code == 2
    suggested = re.search(r"--fit-window (\S+) --eval-window (\S+)", " ".join(result.output.split()))
    assert suggested, result.output
    result = invoke("compare", small_trace, "--policies", "lru,wa", "--capacity", "64", "--fit-window",
                    suggested[1], "--eval-window", suggested[2], "-o", tmp_path / "b")
    assert result.exit_code == 0, result.output


def test_trace_reading_options_as_in_fit(small_trace, fitted, tmp_path):
    """--skip-invalid reports what it skipped and goes on; --format and --trace-block-tokens
    reach the reader (a block size the trace's lengths contradict is refused with the line)."""
    lines = small_trace.read_text().splitlines()
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([lines[0], '{"timestamp": "soon"}', *lines[1:]]) + "\n")
    args = ("--config", fitted[0] / "hp.json", "--policies", "lru", "--capacity", "64", "--json", *WINDOWS)
    result = invoke("compare", broken, *args, "-o", tmp_path / "a")
    assert result.exit_code == 1 and "line 2" in result.stderr
    result = invoke("compare", broken, *args, "-o", tmp_path / "a", "--skip-invalid")
    assert result.exit_code == 0, result.output
    assert "skipped 1" in result.stderr
    assert json.loads(result.stdout)["inputs"]["trace"]["n_requests"] > 0
    args = ("--policies", "lru", "--capacity", "64", "--json", *WINDOWS, "-o", tmp_path / "b", "--format", "bailian")
    result = invoke("compare", small_trace, *args, "--trace-block-tokens", "8")
    assert result.exit_code == 1 and "line 1, field 'hash_ids'" in result.stderr
    result = invoke("compare", small_trace, *args, "--trace-block-tokens", "16")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["inputs"]["trace"]["block_size"] == 16


@pytest.mark.parametrize(
    "change, message",
    [
        ({"block_size": 32}, "fitted on 32-token blocks"),
        ({"class_rule": ClassRule(key="field", field="tenant")}, "'tenant' is not in the trace"),
    ],
)
def test_hp_file_that_does_not_fit_the_trace(small_trace, fitted, tmp_path, change, message):
    hp_path = tmp_path / "other.json"
    replace(load_hp(fitted[0] / "hp.json"), **change).save(hp_path)
    result = invoke("compare", small_trace, "--config", hp_path, "--capacity", "64", "-o", tmp_path, *WINDOWS)
    assert result.exit_code == 1, result.output
    assert message in one_line(result.output)


@pytest.mark.parametrize("failure", ["interrupted sweep", "empty evaluation window", "failed plot"])
def test_the_previous_outputs_stay_until_new_complete_ones_replace_them(small_trace, tmp_path, monkeypatch, failure):
    """A failed run leaves the directory as it was, whichever output failed."""
    old = {"results.json": '{"complete": true, "old": 1}', "hp.json": '{"old": 1}'}
    for name, text in old.items():
        (tmp_path / name).write_text(text)
    args = ["--policies", "lru,wa", "--capacity", "64", "-o", tmp_path, *WINDOWS]
    if failure == "interrupted sweep":
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr("kvprof.sim.sweep.run_sweep", interrupted)
    elif failure == "empty evaluation window":
        args += ["--eval-window", "99999:"]
    else:
        def broken(*args, **kwargs):
            raise RuntimeError("plotting failed")

        monkeypatch.setattr("kvprof.cli.plots.plot_results", broken)
    result = invoke("compare", small_trace, *args)
    assert result.exit_code != 0
    # The outputs of one run are replaced together or not at all: a failed plot keeps the old results too.
    assert {name: (tmp_path / name).read_text() for name in old} == old
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(old)  # no temporary file left


@pytest.mark.parametrize(
    "args, words",
    [
        (("--capacity", "99999999999999"), "blocks fill this machine's"),
        (("--capacity", "9223372036854775808"), "blocks fill this machine's"),
        (("--cpu-capacity", "99999999999999"), "more than this machine's"),
        (("--capacity-schedule", "0:99999999999999"), "more than this machine's"),
        (("-j", "0"), "must not be 0"),
        (("--seed", "-1"), "must be an integer from 0 to"),
        (("--prefill-rate", "nan"), "must be a finite number > 0 and <= 1e+12, written in ASCII digits"),
        (("--prefill-rate", "1e13"), "must be a finite number > 0 and <= 1e+12"),
        (("--step-overhead", "-1"), "must be a finite number from 0 to 1e+06"),
        (("--max-num-seqs", "0"), "must be an integer from 1 to 2147483647"),
        (("--limit", "0"), "must be an integer from 1"),
        (("--block-size", "0"), "must be an integer from 1 to 16777216"),
        (("--sample", "0"), "must be a finite number > 0 and <= 1"),
        (("--sample", "1.5"), "must be a finite number > 0 and <= 1"),
        (("--sample", "nan"), "must be a finite number > 0 and <= 1, written in ASCII digits"),
        (("--sample", "-inf"), "must be a finite number > 0 and <= 1, written in ASCII digits"),
    ],
)
def test_option_values_out_of_range_exit_2_before_reading_the_trace(tmp_path, args, words):
    missing = tmp_path / "no-trace.jsonl"  # never read: the options are refused first
    result = invoke("compare", missing, "-o", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert words in one_line(result.output) and "Traceback" not in result.output


def test_jobs_are_capped_at_the_runs_and_the_cores():
    from joblib import cpu_count

    from kvprof.sim.sweep import sweep_workers

    assert sweep_workers(32, 1) == 1 and sweep_workers(1000, 64) == min(64, cpu_count())
    assert sweep_workers(-1, 64) == cpu_count() and sweep_workers(-1000, 8) == 1


def test_a_dollar_in_the_trace_name_is_plain_text_in_the_plots(small_trace, tmp_path):
    trace = tmp_path / "price$_$.jsonl"
    trace.write_bytes(small_trace.read_bytes())
    result = invoke("compare", trace, "--policies", "lru", "--capacity", "64", "-o", tmp_path / "out", *WINDOWS)
    assert result.exit_code == 0, result.output
    assert {"results.json", "hit_ratio.svg", "qttft.png"} <= {p.name for p in (tmp_path / "out").iterdir()}
    assert "price$_$.jsonl" in (tmp_path / "out" / "hit_ratio.svg").read_text()


def test_cost_model_options_file_and_the_overload_mark(small_trace, tmp_path):
    """An overloaded modelled server is said once on stderr, marked in the table and in results.json;
    --cost reads replay's file and options override it."""
    base = ("--policies", "lru", "--capacity", "64", *WINDOWS)
    slow = invoke("compare", small_trace, *base, "--prefill-rate", "1000", "-o", tmp_path / "slow")
    assert slow.exit_code == 0, slow.output
    assert "overloaded" in slow.stdout and "warning: the modelled server is overloaded in 1 of 1 runs" in slow.stderr
    run = json.loads((tmp_path / "slow" / "results.json").read_text())["runs"][0]
    assert run["qttft_overloaded"] is True and run["offered_load"] > 1
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"schema": "kvprof.cost/1", "prefill_tokens_per_s": 1e6, "step_overhead_s": 0.01,
                                "provenance": {"source": "test"}}))
    fast = invoke("compare", small_trace, *base, "--cost", cost, "--max-batched-tokens", "4096", "--json",
                  "-o", tmp_path / "fast")
    assert fast.exit_code == 0, fast.output
    assert "overloaded" not in fast.stderr
    document = json.loads(fast.stdout)
    assert document["config"]["cost"] == {**document["config"]["cost"], "prefill_tokens_per_s": 1e6,
                                          "step_overhead_s": 0.01, "max_batched_tokens": 4096}
    assert document["runs"][0]["qttft_overloaded"] is False and document["runs"][0]["offered_load"] < 1
    # issue 14, item 26: with --cost given, the warning no longer tells to pass --cost FILE
    cost.write_text(json.dumps({"schema": "kvprof.cost/1", "prefill_tokens_per_s": 1000.0}))
    slow_file = invoke("compare", small_trace, *base, "--cost", cost, "-o", tmp_path / "slow-file")
    assert slow_file.exit_code == 0 and f"The server of {cost} is slower than this traffic" in one_line(slow_file.stderr)
    assert "--cost FILE" not in slow_file.stderr and "--cost FILE" in slow.stderr
    cost.write_text(json.dumps({"schema": "kvprof.cost/1", "prefill_tokens_per_s": "fast"}))
    bad = invoke("compare", small_trace, *base, "--cost", cost, "-o", tmp_path / "bad")
    assert bad.exit_code == 1 and f"{cost}, at prefill_tokens_per_s: must be a finite number" in bad.stderr


def test_engine_block_defaults_to_a_multiple_of_the_trace_block_and_says_so(tmp_path):
    """A Mooncake trace (512-token blocks) runs without --block-size; --limit takes the first requests."""
    rows = [{"timestamp": 100 * i, "input_length": 1024, "output_length": 4, "hash_ids": [i % 3, 10 + i]}
            for i in range(20)]
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = invoke("compare", trace, "--policies", "lru,belady", "--capacity", "4", "--eval-window", ":",
                    "--limit", "12", "-j", "1", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    title = " ".join(result.stdout.split())
    assert "12 requests, 512-token engine blocks (default: the smallest multiple of the trace's 512-token blocks >= 128)" in title
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert document["config"]["engine_block_size"] == 512 and document["inputs"]["limit"] == 12


def test_a_rate_scale_reaches_the_tuning_replays_too(small_trace, tmp_path):
    """compare without --config tunes wa on the fit window under the same rate scale as the sweep."""
    result = invoke("compare", small_trace, "--policies", "lru,wa", "--capacity", "64", "--rate-scale", "2",
                    "--json", "-o", tmp_path, *WINDOWS)
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["config"]["rate_scale"] == 2
    assert {run["policy"] for run in document["runs"]} == {"lru", "wa"}


def test_a_recordings_compare_says_where_qttft_comes_from_and_counts_blocks_as_a_live_run(tmp_path):
    """compare of a recording printed nan in every QTTFT cell under "QTTFT modelled at ..."; its
    capacity was num_gpu_blocks - 1 while the live run of the same server said num_gpu_blocks (issue 21)."""
    from kvprof.limits import usable_blocks
    from tests.test_recording import BS, START, Clock, record, request

    t0 = 1_000_000.0
    requests = []
    for i in range(40):
        r = request(t0 + 5 * i, [b"sys", f"q{i}".encode()], tags={"type": "api", "turn": 1})
        requests.append((r, t0 + 5 * i + 0.1, t0 + 5 * i + 1))
    record(tmp_path / "rec", requests, clock=Clock(t0))
    out = tmp_path / "cmp"
    result = invoke("compare", tmp_path / "rec", "--eval-window", "0:", "--policies", "lru,belady", "-o", out, "-j", "1")
    assert result.exit_code == 0, result.output
    text = one_line(result.stdout)
    assert "nan" not in text and "QTTFT modelled" not in text
    assert "QTTFT -: on recorded timing every policy keeps the server's own schedule" in text
    assert "capacity (usable blocks)" in text and "overloaded" not in one_line(result.stderr)
    document = json.loads((out / "results.json").read_text())
    assert {run["capacity"] for run in document["runs"]} == {usable_blocks(START["num_gpu_blocks"])} == {63}
    assert BS == document["config"]["engine_block_size"]
    shown = invoke("show", out / "results.json")
    assert shown.exit_code == 0 and "capacity (usable blocks)" in one_line(shown.stdout) and "63" in shown.stdout
