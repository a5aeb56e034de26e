"""A vLLM (OpenAI-compatible) server as replay talks to it: its cache's size, its model's context, a
test request, completions.

HTTP goes through one pooled :class:`httpx.Client` shared by the sending threads, streamed answers
through ``httpx-sse`` and ``/metrics`` through ``prometheus_client``'s parser. A number the server
reports is read as any number kvprof is given (:mod:`kvprof.limits`): ``num_gpu_blocks="²"`` or
``"0"`` is no capacity.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx
from httpx_sse import EventSource, SSEError, connect_sse
from prometheus_client.parser import text_string_to_metric_families

from kvprof.errors import KvprofError
from kvprof.limits import BLOCK_TOKENS, BLOCKS, TOKENS, Bound
from kvprof.recording import PROBE_TAG
from kvprof.replay.prompts import FIRST_TOKEN_ID
from kvprof.replay.response import (
    CONNECTION,
    TIMEOUT,
    RequestFailed,
    error_body_message,
    read_stream,
)

#: vLLM's CacheConfig gauge; its labels are the config's fields, as strings.
CACHE_INFO = "vllm:cache_config_info"
#: Most bytes read of one answer: a page (/metrics, /v1/models), an error's body, a completion's stream.
#: A server sending more is misbehaving, and reading on would only fill memory.
MAX_PAGE_BYTES = 16 << 20
MAX_ERROR_BYTES = 64 << 10
MAX_STREAM_BYTES = 16 << 20


class ServerUnreachable(KvprofError):
    """Nothing answers at the server's address (or it does not speak HTTP)."""


@dataclass(frozen=True)
class Answer:
    """What one completion measured: when it was sent and its first token came (``time.monotonic``), prompt and cached tokens."""

    sent_at: float
    first_token_at: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_at - self.sent_at


class Server:
    """One server, one model. Invariant: :meth:`complete` either returns an :class:`Answer` or raises
    :class:`RequestFailed` with the reason to record; the setup calls raise :class:`KvprofError`.
    """

    def __init__(self, url: str, model: str, *, timeout_s: float, max_connections: int):
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        try:
            self._client = httpx.Client(base_url=self.url, timeout=timeout_s,
                                        limits=httpx.Limits(max_connections=max_connections))
        except httpx.InvalidURL as exc:
            raise KvprofError(f"{url} is not a URL replay can use: {exc}") from None

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info) -> None:
        self._client.close()

    def cache_info(self) -> dict:
        """``num_gpu_blocks`` and ``block_size`` (None when not reported) of the server's KV cache.

        Read from the labels of the ``vllm:cache_config_info`` gauge on ``GET /metrics``, one series
        per engine; engines must agree, as a capacity stands for one cache.

        Raises
        ------
        ServerUnreachable
            Nothing answers at the URL.
        KvprofError
            No metrics, no gauge, no ``num_gpu_blocks`` in it, or engines that disagree.
        """
        where = f"{self.url}/metrics"
        text = self._get_text("/metrics")
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as exc:
            raise KvprofError(f"cannot parse {where}: {exc}") from None
        reported = {
            tuple(_label(sample.labels, key, bound, where) for key, bound in (("num_gpu_blocks", BLOCKS),
                                                                               ("block_size", BLOCK_TOKENS)))
            for family in families for sample in family.samples if sample.name == CACHE_INFO
        }
        if len(reported) > 1:
            raise KvprofError(f"the engines behind {where} report different caches (num_gpu_blocks, block_size): "
                              f"{', '.join(map(str, sorted(reported, key=str)))}")
        blocks, block_size = reported.pop() if reported else (None, None)
        if blocks is None:
            raise KvprofError(f"{where} reports no num_gpu_blocks in {CACHE_INFO}")
        return {"num_gpu_blocks": blocks, "block_size": block_size}

    def max_model_len(self) -> int | None:
        """The model's context length (prompt plus output tokens) from ``GET /v1/models``; None when the
        server does not say (another server than vLLM), which replay then cannot check before sending.

        Raises
        ------
        KvprofError
            A ``max_model_len`` that is not a whole number of tokens.
        """
        try:
            text = self._get_text("/v1/models")
            models = json.loads(text).get("data")
        except (KvprofError, ValueError, RecursionError, AttributeError):
            return None
        entry = next((m for m in models if type(m) is dict and m.get("id") == self.model), None) \
            if type(models) is list else None
        if entry is None or entry.get("max_model_len") is None:
            return None
        try:
            return TOKENS.check(entry["max_model_len"], "max_model_len")
        except ValueError as exc:
            raise KvprofError(f"{self.url}/v1/models: model {self.model!r}: {exc}") from None

    def probe(self, vocab_size: int) -> None:
        """Send one two-token request with the lowest and highest token id replay will use.

        Too short to fill a block, it changes no cache; it finds, before the first trace request,
        a wrong model name, a ``--vocab-size`` beyond the model's vocabulary and a server started
        without cached-token details.

        Raises
        ------
        KvprofError
            The server refused the request, could not be reached, or answered without what replay reads.
        """
        try:
            # tagged so that a server recording the replay (--kv-record) leaves it out of the trace
            self.complete([FIRST_TOKEN_ID, vocab_size - 1], max_tokens=1, workload={PROBE_TAG: 1})
        except RequestFailed as exc:
            hint = ""
            if "vocab" in str(exc).lower():
                hint = f"; --vocab-size {vocab_size} is more than the model's vocabulary: pass a smaller one"
            raise KvprofError(f"{self.url} refused a test request for model {self.model!r} with token ids "
                              f"{FIRST_TOKEN_ID} and {vocab_size - 1}: {exc}{hint}") from None

    def complete(self, prompt: list[int], *, max_tokens: int, workload: dict) -> Answer:
        """Stream one completion of ``prompt`` (token ids) tagged with ``workload`` (``vllm_xargs``); measure it.

        Raises
        ------
        RequestFailed
            Timeout (``timeout_s`` without progress: no byte, or no token while the server sends
            only keep-alive comments), connection failure, an HTTP error (with the server's
            message), or an answer :func:`~kvprof.replay.response.read_stream` cannot count.
        """
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if workload:
            body["vllm_xargs"] = workload
        progress = _Progress(self.timeout_s)
        try:
            # ASCII JSON (httpx's json= encodes UTF-8, which a lone surrogate of a trace's tag cannot take)
            with connect_sse(self._client, "POST", "/v1/completions", content=json.dumps(body).encode("ascii"),
                             headers={"Content-Type": "application/json"}) as source:
                response = source.response
                if response.status_code >= 400:
                    body = _read_at_most(response, MAX_ERROR_BYTES).decode("utf-8", "replace")
                    raise RequestFailed(f"HTTP {response.status_code}: {error_body_message(body)}",
                                        f"HTTP {response.status_code}")
                events = (event.data for event in EventSource(_Watched(response, progress)).iter_sse())
                prompt_tokens, cached = read_stream(events, progress.token, prompt_tokens=len(prompt),
                                                    max_tokens=max_tokens)
        except httpx.TimeoutException:
            raise RequestFailed("timeout", TIMEOUT) from None
        except httpx.ConnectError as exc:
            raise RequestFailed(f"cannot connect to {self.url}: {exc}", CONNECTION) from None
        except (httpx.HTTPError, SSEError, UnicodeDecodeError) as exc:
            raise RequestFailed(f"bad response: {type(exc).__name__}: {exc}") from None
        if progress.first_token_at is None:
            raise RequestFailed("bad response: no token was streamed")
        return Answer(sent_at=progress.sent_at, first_token_at=progress.first_token_at, prompt_tokens=prompt_tokens,
                      cached_tokens=cached)

    def _get_text(self, path: str) -> str:
        """The text of ``GET path``, at most :data:`MAX_PAGE_BYTES` of it (more is an error)."""
        where = f"{self.url}{path}"
        try:
            with self._client.stream("GET", path) as response:
                if response.status_code >= 400:
                    raise KvprofError(f"cannot read {where}: HTTP {response.status_code}")
                data = _read_at_most(response, MAX_PAGE_BYTES + 1)
                encoding = response.encoding or "utf-8"
        except (httpx.ConnectError, UnicodeError) as exc:  # UnicodeError: a host name no resolver takes
            raise ServerUnreachable(f"cannot reach the server at {self.url} ({exc}); is it running?") from None
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"no answer from {where}: {type(exc).__name__}: {exc}") from None
        if len(data) > MAX_PAGE_BYTES:
            raise KvprofError(f"{where} sent more than {MAX_PAGE_BYTES:,} bytes; no server's page is so long")
        return data.decode(encoding, "replace")


