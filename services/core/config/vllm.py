"""The vLLM engine's options (`generation.vllm`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from services.core.config.base import Strict as _Strict


class VLLMOptions(_Strict):
    # The engine shares its GPU with the trainer when colocated: leave room for it.
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.35
    enforce_eager: bool = False
    max_model_len: Annotated[int, Field(ge=16)] | None = None
    cudagraph_max_batch: Annotated[int, Field(ge=1)] | None = None
    """Capture CUDA graphs only for decode batches up to this many sequences (vLLM's own sizes up to it,
    plus this one): set it to the sequences a step generates to skip capturing sizes the run never
    uses. null: vLLM's default sizes."""
    compile_cache_dir: str | None = None
    """vLLM's compile cache (torch.compile artefacts), kept across restarts; a relative path is taken
    under run.dir. null: vLLM's default (~/.cache/vllm)."""

    prefix_caching: bool = True
    """Share the KV blocks of equal prompt prefixes (a GRPO group's copies of one prompt prefill once).
    It costs the scheduler per-token work in every decode step (hashing each filled block, caching and
    evicting blocks), on the one thread that paces a small model's decoding; the weight sync empties
    the cache every step, so only the copies within one step share anything. false: short prompts
    and small models, where prefill is cheap and decoding is bound by that thread."""

    kv_cache_gib: Annotated[float, Field(gt=0)] | None = None
    """The KV cache's size, fixed, instead of what vLLM's memory profiling leaves of
    gpu_memory_utilization. The profiling reads the GPU's free memory, so another process allocating
    meanwhile (the trainer, the reference) would shrink or break it; with a fixed size the actor builds
    and compiles its trainer while its engine process starts. It must hold a step's sequences at
    max_model_len (vLLM refuses to start otherwise). null: profile."""

    def engine_options(self, run_dir: Path | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"gpu_memory_utilization": self.gpu_memory_utilization,
                               "enforce_eager": self.enforce_eager, "enable_prefix_caching": self.prefix_caching}
        if self.kv_cache_gib is not None:
            out["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        if self.max_model_len is not None:
            out["max_model_len"] = self.max_model_len
        if self.cudagraph_max_batch is not None:
            out["cudagraph_max_batch"] = self.cudagraph_max_batch
        if self.compile_cache_dir is not None:
            cache = Path(self.compile_cache_dir)
            out["compile_cache_dir"] = str(cache if cache.is_absolute() or run_dir is None else run_dir / cache)
        return out
