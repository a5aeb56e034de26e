"""Where independent tasks run: joblib processes on this machine, or Ray tasks on a cluster.

The tasks (a sweep's replays, policy x capacity or capacity x horizon; a sharded fit's shards;
a fleet's configurations) are independent and read one shared input. :func:`run_tasks` runs
them with joblib's workers (``n_jobs``), or, given a Ray address, as Ray tasks: the shared input
is put once into Ray's object store, where its numpy columns are shared with every task on a
node without a copy, and each task receives a reference to it, not a pickled copy. Tasks are
deterministic, so both give the same results, number for number. Ray is optional (``pip install
'kvprof[ray]'``); nothing imports it unless asked to. This module sits below the simulator and
the profiler, which both run their tasks here.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from joblib import Parallel, cpu_count, delayed, effective_n_jobs

from kvprof.errors import ParallelError

#: ``progress(done, total)`` after each finished run.
Progress = Callable[[int, int], None]


def sweep_workers(n_jobs: int, n_runs: int) -> int:
    """Tasks (a sweep's replays) to run at once: joblib's reading of ``n_jobs``, capped at ``n_runs`` and
    the machine's cores.

    More workers than runs idle, and more than cores only compete for them (and each holds a
    process and its semaphores).

    Raises
    ------
    ParallelError
        ``n_jobs`` is 0.
    """
    if n_jobs == 0:
        raise ParallelError("the number of parallel replays must not be 0 (-1: every core)")
    return max(1, min(effective_n_jobs(n_jobs), cpu_count(), n_runs))


#: Seconds a cluster has to answer ``--ray``: Ray itself retries an address that does not answer
#: (a name that does not resolve, a port that is not Ray's) for minutes, or forever.
RAY_CONNECT_TIMEOUT_S = 30.0


def connect_ray(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S):
    """The ``ray`` module, connected to the cluster at ``address`` (``"auto"``: Ray's own rule,
    ``RAY_ADDRESS`` or the cluster running on this machine); already connected, as it is.

    Raises
    ------
    ParallelError
        Ray is not installed, or no cluster answers at ``address`` within ``timeout_s`` seconds.
    """
    try:
        import ray
    except ImportError:
        raise ParallelError("Ray is not installed here: pip install 'kvprof[ray]'") from None
    if not ray.is_initialized():
        where = _described(address)
        _check_reachable(_resolved(address), where)
        _init_within(ray, address, where, timeout_s)
    return ray


def _resolved(address: str) -> str:
    """The address Ray will try: ``RAY_ADDRESS`` for ``"auto"`` when it is set."""
    return (os.environ.get("RAY_ADDRESS") or address) if address == "auto" else address


def _described(address: str) -> str:
    resolved = _resolved(address)
    return repr(address) if resolved == address else f"{address!r} (RAY_ADDRESS={resolved!r})"


def _init_within(ray, address: str, where: str, timeout_s: float) -> None:
    """``ray.init`` in a daemon thread, waited for at most ``timeout_s``: a cluster that never
    answers leaves the thread behind (it dies with the process), not this command hanging. The
    wait is in short steps, so that an interrupt ends it at once."""
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            ray.init(address=address, logging_level="error", log_to_driver=False)
            outcome.append(None)
        except BaseException as exc:  # handed to the waiting thread
            outcome.append(exc)

    thread = threading.Thread(target=connect, name="ray-connect", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(0.1)
    if not outcome:
        raise ParallelError(f"no Ray cluster at {where} answered within {timeout_s:g} s (is it a Ray head "
                              f"node's address, host:port of its GCS, default port 6379?)")
    if isinstance(outcome[0], (ConnectionError, RuntimeError, ValueError)):
        raise ParallelError(f"no Ray cluster at {where}: {outcome[0]}") from None
    if outcome[0] is not None:
        raise outcome[0]


def _check_reachable(address: str, where: str) -> None:
    """Refuse a ``host:port`` nothing listens on at once (Ray itself keeps retrying for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not (host and port.isdigit()):
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        raise ParallelError(f"no Ray cluster at {where}: {exc.strerror or exc}") from None


def run_tasks(function: Callable, shared, tasks: Sequence[tuple], *, n_jobs: int = 1, ray: str | None = None,
              progress: Progress | None = None) -> list:
    """``[function(shared, *task) for task in tasks]``, run in parallel, in the order of ``tasks``.

    Parameters
    ----------
    function : callable
        A module-level function (Ray and joblib's processes import it by name).
    shared
        What every task reads (a sweep's workload); sent once to each joblib worker, or put once into
        Ray's object store.
    tasks : sequence of tuple
        Each task's own arguments; they run in this order, slowest first is the caller's choice.
    n_jobs : int
        joblib workers (:func:`sweep_workers`); ignored on Ray, whose cluster decides.
    ray : str or None
        A Ray cluster's address (``"auto"``: :func:`connect_ray`); None runs on this machine.
    progress : callable or None
        ``progress(done, total)`` after each finished task.
    """
    outputs = _ray_outputs(function, shared, tasks, ray) if ray is not None else _joblib_outputs(
        function, shared, tasks, n_jobs)
    results = [None] * len(tasks)
    for done, (index, result) in enumerate(outputs, start=1):
        results[index] = result
        if progress:
            progress(done, len(tasks))
    return results


def _indexed(function: Callable, index: int, shared, task: tuple):
    return index, function(shared, *task)


def _joblib_outputs(function, shared, tasks, n_jobs) -> Iterator[tuple[int, object]]:
    parallel = Parallel(n_jobs=sweep_workers(n_jobs, len(tasks)), return_as="generator_unordered")
    return parallel(delayed(_indexed)(function, i, shared, task) for i, task in enumerate(tasks))


def _ray_outputs(function, shared, tasks, address) -> Iterator[tuple[int, object]]:
    ray = connect_ray(address)
    remote = ray.remote(_indexed)
    reference = ray.put(shared)
    pending = [remote.remote(function, i, reference, task) for i, task in enumerate(tasks)]
    while pending:
        finished, pending = ray.wait(pending, num_returns=1)
        yield ray.get(finished[0])
