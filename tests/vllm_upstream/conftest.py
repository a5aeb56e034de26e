"""vLLM's own block-pool and scheduler tests (vendored under ``upstream/``), run against a chosen block pool.

``KVPROF_UPSTREAM_POOL`` picks the pool every KV-cache coordinator builds, and the one the tests get when
they import ``BlockPool`` themselves:

* ``native`` -- vLLM's own ``BlockPool``, unchanged;
* ``lru`` / ``wa`` -- :class:`kvprof.vllm.block_pool.KvprofBlockPool` serving kvprof's policy of that name,
  compiled from the start (``native_first=False``; a server starts on vLLM's own order and hands over once
  the compiled core is loaded). ``wa`` reads the hp file of kvprof's vLLM tests (``tests/vllm/vllm_support.py``,
  ``HP_TEST``) with the block size these tests use.

Unset, nothing here is collected: the repository's own runs (``pytest tests --ignore=tests/vllm``, in an
environment without vLLM) pass over this folder. ``scripts/vllm_upstream.py`` runs it once per pool.

Everything runs offline. The vendored tests build ``ModelConfig`` objects of ``facebook/opt-125m`` (the
scheduler helpers), ``Qwen/Qwen3-0.6B`` (vLLM's default model) and ``Qwen/Qwen1.5-7B``, which read each
model's ``config.json`` through the Hugging Face hub; the session points the hub, offline, at a private cache
holding only those files (``hub_configs.json``; no weights, no tokenizer: the tests load neither), so nothing
is fetched. Models not there (the multimodal tests' ``llava-hf/llava-1.5-7b-hf``) fail to resolve, under
every pool alike.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

POOL_ENV = "KVPROF_UPSTREAM_POOL"
POOLS = ("native", "lru", "wa")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

#: The block size of the hp file ``wa`` serves: the vendored tests' usual one.
HP_BLOCK_SIZE = 16

#: The ``config.json`` of each model the vendored tests name (``hub_configs.json``: repository -> config), all
#: that ``ModelConfig`` reads of them.
HUB_CONFIGS = HERE / "hub_configs.json"

_POOL = os.environ.get(POOL_ENV)

if not _POOL:
    collect_ignore_glob = ["*"]
elif _POOL not in POOLS:
    raise pytest.UsageError(f"{POOL_ENV}={_POOL!r}: expected one of {', '.join(POOLS)}")

_WORK: Path | None = None


def _offline_hub(work: Path) -> None:
    """Point the Hugging Face hub, offline, at a cache holding the named models' ``config.json`` only."""
    hub = work / "hf" / "hub"
    for repo, config in json.loads(HUB_CONFIGS.read_text()).items():
        model = hub / ("models--" + repo.replace("/", "--"))
        (model / "snapshots" / "kvprof").mkdir(parents=True)
        (model / "snapshots" / "kvprof" / "config.json").write_text(json.dumps(config))
        (model / "refs").mkdir()
        (model / "refs" / "main").write_text("kvprof")
    os.environ["HF_HOME"] = str(work / "hf")
    os.environ["HF_HUB_CACHE"] = str(hub)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def _hp_test() -> dict:
    """``HP_TEST`` of kvprof's vLLM tests, read from its file (the folder is no package)."""
    spec = importlib.util.spec_from_file_location("_kvprof_vllm_support", REPO / "tests" / "vllm" / "vllm_support.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return dict(module.HP_TEST, block_size=HP_BLOCK_SIZE)


def policy_spec(name: str, work: Path):
    """The ``PolicySpec`` of kvprof's policy ``name`` (``wa`` from the tests' hp file)."""
    from kvprof.vllm.spec import PolicySpec

    if name == "wa":
        hp = work / "hp.json"
        hp.write_text(json.dumps(_hp_test()))
        return PolicySpec.from_additional_config({"kv_policy": {"config": str(hp), "policy": "wa"}})
    return PolicySpec.from_additional_config({"kv_policy": {"policy": name}})


def install_kvprof_pool(name: str, work: Path) -> type:
    """Rebind ``BlockPool`` where vLLM's coordinator and the vendored tests take it from, to kvprof's pool."""
    import vllm.v1.core.block_pool as block_pool_module
    import vllm.v1.core.kv_cache_coordinator as coordinator_module

    from kvprof.vllm.block_pool import KvprofBlockPool

    spec = policy_spec(name, work)

    class UpstreamKvprofBlockPool(KvprofBlockPool):
        """kvprof's pool with the session's policy, built wherever vLLM's code builds a ``BlockPool``."""

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("kvprof_spec", spec)
            kwargs.setdefault("native_first", False)
            super().__init__(*args, **kwargs)

    UpstreamKvprofBlockPool.kvprof_policy = name
    UpstreamKvprofBlockPool.kvprof_description = (
        f"{KvprofBlockPool.__module__}.KvprofBlockPool (policy {name}, native_first=False)"
    )
    for module in (block_pool_module, coordinator_module):
        module.BlockPool = UpstreamKvprofBlockPool
    # Compile (or load from NUMBA_CACHE_DIR) the policy's core now, not inside the first test.
    UpstreamKvprofBlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=HP_BLOCK_SIZE)
    return UpstreamKvprofBlockPool


def pytest_configure(config):
    global _WORK
    if not _POOL:
        return
    _WORK = Path(tempfile.mkdtemp(prefix="kvprof-upstream-"))
    _offline_hub(_WORK)
    if _POOL != "native":
        install_kvprof_pool(_POOL, _WORK)


def pytest_unconfigure(config):
    if _WORK is not None:
        shutil.rmtree(_WORK, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _kvprof_pool_property(record_testsuite_property):
    """Name the pool the coordinator builds in the JUnit report, so the runner can check it took effect."""
    import vllm.v1.core.kv_cache_coordinator as coordinator_module

    pool = coordinator_module.BlockPool
    record_testsuite_property("kvprof_upstream_pool", _POOL)
    record_testsuite_property(
        "kvprof_block_pool", getattr(pool, "kvprof_description", f"{pool.__module__}.{pool.__qualname__}")
    )
    # The vendored modules that build pools themselves took ``BlockPool`` by name at import: the same class.
    own = sorted(name for name, module in list(sys.modules.items())
                 if name.startswith("tests.v1.") and getattr(module, "BlockPool", None) is not None)
    stale = [name for name in own if sys.modules[name].BlockPool is not pool]
    assert not stale, f"{stale} imported another BlockPool than the session's {pool}"
    record_testsuite_property("kvprof_block_pool_in", ",".join(own))


# The two fixtures below are vLLM's own (tests/conftest.py of vLLM, Apache-2.0), which the vendored tests use.
@pytest.fixture()
def temporary_enable_log_propagate():
    import logging

    logger = logging.getLogger("vllm")
    logger.propagate = True
    yield
    logger.propagate = False


@pytest.fixture()
def caplog_vllm(temporary_enable_log_propagate, caplog):
    # To capture vllm log, we should enable propagate=True temporarily
    # because caplog depends on logs propagated to the root logger.
    yield caplog


def pytest_report_header(config):
    if not _POOL:
        return None
    import vllm.v1.core.kv_cache_coordinator as coordinator_module

    pool = coordinator_module.BlockPool
    built = getattr(pool, "kvprof_description", f"{pool.__module__}.{pool.__qualname__}")
    return f"{POOL_ENV}={_POOL}: the KV-cache coordinator builds {built}"
