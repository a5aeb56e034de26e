"""Sending a trace on schedule: arrival times honoured (scaled), bounded concurrency, one record per request.

Requests leave at ``arrival / rate_scale`` seconds after the start, at most ``max_concurrency``
in flight; waiting for a free slot counts in QTTFT, which runs from the scheduled arrival to the
first token. Failures are counted and recorded, never retried. Every request sent has exactly
one record, in arrival order: each worker's result is collected from its future.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvprof.replay.prompts import ReplayRequest
from kvprof.replay.response import RequestFailed
from kvprof.replay.server import Server

#: ``progress(done, total)`` after each finished request (called from the sending threads).
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class RequestRecord:
    """One line of ``requests.jsonl``. Invariant: ``error`` is None exactly when the token counts and times are set."""

    chat_id: int
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int | None = None
    ttft_s: float | None = None
    qttft_s: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class Pacing:
    """How requests leave: ``rate_scale`` divides arrival times; at most ``max_concurrency`` in flight."""

    rate_scale: float = 1.0
    max_concurrency: int = 8
    max_output_tokens: int = 16
    block_tokens: int = 16
    vocab_size: int = 1000


def send_all(server: Server, requests: Sequence[ReplayRequest], pacing: Pacing,
             progress: Progress | None = None) -> list[RequestRecord]:
    """Send every request at its scheduled time; one record each, in arrival order."""
    slots = threading.Semaphore(pacing.max_concurrency)
    done = 0
    done_lock = threading.Lock()

    def work(request: ReplayRequest, prompt: list[int], due: float) -> RequestRecord:
        nonlocal done
        try:
            return _send(server, request, prompt, due, pacing.max_output_tokens)
        finally:
            slots.release()
            with done_lock:
                done += 1
                if progress:
                    progress(done, len(requests))

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=pacing.max_concurrency) as pool:
        futures = []
        for request in requests:
            prompt = request.prompt(pacing.block_tokens, pacing.vocab_size)
            due = start + request.arrival_s / pacing.rate_scale
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            slots.acquire()
            futures.append(pool.submit(work, request, prompt, due))
        return [future.result() for future in futures]


def _send(server: Server, request: ReplayRequest, prompt: list[int], due: float, max_output_tokens: int) -> RequestRecord:
    base = {"chat_id": request.chat_id, "arrival_s": request.arrival_s, "prompt_tokens": len(prompt)}
    try:
        answer = server.complete(prompt, max_tokens=max(1, min(request.output_length, max_output_tokens)),
                                 workload=request.workload)
    except RequestFailed as exc:
        return RequestRecord(**base, error=str(exc))
    return RequestRecord(**{**base, "prompt_tokens": answer.prompt_tokens}, cached_tokens=answer.cached_tokens,
                         ttft_s=answer.ttft_s, qttft_s=answer.first_token_at - due)
