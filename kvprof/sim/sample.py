"""Miniature simulation: a spatial sample of a trace's chains replayed at a scaled cache.

A cache's hit ratio on a trace is close to the hit ratio at ``capacity x R`` on a sample of its
objects drawn with probability ``R`` by a hash of their keys (SHARDS, Waldspurger et al., FAST
'15; "miniature simulations", ATC '17): the sample sees a fraction ``R`` of the traffic, each
kept object with all of its accesses, so reuse distances shrink by ``R`` with the cache. A prefix
cache's objects are chains of blocks, and blocks of one chain are looked up, pinned, evicted and
reused together, so the unit sampled here is the chain of requests a conversation makes: a
request is kept when the ``chat_id`` of its conversation's first request (followed through
``parent_chat_id``; a request without a parent starts one, so every Mooncake request is its own)
hashes into the sample. A prefix many conversations share (a system prompt) stays in the sample,
used by a fraction ``R`` of them: its reuse distance shrinks by ``R`` as well.

(Sampling by a chain's first block instead, as hardware caches sample lines, keeps or drops
every conversation under one system prompt together: bailian-a's two hours have 15 distinct
first blocks, so a sample of 0.1 holds one or two of them.)

A prefix several sampled conversations share is in the sample whole, not a fraction ``R`` of it,
and such prefixes are the hottest blocks of a cache (hit by every conversation under them), so
the scaled cache keeps room for them: ``capacity x R + (1 - R) x min(shared, capacity)`` blocks,
``shared`` the blocks more than one sampled chain uses (:class:`Miniature`). Small caches stay
the hard case: at 256 blocks of bailian-a a sample of 0.1 caches about one request's worth.

A request that the scaled cache is too small for, but the full cache holds, is rejected in the
miniature only: its tokens' share is added to the error bound, and a sample where such requests
carry more than a tenth of the prompt tokens is refused (:func:`lost_shares`; a sample of 0.001
at 256 blocks scaled them to 2 and rejected every request).

Every estimate carries a bound on its sampling error (:func:`hit_ratio_error`): the hit ratio of
a sample is a ratio estimator over the conversations drawn (cluster sampling: Cochran, *Sampling
Techniques*, 3rd ed., 1977, sections 6.4 and 9A), whose standard error is
``sqrt((1 - R) * sum((h_c - r t_c)^2)) / sum(t_c)`` over the sampled conversations ``c`` (``h_c`` the
conversation's cached tokens, ``t_c`` its prompt tokens, ``r`` the estimate). A conversation's
``|h_c - r t_c|`` is at most ``max(r, 1 - r) t_c``, so the error is at most
``max(r, 1 - r) sqrt((1 - R) / n_eff)``, ``n_eff = sum(t_c)^2 / sum(t_c^2)`` the conversations
the sample effectively holds; two of these are reported. The bound needs no replay beyond the
sample's own (a bootstrap over conversations would need each one's hits, and re-replays to
cover the cache they share); it is conservative, as each conversation is taken at its worst, and
it covers which conversations the hash drew, not the scaling of the cache itself (SHARDS'
model error, which ``benchmarks/bench_quality.py --sample`` measures against full replays).

The modelled server keeps its speed: the sample's requests then finish as fast as the full
trace's would without queueing, so a fraction ``R`` of the blocks is pinned at a time, as the
cache is a fraction ``R`` of the size. Queued TTFT of a sample is the sample's own (its queue is
shorter), not an estimate of the full trace's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kvprof.profiler.trace import Trace
from kvprof.sim.config import SimConfig, SimulationError

#: splitmix64's finalizer: a full-avalanche mix of 64-bit keys (hash ids are often small counters).
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def check_rate(rate: float) -> float:
    """``rate`` as a sampling rate: a number in (0, 1] (``ValueError`` otherwise)."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and 0 < rate <= 1):
        raise ValueError(f"a sampling rate must be a number in (0, 1], got {rate!r}")
    return float(rate)


def chain_roots(trace: Trace) -> np.ndarray:
    """Each request's chain: the ``chat_id`` of the first request of its conversation (int64, (n,)).

    A parent missing from the trace (the conversation began before the window) makes the child
    a first request.
    """
    order = np.argsort(trace.chat_id, kind="stable")
    position = np.minimum(np.searchsorted(trace.chat_id[order], trace.parent_chat_id), max(trace.n_requests - 1, 0))
    found = (trace.parent_chat_id >= 0) & (trace.chat_id[order][position] == trace.parent_chat_id)
    root = np.arange(trace.n_requests)
    root[found] = order[position[found]]
    while True:  # pointer jumping: every round halves the remaining distance to the first turn
        jumped = root[root]
        if np.array_equal(jumped, root):
            return trace.chat_id[root]
        root = jumped


def _mix(keys: np.ndarray) -> np.ndarray:
    z = keys.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _MIX[0]
        z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    return z ^ (z >> np.uint64(31))


def in_sample(keys: np.ndarray, rate: float) -> np.ndarray:
    """Whether each key (int64) hashes into a sample of ``rate``: its mixed hash below ``rate`` of 2**64."""
    if rate >= 1:
        return np.ones(keys.shape, dtype=bool)
    return _mix(keys) < np.uint64(min(int(rate * 2.0**64), 2**64 - 1))


