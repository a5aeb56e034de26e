"""Replay engine: a simulation of vLLM's prefix cache driven by trace timestamps."""
