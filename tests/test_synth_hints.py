"""``kvprof synth --hints``: hints made from each session's true future, as accurate as asked."""

from __future__ import annotations

import numpy as np
import pytest

from kvprof.profiler.reader import read_trace
from tests.helpers import invoke, one_line


def _synth(tmp_path, name, *args):
    path = tmp_path / f"{name}.jsonl"
    result = invoke("synth", "-o", path, "--hours", "0.3", "--seed", "2", *args)
    assert result.exit_code == 0, result.output
    return read_trace(path)[0]


def _truth(trace):
    """Each request's gap to its session's next request (inf: none)."""
    from kvprof.models.sessions import next_request_rows

    following = next_request_rows(trace.chat_id, trace.parent_chat_id)
    gap = np.full(trace.n_requests, np.inf)
    gap[following >= 0] = trace.timestamp[following[following >= 0]] - trace.timestamp[following >= 0]
    return gap


def test_synth_hints_follow_the_sessions_future_as_accurately_as_asked(tmp_path):
    plain = _synth(tmp_path, "plain")
    perfect = _synth(tmp_path, "perfect", "--hints", "future")
    assert plain.hints is None
    np.testing.assert_array_equal(perfect.hash_ids, plain.hash_ids)  # the same requests
    np.testing.assert_array_equal(perfect.timestamp, plain.timestamp)
    gap, hints = _truth(perfect), perfect.hints
    continues = np.isfinite(gap)
    assert continues.any() and (~continues).any()
    np.testing.assert_array_equal(hints.release, ~continues)
    np.testing.assert_allclose(hints.retain_s[continues], np.maximum(gap[continues], 0.001), rtol=1e-9, atol=1e-6)
    np.testing.assert_array_equal(hints.tag, perfect.type_code)  # a tenant per request type
    from kvprof.sim.sample import chain_roots
    np.testing.assert_array_equal(hints.session.astype(np.int64), chain_roots(perfect))  # its conversation

    slow = _synth(tmp_path, "slow", "--hints", "future", "--hint-time-factor", "2")
    np.testing.assert_allclose(slow.hints.retain_s[continues], 2 * np.maximum(gap[continues], 0.001), rtol=1e-9)

    rough = _synth(tmp_path, "rough", "--hints", "future", "--hint-accuracy", "0.7")
    wrong = (rough.hints.retain_s > 0) != continues
    assert np.array_equal(rough.hints.release, rough.hints.retain_s == 0)  # every request says one or the other
    assert abs(wrong.mean() - 0.3) < 4 * np.sqrt(0.3 * 0.7 / perfect.n_requests)


def test_synth_adversarial_hints(tmp_path):
    everything = _synth(tmp_path, "all", "--hints", "retain-all", "--hint-retain-s", "120")
    assert (everything.hints.retain_s == 120).all() and not everything.hints.release.any()
    coin = _synth(tmp_path, "coin", "--hints", "random")
    retains = coin.hints.retain_s > 0
    assert np.array_equal(coin.hints.release, ~retains)
    assert abs(retains.mean() - 0.5) < 4 * np.sqrt(0.25 / coin.n_requests)


@pytest.mark.parametrize("args, option", [
    (("--hint-accuracy", "0.5"), "--hint-accuracy"),
    (("--hints", "random", "--hint-time-factor", "2"), "--hint-time-factor"),
    (("--hints", "future", "--hint-retain-s", "60"), "--hint-retain-s"),
    (("--hints", "maybe"), "--hints"),
    (("--hints", "future", "--hint-accuracy", "1.5"), "--hint-accuracy"),
])
def test_synth_hint_options_out_of_place_exit_2(tmp_path, args, option):
    result = invoke("synth", "-o", tmp_path / "t.jsonl", "--hours", "0.1", *args)
    assert result.exit_code == 2 and option in one_line(result.output)
    assert not (tmp_path / "t.jsonl").exists()