def _read_at_most(response: httpx.Response, limit: int) -> bytes:
    """The first ``limit`` bytes of a streamed response's body (fewer if it ends sooner)."""
    data = bytearray()
    for chunk in response.iter_bytes():
        data += chunk[: limit - len(data)]
        if len(data) >= limit:
            break
    return bytes(data)


class _Progress:
    """When a completion was sent and its tokens came; :meth:`check` fails it once ``timeout_s`` pass
    without a token (the first counted from sending)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.sent_at = self.last_at = time.monotonic()
        self.first_token_at: float | None = None

    def token(self) -> None:
        self.last_at = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = self.last_at

    def check(self) -> None:
        if time.monotonic() - self.last_at > self.timeout_s:
            raise RequestFailed(f"timeout: no token for {self.timeout_s:g} s (the server sent only keep-alives)",
                                TIMEOUT)


class _Watched:
    """What :class:`httpx_sse.EventSource` reads of a response (its headers, its text as it arrives),
    with the progress checked as each piece arrives (keep-alive comments are bytes, not progress)
    and the stream's length bounded."""

    def __init__(self, response: httpx.Response, progress: _Progress):
        self._response = response
        self._progress = progress
        self.headers = response.headers

    def iter_text(self):
        received = 0
        for text in self._response.iter_text():
            self._progress.check()
            received += len(text)
            if received > MAX_STREAM_BYTES:
                raise RequestFailed(f"bad response: a stream of more than {MAX_STREAM_BYTES:,} bytes")
            yield text


def _label(labels: dict, key: str, bound: Bound, where: str) -> int | None:
    """A label's whole number, None when absent or ``"None"`` (vLLM writes so before the value is known).

    Raises
    ------
    KvprofError
        A value that is not such a number (``"²"``, ``"0"``, one beyond 64 bits).
    """
    text = labels.get(key)
    if text is None or text == "None":
        return None
    try:
        return bound.parse(text, f"{key}")
    except ValueError as exc:
        raise KvprofError(f"{where} reports {CACHE_INFO} with {exc}") from None
