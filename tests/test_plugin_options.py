"""The ``kv_policy`` options, however given (``vllm serve`` flags, ``--additional-config`` JSON,
``LLM(additional_config=...)``): one rule each, and a refusal that names the option and the flag.
Without vLLM: the flags are added to a plain argparse parser the way the plugin adds them to vLLM's."""

from __future__ import annotations

import argparse
import json
import os
import threading

import pytest

from kvprof.vllm.plugin import add_arguments, cli_values, merge_cli_into
from kvprof.vllm.spec import KvPolicyConfigError, PolicySpec

from tests.test_live import HP


@pytest.fixture
def hp_file(tmp_path):
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(HP))
    return str(path)


def spec_of(**entry) -> PolicySpec:
    return PolicySpec.from_additional_config({"kv_policy": entry})


def spec_of_flags(*argv: str) -> PolicySpec:
    """The spec ``vllm serve ... *argv`` configures: parsed, merged and validated as the plugin does."""
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return PolicySpec.from_additional_config(merge_cli_into(None, cli_values(parser.parse_args(argv))))


@pytest.mark.parametrize("argv,message", [
    (("--kv-record-rotate", "1e-300", "--kv-record", "{rec}"),
     "record_rotate_s (--kv-record-rotate) must be a finite number from 1 to 1e+09 seconds, got '1e-300'"),
    (("--kv-log-interval", "1e-300", "--kv-policy-config", "{hp}"),
     "log_interval_s (--kv-log-interval) must be 0 (off) or a finite number from 1 to 1e+09 seconds"),
    (("--kv-policy-reload-interval", "1e-300", "--kv-policy-config", "{hp}"),
     "reload_interval_s (--kv-policy-reload-interval) must be 0 (off) or a finite number from 0.01"),
    (("--kv-log-interval", "1" * 400, "--kv-policy-config", "{hp}"), "log_interval_s (--kv-log-interval) must be"),
    (("--kv-log-interval", "\uff16\uff10", "--kv-policy-config", "{hp}"), "got '\\uff16\\uff10'"),  # full-width 60
    (("--kv-log-interval", "nan", "--kv-policy-config", "{hp}"), "log_interval_s (--kv-log-interval) must be"),
    (("--kv-policy-mode", "", "--kv-policy-config", "{hp}"),
     "mode (--kv-policy-mode) must be one of enforce, shadow, got ''"),
    (("--kv-policy", "", "--kv-policy-config", "{hp}"), "policy (--kv-policy) must be one of lru, wa"),
    (("--kv-policy-config", "{hp}\0x",), "config (--kv-policy-config) must be a path (non-empty, no NUL byte)"),
    (("--kv-record", "rec\0",), "record (--kv-record) must be a path (non-empty, no NUL byte)"),
    (("--kv-record-rotate", "60",), "record_rotate_s (--kv-record-rotate) is about a recording: it needs --kv-record"),
    (("--kv-log-interval", "5",), "nothing to serve or record: pass --kv-policy-config PATH"),
    (("--kv-tool-call-tokens", "151657,x", "--kv-policy-config", "{hp}"),
     "tool_call_tokens (--kv-tool-call-tokens) must be token ids, comma-separated integers in [0, 2147483648), "
     "got '151657,x'"),
    (("--kv-tool-call-tokens", "-1", "--kv-policy-config", "{hp}"), "tool_call_tokens (--kv-tool-call-tokens) must be"),
    (("--kv-tool-call-tokens", "", "--kv-policy-config", "{hp}"), "tool_call_tokens (--kv-tool-call-tokens) must be"),
])
def test_a_bad_flag_is_refused_naming_it(argv, message, hp_file, tmp_path):
    argv = tuple(a.replace("{hp}", hp_file).replace("{rec}", str(tmp_path / "rec")) for a in argv)
    with pytest.raises(KvPolicyConfigError) as caught:
        spec_of_flags(*argv)
    assert message in str(caught.value)


