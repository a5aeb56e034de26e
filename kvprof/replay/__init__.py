"""Replay a trace against a live OpenAI-compatible server (vLLM) and measure what its prefix cache does.

Needs the ``replay`` extra (``pip install 'kvprof[replay]'``: httpx, httpx-sse, prometheus_client).
:func:`run_replay` is the whole replay; the modules are its parts: prompts of token ids
(:mod:`~kvprof.replay.prompts`), the server (:mod:`~kvprof.replay.server`) and how its answers
are read (:mod:`~kvprof.replay.response`), sending on schedule (:mod:`~kvprof.replay.runner`) and
the cost model fitted to what was measured (:mod:`~kvprof.replay.calibrate`).
"""

from kvprof.replay.runner import Pacing
from kvprof.replay.run import ReplayOutcome, ReplaySettings, run_replay

__all__ = ["Pacing", "ReplayOutcome", "ReplaySettings", "run_replay"]
