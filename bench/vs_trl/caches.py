"""Each framework's compile caches (vLLM's graphs, Inductor's, Triton's and FlashInfer's kernels) under a
home of its own, and whether a phase found vLLM's graphs there or compiled them."""

from __future__ import annotations

import os
from pathlib import Path

from bench.vs_trl.phases import Phase
from bench.vs_trl.workload import DRY, WORK


def framework(p: Phase) -> str:
    return "trl" if p.kind.startswith("trl") else "rlfleet"


def framework_home(p: Phase) -> Path:
    return WORK / "home" / framework(p)


def phase_env(p: Phase) -> dict[str, str]:
    """Each framework compiles into caches of its own: vLLM's graphs, Inductor's and Triton's kernels,
    FlashInfer's JIT (everything under a home of its own). Its first launch on the host compiles from
    cold, as a user's first run does, later launches load what it compiled, and no framework starts on
    kernels another one compiled (on 2026-12-02 TRL ran after rlfleet on one shared cache)."""
    home = framework_home(p)
    home.mkdir(parents=True, exist_ok=True)
    env = os.environ.copy()
    env.pop("VLLM_CACHE_ROOT", None)
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), TORCHINDUCTOR_CACHE_DIR=str(home / "inductor"),
               TRITON_CACHE_DIR=str(home / ".triton" / "cache"))
    return env


def vllm_compile_cache(p: Phase) -> set[str]:
    """vLLM's compiled-graph cache entries of `p`'s framework, one per model and engine configuration
    (its hash). A phase that adds one compiled from cold; one that adds none loaded its graphs."""
    cache = framework_home(p) / ".cache" / "vllm" / "torch_compile_cache"
    return {d.name for d in cache.iterdir()} if cache.is_dir() else set()


def uses_vllm(p: Phase) -> bool:
    return not DRY and (p.kind in ("trl-vllm", "vllm-alone") or (p.kind == "fleet" and p.engine == "vllm"))
