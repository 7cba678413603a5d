"""`make_engine`: the one way services and the local loop build a generation engine."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.models.engine import EngineError, EngineUnavailable, GenerationEngine
from services.models.engines.backends import ENGINE_NAMES, available_engines, build_engine, check_engine_name
from services.models.weights.route import TRANSFERS
from services.models.weights.transfer import resolve

__all__ = ["ENGINE_NAMES", "available_engines", "make_engine", "visible_gpus"]


def visible_gpus(device: str) -> list[str]:
    """The GPUs an engine on `device` may use, as CUDA_VISIBLE_DEVICES entries: the variable's own
    entries when set (`rlfleet up` sets it to the actor's device group), else every GPU torch counts;
    none for a CPU device."""
    if not device.startswith("cuda"):
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def make_engine(
    name: str,
    model_path: Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    micro_batch: int = 0,
    process: bool = False,
    replicas: int = 1,
    tensor_parallel_size: int = 1,
    weight_transfer: str = "auto",
    weight_transfer_backend: str = "auto",
    weight_transfer_bucket_mb: int = 512,
    weight_transfer_timeout_s: float = 300.0,
    **options: Any,
) -> GenerationEngine:
    """`options` go to the backend (vLLM: gpu_memory_utilization, enforce_eager, max_model_len, ...).
    `process=True` runs the engine in a child process of its own (`services.models.engines.proc`).
    `replicas` > 1 builds that many engines, each in its own process pinned to its GPUs
    (`services.models.engines.replicas`), served as one; `tensor_parallel_size` is vLLM's, per replica.
    `weight_transfer` (auto, ipc, collective) is how weight syncs reach a child process
    (`services.models.weights.transfer`)."""
    if weight_transfer not in TRANSFERS:
        raise EngineError(f"unknown weight transfer {weight_transfer!r}: use one of {', '.join(TRANSFERS)}")
    transfer: dict[str, Any] = {"transfer_backend": weight_transfer_backend,
                                "transfer_bucket_bytes": weight_transfer_bucket_mb * 2**20,
                                "transfer_timeout_s": weight_transfer_timeout_s}
    check_engine_name(name)
    if tensor_parallel_size > 1:
        if name != "vllm":
            raise EngineError(f"generation.tensor_parallel_size {tensor_parallel_size} needs engine 'vllm'"
                              f" (engine {name!r} runs on one device)")
        # vLLM would start its TP workers, but our weight sync loads the model in the engine's own
        # process only: the workers would keep the old weights. Refuse rather than train on stale ones.
        raise EngineUnavailable(
            f"generation.tensor_parallel_size {tensor_parallel_size}: syncing weights into tensor-parallel vLLM"
            " workers needs vLLM's NCCL weight-transfer path, which is not built yet (docs/architecture.md,"
            " \"Engine replicas\"); use replicas with tensor_parallel_size 1")
    if replicas > 1:
        return _make_replicas(name, model_path, replicas, tensor_parallel_size, weight_transfer, transfer,
                              dtype=dtype, device=device, micro_batch=micro_batch, **options)
    if process:
        from services.models.engines import boot as engine_boot
        from services.models.engines.proc import ProcessEngine

        # One engine process runs where the actor does: it shares the trainer's device. The actor may
        # have spawned it before its own imports (engine_boot.start_early).
        started = engine_boot.take(name, str(model_path), dict(dtype=dtype, device=device, micro_batch=micro_batch,
                                                               **options))
        return ProcessEngine(name, model_path, transfer=resolve(weight_transfer, shares_trainer_device=True),
                             started=started, dtype=dtype, device=device, micro_batch=micro_batch, **transfer,
                             **options)
    return build_engine(name, model_path, dtype=dtype, device=device, micro_batch=micro_batch, **options)


def _make_replicas(name: str, model_path: Path, replicas: int, tp: int, weight_transfer: Any,
                   transfer: dict[str, Any], **kw: Any) -> GenerationEngine:
    import torch

    from services.models.engines.proc import ProcessEngine
    from services.models.engines.replicas import ReplicaEngine, replica_layout

    layout = replica_layout(replicas, tp, visible_gpus(str(kw["device"])))
    if layout.memory_share < 1.0 and "gpu_memory_utilization" in kw:
        # Replicas on one GPU split the share the config gives the engine.
        kw["gpu_memory_utilization"] = float(kw["gpu_memory_utilization"]) * layout.memory_share
    # CPU replicas split this process's threads instead of each taking all of them.
    threads = None if any(layout.devices) else max(1, torch.get_num_threads() // replicas)

    def start(r: int) -> GenerationEngine:
        pinned = layout.visible_devices(r)
        # A pinned replica sees its GPUs from index 0 on.
        rkw = dict(kw, device="cuda") if pinned is not None else kw
        # The trainer (rank 0) runs on the first of the actor's GPUs: replicas elsewhere cannot
        # open its CUDA IPC handles.
        how = resolve(weight_transfer, shares_trainer_device=not layout.devices[r] or 0 in layout.ordinals[r])
        if name == "vllm" and r > 0:
            # Replicas start together, so each compiles into (or loads from) a vLLM cache of its own,
            # as vLLM's own data-parallel ranks do: none reads another's artefacts half written.
            rkw = dict(rkw, compile_cache_subdir=f"replica{r}")
        return ProcessEngine(name, model_path, visible_devices=pinned, label=f"-replica{r}",
                             threads=threads, transfer=how, **transfer, **rkw)

    # vLLM sizes its KV cache from the GPU's free memory unless the size is fixed: replicas sharing a
    # GPU then start one after the other, so that none counts another's allocations as taken.
    profiles = (name == "vllm" and layout.memory_share < 1.0 and "kv_cache_memory_bytes" not in kw
                and not os.environ.get("RLFLEET_VLLM_KV_CACHE_MEMORY_BYTES"))
    engines: list[GenerationEngine] = []
    try:
        if profiles:
            for r in range(replicas):
                engines.append(start(r))
        else:
            with ThreadPoolExecutor(max_workers=replicas, thread_name_prefix="engine-start") as pool:
                futures = [pool.submit(start, r) for r in range(replicas)]
            engines += [f.result() for f in futures if f.exception() is None]
            failed = next((f.exception() for f in futures if f.exception() is not None), None)
            if failed is not None:
                raise failed
    except BaseException:
        for e in engines:
            e.close()
        raise
    return ReplicaEngine(engines, layout)
