"""Synthetic Bailian-format traces, one module per job.

* :mod:`~kvprof.profiler.synth.presets`: the per-type session profiles and the named presets
  (``bailian-a``, ``bailian-b``) calibrated to the published statistics (``docs/synth.md``);
* :mod:`~kvprof.profiler.synth.generator`: :func:`generate`, records of a preset;
* :mod:`~kvprof.profiler.synth.planted`: :func:`planted`, a trace with known reuse parameters for
  testing the profiler's fits;
* :mod:`~kvprof.profiler.synth.writer`: :func:`write_jsonl`, plain or compressed, atomically;
* :mod:`~kvprof.profiler.synth.measure`: :func:`measure`, the calibrated statistics, with the
  profiler's definitions of a hit and a reuse.

Records are plain dicts in the Bailian JSONL layout, which the reader then treats like any real trace.
"""

from kvprof.profiler.synth.generator import generate
from kvprof.profiler.synth.measure import measure
from kvprof.profiler.synth.planted import planted
from kvprof.profiler.synth.presets import BLOCK_SIZE, PRESETS, SynthPreset, TypeProfile
from kvprof.profiler.synth.writer import write_jsonl

__all__ = ["BLOCK_SIZE", "PRESETS", "SynthPreset", "TypeProfile", "generate", "measure", "planted", "write_jsonl"]
