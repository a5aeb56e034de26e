"""``kvprof compare`` end to end: outputs, JSON, and exit codes and messages for bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvprof.models.hp import load_hp
from kvprof.profiler.classes import ClassRule
from kvprof.profiler.synth import generate, write_jsonl
from tests.helpers import invoke


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
        (("--capacity", "0,64"), 2, "capacities must be > 0"),
        (("--capacity", "many"), 2, "whole numbers"),
        (("--policies", "lru,mru"), 2, "unknown policy 'mru'"),
        (("--capacity-schedule", "0:64,soon:32"), 2, "seconds:blocks"),
        (("--eval-window", "99999:"), 1, "holds no requests"),
        (("--block-size", "24"), 1, "multiple of the trace's block size"),
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
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "results.json").exists()


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
    assert message in " ".join(result.output.split())


def test_a_failed_sweep_leaves_no_results_that_look_complete(small_trace, fitted, tmp_path, monkeypatch):
    (tmp_path / "results.json").write_text('{"complete": true}')

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvprof.sim.sweep.run_sweep", interrupted)
    result = invoke("compare", small_trace, "--config", fitted[0] / "hp.json", "--capacity", "64", "-o", tmp_path,
                    *WINDOWS)
    assert result.exit_code != 0
    assert not (tmp_path / "results.json").exists()
