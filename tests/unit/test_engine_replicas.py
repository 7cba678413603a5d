"""ReplicaEngine below the processes: spreading and joining order, seeds per row, the all-or-nothing
version, fail-fast on a dead replica, and where replicas are placed. Real tiny transformers engines
in this process (the process-engine replicas are in tests/integration/test_engine_replicas.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from services.core.config.run import parse_config
from services.models.engine import Completion, EngineError, SamplingParams, WeightSyncError
from services.models.engines.factory import make_engine
from services.models.engines.hf_engine import TransformersEngine
from services.models.engines.replicas import ReplicaEngine, ReplicaSetBroken, replica_layout, spread
from services.models.roles.tokenizer import encode_prompt
from services.tasks import make_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(random_model: Path) -> Path:
    return random_model  # EOS is rare, so rows run to max_new_tokens and sampling shows


@pytest.fixture(scope="module")
def prompts(model: Path) -> list[list[int]]:
    from services.models.io.loading import load_tokenizer

    task, tok = make_task("arithmetic"), load_tokenizer(model)
    return [encode_prompt(tok, task.prompt(i).text)[: 2 + i % 4] for i in range(7)]


def test_spread_gives_contiguous_slices_that_differ_by_one_and_cover_every_row() -> None:
    assert spread(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert spread(2, 4) == [(0, 1), (1, 2)]  # idle replicas get no empty call
    assert spread(0, 2) == []
    for n in range(12):
        for m in range(1, 5):
            parts = spread(n, m)
            assert [i for a, b in parts for i in range(a, b)] == list(range(n))
            sizes = [b - a for a, b in parts]
            assert not sizes or max(sizes) - min(sizes) <= 1


class _Tagged:
    """A stand-in replica that answers each prompt with its own first token and the row's seed id,
    and records what it was asked: the join order and the first_row arithmetic are what is checked."""

    def __init__(self) -> None:
        self.version, self.eos_token_ids, self.in_flight, self.alive = 0, (0,), 0, True
        self.calls: list[tuple[int, int]] = []
        self.fail_update: Exception | None = None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.calls.append((params.first_row, len(prompts)))
        return [Completion([p[0], params.first_row + i], [0.0, 0.0], "length") for i, p in enumerate(prompts)]

    def update_weights(self, named, version: int) -> None:  # type: ignore[no-untyped-def]
        if self.fail_update is not None:
            raise self.fail_update
        list(named)
        self.version = version

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def abort(self) -> None: ...
    def close(self) -> None:
        self.alive = False


class _Synced(_Tagged):
    """A replica whose sync takes a while and records how many syncs of its set run at once."""

    lock = threading.Lock()

    def __init__(self, by_broadcast: bool, live: list[int]) -> None:
        super().__init__()
        self.by_broadcast, self._live = by_broadcast, live

    def update_weights(self, named, version: int) -> None:  # type: ignore[no-untyped-def]
        with self.lock:
            self._live[0] += 1
            self._live[1] = max(self._live[1], self._live[0])
        try:
            threading.Event().wait(0.2)
            super().update_weights(named, version)
        finally:
            with self.lock:
                self._live[0] -= 1


def test_completions_join_in_request_order_and_each_slice_knows_its_first_row() -> None:
    reps = [_Tagged(), _Tagged(), _Tagged()]
    engine = ReplicaEngine(reps)  # type: ignore[arg-type]
    out = engine.generate([[10 + i] for i in range(8)], SamplingParams(first_row=100))
    assert [c.token_ids for c in out] == [[10 + i, 100 + i] for i in range(8)]
    assert [r.calls for r in reps] == [[(100, 3)], [(103, 3)], [(106, 2)]]


def test_rows_sample_the_same_on_one_replica_or_three(model: Path, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)
    one = TransformersEngine.from_path(model).generate(prompts, params)
    three = ReplicaEngine([TransformersEngine.from_path(model) for _ in range(3)]).generate(prompts, params)
    assert [c.token_ids for c in three] == [c.token_ids for c in one]
    for a, b in zip(one, three, strict=True):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
    # and the rows of a GRPO group (one prompt repeated) still differ from each other
    group = TransformersEngine.from_path(model).generate([prompts[0]] * 6, params)
    assert len({tuple(c.token_ids) for c in group}) > 1


def test_weight_sync_reaches_every_replica_before_the_version_moves(model: Path, prompts: list[list[int]]) -> None:
    reps = [TransformersEngine.from_path(model) for _ in range(2)]
    engine = ReplicaEngine(reps)
    policy = TransformersEngine.from_path(model).model
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    seen: list[tuple[int, int, int]] = []
    entered, release = threading.Event(), threading.Event()
    real = reps[1].update_weights

    def slow_update(named, version):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(10)
        real(named, version)

    reps[1].update_weights = slow_update  # type: ignore[method-assign]
    sync = threading.Thread(target=engine.update_weights, args=(policy.state_dict().items(), 1))
    sync.start()
    assert entered.wait(10)
    # Replica 0 has the new weights, replica 1 not yet: the set still says 0, and a generate waits.
    assert (reps[0].version, reps[1].version, engine.version) == (1, 0, 0)
    gen = threading.Thread(target=lambda: seen.append((engine.version, *(r.version for r in reps))))
    caller = threading.Thread(target=lambda: (engine.generate(prompts[:2], SamplingParams(max_new_tokens=2)),
                                              gen.start()))
    caller.start()
    caller.join(0.3)
    assert caller.is_alive(), "a generate ran while the replicas held two versions"
    release.set()
    sync.join(10)
    caller.join(10)
    gen.join(10)
    assert seen == [(1, 1, 1)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    ref = TransformersEngine(policy, reps[0].eos_token_ids, 0).generate(prompts, greedy)
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == [c.token_ids for c in ref]


@pytest.mark.parametrize("by_broadcast", [False, True])
def test_a_strict_check_that_fails_changes_no_replica(by_broadcast: bool) -> None:
    reps = [_Synced(by_broadcast, [0, 0]), _Synced(by_broadcast, [0, 0])]
    engine = ReplicaEngine(reps)  # type: ignore[arg-type]
    for r in reps:  # they hold the same model: the check fails on each alike
        r.fail_update = WeightSyncError("missing: lm_head.weight")
    with pytest.raises(WeightSyncError):
        engine.update_weights([], 1)
    assert engine.version == 0 and engine.alive
    assert [r.version for r in reps] == [0, 0]


@pytest.mark.parametrize("by_broadcast, at_once", [(True, 3), (False, 1)])
def test_broadcast_syncs_reach_the_replicas_at_once_and_by_reference_ones_one_after_the_other(
    by_broadcast: bool, at_once: int,
) -> None:
    live = [0, 0]  # syncs running now, most at once
    reps = [_Synced(by_broadcast, live) for _ in range(3)]
    engine = ReplicaEngine(reps)  # type: ignore[arg-type]
    engine.update_weights([], 1)
    assert live[1] == at_once and engine.version == 1 and [r.version for r in reps] == [1, 1, 1]


@pytest.mark.parametrize("by_broadcast", [False, True])
def test_a_sync_that_fails_on_one_replica_after_another_took_it_kills_the_set(by_broadcast: bool) -> None:
    reps = [_Synced(by_broadcast, [0, 0]), _Synced(by_broadcast, [0, 0])]
    engine = ReplicaEngine(reps)  # type: ignore[arg-type]
    reps[1].fail_update = EngineError("engine process died (exit code -9) during update_weights")
    with pytest.raises(ReplicaSetBroken, match=r"replicas \[0\].*replica 1"):
        engine.update_weights([], 1)
    assert not engine.alive and engine.version == 0
    with pytest.raises(ReplicaSetBroken):
        engine.generate([[1]], SamplingParams())


def test_one_dead_replica_makes_the_set_dead() -> None:
    reps = [_Tagged(), _Tagged()]
    engine = ReplicaEngine(reps)  # type: ignore[arg-type]
    reps[1].alive = False
    assert not engine.alive and engine.dead_replicas() == [1]


def test_layout_gives_each_replica_its_gpus_or_splits_one_gpu() -> None:
    own = replica_layout(2, 2, ["GPU-a", "GPU-b", "GPU-c", "GPU-d"])
    assert own.devices == (("GPU-a", "GPU-b"), ("GPU-c", "GPU-d")) and own.memory_share == 1.0
    shared = replica_layout(2, 1, ["3"])
    assert shared.devices == (("3",), ("3",)) and shared.memory_share == 0.5
    assert shared.visible_devices(1) == "3"
    cpu = replica_layout(2, 1, [])
    assert cpu.visible_devices(0) is None
    with pytest.raises(EngineError, match=r"needs 4 GPUs.*has 2"):
        replica_layout(2, 2, ["0", "1"])
    with pytest.raises(EngineError, match="needs 2 GPUs per replica"):
        replica_layout(1, 2, [])


def test_config_checks_replicas_against_the_actors_device_group() -> None:
    base = {"devices": {"act": {"ids": [0, 1]}}, "services": {"actor": {"device_group": "act"}}}
    cfg = parse_config({**base, "generation": {"engine": "vllm", "replicas": 2}})
    assert cfg.actor_gpu_count == 2
    assert cfg.generation.engine_kwargs()["replicas"] == 2
    with pytest.raises(Exception, match="replicas 2 x tensor_parallel_size 2 needs 4 GPUs"):
        parse_config({**base, "generation": {"engine": "vllm", "replicas": 2, "tensor_parallel_size": 2}})
    with pytest.raises(Exception, match="tensor_parallel_size 2 needs engine 'vllm'"):
        parse_config({"generation": {"tensor_parallel_size": 2}})


def test_tensor_parallel_engines_are_refused_until_their_weight_sync_exists(model: Path) -> None:
    with pytest.raises(EngineError, match="needs engine 'vllm'"):
        make_engine("transformers", model, tensor_parallel_size=2)
    with pytest.raises(EngineError, match="NCCL weight-transfer path, which is not built yet"):
        make_engine("vllm", model, tensor_parallel_size=2)


def test_replica_metrics_carry_the_nvml_index_of_each_replicas_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML cannot run here: a stand-in module answers like a host whose GPUs 2 and 5 the actor sees
    (CUDA_VISIBLE_DEVICES=2,5); each replica's `gpu` label is the host index, its memory its process's."""
    import types

    from prometheus_client import generate_latest

    from services.actor.engine_metrics import ReplicaCollector, replica_rows
    from services.core.observability.gpu import GpuMonitor
    from services.core.observability.metrics import ServiceMetrics

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    reps = [_Tagged(), _Tagged()]
    for pid, r in zip((101, 202), reps, strict=True):
        r.describe = lambda pid=pid: {"engine": "vllm", "process": pid}  # type: ignore[attr-defined]
    engine = ReplicaEngine(reps, replica_layout(2, 1, ["2", "5"]))  # type: ignore[arg-type]
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 8,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}", nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            types.SimpleNamespace(pid=101 if h == "h2" else 202, usedGpuMemory=(3 if h == "h2" else 4) << 30)])
    m = ServiceMetrics("actor")
    gpu = GpuMonitor(m, nvml=nvml)
    engine.generate([[7], [8], [9]], SamplingParams())
    rows = replica_rows(engine, gpu)
    assert [r["gpus"] for r in rows] == [[{"gpu": 2, "memory_bytes": 3 << 30}], [{"gpu": 5, "memory_bytes": 4 << 30}]]
    assert [r["tokens"] for r in rows] == [4, 2]
    m.registry.register(ReplicaCollector(engine, gpu))
    text = generate_latest(m.registry).decode()
    assert 'rlfleet_engine_replica_gpu_memory_bytes{gpu="5",replica="1",service="actor"} 4.294967296e+09' in text
    assert 'rlfleet_engine_replica_tokens_total{replica="0",service="actor"} 4.0' in text


