"""What a replay is configured with: the server cost model, block geometry, tiers, elastic capacity."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from kvprof.atomic import atomic_write_text
from kvprof.errors import CostFileError, KvprofError
from kvprof.jsonfile import JsonChecks, read_json
from kvprof.limits import BLOCKS, INT32_MAX, RATE_SCALE, TOKENS, TOKENS_PER_SECOND, Bound

#: Schema of a cost-model file (``kvprof replay`` writes one, ``compare --cost`` reads it).
COST_SCHEMA = "kvprof.cost/1"
#: The engine block compare defaults to, as in the published benchmark (tokens); rounded up to
#: a multiple of the trace's block.
DEFAULT_ENGINE_BLOCK_TOKENS = 128
#: Bytes one replay holds per block slot of a cache tier (its slot lists), measured at 57 for
#: every policy on an idle pool of 10^6 slots; cached contents come on top, bounded by the trace.
BYTES_PER_SLOT = 64
#: How a replay decides how long requests hold their blocks (``SimConfig.timing``).
TIMINGS = ("auto", "recorded", "model")


class SimulationError(KvprofError):
    """A simulation that cannot be set up from the given inputs (CLI exit code 1)."""


#: Seconds a step, a token or a block load may take in the cost model.
_STEP_SECONDS = Bound(0.0, 1e6)
#: What each number of the cost model may be: the same rule for its options, its file and the dataclass.
COST_BOUNDS = {
    "prefill_tokens_per_s": TOKENS_PER_SECOND,
    "step_overhead_s": _STEP_SECONDS,
    "max_batched_tokens": TOKENS,
    "max_num_seqs": Bound(1, INT32_MAX, whole=True),
    "time_per_output_token_s": _STEP_SECONDS,
    "host_load_s_per_block": _STEP_SECONDS,
}


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
        for name, bound in COST_BOUNDS.items():
            try:
                bound.check(getattr(self, name), name)
            except ValueError as exc:
                raise SimulationError(f"cost model: {exc}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike, base: CostModel | None = None) -> CostModel:
        """The cost model of a ``kvprof.cost/1`` file: its values over ``base`` (the defaults).

        Raises
        ------
        CostFileError
            Not such a file, an unknown key, or a value of the wrong type or range (named).
        """
        checks = JsonChecks(str(path), CostFileError)
        data = checks.mapping(read_json(path, CostFileError), None)
        if data.get("schema") != COST_SCHEMA:
            checks.fail("schema", f"must be {COST_SCHEMA!r}, got {data.get('schema')!r}")
        names = [f.name for f in fields(cls)]
        checks.known_keys(data, None, ["schema", "provenance", *names])
        values = {}
        for name in names:
            if name not in data:
                continue
            if name in COST_BOUNDS:
                value = checks.bounded(data[name], name, COST_BOUNDS[name])
                values[name] = value if COST_BOUNDS[name].whole else float(value)
            else:
                values[name] = checks.boolean(data[name], name)
        return replace(base or cls(), **values)

    def write(self, path: str | os.PathLike, provenance: dict, keys: tuple[str, ...] | None = None) -> Path:
        """Write a ``kvprof.cost/1`` file of ``keys`` (default: every field) and ``provenance``, atomically."""
        values = {k: v for k, v in asdict(self).items() if keys is None or k in keys}
        document = {"schema": COST_SCHEMA, **values, "provenance": provenance}
        return atomic_write_text(path, json.dumps(document, indent=2, allow_nan=False) + "\n")


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
        Elastic GPU capacity: ``(seconds from evaluation start, blocks)`` pairs, times strictly increasing.
        Empty for a fixed capacity. When given, it replaces the swept capacity.
    rate_scale : float
        Arrivals come this many times as fast as in the trace (``kvprof replay --rate-scale``);
        the schedule's times are in the sped-up clock.
    timing : {"auto", "recorded", "model"}
        How long requests hold their blocks: as the server did (``recorded``: a vLLM recording's
        ``scheduled``/``finished`` times, :mod:`kvprof.sim.recorded`), as the cost model says
        (``model``), or recorded where the workload has it (``auto``).
    sample_rate : float
        In (0, 1]: replay only the chains whose first block hashes into a sample of this rate, at
        every capacity times the rate (:mod:`kvprof.sim.sample`); 1 replays everything.
    """

    engine_block_size: int = 128
    cost: CostModel = field(default_factory=CostModel)
    cpu_capacity: int = 0
    cpu_policy: str = "lru"
    capacity_schedule: tuple[tuple[float, int], ...] = ()
    rate_scale: float = 1.0
    timing: str = "auto"
    sample_rate: float = 1.0

    def __post_init__(self):
        if self.timing not in TIMINGS:
            raise SimulationError(f"timing must be one of {', '.join(TIMINGS)}, got {self.timing!r}")
        if self.engine_block_size < 1:
            raise SimulationError(f"engine block size must be >= 1 token, got {self.engine_block_size}")
        if self.cpu_capacity < 0:
            raise SimulationError(f"CPU capacity must be >= 0 blocks, got {self.cpu_capacity}")
        if not RATE_SCALE.accepts(self.rate_scale):
            raise SimulationError(f"the rate scale must be {RATE_SCALE.describe()}, got {self.rate_scale}")
        times = [t for t, _ in self.capacity_schedule]
        if any(b <= a for a, b in zip(times, times[1:])) or any(not math.isfinite(t) or t < 0 for t in times):
            raise SimulationError("capacity schedule times must be finite, >= 0 and strictly increasing")
        if any(c <= 0 for _, c in self.capacity_schedule):
            raise SimulationError("capacities in the schedule must be > 0 blocks")
        if not (math.isfinite(self.sample_rate) and 0 < self.sample_rate <= 1):
            raise SimulationError(f"the sample rate must be a number in (0, 1], got {self.sample_rate}")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["capacity_schedule"] = [list(step) for step in self.capacity_schedule]
        return out


