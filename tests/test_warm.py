"""``kvprof warm``: what `vllm serve` runs, compiled (or found in the cache) for every live policy."""

from __future__ import annotations

from kvprof import registry
from kvprof.vllm import warmup
from tests.helpers import invoke, one_line


def test_warm_compiles_what_a_server_runs_under_every_live_policy(monkeypatch):
    monkeypatch.setattr(warmup, "_WARMED", set())  # as a fresh process: every policy warmed by the command
    result = invoke("warm", "--serving-only")
    assert result.exit_code == 0, result.output
    text = one_line(result.output)
    assert "the fit" in text and "replays of" not in text
    names = [registration.name for registration in registry.live()]
    for name in names:
        assert f"vllm serve under {name} " in text
    assert {key[0] for key in warmup._WARMED} == set(names)
    assert "compiled into" in text


def test_warm_refuses_a_cache_directory_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    result = invoke("warm", "--cache-dir", path)
    assert result.exit_code == 2 and "not a directory" in one_line(result.output)
