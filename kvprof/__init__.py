"""kvprof: profile-driven KV-cache eviction for LLM serving."""

__version__ = "0.1.0"

from kvprof import jitcache

jitcache.register()  # before any compiled function is declared
