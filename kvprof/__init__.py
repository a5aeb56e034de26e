"""kvprof: profile-driven KV-cache eviction for LLM serving."""

__version__ = "0.1.0"
