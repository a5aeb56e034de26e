"""What a replay is configured with: the server cost model, block geometry, tiers, elastic capacity."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvprof.errors import KvprofError


class SimulationError(KvprofError):
    """A simulation that cannot be set up from the given inputs (CLI exit code 1)."""


@dataclass(frozen=True)
class CostModel:
    """How long the modelled server takes; decides how long blocks stay pinned and how long requests queue.

    The server runs vLLM-style steps: each step schedules up to ``max_batched_tokens`` prefill
    tokens (chunked prefill, running requests first, then waiting ones in arrival order) and takes
    ``step_overhead_s + tokens / prefill_tokens_per_s + host_loads * host_load_s_per_block``.
    Only uncached prompt tokens cost compute.

    The defaults model the published evaluation (prefill-only node, Qwen2.5-7B on one A800,
    ``max_num_batched_tokens`` 16384): at Bailian trace A's ~6 requests/s of ~2.3k tokens the
    server must prefill ~12k uncached tokens/s at LRU's hit ratios, so a server of 13k tokens/s
    runs at ~90 % load and a few points of hit ratio move queueing time by seconds, as in the
    published QTTFT tables.

    Parameters
    ----------
    prefill_tokens_per_s : float
        Prefill throughput of the engine, tokens per second.
    step_overhead_s : float
        Fixed cost of one engine step (scheduling, launch), seconds.
    max_batched_tokens : int
        Token budget of one step (vLLM's ``max_num_batched_tokens``).
    max_num_seqs : int
        Most requests running at once (vLLM's ``max_num_seqs``).
    decode : bool
        Model decoding: requests hold their blocks (and blocks for their output tokens) for
        ``output_length * time_per_output_token_s`` after the first token. Off by default, like
        the published prefill-only evaluation, where a request frees its blocks at its first token.
    time_per_output_token_s : float
        Decode time per output token, seconds (only with ``decode``).
    host_load_s_per_block : float
        Time to load one engine block from the CPU tier, seconds; the default is a 128-token block
        of Qwen2.5-7B (28 layers x 2 x 4 KV heads x 128 x 2 bytes x 128 tokens = 7.3 MB) over
        ~25 GB/s PCIe.
    """

    prefill_tokens_per_s: float = 13_500.0
    step_overhead_s: float = 0.005
    max_batched_tokens: int = 16_384
    max_num_seqs: int = 256
    decode: bool = False
    time_per_output_token_s: float = 0.02
    host_load_s_per_block: float = 3e-4

    def __post_init__(self):
        if not self.prefill_tokens_per_s > 0:
            raise SimulationError(f"prefill throughput must be > 0 tokens/s, got {self.prefill_tokens_per_s}")
        if self.max_batched_tokens < 1 or self.max_num_seqs < 1:
            raise SimulationError("max_batched_tokens and max_num_seqs must be >= 1")
        if min(self.step_overhead_s, self.time_per_output_token_s, self.host_load_s_per_block) < 0:
            raise SimulationError("times in the cost model must be >= 0 seconds")


@dataclass(frozen=True)
class SimConfig:
    """Everything about a replay except the eviction policy and the GPU capacity being swept.

    Parameters
    ----------
    engine_block_size : int
        Tokens per engine (KV-cache) block; a multiple of the trace's block size.
    cost : CostModel
    cpu_capacity : int
        Engine blocks in the CPU (host) tier; 0 for none.
    cpu_policy : str
        Policy name of the CPU tier (``make_policy`` name).
    capacity_schedule : tuple of (float, int)
        Elastic GPU capacity: ``(seconds from evaluation start, blocks)`` pairs, sorted by time.
        Empty for a fixed capacity. When given, it replaces the swept capacity.
    """

    engine_block_size: int = 128
    cost: CostModel = field(default_factory=CostModel)
    cpu_capacity: int = 0
    cpu_policy: str = "lru"
    capacity_schedule: tuple[tuple[float, int], ...] = ()

    def __post_init__(self):
        if self.engine_block_size < 1:
            raise SimulationError(f"engine block size must be >= 1 token, got {self.engine_block_size}")
        if self.cpu_capacity < 0:
            raise SimulationError(f"CPU capacity must be >= 0 blocks, got {self.cpu_capacity}")
        times = [t for t, _ in self.capacity_schedule]
        if times != sorted(times) or any(not math.isfinite(t) or t < 0 for t in times):
            raise SimulationError("capacity schedule times must be finite, >= 0 and increasing")
        if any(c <= 0 for _, c in self.capacity_schedule):
            raise SimulationError("capacities in the schedule must be > 0 blocks")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["capacity_schedule"] = [list(step) for step in self.capacity_schedule]
        return out


def parse_schedule(text: str) -> tuple[tuple[float, int], ...]:
    """Parse ``"0:4096,1800:2048"`` into ``((0.0, 4096), (1800.0, 2048))``.

    Raises
    ------
    ValueError
        On anything else, with a message saying what the format is.
    """
    steps = []
    for part in text.split(","):
        seconds, sep, blocks = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            steps.append((float(seconds), int(blocks)))
        except ValueError:
            raise ValueError(f"capacity schedule {text!r} must look like 0:4096,1800:2048 (seconds:blocks)") from None
    if steps and steps[0][0] != 0:
        raise ValueError(f"capacity schedule {text!r} must start at time 0")
    return tuple(steps)
