"""What a run tells its operators: structured JSON-lines logs, Prometheus metrics (and NVML GPU
gauges), the append-only event log `rlfleet audit` reads, and experiment trackers.

May import: services.core.config
"""
