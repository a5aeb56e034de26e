"""Shares printed as percentages say which share they are: as many digits as it takes to tell the shares
listed together apart, never a share below 1 as 100 % nor one above 0 as 0 %, never "-0"."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.cli.output import percent
from kvprof.profiler.synth import generate, write_jsonl
from tests.helpers import invoke, one_line


@settings(max_examples=500, deadline=None)
@given(st.lists(st.floats(0.0, 1.0) | st.sampled_from([-0.0, 0.5, 0.9, 0.99, 0.995, 0.999, 0.9991, 0.9992, 1.0,
                                                        1e-9, 1 - 1e-9, 0.12345]), min_size=1, max_size=6))
def test_share_labels_tell_the_shares_apart_and_keep_them_off_the_bounds(shares):
    labels = [percent(share, shares) for share in shares]
    for share, label in zip(shares, labels):
        assert re.fullmatch(r"[0-9]+(\.[0-9]+)?(e-[0-9]+)?%", label), label  # no sign: never -0
        shown = float(label[:-1]) / 100
        assert (shown == 1.0) == (share == 1.0) and (shown == 0.0) == (share == 0.0), (share, label)
        assert abs(shown - share) <= 0.0005 + 1e-12, (share, label)  # to within the 0.1 % a decimal shows
    for a, label_a in zip(shares, labels):
        for b, label_b in zip(shares, labels):
            assert (label_a == label_b) == (a == b), (a, b, label_a, label_b)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    write_jsonl(path, generate("bailian-a", 0.1, 3))
    return path


@pytest.mark.parametrize("case, expected, refused", [
    ("synth -0", ["(0% right"], ["-0%"]),
    ("synth 0.995", ["(99.5% right"], ["100% right"]),
    ("fit 0.5,0.995", ["catching 99.5% of a session's returns"], ["catching 100%"]),
    ("show 0.9991,0.9992", ["99.91% of returns", "99.92% of returns"], ["99.9% of returns"]),
])
def test_the_commands_label_shares_by_the_rule(tmp_path, trace, case, expected, refused):
    command, value = case.split(" ")
    if command == "synth":
        result = invoke("synth", "--hours", "0.01", "--hints", "future", "--hint-accuracy", value, "-o", tmp_path / "t.jsonl")
    else:
        hp = tmp_path / "hp.json"
        result = invoke("fit", trace, "--window", "0:360", "--horizon", "30", "--retention-shares", value, "-o", hp)
        if command == "show":
            assert result.exit_code == 0, result.output
            result = invoke("show", hp)
    assert result.exit_code == 0, result.output
    text = one_line(result.output)
    assert all(words in text for words in expected), result.output
    assert not any(words in text for words in refused), result.output
