"""The in-process generation backends by name: which can run here, and building one.

The engine child process (`engines.proc`) builds its engine here too, so this module must not know
about process engines: `factory.make_engine` is the one entry point that does.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from services.models.engine import EngineError, EngineUnavailable, GenerationEngine

ENGINE_NAMES: tuple[str, ...] = ("transformers", "vllm")


def _vllm_status() -> str | None:
    """None when the vLLM backend can run here (vllm importable and a CUDA GPU), else why not."""
    if importlib.util.find_spec("vllm") is None:
        return "generation engine 'vllm' needs the 'vllm' package, which is not importable here" \
               " (install it with: pip install 'rlfleet[vllm]', or use engine: transformers)"
    from services.models.engines.vllm_engine import vllm_unavailable_reason

    return vllm_unavailable_reason()


def available_engines() -> dict[str, str | None]:
    """Every backend name mapped to None when it can run here, else the reason it cannot."""
    return {"transformers": None, "vllm": _vllm_status()}


def check_engine_name(name: str) -> None:
    if name not in ENGINE_NAMES:
        raise EngineError(f"unknown generation engine {name!r}; known: {', '.join(ENGINE_NAMES)}")


def build_engine(
    name: str,
    model_path: Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    micro_batch: int = 0,
    **options: Any,
) -> GenerationEngine:
    """The backend `name` on `model_path`, in this process; `options` go to the backend."""
    check_engine_name(name)
    if name == "transformers":
        from services.models.engines.hf_engine import TransformersEngine

        if options:
            raise EngineError(f"engine 'transformers' takes no options; got {', '.join(sorted(options))}")
        return TransformersEngine.from_path(model_path, dtype=dtype, device=device, micro_batch=micro_batch)
    reason = _vllm_status()
    if reason is not None:
        raise EngineUnavailable(reason)
    from services.models.engines.vllm_engine import VLLMEngine

    return VLLMEngine.from_path(model_path, dtype=dtype, device=device, micro_batch=micro_batch, **options)
