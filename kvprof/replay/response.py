"""What a completion's answer means: the events of its stream, its usage, and a server's error messages.

Pure functions over decoded text, so every way a server (or something posing as one) can answer
is testable without a network. Anything a request cannot be counted from raises
:class:`RequestFailed` with the reason replay records; nothing else escapes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

#: The flag without which vLLM reports no cached tokens.
DETAILS_FLAG = "--enable-prompt-tokens-details"


class RequestFailed(Exception):
    """A request whose answer cannot be counted; ``str(exc)`` is the reason recorded for it."""


def read_stream(events: Iterable[str], on_first_token: Callable[[], None]) -> tuple[int, int]:
    """Prompt and cached tokens from the ``data`` of a streamed completion's events.

    ``on_first_token`` is called when the first event with a choice arrives (the first token).
    The stream ends at ``[DONE]`` or when ``events`` does.

    Raises
    ------
    RequestFailed
        An error event (the server's message), an event that is not a JSON object, a stream
        without usage, or usage that does not say how many prompt tokens were cached.
    """
    usage = None
    first = True
    for data in events:
        if data.strip() == "[DONE]":
            break
        chunk = _json(data)
        if type(chunk) is not dict:
            raise RequestFailed(f"bad response: an event that is not a JSON object: {_clip(data)}")
        if "error" in chunk:
            raise RequestFailed(f"server error: {server_message(chunk)}")
        if first and chunk.get("choices"):
            first = False
            on_first_token()
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
    if usage is None:
        raise RequestFailed("bad response: the stream ended without usage (stream_options.include_usage ignored?)")
    return read_usage(usage)


def read_usage(usage: object) -> tuple[int, int]:
    """``(prompt_tokens, cached_tokens)`` from an OpenAI usage object, checked.

    Raises
    ------
    RequestFailed
        Not an object, counts that are not non-negative integers, no cached-token details (a vLLM
        started without ``--enable-prompt-tokens-details``), or more cached than prompt tokens.
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
    cached = _count(details.get("cached_tokens", 0), "usage.prompt_tokens_details.cached_tokens")
    if cached > prompt:
        raise RequestFailed(f"bad response: {cached} cached tokens of a {prompt}-token prompt")
    return prompt, cached


def server_message(body: object) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}`` and its variants), else the body."""
    if type(body) is dict:
        error = body.get("error", body)
        if type(error) is dict:
            for key in ("message", "detail"):
                if type(error.get(key)) is str:
                    return error[key]
        if type(error) is str:
            return error
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
