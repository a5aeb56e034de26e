"""Offline profiler: traces in, per-workload reuse statistics and fits out."""