def check_memory(gpu_blocks: int, cpu_blocks: int, workers: int) -> None:
    """Refuse replays whose cache tiers alone would not fit in this machine's memory.

    Parameters
    ----------
    gpu_blocks : int
        The largest GPU capacity any replay reaches (a schedule's peak included).
    cpu_blocks : int
        The CPU tier's capacity.
    workers : int
        Replays running at once, each with its own tiers.

    Raises
    ------
    SimulationError
        With the estimate and the machine's memory.
    """
    need = workers * BYTES_PER_SLOT * (gpu_blocks + cpu_blocks)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise SimulationError(
            f"{gpu_blocks:,} GPU + {cpu_blocks:,} CPU blocks need about {need / 2**30:,.1f} GiB "
            f"({workers} replay{'s' if workers > 1 else ''} at once x ~{BYTES_PER_SLOT} bytes per block slot), "
            f"more than this machine's {have / 2**30:,.1f} GiB"
        )


def default_engine_block(trace_block_size: int) -> int:
    """The smallest multiple of the trace's block size that is at least 128 tokens."""
    return trace_block_size * -(-DEFAULT_ENGINE_BLOCK_TOKENS // trace_block_size)


#: Times of a capacity schedule, seconds from the evaluation start.
SCHEDULE_SECONDS = Bound(0.0, 1e15)


def parse_schedule(text: str) -> tuple[tuple[float, int], ...]:
    """Parse ``"0:4096,1800:2048"`` into ``((0.0, 4096), (1800.0, 2048))``.

    Raises
    ------
    ValueError
        On anything else, with a message saying what the format is.
    """
    steps = []
    for part in text.split(","):
        seconds, sep, blocks = part.partition(":")  # numbers as every number is read: no spaces
        if not sep:
            raise ValueError(f"capacity schedule {text!r} must look like 0:4096,1800:2048 (seconds:blocks)")
        try:
            steps.append((SCHEDULE_SECONDS.parse(seconds, f"time {seconds!r}"),
                          BLOCKS.parse(blocks, f"capacity {blocks!r}")))
        except ValueError as exc:
            raise ValueError(f"capacity schedule {text!r}: {exc} (seconds:blocks, e.g. 0:4096,1800:2048)") from None
    if steps and steps[0][0] != 0:
        raise ValueError(f"capacity schedule {text!r} must start at time 0")
    repeated = next((b for a, b in zip(steps, steps[1:]) if b[0] <= a[0]), None)
    if repeated is not None:
        raise ValueError(f"capacity schedule {text!r}: its times must increase, and {repeated[0]:g} s does not")
    return tuple(steps)
