"""A vLLM (OpenAI-compatible) server as replay talks to it: its cache's size, a test request, completions.

HTTP goes through one pooled :class:`httpx.Client` shared by the sending threads, streamed answers
through ``httpx-sse`` and ``/metrics`` through ``prometheus_client``'s parser.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from httpx_sse import SSEError, connect_sse
from prometheus_client.parser import text_string_to_metric_families

from kvprof.errors import KvprofError
from kvprof.replay.prompts import FIRST_TOKEN_ID
from kvprof.replay.response import RequestFailed, error_body_message, read_stream

#: vLLM's CacheConfig gauge; its labels are the config's fields, as strings.
CACHE_INFO = "vllm:cache_config_info"


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
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s,
                                    limits=httpx.Limits(max_connections=max_connections))

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
            tuple(_whole(sample.labels.get(key)) for key in ("num_gpu_blocks", "block_size"))
            for family in families for sample in family.samples if sample.name == CACHE_INFO
        }
        if len(reported) > 1:
            raise KvprofError(f"the engines behind {where} report different caches (num_gpu_blocks, block_size): "
                              f"{', '.join(map(str, sorted(reported, key=str)))}")
        blocks, block_size = reported.pop() if reported else (None, None)
        if blocks is None:
            raise KvprofError(f"{where} reports no num_gpu_blocks in {CACHE_INFO}")
        return {"num_gpu_blocks": blocks, "block_size": block_size}

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
            self.complete([FIRST_TOKEN_ID, vocab_size - 1], max_tokens=1, workload={})
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
            Timeout (``timeout_s`` without a byte), connection failure, an HTTP error (with the
            server's message), or an answer :func:`~kvprof.replay.response.read_stream` cannot count.
        """
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if workload:
            body["vllm_xargs"] = workload
        sent = time.monotonic()
        first_token: list[float] = []
        try:
            with connect_sse(self._client, "POST", "/v1/completions", json=body) as source:
                response = source.response
                if response.status_code >= 400:
                    response.read()
                    raise RequestFailed(f"HTTP {response.status_code}: {error_body_message(response.text)}")
                events = (event.data for event in source.iter_sse())
                prompt_tokens, cached = read_stream(events, lambda: first_token.append(time.monotonic()))
        except httpx.TimeoutException:
            raise RequestFailed("timeout") from None
        except httpx.ConnectError as exc:
            raise RequestFailed(f"cannot connect to {self.url}: {exc}") from None
        except (httpx.HTTPError, SSEError, UnicodeDecodeError) as exc:
            raise RequestFailed(f"bad response: {type(exc).__name__}: {exc}") from None
        if not first_token:
            raise RequestFailed("bad response: no token was streamed")
        return Answer(sent_at=sent, first_token_at=first_token[0], prompt_tokens=prompt_tokens, cached_tokens=cached)

    def _get_text(self, path: str) -> str:
        where = f"{self.url}{path}"
        try:
            response = self._client.get(path)
        except httpx.ConnectError as exc:
            raise ServerUnreachable(f"cannot reach the server at {self.url} ({exc}); is it running?") from None
        except httpx.HTTPError as exc:
            raise ServerUnreachable(f"no answer from {where}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            raise KvprofError(f"cannot read {where}: HTTP {response.status_code}")
        return response.text


def _whole(text: str | None) -> int | None:
    """A label's whole number (vLLM writes "None" before the value is known)."""
    return int(text) if text is not None and text.isdigit() else None
