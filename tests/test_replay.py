"""``kvprof.replay`` parts that need no server: prompts, reading answers (fuzzed), the cost-model fit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprof.replay.calibrate import Calibration, calibrate
from kvprof.replay.prompts import FIRST_TOKEN_ID, ReplayRequest, prompt_tokens
from kvprof.replay.response import RequestFailed, read_stream, read_usage, server_message
from kvprof.replay.runner import RequestRecord
from tests.test_fuzz import json_values


def test_equal_hash_prefixes_are_equal_token_prefixes():
    a = ReplayRequest(1, 0.0, np.array([1, 2, 3]), 40, 4, {}).prompt(16, 500)
    b = ReplayRequest(2, 0.0, np.array([1, 2, 9]), 48, 4, {}).prompt(16, 500)
    assert a[:32] == b[:32] and a[32:40] != b[32:40] and len(a) == 40 and len(b) == 48
    assert prompt_tokens(np.array([5]), 16, 500) == prompt_tokens(np.array([5]), 16, 500)
    assert all(FIRST_TOKEN_ID <= t < 500 for t in a)
    assert ReplayRequest(3, 0.0, np.array([], dtype=np.int64), 0, 4, {}).prompt(16, 500) == [FIRST_TOKEN_ID]


def test_a_stream_gives_its_usage_and_marks_the_first_token():
    marks = []
    events = [json.dumps({"choices": []}), json.dumps({"choices": [{"text": "a"}]}), json.dumps({"choices": [{"text": "b"}]}),
              json.dumps({"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}),
              "[DONE]", "ignored after the end"]
    assert read_stream(events, lambda: marks.append(1)) == (40, 32) and marks == [1, 1]  # one call per token


@pytest.mark.parametrize("body, message", [
    ({"error": {"message": "m1", "code": 400}}, "m1"),
    ({"error": "m2"}, "m2"),
    ({"detail": "m3"}, "m3"),
    ({"object": "error", "message": "m4"}, "m4"),
    ([1, 2], "[1, 2]"),
])
def test_server_messages_in_their_usual_places(body, message):
    assert server_message(body) == message


def test_usage_without_details_names_the_server_flag():
    with pytest.raises(RequestFailed, match="--enable-prompt-tokens-details"):
        read_usage({"prompt_tokens": 3, "prompt_tokens_details": None})
    assert read_usage({"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}) == (3, 0)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(json_values.map(json.dumps) | st.text(max_size=20), max_size=4),
       usage=json_values)
def test_any_answer_is_counted_or_one_request_failed(events, usage):
    """Whatever a server streams, reading it gives token counts or RequestFailed, never another exception."""
    events = [*events, json.dumps({"choices": [], "usage": usage})]
    try:
        prompt, cached = read_stream(events, lambda: None)
    except RequestFailed:
        return
    assert 0 <= cached <= prompt


def _records(rate: float, overhead: float, uncached: list[int], queued: float = 0.0) -> list[RequestRecord]:
    return [RequestRecord(chat_id=i, arrival_s=float(i), prompt_tokens=n + 16, cached_tokens=16,
                          ttft_s=overhead + n / rate + (queued if i % 3 == 0 else 0.0), qttft_s=0.0)
            for i, n in enumerate(uncached)]


def test_calibration_follows_the_unqueued_requests():
    """A third of the requests queued 2 s behind others: the fit still finds the server's rate and overhead."""
    uncached = [int(n) for n in np.linspace(100, 4000, 60)]
    fitted = calibrate(_records(5000.0, 0.02, uncached, queued=2.0))
    assert isinstance(fitted, Calibration) and fitted.n_requests == 60
    assert fitted.prefill_tokens_per_s == pytest.approx(5000.0, rel=0.05)
    assert fitted.step_overhead_s == pytest.approx(0.02, abs=0.01)


@pytest.mark.parametrize("records, words", [
    (_records(5000.0, 0.02, [100] * 3), "too few"),
    (_records(5000.0, 0.02, [100] * 40), "too alike"),
    ([RequestRecord(i, 0.0, 100 * i + 1, 0, ttft_s=1.0 / i, qttft_s=0.0) for i in range(1, 40)], "do not grow"),
])
def test_calibration_says_why_it_cannot_fit(records, words):
    reason = calibrate(records)
    assert isinstance(reason, str) and words in reason