class _Starting:
    """Stands in for a ProcessEngine: records when its start began and ended."""

    spans: ClassVar[dict[str, tuple[float, float]]] = {}
    options: ClassVar[dict[str, dict[str, object]]] = {}
    fail: ClassVar[str | None] = None

    def __init__(self, name: str, model_path: Path, *, label: str = "", **kw: object) -> None:
        import time

        t0 = time.monotonic()
        time.sleep(0.3)
        _Starting.spans[label] = (t0, time.monotonic())
        _Starting.options[label] = kw
        if label == _Starting.fail:
            raise EngineError(f"{label} did not start")
        self.version, self.closed = 0, False

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(("kv_fixed", "together"), [(True, True), (False, False)])
def test_replicas_on_one_gpu_start_together_unless_vllm_profiles_free_memory(
        monkeypatch: pytest.MonkeyPatch, kv_fixed: bool, together: bool) -> None:
    import services.models.engines.proc as engine_proc

    monkeypatch.setattr(engine_proc, "ProcessEngine", _Starting)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("RLFLEET_VLLM_KV_CACHE_MEMORY_BYTES", raising=False)
    _Starting.spans, _Starting.fail = {}, None
    opts: dict[str, Any] = {"kv_cache_memory_bytes": 2**30} if kv_fixed else {}
    eng = make_engine("vllm", Path("/m"), device="cuda", replicas=3, gpu_memory_utilization=0.6, **opts)
    assert isinstance(eng, ReplicaEngine) and len(eng.engines) == 3
    spans = [_Starting.spans[f"-replica{r}"] for r in range(3)]
    overlap = min(end for _, end in spans) > max(start for start, _ in spans)
    assert overlap is together
    if not together:  # one after the other
        assert spans[1][0] >= spans[0][1] and spans[2][0] >= spans[1][1]