@pytest.mark.parametrize("entry,message", [
    ({"mode": 0}, "mode (--kv-policy-mode) must be one of enforce, shadow, got 0"),
    ({"mode": {}}, "mode (--kv-policy-mode) must be one of enforce, shadow, got {}"),
    ({"mode": ""}, "mode (--kv-policy-mode) must be one of enforce, shadow, got ''"),
    ({"policy": False}, "policy (--kv-policy) must be one of lru, wa, wa-paper, lfu, s3fifo, arc, sieve, first-turn, "
                        "finish-reason, got False"),
    ({"policy": "nope"}, "unknown policy 'nope'; live policies: lru, wa, wa-paper, lfu, s3fifo, arc"),
    ({"log_interval_s": 10 ** 400}, "log_interval_s (--kv-log-interval) must be"),
    ({"log_interval_s": True}, "log_interval_s (--kv-log-interval) must be"),
    ({"reload_interval_s": -1}, "reload_interval_s (--kv-policy-reload-interval) must be"),
    ({"config": "hp\0.json"}, "config (--kv-policy-config) must be a path"),
    ({"config": ""}, "config (--kv-policy-config) must be a path"),
    ({"config": 3}, "config (--kv-policy-config) must be a path"),
    ({"record_rotate_s": 60}, "it needs --kv-record DIR"),
    ({}, "nothing to serve or record"),
    ({"tool_call_tokens": []}, "tool_call_tokens (--kv-tool-call-tokens) must be token ids"),
    ({"tool_call_tokens": [True]}, "tool_call_tokens (--kv-tool-call-tokens) must be token ids"),
    ({"tool_call_tokens": [2 ** 31]}, "tool_call_tokens (--kv-tool-call-tokens) must be token ids"),
    ({"tool_call_tokens": 5}, "tool_call_tokens (--kv-tool-call-tokens) must be token ids"),
])
def test_a_bad_additional_config_value_is_refused_naming_it(entry, message, hp_file):
    entry = {"config": hp_file, **entry} if "config" not in entry and entry and "record_rotate_s" not in entry \
        else entry
    with pytest.raises(KvPolicyConfigError) as caught:
        spec_of(**entry)
    assert message in str(caught.value)


def test_good_values_pass_by_flag_and_by_json_alike(hp_file, tmp_path):
    by_flags = spec_of_flags("--kv-policy-config", hp_file, "--kv-log-interval", "0", "--kv-policy-reload-interval",
                             "0.5", "--kv-record", str(tmp_path / "rec"), "--kv-record-rotate", "1")
    by_json = spec_of(config=hp_file, log_interval_s=0, reload_interval_s=0.5, record=str(tmp_path / "rec"),
                      record_rotate_s=1)
    for spec in (by_flags, by_json):
        assert (spec.policy, spec.mode, spec.log_interval_s, spec.reload_interval_s, spec.record_rotate_s) == \
            ("wa", "enforce", 0.0, 0.5, 1.0)
    defaults = spec_of(config=hp_file)
    assert (defaults.log_interval_s, defaults.reload_interval_s, defaults.record_rotate_s) == (300.0, 10.0, 3600.0)
    assert defaults.tool_call_tokens == frozenset()
    assert spec_of_flags("--kv-policy-config", hp_file, "--kv-tool-call-tokens", "151657, 7").tool_call_tokens == \
        spec_of(config=hp_file, tool_call_tokens=[7, 151657]).tool_call_tokens == frozenset({7, 151657})


def test_help_states_each_default_once():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "(default: None)" not in text and "(default 300; 0: never)." in text
    assert set(cli_values(parser.parse_args([])).values()) == {None}  # a flag not given is not in kv_policy


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    fifo = tmp_path / "hp.fifo"
    os.mkfifo(fifo)
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(_refusal(config=str(fifo))), daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "reading the hp file blocked on a FIFO with no writer"
    assert "it is a FIFO or pipe, not a regular file" in outcome[0]


