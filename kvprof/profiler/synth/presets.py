"""The synthetic workloads: per-type session profiles and the named presets calibrated to Bailian's statistics.

Values were calibrated against the published statistics of the Bailian traces (see
``docs/synth.md``, which explains how each knob reaches its target).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import ndtri

#: Tokens per hash block in the Bailian format.
BLOCK_SIZE = 16


@dataclass(frozen=True)
class TypeProfile:
    """How the sessions of one request type arrive and what their prompts hold.

    A session picks one shared system prompt, then sends turns. Turn 1's prompt is the system
    prompt, an optional attached document and the first user message; turn ``k`` re-sends turn
    ``k - 1``'s prompt plus its output plus a new user message. Token counts are lognormal.

    Parameters
    ----------
    name : str
        The ``type`` field of the records (``text``, ``api`` ...).
    sessions_per_hour : float
        Sessions arrive as a Poisson process at this rate (sessions/hour), each bringing
        ``expected_turns`` requests on average, fewer for sessions that the trace's end cuts.
    continue_prob : float
        Probability, in [0, 1), that a session sends another turn after each turn.
    think_median_s, think_sigma : float
        Time between a turn's arrival and the next turn's arrival: lognormal with this median
        (seconds) and log-space standard deviation.
    user_tokens_mean, user_tokens_sigma : float
        New user text per turn (tokens, at least 1): lognormal with this mean and log-sigma.
    output_tokens_mean, output_tokens_sigma : float
        Output per turn (tokens, at least 1); re-sent as history by the next turn.
    system_prompts : int
        Size of the type's pool of shared system prompts.
    system_tokens_mean : float
        Mean system-prompt length per session (tokens), i.e. weighted by popularity. The
        pool's lengths are evenly spaced lognormal quantiles, identical for every seed so the
        calibration holds for every seed.
    system_tokens_sigma : float
        Log-space spread of the pool's lengths.
    system_zipf : float
        Popularity of the pool's prompts: rank ``r`` (1-based) is picked with probability
        proportional to ``r ** -system_zipf``.
    document_tokens_mean, document_tokens_sigma : float
        An attachment (file text, image tokens) in turn 1, re-sent by every later turn, so its
        blocks recur across the session's questions. Mean 0 means no attachment.
    max_turns : int
        Turns per session are geometric with ``continue_prob``, capped here.
    """

    name: str
    sessions_per_hour: float
    continue_prob: float
    think_median_s: float
    think_sigma: float
    user_tokens_mean: float
    user_tokens_sigma: float
    output_tokens_mean: float
    output_tokens_sigma: float
    system_prompts: int
    system_tokens_mean: float
    system_tokens_sigma: float = 0.5
    system_zipf: float = 1.0
    document_tokens_mean: float = 0.0
    document_tokens_sigma: float = 0.5
    max_turns: int = 50

    def __post_init__(self):
        if not self.name:
            raise ValueError("a type profile needs a name")
        if not 0.0 <= self.continue_prob < 1.0:
            raise ValueError(f"{self.name}: continue_prob must be in [0, 1), got {self.continue_prob}")
        positive = ("sessions_per_hour", "think_median_s", "user_tokens_mean", "output_tokens_mean")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.name}: {name} must be > 0")
        non_negative = (
            "think_sigma", "user_tokens_sigma", "output_tokens_sigma", "system_tokens_mean",
            "system_tokens_sigma", "system_zipf", "document_tokens_mean", "document_tokens_sigma",
        )  # fmt: skip
        for name in non_negative:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{self.name}: {name} must be >= 0")
        if self.system_prompts < 1 or self.max_turns < 1:
            raise ValueError(f"{self.name}: system_prompts and max_turns must be >= 1")

    @property
    def expected_turns(self) -> float:
        """Mean turns per session (geometric, capped at ``max_turns``)."""
        q = self.continue_prob
        return (1.0 - q**self.max_turns) / (1.0 - q)

    def system_pool(self) -> tuple[np.ndarray, np.ndarray]:
        """The shared system prompts: popularity (sums to 1) and length in tokens, by rank."""
        n = self.system_prompts
        popularity = np.arange(1, n + 1, dtype=float) ** -self.system_zipf
        popularity /= popularity.sum()
        quantiles = np.exp(self.system_tokens_sigma * ndtri((np.arange(n) + 0.5) / n))
        # A fixed scatter of lengths over ranks, so the most popular prompt is not always the
        # shortest, and the same pool for every seed.
        lengths = quantiles[np.random.default_rng(n).permutation(n)]
        lengths *= self.system_tokens_mean / (popularity @ lengths)
        return popularity, np.rint(lengths).astype(np.int64)


@dataclass(frozen=True)
class SynthPreset:
    """A named synthetic workload.

    Parameters
    ----------
    name : str
        Preset name (``bailian-a`` ...).
    description : str
        One line on what it imitates.
    types : tuple of TypeProfile
        One profile per request type; type names must be distinct.
    max_input_tokens : int
        Context limit: a session ends before a turn whose prompt would exceed it.
    """

    name: str
    description: str
    types: tuple[TypeProfile, ...]
    max_input_tokens: int = 131_072

    def __post_init__(self):
        names = [t.name for t in self.types]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"preset {self.name!r}: needs types with distinct names, got {names}")


# Values calibrated against the published statistics, on seeds 0-2 (docs/synth.md explains how
# each knob reaches its target).
PRESETS: dict[str, SynthPreset] = {
    "bailian-a": SynthPreset(
        name="bailian-a",
        description="Bailian trace A (to-C chat): 6 QPS, text/search/image/file, multi-turn sessions",
        types=(
            TypeProfile(
                name="text", sessions_per_hour=6_630, continue_prob=0.62,
                think_median_s=160.0, think_sigma=1.4,
                user_tokens_mean=320, user_tokens_sigma=1.2,
                output_tokens_mean=425, output_tokens_sigma=0.9,
                system_prompts=8, system_tokens_mean=450,
            ),
            TypeProfile(
                name="search", sessions_per_hour=2_390, continue_prob=0.45,
                think_median_s=175.0, think_sigma=1.4,
                user_tokens_mean=1_750, user_tokens_sigma=0.6,
                output_tokens_mean=500, output_tokens_sigma=0.8,
                system_prompts=3, system_tokens_mean=300,
            ),
            TypeProfile(
                name="image", sessions_per_hour=320, continue_prob=0.6,
                think_median_s=5.0, think_sigma=1.0,
                user_tokens_mean=80, user_tokens_sigma=0.8,
                output_tokens_mean=250, output_tokens_sigma=0.8,
                system_prompts=2, system_tokens_mean=300,
                document_tokens_mean=1_200, document_tokens_sigma=0.4,
            ),
            TypeProfile(
                name="file", sessions_per_hour=410, continue_prob=0.5,
                think_median_s=220.0, think_sigma=1.4,
                user_tokens_mean=100, user_tokens_sigma=0.8,
                output_tokens_mean=500, output_tokens_sigma=0.8,
                system_prompts=2, system_tokens_mean=400,
                document_tokens_mean=6_000, document_tokens_sigma=1.0,
            ),
        ),
    ),  # fmt: skip
    "bailian-b": SynthPreset(
        name="bailian-b",
        description="Bailian trace B (to-B API): 24 QPS, api/text, single-turn, shared system prompts",
        types=(
            TypeProfile(
                name="api", sessions_per_hour=75_050, continue_prob=0.0005,
                think_median_s=10.0, think_sigma=1.0,
                user_tokens_mean=900, user_tokens_sigma=1.0,
                output_tokens_mean=150, output_tokens_sigma=1.0,
                system_prompts=130, system_tokens_mean=1_200, system_tokens_sigma=0.8,
                system_zipf=0.85,
            ),
            TypeProfile(
                name="text", sessions_per_hour=10_950, continue_prob=0.001,
                think_median_s=60.0, think_sigma=1.0,
                user_tokens_mean=600, user_tokens_sigma=1.0,
                output_tokens_mean=300, output_tokens_sigma=0.9,
                system_prompts=4, system_tokens_mean=400,
            ),
        ),
    ),  # fmt: skip
}
