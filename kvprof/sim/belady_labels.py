"""Belady's labels at every access, from the compiled replay: what a learned policy is trained on.

The label of access ``k`` (Hawkeye's OPT label, Jain & Lin, ISCA '16, at each access rather than
at each free) is 1 when the next access of the same block -- by a later request -- is a hit
under Belady, Belady having kept the block from ``k`` until then, and 0 when it is a miss or
there is none in the window (the block is not wanted again: cache-averse).

:func:`access_labels` replays Belady on the compiled engine (:func:`kvprof.core.engine.run`,
the replay :func:`~kvprof.sim.engine.simulate` runs, asked for each request's device hits) and
reads the labels off the hits: a request's hits are the first ``request_hits[r]`` blocks of its
chain (vLLM's longest-prefix lookup), so no Python runs per block. :func:`python_access_labels`
gets the same labels by driving the Python policy block by block (the reference the compiled
labels are tested against, and the cost the compiled one saves).
"""

from __future__ import annotations

import numpy as np

from kvprof.policy.belady import BeladyPolicy
from kvprof.profiler.reuse import next_access
from kvprof.sim.config import SimConfig, SimulationError
from kvprof.sim.engine import simulate
from kvprof.sim.oracles import AccessIndexed, BeladyRecorder
from kvprof.sim.workload import Workload


def _owner(workload: Workload) -> np.ndarray:
    return np.repeat(np.arange(workload.n_requests, dtype=np.int64), np.diff(workload.offsets))


def labels_from_hits(workload: Workload, hit: np.ndarray) -> np.ndarray:
    """Per access (int8, (m,)): 1 when the block's next access by a later request is a hit, else 0."""
    nxt = next_access(workload.block, _owner(workload))
    labels = np.zeros(nxt.shape[0], dtype=np.int8)
    labels[nxt >= 0] = hit[nxt[nxt >= 0]]
    return labels


def access_labels(workload: Workload, capacity: int, config: SimConfig = SimConfig()) -> np.ndarray:
    """Belady's label of every access of ``workload`` at ``capacity`` GPU blocks, compiled
    (:func:`belady_hits` read by :func:`labels_from_hits`)."""
    return labels_from_hits(workload, belady_hits(workload, capacity, config))


def belady_hits(workload: Workload, capacity: int, config: SimConfig = SimConfig()) -> np.ndarray:
    """Whether each access of ``workload`` hits under Belady at ``capacity`` GPU blocks (bool, (m,)), compiled.

    Raises
    ------
    SimulationError
        A CPU tier, a capacity schedule or a replay on recorded timing: the labels are those of
        one GPU tier on the timing model.
    """
    if config.cpu_capacity or config.capacity_schedule:
        raise SimulationError("Belady's labels are those of one GPU tier of a fixed capacity")
    if config.timing == "recorded" or (config.timing == "auto" and workload.timing is not None):
        raise SimulationError("Belady's labels replay the timing model (--timing model)")
    if (workload.engine_block_size, workload.rate_scale) != (config.engine_block_size, config.rate_scale):
        raise SimulationError("workload and config disagree on the engine block size or rate")
    from kvprof.core.engine import run  # numba is imported only when a compiled replay runs

    outcome = run(workload, BeladyPolicy(), None, config, [(0.0, capacity)], per_request=True)
    owner = _owner(workload)
    depth = np.arange(workload.n_accesses, dtype=np.int64) - workload.offsets[owner]
    return depth < outcome["request_hits"][owner]


def python_access_labels(workload: Workload, capacity: int, config: SimConfig = SimConfig()) -> np.ndarray:
    """:func:`access_labels` by the Python engine: Belady driven block by block, recording which
    accesses hit (:class:`~kvprof.sim.oracles.BeladyRecorder` on the access-indexed workload)."""
    recorder = BeladyRecorder(workload.next_use)
    simulate(AccessIndexed.of(workload), recorder, capacity, config, engine="python")
    return labels_from_hits(workload, recorder.hit)
