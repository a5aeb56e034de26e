"""Sweeps on a real local Ray cluster (started here, two worker processes) give the local results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from kvprof.profiler.fit import fit_trace
from kvprof.sim.config import SimConfig
from kvprof.sim.sweep import run_sweep
from kvprof.sim.tune import tune
from tests.helpers import invoke, one_line, synthetic

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of two CPUs; ``--ray auto`` and ``ray="auto"`` find it (this process is its driver)."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    yield "auto"
    ray.shutdown()


@pytest.fixture(scope="module")
def bailian(tmp_path_factory):
    path, trace = synthetic(tmp_path_factory.mktemp("ray"), hours=0.15, seed=7)
    return path, trace, fit_trace(trace.time_window(None, 270.0))


def test_a_sweep_on_the_cluster_equals_the_local_one_number_for_number(cluster, bailian):
    _, trace, hp = bailian
    evaluated = trace.time_window(270.0, None)
    args = (evaluated, hp, ["lru", "wa", "belady"], [64, 256], SimConfig())
    on_ray = run_sweep(*args, ray=cluster)
    assert on_ray.runs == run_sweep(*args, n_jobs=1).runs
    tuned = tune(hp, trace.time_window(None, 270.0), [64, 256], SimConfig(), ray=cluster)
    assert tuned.tuning == tune(hp, trace.time_window(None, 270.0), [64, 256], SimConfig(), n_jobs=1).tuning


def test_compare_on_the_cluster_writes_the_local_results(cluster, bailian, tmp_path):
    path, _, _ = bailian
    common = ("--policies", "lru,wa", "--capacity", "128", "--fit-window", "0:270", "--eval-window", "270:")
    local = invoke("compare", path, *common, "-j", "1", "-o", tmp_path / "local")
    remote = invoke("compare", path, *common, "--ray", cluster, "-o", tmp_path / "ray")
    assert local.exit_code == 0 and remote.exit_code == 0, remote.output
    runs = [json.loads((tmp_path / out / "results.json").read_text())["runs"] for out in ("local", "ray")]
    assert runs[0] == runs[1]


def test_no_cluster_at_the_address_is_a_usage_error_before_any_work(tmp_path):
    code = "import sys; from kvprof.cli.app import main; sys.argv[0] = 'kvprof'; main()"
    done = subprocess.run([sys.executable, "-c", code, "compare", str(tmp_path / "never-read.jsonl"), "--ray",
                           "127.0.0.1:9", "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "no Ray cluster at '127.0.0.1:9'" in " ".join(done.stderr.split())


def test_a_sharded_fit_on_the_cluster_writes_the_local_file(cluster, bailian, tmp_path):
    from kvprof.profiler.shards import fit_sharded

    path, trace, _ = bailian
    whole = fit_trace(trace.time_window(0, 270), holdout=trace.time_window(270, 540))
    on_ray = fit_sharded([path], window=(0, 270), shard_accesses=30_000, ray=cluster, spill_dir=tmp_path)
    documents = [hp.to_dict() for hp in (whole, on_ray)]
    for document in documents:
        document["provenance"].pop("created")
    assert documents[0] == documents[1]


RUN_KVPROF = "import sys; from kvprof.cli.app import main; sys.argv[0] = 'kvprof'; main()"


@pytest.mark.parametrize("ray_address", ["127.0.0.1:1", "bogus.invalid:1"])
@pytest.mark.parametrize("verb", [("compare",), ("fit", "--sharded")])
def test_auto_with_a_ray_address_nothing_answers_at_is_a_usage_error_naming_it(tmp_path, ray_address, verb):
    done = subprocess.run([sys.executable, "-c", RUN_KVPROF, *verb, str(tmp_path / "never-read.jsonl"), "--ray",
                           "auto", "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_ADDRESS": ray_address})
    assert done.returncode == 2, done.stderr
    assert f"no Ray cluster at 'auto' (RAY_ADDRESS={ray_address!r})" in one_line(done.stderr)
    assert not (tmp_path / "out").exists()


def test_a_port_that_is_not_rays_fails_within_the_connect_timeout():
    """Something listens, but not Ray: Ray would retry for ever; kvprof gives up after its timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        code = ("from kvprof.parallel import connect_ray; from kvprof.errors import ParallelError\n"
                "try:\n    connect_ray('auto', timeout_s=3)\nexcept ParallelError as exc:\n    print(exc)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "RAY_ADDRESS": address})
    assert done.returncode == 0, done.stderr
    assert f"no Ray cluster at 'auto' (RAY_ADDRESS={address!r}) answered within 3 s" in done.stdout
