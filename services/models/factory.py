"""`make_engine`: the one way services and the local loop build a generation engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.models.backends import ENGINE_NAMES, available_engines, build_engine, check_engine_name
from services.models.engine import GenerationEngine

__all__ = ["ENGINE_NAMES", "available_engines", "make_engine"]


def make_engine(
    name: str,
    model_path: Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    micro_batch: int = 0,
    process: bool = False,
    **options: Any,
) -> GenerationEngine:
    """`options` go to the backend (vLLM: gpu_memory_utilization, enforce_eager, max_model_len, ...).
    `process=True` runs the engine in a child process of its own (`services.models.engine_proc`)."""
    if process:
        check_engine_name(name)
        from services.models.engine_proc import ProcessEngine

        return ProcessEngine(name, model_path, dtype=dtype, device=device, micro_batch=micro_batch, **options)
    return build_engine(name, model_path, dtype=dtype, device=device, micro_batch=micro_batch, **options)
