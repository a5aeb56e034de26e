"""Sending a trace on schedule: arrival times honoured (scaled), bounded concurrency, one record per request.

Requests leave at ``arrival / rate_scale`` seconds after the start, at most ``max_concurrency``
in flight; waiting for a free slot counts in QTTFT, which runs from the scheduled arrival to the
first token (and is recorded apart as ``wait_s``). Failures are counted and recorded, never
retried. A prompt longer than the server's context (``max_model_len``, less the output asked
for) is skipped or clipped, as ``Pacing.too_long`` says, before it is sent. Every request of the
trace has exactly one record, in arrival order: each worker's result is collected from its
future. An interrupt (SIGINT, SIGTERM) stops the sending; the requests already answered keep
their records (:class:`Sent`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvprof.replay.prompts import ReplayRequest
from kvprof.replay.response import RequestFailed
from kvprof.replay.server import Server

#: ``progress(done, total)`` after each finished request (called from the sending threads).
Progress = Callable[[int, int], None]
#: ``route(index, prompt, loads) -> server``: the server of the request at ``index`` (arrival order) whose
#: ``prompt`` is due now, ``loads`` the requests in flight at each server.
Route = Callable[[int, list[int], list[int]], int]
#: What to do with a prompt longer than the server's context: leave it out (counted) or cut it.
TOO_LONG = ("skip", "clip")
#: Longest single sleep while waiting for an arrival (a long trace at a slow rate would overflow one).
_LONGEST_SLEEP_S = 3600.0


@dataclass(frozen=True)
class RequestRecord:
    """One line of ``requests.jsonl`` (docs/results-schema.md).

    Invariant: a skipped request (``skipped`` set) was never sent and has no other measurement;
    otherwise ``error`` (with its ``error_kind``) is None exactly when ``cached_tokens``,
    ``ttft_s`` and ``qttft_s`` are set, and ``prompt_tokens`` are the tokens sent.
    """

    chat_id: int
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int | None = None
    ttft_s: float | None = None
    qttft_s: float | None = None
    error: str | None = None
    error_kind: str | None = None
    wait_s: float | None = None
    workload: dict = field(default_factory=dict)
    workload_class: str | None = None
    trace_tokens: int | None = None
    skipped: str | None = None
    replica: int | None = None  # behind a router (several servers): the server it was sent to, else None

    @property
    def answered(self) -> bool:
        return self.skipped is None and self.error is None

    @property
    def sent(self) -> bool:
        return self.skipped is None


@dataclass(frozen=True)
class Pacing:
    """How requests leave: ``rate_scale`` divides arrival times; at most ``max_concurrency`` in flight;
    a prompt beyond ``max_model_len`` (less its output) is ``too_long``: skipped or clipped."""

    rate_scale: float = 1.0
    max_concurrency: int = 8
    max_output_tokens: int = 16
    block_tokens: int = 16
    vocab_size: int = 1000
    too_long: str = "skip"


@dataclass(frozen=True)
class Sent:
    """What :func:`send_all` did: a record per request finished (all of them unless ``stopped_by``),
    in arrival order, and the interrupt or error that stopped the sending, if one did."""

    records: list[RequestRecord]
    stopped_by: BaseException | None = None


def send_all(servers: Server | Sequence[Server], requests: Sequence[ReplayRequest], pacing: Pacing,
             progress: Progress | None = None, *, max_model_len: int | None = None,
             classes: Callable[[ReplayRequest], str | None] | None = None, route: Route | None = None) -> Sent:
    """Send every request at its scheduled time; one record each, in arrival order.

    ``classes`` names each request's workload class for its record (the hp file's rule), if given.
    With several ``servers`` (a fleet), ``route`` picks each request's server when it is due, and
    its record says which (``replica``); with one server records have no ``replica``.
    An exception while sending (an interrupt above all) stops it: the records of the requests
    that finished are returned with it, the others are cancelled or left to end on their own.
    """
    servers = [servers] if isinstance(servers, Server) else list(servers)
    if len(servers) > 1 and route is None:
        raise ValueError("several servers need a route")
    slots = threading.Semaphore(pacing.max_concurrency)
    done = 0
    done_lock = threading.Lock()
    in_flight = [0] * len(servers)  # per server: requests sent and not yet answered (what least-loaded reads)

    def work(request: ReplayRequest, prompt: list[int], max_tokens: int, due: float, base: dict) -> RequestRecord:
        nonlocal done
        replica = base.get("replica") or 0
        try:
            return _send(servers[replica], request, prompt, max_tokens, due, base)
        finally:
            slots.release()
            with done_lock:
                in_flight[replica] -= 1
                done += 1
                if progress:
                    progress(done, len(requests))

    start = time.monotonic()
    futures: list[Future | RequestRecord] = []
    pool = ThreadPoolExecutor(max_workers=pacing.max_concurrency)
    try:
        for request in requests:
            base = {"chat_id": request.chat_id, "arrival_s": request.arrival_s, "workload": request.workload,
                    "workload_class": classes(request) if classes else None,
                    "trace_tokens": request.prompt_length(pacing.block_tokens)}
            max_tokens = max(1, min(request.output_length, pacing.max_output_tokens))
            length, skipped = _fitted_length(request, pacing, max_tokens, max_model_len)
            if skipped:
                futures.append(RequestRecord(**base, prompt_tokens=0, skipped=skipped))
                continue
            prompt = request.prompt(pacing.block_tokens, pacing.vocab_size, length)
            due = start + request.arrival_s / pacing.rate_scale
            _sleep_until(due)
            slots.acquire()
            if route is not None:  # routed once a slot is free: the loads it reads are those it is sent into
                with done_lock:
                    loads = list(in_flight)
                base["replica"] = route(len(futures), prompt, loads)
            with done_lock:
                in_flight[base.get("replica") or 0] += 1
            futures.append(pool.submit(work, request, prompt, max_tokens, due, base))
        records = [f if isinstance(f, RequestRecord) else f.result() for f in futures]
    except BaseException as exc:  # noqa: BLE001 - an interrupt above all: keep what was measured
        pool.shutdown(wait=False, cancel_futures=True)
        finished = [f if isinstance(f, RequestRecord) else f.result() for f in futures
                    if isinstance(f, RequestRecord) or (f.done() and not f.cancelled() and f.exception() is None)]
        return Sent(finished, exc)
    pool.shutdown(wait=True)
    return Sent(records)


def _fitted_length(request: ReplayRequest, pacing: Pacing, max_tokens: int,
                   max_model_len: int | None) -> tuple[int | None, str | None]:
    """The prompt length to send (None: the whole prompt) and, if the request is skipped, why."""
    if max_model_len is None:
        return None, None
    length = request.prompt_length(pacing.block_tokens)
    room = max_model_len - max_tokens
    if length <= room:
        return None, None
    if pacing.too_long == "clip" and room >= 1:
        return room, None
    return None, (f"too long: {length} prompt + {max_tokens} output tokens exceed the server's max_model_len "
                  f"{max_model_len}")


def _sleep_until(due: float) -> None:
    while (delay := due - time.monotonic()) > 0:
        time.sleep(min(delay, _LONGEST_SLEEP_S))


def _send(server: Server, request: ReplayRequest, prompt: list[int], max_tokens: int, due: float,
          base: dict) -> RequestRecord:
    base = {**base, "prompt_tokens": len(prompt), "wait_s": max(0.0, time.monotonic() - due)}
    try:
        answer = server.complete(prompt, max_tokens=max_tokens, workload=request.workload)
    except RequestFailed as exc:
        return RequestRecord(**base, error=str(exc), error_kind=exc.kind)
    return RequestRecord(**base, cached_tokens=answer.cached_tokens, ttft_s=answer.ttft_s,
                         qttft_s=answer.first_token_at - due)
