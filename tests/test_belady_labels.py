"""Belady's labels at every access: the compiled labeller against the Python one and the free labeller."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings

from kvprof.profiler.fit import fit_trace
from kvprof.sim.belady_labels import access_labels, labels_from_hits, python_access_labels
from kvprof.sim.config import SimConfig, SimulationError
from kvprof.sim.engine import simulate
from kvprof.sim.learn import LabellingBelady
from kvprof.sim.oracles import AccessIndexed
from kvprof.sim.workload import prepare_workload
from tests.helpers import make_trace, synthetic
from tests.test_sim_engine import random_replays


def test_labels_on_a_hand_made_trace():
    # r0 [1, 2], r1 [1, 5], r2 [1, 2, 3]; a large cache keeps everything: r1 hits 1, r2 hits 1 and 2
    # (its last block, 3, is never looked up: vLLM recomputes a prompt's last token)
    trace = make_trace([(0.0, "a", 1, [1, 2]), (1.0, "a", 1, [1, 5]), (5.0, "a", 1, [1, 2, 3])])
    config = SimConfig(engine_block_size=16)
    workload = prepare_workload(trace, engine_block_size=16)
    hit = np.array([False, False, True, False, True, True, False])
    assert labels_from_hits(workload, hit).tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert access_labels(workload, 100, config).tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert python_access_labels(workload, 100, config).tolist() == [1, 1, 1, 0, 0, 0, 0]
    # with one block, r0's blocks are gone when r1 and r2 come: nothing is kept
    single = make_trace([(0.0, "a", 1, [1, 2]), (10.0, "a", 1, [3, 4]), (20.0, "a", 1, [1, 2, 5])])
    small = prepare_workload(single, engine_block_size=16)
    assert access_labels(small, 2, config).tolist() == python_access_labels(small, 2, config).tolist()


@settings(max_examples=60, deadline=None)
@given(random_replays())
def test_compiled_labels_equal_the_python_labeller(case):
    trace, capacity, config = case
    config = dataclasses.replace(config, cpu_capacity=0, capacity_schedule=())
    workload = prepare_workload(trace, engine_block_size=config.engine_block_size)
    assert access_labels(workload, capacity, config).tolist() == python_access_labels(workload, capacity,
                                                                                       config).tolist()


def test_labels_refuse_a_cpu_tier():
    workload = prepare_workload(make_trace([(0.0, "a", 1, [1, 2])]), engine_block_size=16)
    with pytest.raises(SimulationError, match="one GPU tier"):
        access_labels(workload, 4, SimConfig(engine_block_size=16, cpu_capacity=4))


class _FreeLabeller(LabellingBelady):
    """The free labeller of kvprof.sim.learn on an access-indexed workload: records the access
    each free follows."""

    def __init__(self, next_use, n_cells, n_tiers):
        super().__init__(n_cells, n_tiers)
        self.future_use = next_use.tolist()
        self.latest = {}
        self.free_access = []

    def access(self, block, now, workload=0, depth=0, *, hit=False, next_use=math.inf, content=None):
        self.latest[block] = int(next_use)
        super().access(block, now, workload, depth, hit=hit, next_use=self.future_use[int(next_use)], content=content)

    def free(self, blocks, now):
        blocks = list(blocks)
        self.free_access += [self.latest[block] for block in blocks]
        super().free(blocks, now)


def test_access_labels_agree_with_the_free_labeller_where_it_resolves(tmp_path):
    _, trace = synthetic(tmp_path, hours=0.2, seed=3)
    hp = fit_trace(trace)
    config = SimConfig(engine_block_size=128)
    workload = prepare_workload(trace, hp, 128)
    for capacity in (64, 512):
        labels = access_labels(workload, capacity, config)
        free = _FreeLabeller(workload.next_use, len(hp.cell_names()), 4)
        simulate(AccessIndexed.of(workload), free, capacity, config, engine="python")
        resolved = np.asarray(free.labels) >= 0
        mine = labels[np.asarray(free.free_access)[resolved]]
        theirs = np.asarray(free.labels)[resolved]
        assert resolved.sum() > 100 and 0 < theirs.mean() < 1
        assert (mine == theirs).mean() >= 0.99, (capacity, (mine == theirs).mean())
