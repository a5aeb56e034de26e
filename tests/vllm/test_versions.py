"""Which vLLM releases the plugin serves: 0.30 to 0.33; any other is refused at startup, naming the version.

The range check itself needs no vLLM; the last test pretends an unsupported release inside a real
``vllm serve`` (the plugin's version lookup patched in the API-server process) and checks that vLLM
stops before loading the model, with the version in the message.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from kvprof.vllm import plugin
from kvprof.vllm.spec import KvPolicyConfigError, check_version

from vllm_support import free_port, run_to_exit, serve_command, vllm_python


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0+cpu", "0.32.0+cpu", "0.33.0", "0.33.1.dev4+g0123abc"])
def test_supported_releases_pass(version):
    check_version(version)


@pytest.mark.parametrize("version", ["0.29.0", "0.29.1+cpu", "0.34.0", "1.0.0", "unknown"])
def test_other_releases_are_refused_naming_the_version(version):
    with pytest.raises(KvPolicyConfigError, match=rf"vLLM {re.escape(version)} is not supported"):
        check_version(version)


def test_plugin_checks_the_version_only_when_kvprof_is_configured(monkeypatch):
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.34.0")
    configured = SimpleNamespace(additional_config={"kv_policy": {"policy": "lru"}})
    with pytest.raises(KvPolicyConfigError, match=r"vLLM 0\.34\.0 is not supported .* 0\.30 to 0\.33"):
        plugin.validate_vllm_config(configured)
    assert plugin.validate_vllm_config(SimpleNamespace(additional_config={})) is None


PRETEND = """
import sys
import kvprof.vllm.plugin as plugin
plugin.vllm_version = lambda: "0.29.0"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serve_refuses_an_unsupported_release(vllm_venv, tiny_model, hp_file, tmp_path):
    cmd = serve_command(vllm_venv, tiny_model, free_port(), "--kv-policy-config", str(hp_file))
    rc, out = run_to_exit([vllm_python(vllm_venv), "-c", PRETEND, *cmd[1:]], timeout=240, cwd=tmp_path)
    assert rc not in (0, -1), out[-3000:]
    assert "kvprof kv_policy: vLLM 0.29.0 is not supported" in out, out[-3000:]
    assert "Application startup complete" not in out
