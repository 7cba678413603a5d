"""The run configuration: `run.RunConfig` (one YAML file, validated once at start-up) and its
sections (`algo`, `workload`, `trackers`, `vllm`), all built on `base`.

May import: services.core.ids
"""
