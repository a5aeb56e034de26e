"""What a completion's answer means: the events of its stream, its usage, and a server's error messages.

Pure functions over decoded text, so every way a server (or something posing as one) can answer
is testable without a network. Anything a request cannot be counted from raises
:class:`RequestFailed` with the reason replay records and its kind (what replay groups errors
by); nothing else escapes. A server's numbers are not taken on trust: usage must count the
prompt replay sent, and no more tokens may stream than were asked for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

#: The flag without which vLLM reports no cached tokens.
DETAILS_FLAG = "--enable-prompt-tokens-details"

#: Kinds of failure (``RequestFailed.kind``), what replay groups errors by.
TIMEOUT, CONNECTION, BAD_RESPONSE, SERVER_ERROR, WRONG_COUNT = (
    "timeout", "connection", "bad response", "server error", "wrong count")


class RequestFailed(Exception):
    """A request whose answer cannot be counted: ``str(exc)`` is the reason recorded for it, ``kind``
    its kind (``timeout``, ``connection``, ``bad response``, ``server error``, ``wrong count`` or
    ``HTTP <status>``), the same for every request that failed alike whatever its token counts."""

    def __init__(self, message: str, kind: str = BAD_RESPONSE):
        super().__init__(message)
        self.kind = kind


def read_stream(events: Iterable[str], on_token: Callable[[], None], *, prompt_tokens: int | None = None,
                max_tokens: int | None = None) -> tuple[int, int]:
    """Prompt and cached tokens from the ``data`` of a streamed completion's events.

    ``on_token`` is called for each event that carries a choice (the first call marks the first
    token). The stream ends at ``[DONE]`` or when ``events`` does.

    Parameters
    ----------
    prompt_tokens : int or None
        Tokens of the prompt sent; usage that counts another number is a ``wrong count``.
    max_tokens : int or None
        Tokens asked for; a stream of more token events (one more is allowed: vLLM may end with
        an empty one) is a ``bad response``.

    Raises
    ------
    RequestFailed
        An error event (the server's message), an event that is not a JSON object or whose
        ``choices`` is not a list of objects, too many tokens, a stream without usage, or usage
        that does not say how many prompt tokens were cached or disagrees with what was sent.
    """
    usage = None
    tokens = 0
    for data in events:
        if data.strip() == "[DONE]":
            break
        chunk = _json(data)
        if type(chunk) is not dict:
            raise RequestFailed(f"bad response: an event that is not a JSON object: {_clip(data)}")
        if "error" in chunk:
            raise RequestFailed(f"server error: {server_message(chunk)}", SERVER_ERROR)
        choices = chunk.get("choices", [])
        if type(choices) is not list or any(type(choice) is not dict for choice in choices):
            raise RequestFailed(f"bad response: choices is not a list of objects: {_show(choices)}")
        if choices:
            tokens += 1
            if max_tokens is not None and tokens > max_tokens + 1:
                raise RequestFailed(f"bad response: more than {max_tokens + 1} token events for max_tokens "
                                    f"{max_tokens}")
            on_token()
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
    if usage is None:
        raise RequestFailed("bad response: the stream ended without usage (stream_options.include_usage ignored?)")
    return read_usage(usage, prompt_tokens)


def read_usage(usage: object, sent: int | None = None) -> tuple[int, int]:
    """``(prompt_tokens, cached_tokens)`` from an OpenAI usage object, checked.

    Raises
    ------
    RequestFailed
        Not an object, counts that are not non-negative integers, no cached-token details (a vLLM
        started without ``--enable-prompt-tokens-details``: details missing, or without
        ``cached_tokens``), more cached than prompt tokens, or a prompt of another length than
        the ``sent`` one.
    """
    if type(usage) is not dict:
        raise RequestFailed(f"bad response: usage is not an object: {_show(usage)}")
    prompt = _count(usage.get("prompt_tokens"), "usage.prompt_tokens")
    details = usage.get("prompt_tokens_details")
    if details is None:
        raise RequestFailed(f"the server reports no cached tokens (prompt_tokens_details is missing): "
                            f"start vLLM with {DETAILS_FLAG}")
    if type(details) is not dict:
        raise RequestFailed(f"bad response: usage.prompt_tokens_details is not an object: {_show(details)}")
    if "cached_tokens" not in details:
        raise RequestFailed(f"the server reports no cached tokens (prompt_tokens_details has no cached_tokens): "
                            f"start vLLM with {DETAILS_FLAG}")
    cached = _count(details["cached_tokens"], "usage.prompt_tokens_details.cached_tokens")
    if sent is not None and prompt != sent:
        raise RequestFailed(f"wrong count: the server counts {prompt} prompt tokens of the {sent} sent", WRONG_COUNT)
    if cached > prompt:
        raise RequestFailed(f"wrong count: {cached} cached tokens of a {prompt}-token prompt", WRONG_COUNT)
    return prompt, cached


def server_message(body: object) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}`` and its variants), else the body."""
    if type(body) is dict:
        error = body.get("error", body)
        if type(error) is dict:
            for key in ("message", "detail"):
                if type(error.get(key)) is str:
                    return _clip(error[key], 400)
        if type(error) is str:
            return _clip(error, 400)
    return _clip(body) if isinstance(body, str) else _show(body)


def error_body_message(text: str) -> str:
    """The message of an HTTP error response's body (JSON or plain text)."""
    try:
        return server_message(json.loads(text))
    except (ValueError, RecursionError):
        return _clip(text.strip()) or "(no body)"


def _json(data: str):
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise RequestFailed(f"bad response: an event that is not JSON: {_clip(data)}") from None


def _count(value, where: str) -> int:
    if type(value) is not int or value < 0:
        raise RequestFailed(f"bad response: {where} must be a non-negative integer, got {_show(value)}")
    return value


def _show(value) -> str:
    """A decoded JSON value as (clipped) JSON text, for a message."""
    try:
        return _clip(json.dumps(value))
    except (ValueError, RecursionError):
        return _clip(repr(value))


def _clip(text: str, size: int = 120) -> str:
    return text if len(text) <= size else text[:size] + "..."
