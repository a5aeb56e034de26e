"""``tune`` judges the fitted orders out of sample: ``wa``'s replays run on a file fitted before the replayed part."""

from __future__ import annotations

import pytest

from kvprof.profiler.fit import fit_trace
from kvprof.profiler.reader import read_trace
from kvprof.profiler.synth import generate, write_jsonl
from kvprof.sim import tune as tune_module
from kvprof.sim.config import SimConfig


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("tune") / "trace.jsonl"
    write_jsonl(path, generate("bailian-a", 0.1, 7))
    return read_trace(path)[0]


def tuned(trace, monkeypatch, **kwargs):
    """``tune`` of ``trace`` at two capacities, with the windows ``refit`` was given, the files it returned
    and the files ``wa``'s replays ran on."""
    windows, made, replayed_on = [], [], []

    def refit(window):
        windows.append(window)
        made.append(fit_trace(window))
        return made[-1]

    replay = tune_module._replay

    def logged(workload, hp, *args):
        replayed_on.append(hp)
        return replay(workload, hp, *args)

    monkeypatch.setattr(tune_module, "_replay", logged)
    hp = fit_trace(trace)
    out = tune_module.tune(hp, trace, [64, 512], SimConfig(engine_block_size=16), refit=refit, **kwargs)
    return hp, out, windows, made, replayed_on


def test_the_replays_run_on_a_file_fitted_on_the_window_before_the_replayed_part(trace, monkeypatch):
    hp, out, windows, made, replayed_on = tuned(trace, monkeypatch)
    end = trace.censor_time
    cut = end - (end - trace.first_arrival) * tune_module.REPLAYED_SHARE
    assert len(windows) == 1 and windows[0].window[1] == pytest.approx(cut)
    assert windows[0].n_requests and float(windows[0].timestamp[-1]) < cut
    assert replayed_on and all(judged is made[0] for judged in replayed_on)
    assert out.cell_names() == hp.cell_names() and out.classes == hp.classes  # the file written is the whole fit
    assert [entry["capacity"] for entry in out.tuning] == [64, 512]


def test_with_the_learned_candidate_the_replays_run_on_the_file_itself(trace, monkeypatch):
    """The predictor is trained for the file's cells, so its replays need that file."""
    hp, _, windows, _, replayed_on = tuned(trace, monkeypatch, learn=True)
    assert not windows and replayed_on and all(judged is hp for judged in replayed_on)
