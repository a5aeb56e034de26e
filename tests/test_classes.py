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


# --- names from trace text cannot collide with names kvprof derives (issue 14, items 4 and 5) -----------

from kvprof.classes import is_name_text, name_text  # noqa: E402
from kvprof.models.hp import DEFAULT_CLASS, REUSED_SUFFIX  # noqa: E402

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
ANY_TEXT = st.lists(st.characters(max_codepoint=0x10FFFF) | SURROGATES | st.sampled_from("%@<>,=\x00\x1b"),
                    max_size=12).map("".join) | \
    st.sampled_from(["text", "text@reused", "<default>", "all", "a,b=c", "50%", "%40", "%2540", "x<=3", "@", ""])


@given(a=ANY_TEXT, b=ANY_TEXT)
def test_name_text_is_one_to_one_and_holds_no_character_of_derived_names(a, b):
    named_a, named_b = name_text(a), name_text(b)
    assert (named_a == named_b) == (a == b or not a and not b)
    for named in (named_a, named_b):
        assert named is None or is_name_text(named) and named.encode("utf-8")  # no lone surrogate either


@given(value=ANY_TEXT, turn=st.integers(1, 20), key=st.sampled_from(["type_turn", "type", "field"]))
def test_no_value_names_the_default_a_reused_tier_or_the_no_value_class(value, turn, key):
    rule = ClassRule(key=key, field="f" if key == "field" else None)
    name = workload_class(rule, value, turn, value)
    if not value:
        assert name == SINGLE_CLASS
        return
    assert name not in (DEFAULT_CLASS, SINGLE_CLASS) and not name.endswith(REUSED_SUFFIX)
    assert is_name_text(name)


def test_the_classes_that_collided():
    """A type literally named text@reused replaced text's reused fit; <default> made an hp file fit wrote
    and its loader refused; all merged with the requests that have no type."""
    rule = ClassRule(key="type")
    assert workload_class(rule, "text@reused") == "text%40reused"
    assert workload_class(rule, "<default>") == "%3Cdefault%3E"
    assert workload_class(rule, "all") == "%61ll" != workload_class(rule, "") == SINGLE_CLASS
    assert workload_class(ClassRule(key="field", field="f"), value="%40") == "%2540"


def test_a_missing_field_value_is_no_value_as_live():
    """classify_trace named a request without the field 'None'; the live policy, with no value, 'all'."""
    trace = make_trace([(0.0, "text", 1, [1]), (1.0, "text", 1, [2]), (2.0, "text", 1, [3])])
    trace.extra["tenant"] = np.array(["a", None, "None"], dtype=object)
    codes, names = classify_trace(trace, ClassRule(key="field", field="tenant"))
    live = [workload_class(ClassRule(key="field", field="tenant"), value=v) for v in ("a", None, "None")]
    assert [names[c] for c in codes] == live == ["a", SINGLE_CLASS, "None"]