def chain_sample(trace: Trace, rate: float) -> Trace:
    """The requests of ``trace`` whose chain (:func:`chain_roots`) hashes into a sample of ``rate``."""
    rate = check_rate(rate)
    if rate == 1 or not trace.n_requests:
        return trace
    keep = in_sample(chain_roots(trace), rate)
    if not keep.any():
        raise SimulationError(f"none of the {trace.n_requests:,} requests' chains hashes into a sample of {rate:g}; "
                              f"sample more")
    return trace.select(keep, window=trace.window)


@dataclass(frozen=True)
class Miniature:
    """How a sample of ``rate`` scales the caches replayed on it (see the module docstring).

    ``shared``: engine blocks that more than one chain of the sample uses.
    """

    rate: float = 1.0
    shared: int = 0

    @classmethod
    def of(cls, sample: Trace, workload, rate: float) -> Miniature:
        """The scaling for ``workload``, prepared from ``sample`` (:func:`chain_sample` at ``rate``)."""
        if rate == 1:
            return cls()
        owner = np.repeat(np.arange(workload.n_requests), np.diff(workload.offsets))
        pairs = np.unique(np.stack([workload.block, chain_roots(sample)[owner]]), axis=1)
        _, chains = np.unique(pairs[0], return_counts=True)
        return cls(rate, int(np.count_nonzero(chains > 1)))

    def capacity(self, blocks: int) -> int:
        """A cache of ``blocks`` scaled to the sample, at least 1 block."""
        if self.rate == 1:
            return blocks
        return max(1, round(blocks * self.rate + (1 - self.rate) * min(self.shared, blocks)))

    def config(self, config: SimConfig) -> SimConfig:
        """``config`` for replaying the sample: its CPU tier and capacity schedule scaled too."""
        if self.rate == 1:
            return config
        return replace(config, cpu_capacity=self.capacity(config.cpu_capacity) if config.cpu_capacity else 0,
                       capacity_schedule=tuple((t, self.capacity(c)) for t, c in config.capacity_schedule))


#: The most of a sample's prompt tokens that requests its scaled cache cannot hold (but the full
#: one can) may carry: beyond it the estimate is mostly their rejections, and is refused.
MAX_LOST_SHARE = 0.1


def lost_shares(miniature: Miniature, needs: np.ndarray, tokens: np.ndarray, capacities) -> dict[int, float]:
    """Per full capacity, the share of the sample's prompt tokens in requests that the scaled cache
    cannot hold and the full one can: the most by which their rejection in the miniature alone can
    move the estimate (added to :func:`hit_ratio_error`).

    Parameters
    ----------
    miniature : Miniature
    needs : int64 array
        The engine blocks each sampled request holds while running.
    tokens : int64 array
        Each sampled request's prompt tokens.
    capacities : iterable of int
        The full caches replayed (capacities and a schedule's).

    Raises
    ------
    SimulationError
        A share above :data:`MAX_LOST_SHARE`, naming the capacity, the scaled one, the requests it
        cannot hold and the rate that would hold them.
    """
    shares = {}
    total = float(tokens.sum())
    for capacity in sorted(set(capacities)):
        scaled = miniature.capacity(capacity)
        lost = (needs > scaled) & (needs <= capacity)
        shares[capacity] = float(tokens[lost].sum()) / total if total else 0.0
        if shares[capacity] > MAX_LOST_SHARE:
            largest, kept = int(needs[lost].max()), min(miniature.shared, capacity)
            enough = (largest - kept) / (capacity - kept) if capacity > kept else 1.0
            raise SimulationError(
                f"a sample of {miniature.rate:g} scales the cache of {capacity:,} blocks to {scaled:,}, too small "
                f"for {int(lost.sum()):,} of the sample's {needs.size:,} requests (up to {largest:,} blocks, "
                f"{shares[capacity]:.0%} of its prompt tokens) that {capacity:,} blocks hold: their rejections "
                f"would be the estimate. Sample at least about {min(enough, 1.0):.2g}, or replay the whole trace "
                f"(--sample 1)")
    return shares


def effective_chains(sample: Trace) -> float:
    """``n_eff = sum(t_c)^2 / sum(t_c^2)`` over the sample's conversations, ``t_c`` their prompt tokens."""
    _, chain = np.unique(chain_roots(sample), return_inverse=True)
    tokens = np.bincount(chain, weights=sample.input_length.astype(np.float64))
    squares = float(np.square(tokens).sum())
    return float(tokens.sum()) ** 2 / squares if squares else 0.0


def hit_ratio_error(hit_ratio: float | None, rate: float, n_effective: float, lost_share: float = 0.0) -> float | None:
    """Two standard errors, at most, of a sampled token hit ratio (see the module docstring), plus
    the share of tokens in requests only the miniature rejects (:func:`lost_shares`); None without
    an estimate, 0 for the whole trace."""
    if hit_ratio is None or not n_effective:
        return None
    return 2 * max(hit_ratio, 1 - hit_ratio) * math.sqrt((1 - rate) / n_effective) + lost_share


def sample_facts(trace: Trace, sample: Trace, miniature: Miniature, lost: dict[int, float]) -> dict:
    """What a results file says of a sample: its requests and chains out of the trace's, its shared
    blocks, and for :func:`hit_ratio_error` the conversations it effectively holds and, per
    capacity (a JSON key), the share of tokens only the miniature rejects (:func:`lost_shares`)."""
    return {"requests": sample.n_requests, "chains": int(np.unique(chain_roots(sample)).size),
            "of_requests": trace.n_requests, "of_chains": int(np.unique(chain_roots(trace)).size),
            "shared_blocks": miniature.shared, "effective_chains": effective_chains(sample),
            "lost_token_share": {str(capacity): share for capacity, share in lost.items()}}