def test_vllm_replicas_after_the_first_compile_into_caches_of_their_own(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import services.models.engines.proc as engine_proc

    monkeypatch.setattr(engine_proc, "ProcessEngine", _Starting)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    _Starting.spans, _Starting.fail, _Starting.options = {}, None, {}
    make_engine("vllm", Path("/m"), device="cuda", replicas=3, kv_cache_memory_bytes=2**30,
                compile_cache_dir=str(tmp_path / "vc"))
    opts = [_Starting.options[f"-replica{r}"] for r in range(3)]
    # Replica 0 keeps the cache a single engine uses; the others name a directory of their own under it,
    # which the engine's process resolves (tests/unit/test_vllm_options.py).
    assert [o.get("compile_cache_subdir") for o in opts] == [None, "replica1", "replica2"]
    assert {o["compile_cache_dir"] for o in opts} == {str(tmp_path / "vc")}


def test_a_replica_that_fails_to_start_closes_the_ones_that_started(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.models.engines.proc as engine_proc

    built: list[_Starting] = []

    class Recorded(_Starting):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, **kw)  # type: ignore[arg-type]
            built.append(self)

    monkeypatch.setattr(engine_proc, "ProcessEngine", Recorded)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    _Starting.spans, _Starting.fail = {}, "-replica2"
    with pytest.raises(EngineError, match="-replica2 did not start"):
        make_engine("vllm", Path("/m"), device="cuda", replicas=3, kv_cache_memory_bytes=2**30)
    assert len(built) == 2 and all(e.closed for e in built)
