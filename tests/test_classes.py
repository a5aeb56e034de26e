import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvprof.classes import MAX_TURN_CAP, SINGLE_CLASS, ClassRule, workload_class
from kvprof.profiler.classes import classify_trace
from tests.helpers import make_trace


def test_type_turn_caps_turns():
    rule = ClassRule(turn_cap=5)
    assert [workload_class(rule, "text", t) for t in (1, 4, 5, 9)] == ["text_1", "text_4", "text_5+", "text_5+"]
    assert workload_class(ClassRule(turn_cap=2), "file", 2) == "file_2+"


def test_other_keys_and_untyped_requests():
    assert workload_class(ClassRule(key="type"), "image", 3) == "image"
    assert workload_class(ClassRule(key="none"), "image", 3) == SINGLE_CLASS
    assert workload_class(ClassRule(), "", 2) == SINGLE_CLASS
    assert workload_class(ClassRule(), None, None) == SINGLE_CLASS
    assert workload_class(ClassRule(key="field", field="tenant"), value=7) == "7"


@pytest.mark.parametrize("kwargs", [dict(key="bogus"), dict(turn_cap=0), dict(turn_cap=MAX_TURN_CAP + 1), dict(key="field"),
                                    dict(field="x"), dict(key="field", field="")])
def test_invalid_rules_are_refused(kwargs):
    with pytest.raises(ValueError):
        ClassRule(**kwargs)


def test_rule_round_trips_through_dict():
    for rule in (ClassRule(), ClassRule(key="type", turn_cap=3), ClassRule(key="field", field="tenant")):
        assert ClassRule.from_dict(rule.to_dict()) == rule


@given(
    st.lists(st.tuples(st.sampled_from(["text", "file", "image"]), st.integers(1, 12)), min_size=1, max_size=40),
    st.integers(1, 6),
    st.sampled_from(["type_turn", "type", "none"]),
)
def test_vectorised_classes_equal_the_pure_function(requests, cap, key):
    rule = ClassRule(key=key, turn_cap=cap)
    trace = make_trace([(float(i), ty, turn, [i]) for i, (ty, turn) in enumerate(requests)])
    codes, names = classify_trace(trace, rule)
    assert list(names) == sorted(set(names))
    assert [names[c] for c in codes] == [workload_class(rule, ty, turn) for ty, turn in requests]


def test_field_rule_uses_extra_column_and_reports_missing_field():
    trace = make_trace([(0.0, "a", 1, [1]), (1.0, "a", 1, [2])])
    with pytest.raises(ValueError, match="tenant"):
        classify_trace(trace, ClassRule(key="field", field="tenant"))
    trace.extra["tenant"] = np.array(["x", "y"], dtype=object)
    codes, names = classify_trace(trace, ClassRule(key="field", field="tenant"))
    assert [names[c] for c in codes] == ["x", "y"]


def test_the_largest_turn_cap_classifies_a_trace():
    """The published files' cap (no int32 turn reaches it) keeps every turn its own class."""
    trace = make_trace([(0.0, "text", 1, [1]), (1.0, "text", 7, [2]), (2.0, "text", MAX_TURN_CAP, [3])])
    codes, names = classify_trace(trace, ClassRule(turn_cap=MAX_TURN_CAP))
    assert [names[c] for c in codes] == ["text_1", "text_7", f"text_{MAX_TURN_CAP}+"]
