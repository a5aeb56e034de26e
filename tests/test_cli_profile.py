"""The offline commands end to end: synth -> inspect -> fit -> show, exit codes and messages."""

import json

import pytest
from kvprof.models.hp import load_hp
from kvprof.profiler.synth import generate, planted, write_jsonl
from tests.helpers import invoke

GOOD = {
    "chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 40, "output_length": 5,
    "type": "text", "turn": 1, "hash_ids": [1, 2, 3],
}


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "a.jsonl"
    write_jsonl(path, generate("bailian-a", 0.1, 3))
    return path


def test_synth_inspect_fit_show_round_trip(small_trace, tmp_path):
    result = invoke("inspect", small_trace, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["requests"] > 1000 and 0 < summary["ideal_hit_ratio"] < 1
    assert set(summary["types"]) <= {"text", "search", "image", "file"}

    hp_path = tmp_path / "hp.json"
    result = invoke("fit", small_trace, "-o", hp_path, "--window", "0:360", "--horizon", "30")
    assert result.exit_code == 0, result.output
    hp = load_hp(hp_path)
    assert hp.horizon == 30 and hp.provenance["n_requests"] == summary["requests"]
    assert "text_1" in hp.classes and all(0 <= c.p <= 1 and c.lam >= 0 for c in hp.classes.values())

    result = invoke("show", hp_path)
    assert result.exit_code == 0 and "text_1" in result.stdout
    result = invoke("show", hp_path, "--json")
    assert json.loads(result.stdout)["schema"] == "kvprof.hp/6"


def test_fit_recovers_planted_parameters_censored_and_naive(tmp_path):
    truth = {"chat": (0.6, 1 / 40), "doc": (0.3, 1 / 150)}
    path = tmp_path / "planted.jsonl"
    write_jsonl(path, planted(truth, hours=1.0, seed=1))
    hp_path = tmp_path / "hp.json"
    result = invoke("fit", path, "-o", hp_path, "--class-key", "type", "--min-gap", "0", "--json")
    assert result.exit_code == 0, result.output
    hp = load_hp(hp_path)
    for name, (p, lam) in truth.items():
        fitted = hp.classes[name]
        assert fitted.p == pytest.approx(p, rel=0.10), name
        assert fitted.lam == pytest.approx(lam, rel=0.10), name
        # The published profiler's estimates sit beside the censored fit, visibly biased.
        assert fitted.naive["p"] < fitted.p
        assert fitted.naive["lambda"] > fitted.lam


def write_lines(path, lines):
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return path


BAD_INPUTS = {
    "malformed json": (["{\"chat_id\": 1,\n"], 1, None),
    "missing field": ([{k: v for k, v in GOOD.items() if k != "input_length"}], 1, "input_length"),
    "wrong type": ([dict(GOOD, timestamp="soon")], 1, "timestamp"),
    "negative number": ([dict(GOOD, output_length=-3)], 1, "output_length"),
    "nan": (['{"chat_id": 1, "parent_chat_id": -1, "timestamp": NaN, "input_length": 40, "output_length": 5, '
             '"type": "text", "turn": 1, "hash_ids": [1, 2, 3]}\n'], 1, "timestamp"),
    "time backwards": ([GOOD, dict(GOOD, chat_id=2, timestamp=-5.0)], 2, "timestamp"),
    "hash length": ([dict(GOOD, input_length=100)], 1, "hash_ids"),
    "unknown parent": ([GOOD, dict(GOOD, chat_id=2, parent_chat_id=99, turn=2, timestamp=1.0)], 2, "parent_chat_id"),
}


@pytest.mark.parametrize("command", ["fit", "inspect"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_trace_exits_1_naming_line_and_field(tmp_path, command, case):
    lines, line_no, field = BAD_INPUTS[case]
    path = write_lines(tmp_path / "bad.jsonl", lines)
    extra = ["-o", tmp_path / "hp.json"] if command == "fit" else []
    result = invoke(command, path, *extra)
    assert result.exit_code == 1, result.output
    assert "bad.jsonl" in result.stderr and f"line {line_no}" in result.stderr
    if field:
        assert field in result.stderr
    assert not (tmp_path / "hp.json").exists(), "no output may be written for bad input"


def test_empty_file_and_empty_window_exit_1(tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", [])
    result = invoke("inspect", empty)
    assert result.exit_code == 1 and "empty.jsonl" in result.stderr
    one = write_lines(tmp_path / "one.jsonl", [GOOD])
    result = invoke("fit", one, "-o", tmp_path / "hp.json", "--window", "100:200")
    assert result.exit_code == 1 and "window" in result.stderr


def test_skip_invalid_reports_what_it_skipped(tmp_path):
    path = write_lines(tmp_path / "mixed.jsonl", [GOOD, dict(GOOD, chat_id=2, timestamp=1.0, output_length=-1)])
    result = invoke("inspect", path, "--skip-invalid", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"] == 1
    assert "skipped 1" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["fit", "{trace}", "-o", "{out}", "--window", "10:5"],
        ["fit", "{trace}", "-o", "{out}", "--window", "abc"],
        ["fit", "{trace}", "-o", "{out}", "--class-key", "bogus"],
        ["fit", "{trace}", "-o", "{out}", "--horizon", "0"],
        ["fit", "{trace}", "-o", "{out}", "--format", "csv"],
        ["synth", "-o", "{out}", "--preset", "nope"],
        ["fit", "{trace}", "-o", "{out}", "--horizon", "inf"],
        ["fit", "{trace}", "-o", "{out}", "--min-gap", "inf"],
        ["fit", "{trace}", "-o", "{out}", "--min-gap", "nan"],
        ["fit", "{trace}", "-o", "{out}", "--turn-cap", "2147483648"],
        ["synth", "-o", "{out}", "--hours", "inf"],
        ["synth", "-o", "{out}", "--seed", "-1"],
        ["fit", "{trace}"],
    ],
)
def test_usage_errors_exit_2(tmp_path, args):
    trace = write_lines(tmp_path / "t.jsonl", [GOOD])
    filled = [a.format(trace=trace, out=tmp_path / "out.json") for a in args]
    result = invoke(*filled)
    assert result.exit_code == 2, result.output


def test_show_rejects_bad_hp_file_with_exit_1(tmp_path):
    path = tmp_path / "hp.json"
    path.write_text(json.dumps({"schema": "kvprof.hp/9"}))
    result = invoke("show", path)
    assert result.exit_code == 1 and "hp.json" in result.stderr and "kvprof.hp/9" in result.stderr


def test_show_accepts_the_published_format(tmp_path):
    path = tmp_path / "published.json"
    path.write_text(json.dumps({"a": {"text_1": 0.02, "file_1": 0.005}, "p": {"text_1": 0.4, "file_1": 0.2}}))
    result = invoke("show", path)
    assert result.exit_code == 0, result.output
    assert "text_1" in result.stdout and "published" in result.stdout


def test_the_fitted_and_the_tuned_horizon_are_named_apart(small_trace, tmp_path):
    """fit and show printed 60 s, the tuning table and the server 15 s, each as "horizon" (issue 21)."""
    hp_path = tmp_path / "hp.json"
    result = invoke("fit", small_trace, "-o", hp_path, "--window", "0:360", "--capacity", "256")
    assert result.exit_code == 0, result.output
    hp = load_hp(hp_path)
    tuned = hp.tuning[0]["horizon_s"]
    named = f"fitted horizon {hp.horizon:g} s, wa's tuned horizon {tuned:g} s"
    assert named in " ".join(result.stderr.split())
    assert "wa's horizon (s)" in result.stdout
    shown = invoke("show", hp_path)
    assert shown.exit_code == 0 and named in " ".join(shown.stdout.split())


def test_fit_learned_says_why_it_learned_nothing(tmp_path):
    """One request: no frees for Belady to label, so nothing to learn; once printed "-" with no reason."""
    trace = tmp_path / "one.jsonl"
    write_lines(trace, [GOOD])
    result = invoke("fit", trace, "-o", tmp_path / "hp.json", "--capacity", "64", "--learned")
    assert result.exit_code == 0, result.output
    assert "nothing to learn" in " ".join(result.stdout.split())


@pytest.mark.parametrize("option", ["--class-field", "--cell-fields"])
@pytest.mark.parametrize("field", ["grown", "output_hash_ids"])
def test_a_recordings_list_fields_are_no_class_keys(tmp_path, option, field):
    path = tmp_path / "t.jsonl"
    write_lines(path, [({"chat_id": i, "parent_chat_id": -1, "timestamp": float(i), "input_length": 32,
                                   "output_length": 4, "type": "chat", "turn": 1, "hash_ids": [i, i + 100],
                                   "grown": [i + 0.5], "output_hash_ids": [i + 200], "tenant": "a"})
                       for i in range(20)])
    result = invoke("fit", path, "-o", tmp_path / "hp.json", option, field)
    assert result.exit_code == 2 and "a list per request" in result.stderr and "tenant" in result.stderr, result.output
    assert not (tmp_path / "hp.json").exists()