def test_a_path_that_can_be_read_once_is_refused_clearly():
    """``--kv-policy-config <(cat hp.json)``: the file is read where vLLM starts, in each engine
    core and at each reload, which a pipe cannot give; the message says so (not "not valid JSON")."""
    read, write = os.pipe()
    try:
        os.write(write, json.dumps(HP).encode())
        os.close(write)
        message = _refusal(config=f"/proc/self/fd/{read}")
    finally:
        os.close(read)
    assert "it is a FIFO or pipe, not a regular file" in message and "write it to a file" in message


def test_a_directory_is_refused(tmp_path):
    assert "cannot use hp file" in _refusal(config=str(tmp_path))


def _refusal(**entry) -> str:
    try:
        spec_of(**entry)
    except KvPolicyConfigError as err:
        return str(err)
    return "accepted"


def test_the_record_key_flag_needs_a_recording_and_a_path(tmp_path):
    for argv, message in ((("--kv-record-key", str(tmp_path / "k")),
                           "record_key (--kv-record-key) is about a recording: it needs --kv-record DIR"),
                          (("--kv-record", str(tmp_path / "rec"), "--kv-record-key", "k\0"),
                           "record_key (--kv-record-key) must be a path (non-empty, no NUL byte)")):
        with pytest.raises(KvPolicyConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            spec_of_flags(*argv)
    by_flag = spec_of_flags("--kv-record", str(tmp_path / "rec"), "--kv-record-key", str(tmp_path / "k"))
    by_json = spec_of(record=str(tmp_path / "rec"), record_key=str(tmp_path / "k"))
    assert by_flag.record_key == by_json.record_key == str(tmp_path / "k")
    assert "keyed by the shared" in by_flag.describe()


def test_the_shared_record_key_is_made_at_start_up_and_handed_to_the_engine_cores(tmp_path, monkeypatch):
    from kvprof.vllm.plugin import share_record_key
    from kvprof.vllm.record import RECORD_KEY_ENV, shared_key

    # set, then deleted: monkeypatch then removes what share_record_key puts there (a bare delenv of an
    # unset variable restores nothing, and the key would leak into every later test's recorders)
    monkeypatch.setenv(RECORD_KEY_ENV, "unset")
    monkeypatch.delenv(RECORD_KEY_ENV)
    share_record_key(None)
    assert RECORD_KEY_ENV not in os.environ  # no key asked for: each start draws its own
    monkeypatch.chdir(tmp_path)
    share_record_key("fleet.key")  # relative to where vllm serve starts
    assert os.environ[RECORD_KEY_ENV] == str(tmp_path / "fleet.key") and len(shared_key("fleet.key")) == 32
    (tmp_path / "bad.key").write_text("not a key")
    with pytest.raises(KvPolicyConfigError, match=r"--kv-record-key .*bad\.key: is not a recording key"):
        share_record_key("bad.key")


def test_a_start_refused_for_its_recording_key_leaves_no_recording_directory(tmp_path, monkeypatch):
    from kvprof.vllm.plugin import check_recording
    from kvprof.vllm.record import RECORD_KEY_ENV

    monkeypatch.delenv(RECORD_KEY_ENV, raising=False)
    key = tmp_path / "key"
    key.write_text("not a key\n")
    spec = spec_of(policy="lru", record=str(tmp_path / "rec"), record_key=str(key))
    with pytest.raises(KvPolicyConfigError, match="is not a recording key"):
        check_recording(spec, 16)
    assert not (tmp_path / "rec").exists()


def test_the_hint_counterfactual_switch_is_given_or_not(hp_file):
    assert spec_of_flags("--kv-policy-config", hp_file, "--kv-hint-counterfactual").hint_counterfactual is True
    assert spec_of_flags("--kv-policy-config", hp_file).hint_counterfactual is False
    with pytest.raises(KvPolicyConfigError, match=r"hint_counterfactual \(--kv-hint-counterfactual\) replays the "
                                                  "policy in force"):
        spec_of_flags("--kv-policy-config", hp_file, "--kv-policy-mode", "shadow", "--kv-hint-counterfactual")
