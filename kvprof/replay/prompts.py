"""Trace requests as the prompts replay sends: token ids such that equal hash-id prefixes are equal token prefixes.

Each trace block (hash id) becomes a fixed run of ``block_tokens`` token ids drawn from
``[FIRST_TOKEN_ID, vocab_size)`` by a hash of (hash id, position), so a prompt is the
concatenation of its blocks' runs, cut to the request's ``input_length``. Prompts go to the server
as token ids: no tokenizer in the way, and blocks stay aligned with the server's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvprof.profiler.trace import Trace

#: Token ids below this are left out: small ids are often special (padding, begin and end of text).
FIRST_TOKEN_ID = 4


@dataclass(frozen=True, eq=False)
class ReplayRequest:
    """One trace request as replay sends it.

    Invariant: ``arrival_s`` is seconds from the replayed slice's first request (>= 0) and
    ``hash_ids`` are the request's trace blocks in prompt order.
    """

    chat_id: int
    arrival_s: float
    hash_ids: np.ndarray
    input_length: int
    output_length: int
    workload: dict  # vllm_xargs: the trace's type and turn (the plugin's class rule) and its client hint

    def prompt_length(self, block_tokens: int) -> int:
        """Tokens :meth:`prompt` gives: the trace's ``input_length``, at least one, at most its blocks'."""
        return max(1, min(self.input_length, len(self.hash_ids) * block_tokens))

    def prompt(self, block_tokens: int, vocab_size: int, length: int | None = None) -> list[int]:
        """The prompt's token ids: :meth:`prompt_length` of them, or its first ``length`` (at least one)."""
        n = self.prompt_length(block_tokens) if length is None else max(1, min(length, self.prompt_length(block_tokens)))
        return prompt_tokens(self.hash_ids, block_tokens, vocab_size, n) or [FIRST_TOKEN_ID]


def prompt_tokens(hash_ids: np.ndarray, block_tokens: int, vocab_size: int, length: int | None = None) -> list[int]:
    """The token ids of a chain of trace blocks, ``block_tokens`` per block, all in ``[FIRST_TOKEN_ID, vocab_size)``;
    only the first ``length`` are made (a prompt is cut to its length before its tokens are drawn)."""
    total = len(hash_ids) * block_tokens if length is None else min(length, len(hash_ids) * block_tokens)
    position = np.arange(total, dtype=np.uint64)
    ids = np.asarray(hash_ids, dtype=np.uint64)[position // np.uint64(block_tokens)]
    mixed = _splitmix64(ids * np.uint64(block_tokens) + position % np.uint64(block_tokens))
    return (mixed % np.uint64(vocab_size - FIRST_TOKEN_ID) + np.uint64(FIRST_TOKEN_ID)).astype(np.int64).tolist()


def requests_of(trace: Trace) -> list[ReplayRequest]:
    """The trace's requests in arrival order, arrival times from its first request.

    Each is tagged with its type and turn (the plugin's class rule), its client hint where the trace
    carries one (its hint fields, which the plugin honours: docs/hints.md) and, when it belongs
    to a conversation (it has a parent or children), ``session``: the chat id of the conversation's
    first request, so that a server recording the replay (``--kv-record``) links the turns.
    """
    start = float(trace.timestamp[0])
    types = trace.types
    hints = trace.hints.hints() if trace.hints is not None else None
    root: dict[int, int] = {}  # chat id -> its conversation's first chat id
    parents = set(trace.parent_chat_id.tolist()) - {-1}
    out = []
    for i in range(trace.n_requests):
        chat, parent = int(trace.chat_id[i]), int(trace.parent_chat_id[i])
        root[chat] = root.get(parent, chat) if parent != -1 else chat
        workload = {}
        if trace.has_types:  # an empty type is no type: the plugin's default class
            workload = {"type": types[i], "turn": int(trace.turn[i])} if types[i] else {"turn": int(trace.turn[i])}
        if parent != -1 or chat in parents:
            workload["session"] = root[chat]
        if hints is not None and hints[i] is not None:
            workload.update(hints[i].fields())
        out.append(ReplayRequest(chat_id=int(trace.chat_id[i]), arrival_s=float(trace.timestamp[i]) - start,
                                 hash_ids=trace.blocks_of(i), input_length=int(trace.input_length[i]),
                                 output_length=int(trace.output_length[i]), workload=workload))
    return out


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele et al., 2014): a bijection of uint64 that scatters neighbouring inputs."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
