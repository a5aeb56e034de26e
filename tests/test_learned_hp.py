"""The learned predictor's chain-feature weights in the hp file: read strictly, optional for older version-3 files."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvprof.errors import HpFileError
from kvprof.models.hp import load_hp
from kvprof.models.learned import LOG_BINNED, N_LOG_BINS
from tests.test_hp import _learned_data, _with_learned, fitted_v2  # noqa: F401 (the fixture)


def test_chain_feature_weights_round_trip(fitted_v2, tmp_path):  # noqa: F811
    hp = _with_learned(fitted_v2)
    entry = hp.tuning[0]
    model = dataclasses.replace(entry["learned"], turn=(0.5,) * N_LOG_BINS, gap=(-0.25,) * N_LOG_BINS,
                                fanout=tuple(0.1 * i for i in range(N_LOG_BINS)))
    hp = dataclasses.replace(hp, tuning=({**entry, "learned": model},))
    hp.save(tmp_path / "hp.json")
    assert load_hp(tmp_path / "hp.json").tuning[0]["learned"] == model


def test_a_version_3_file_written_without_chain_features_loads_them_as_zero(fitted_v2, tmp_path):  # noqa: F811
    data = _learned_data(fitted_v2)
    for name in ("turn", "gap", "fanout"):
        del data["tuning"][0]["learned"][name]
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))
    model = load_hp(path).tuning[0]["learned"]
    assert model.turn == model.gap == model.fanout == (0.0,) * N_LOG_BINS
    assert model.depth == (0.25,) * N_LOG_BINS  # the rest as written


@pytest.mark.parametrize("name", [n for n in LOG_BINNED if n not in ("depth", "tail")])
@pytest.mark.parametrize("edit, where, words", [
    (lambda weights: weights.pop(), "", "must hold 12 weights"),
    (lambda weights: weights.__setitem__(3, "x"), "[3]", "finite number"),
    (lambda weights: weights.__setitem__(0, 1e9), "[0]", "from -1000 to 1000"),
])
def test_a_bad_chain_feature_weight_is_a_located_error(fitted_v2, tmp_path, name, edit, where, words):  # noqa: F811
    data = _learned_data(fitted_v2)
    edit(data["tuning"][0]["learned"][name])
    path = tmp_path / "hp.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HpFileError) as caught:
        load_hp(path)
    assert caught.value.where == f"tuning[0].learned.{name}{where}" and words in str(caught.value)
