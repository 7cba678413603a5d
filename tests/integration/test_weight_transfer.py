"""Weight syncs broadcast to an engine process over torch.distributed (`weight_transfer: collective`,
gloo on the CPU: the path replicas pinned to GPUs of their own take with NCCL): the engine ends up
holding exactly what a by-reference (ipc) sync gives it, bucket by bucket and cast to its dtype; a
refused sync leaves the two processes in step; a dead engine fails the sync at once, not at the
timeout. Real transformers engines in real child processes."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from services.core.config.run import ConfigError, parse_config
from services.models.engine import GenerationEngine, SamplingParams, WeightSyncError
from services.models.engines.factory import make_engine
from services.models.engines.proc import EngineDied, ProcessEngine
from services.models.engines.replicas import ReplicaEngine, ReplicaSetBroken
from services.models.weights.check import FAULT_ENV, WeightsMismatch
from services.models.weights.transfer import Receiver, Sender, backend_for, plan, resolve
from tests.fleet_helpers import perturbed_state

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

PROMPTS = [[1, 5, 7, 9, 11, 4], [2, 3, 3, 8], [6, 1, 2, 2, 9, 9, 10]]


def _out(engine: GenerationEngine) -> list[tuple[list[int], list[float]]]:
    """What the engine samples for fixed prompts and seed: equal outputs mean equal weights."""
    done = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3))
    return [(c.token_ids, c.logprobs) for c in done]


def _checked(engine: ProcessEngine, weights: dict[str, Any]) -> None:
    """The sync's checksums were compared for every tensor the engine holds (a mismatch would have
    raised): the engine holds exactly what was sent, checked directly, not through its samples."""
    held = len({t.untyped_storage().data_ptr() for t in weights.values()})  # a tied pair is one tensor
    assert (engine.last_sync["checksums_checked"], engine.last_sync["checksums_unpaired"]) == (held, 0)


def test_a_collective_sync_loads_exactly_what_an_ipc_sync_loads_and_a_refused_one_changes_nothing(
    random_model: Path,
) -> None:
    weights = perturbed_state(random_model, 1)
    ipc = ProcessEngine("transformers", random_model, transfer="ipc", threads=1)
    coll = ProcessEngine("transformers", random_model, transfer="collective", transfer_bucket_bytes=64 * 2**10,
                         threads=1)
    try:
        assert coll.describe()["weight_transfer"] == "collective"
        assert _out(coll) == _out(ipc)
        ipc.update_weights(weights.items(), 1)
        coll.update_weights(weights.items(), 1)
        assert coll.version == 1
        _checked(ipc, weights)
        _checked(coll, weights)
        assert _out(coll) == _out(ipc)  # bit for bit: float32 both ways
        unique = {t.untyped_storage().data_ptr(): t for t in weights.values()}  # tied tensors travel twice
        assert coll.last_sync["bytes"] >= sum(t.numel() * t.element_size() for t in unique.values())
        assert coll.last_sync["buckets"] > 1  # 64 KiB buckets for a model of a few hundred
        # Twice more, each a new version: the group is joined once and reused.
        for v, seed in ((2, 2), (3, 3)):
            w = perturbed_state(random_model, seed)
            ipc.update_weights(w.items(), v)
            coll.update_weights(w.items(), v)
            _checked(ipc, w)
            _checked(coll, w)
        assert _out(coll) == _out(ipc)

        # A refused sync (checked in the child after every bucket arrived) leaves both in step.
        before = _out(coll)
        with pytest.raises(WeightSyncError, match="version"):
            coll.update_weights(perturbed_state(random_model, 6).items(), 1)  # a version from the past
        bad = dict(perturbed_state(random_model, 7))
        bad["not.a.weight"] = torch.zeros(3)
        with pytest.raises(WeightSyncError, match=r"not\.a\.weight"):
            coll.update_weights(bad.items(), 4)
        assert coll.alive and coll.version == 3 and _out(coll) == before
        coll.update_weights(perturbed_state(random_model, 8).items(), 4)  # the next broadcast still lines up
        assert coll.version == 4 and _out(coll) != before
        hollow = dict(perturbed_state(random_model, 9))
        hollow[next(iter(hollow))] = torch.empty(3, device="meta")
        with pytest.raises(WeightSyncError, match="is a meta tensor"):
            coll.update_weights(hollow.items(), 5)  # refused before the plan goes out
        coll.update_weights(perturbed_state(random_model, 9).items(), 5)
        assert coll.alive and coll.version == 5
    finally:
        ipc.close()
        coll.close()


def test_a_collective_sync_casts_to_the_engines_dtype_before_it_travels(random_model: Path) -> None:
    weights = perturbed_state(random_model, 4)
    ref = make_engine("transformers", random_model, dtype="bfloat16")
    coll = ProcessEngine("transformers", random_model, transfer="collective", dtype="bfloat16", threads=1)
    try:
        ref.update_weights(weights.items(), 1)
        coll.update_weights(weights.items(), 1)
        _checked(coll, weights)  # against the trainer's float32 tensors cast as the engine casts them
        assert _out(coll) == _out(ref)
        fp32_bytes = sum(t.numel() * 4 for t in weights.values())
        assert coll.last_sync["bytes"] == pytest.approx(fp32_bytes / 2)
    finally:
        ref.close()
        coll.close()


def test_a_sync_that_leaves_one_tensor_one_ulp_off_fails_naming_replica_and_parameter_and_serves_nothing(
    random_model: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    w1 = perturbed_state(random_model, 1)
    name = next(n for n in sorted(w1) if ".layers.0." in n and n.endswith("weight"))
    # Replica 1 (by broadcast) loads it one ulp off at version 2; replica 0 (by reference) at version 3.
    monkeypatch.setenv(FAULT_ENV, f"2:{name}:-replica1,3:{name}:-replica0")
    e0 = ProcessEngine("transformers", random_model, transfer="ipc", label="-replica0", threads=1)
    e1 = ProcessEngine("transformers", random_model, transfer="collective", label="-replica1", threads=1)
    replicas = ReplicaEngine([e0, e1])
    try:
        replicas.update_weights(w1.items(), 1)
        _checked(e0, w1)
        _checked(e1, w1)
        want = (rf"replica 1: weight sync to version 2 failed its checksum check: engine-replica1 holds"
                rf" {re.escape(name)} with checksum \(-?\d+, \d+\), the trainer sent \(-?\d+, \d+\)")
        with pytest.raises(WeightsMismatch, match=want) as err:
            replicas.update_weights(perturbed_state(random_model, 2).items(), 2)
        assert err.value.parameter == name and err.value.held != err.value.sent
        # Fail closed: the version does not move, the replica that holds it is stopped, nothing generates.
        assert replicas.version == 1 and not replicas.alive and replicas.stopped_for == str(err.value)
        assert replicas.dead_replicas() == [1] and e1.version == 1
        with pytest.raises(ReplicaSetBroken, match="checksum"):
            replicas.generate(PROMPTS, SamplingParams(max_new_tokens=2))
        with pytest.raises(EngineDied, match="checksum"):
            e1.generate(PROMPTS, SamplingParams(max_new_tokens=2))

        with pytest.raises(WeightsMismatch, match=rf"engine-replica0 holds {re.escape(name)}"):
            e0.update_weights(perturbed_state(random_model, 3).items(), 3)
        assert not e0.alive and e0.version == 2 and e0.stopped_for is not None
    finally:
        replicas.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("to", [None, "cuda"])
def test_a_gloo_broadcast_of_cuda_tensors_sends_their_values_not_what_the_staging_buffer_held(to: str | None) -> None:
    # Issue 34: the host copies of a gloo bucket were read before the GPU had written them. With
    # `to="cuda"` the receiver lands each bucket on the GPU from its reused pinned buffers.
    sender = Sender("gloo", timeout_s=60, bucket_bytes=64 * 2**20)
    named = [(f"w{i}", torch.zeros(1 << 22, device="cuda")) for i in range(16)]  # 16 MiB each, 4 buckets
    receivers: list[Receiver] = []

    def receive(buckets: Any, got: dict[str, torch.Tensor]) -> None:
        if not receivers:
            receivers.append(Receiver(sender.link, device=to))
        for bucket in receivers[0].stream(buckets):
            got.update((n, t.cpu()) for n, t in bucket)

    try:
        for r in range(1, 4):  # later rounds reuse the pinned blocks of earlier ones
            for i, (_, t) in enumerate(named):
                t.fill_(100.0 * r + i)  # queued on the GPU, still running when the sender stages
            buckets, tensors = sender.plan(named)
            got: dict[str, torch.Tensor] = {}
            th = threading.Thread(target=receive, args=(buckets, got))
            th.start()
            sender.send(tensors)
            th.join(60)
            for n, t in named:
                assert torch.equal(got[n], t.cpu()), f"round {r}: {n} arrived with values it did not have"
    finally:
        sender.close()


def test_an_engine_process_killed_before_a_collective_sync_fails_it_fast(random_model: Path) -> None:
    coll = ProcessEngine("transformers", random_model, transfer="collective", transfer_timeout_s=120, threads=1)
    try:
        # The group exists now: a broadcast to the dead peer would wait on it, were it not for the error.
        coll.update_weights(perturbed_state(random_model, 9).items(), 1)
        os.kill(coll.describe()["process"], signal.SIGKILL)
        time.sleep(0.5)
        t0 = time.monotonic()
        with pytest.raises(EngineDied):
            coll.update_weights(perturbed_state(random_model, 10).items(), 2)
        assert time.monotonic() - t0 < 10, "the sync waited for the timeout instead of failing on the dead peer"
        assert not coll.alive
        with pytest.raises(EngineDied):
            _out(coll)
    finally:
        coll.close()


def test_a_plan_groups_one_dtype_per_bucket_and_casts_only_floating_tensors() -> None:
    named = [("a", torch.zeros(256)), ("b", torch.zeros(256)), ("ids", torch.arange(8)), ("c", torch.zeros(600))]
    buckets, tensors = plan(named, torch.bfloat16, bucket_bytes=1024)
    assert [(b.dtype, b.names) for b in buckets] == [("bfloat16", ("a", "b")), ("bfloat16", ("c",)),
                                                     ("int64", ("ids",))]
    assert [t.dtype for ts in tensors for t in ts] == [torch.bfloat16] * 3 + [torch.int64]
    assert buckets[1].numel == 600  # a tensor larger than a bucket travels alone, whole
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan(named, None, bucket_bytes=0)


def test_auto_transfer_is_ipc_where_the_engine_shares_the_trainers_device() -> None:
    assert resolve("auto", shares_trainer_device=True) == "ipc"
    assert resolve("auto", shares_trainer_device=False) == "collective"
    assert resolve("ipc", shares_trainer_device=False) == "ipc"
    with pytest.raises(WeightSyncError, match="unknown weight transfer 'nccl'"):
        resolve("nccl", shares_trainer_device=True)


def test_the_backend_is_nccl_on_cuda_and_gloo_on_the_cpu_unless_asked() -> None:
    assert backend_for("cuda") == "nccl" and backend_for("cpu") == "gloo"
    assert backend_for("cuda:1", "gloo") == "gloo"  # staged through host memory
    with pytest.raises(WeightSyncError, match="'nccl' needs a CUDA engine"):
        backend_for("cpu", "nccl")
    with pytest.raises(WeightSyncError, match="unknown weight transfer backend 'mpi'"):
        backend_for("cuda", "mpi")


def test_a_collective_transfer_without_an_engine_process_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="weight_transfer 'collective' needs an engine in its own process"):
        parse_config({"generation": {"weight_transfer": "collective"}})
    with pytest.raises(ConfigError, match="weight_transfer_backend 'nccl' needs a CUDA engine"):
        parse_config({"generation": {"replicas": 2, "weight_transfer_backend": "nccl"}})
    cfg = parse_config({"generation": {"weight_transfer": "collective", "replicas": 2}})
    assert cfg.generation.engine_kwargs()["weight_transfer"] == "collective"


def test_a_pipelined_gloo_sync_delivers_every_bucket_whole_sync_after_sync_to_a_caller_that_keeps_them() -> None:
    # Two buckets are in flight on each side and the host buffers are reused across syncs: a bucket
    # written again before its broadcast had left, or handed out before it had arrived, shows here.
    sender = Sender("gloo", timeout_s=60, bucket_bytes=3 * 2**12)
    named = [(f"w{i}", torch.empty(1000 + 37 * i)) for i in range(24)]  # ~10 buckets of ~3 tensors
    receivers: list[Receiver] = []

    def receive(buckets: Any, kept: list[list[tuple[str, torch.Tensor]]]) -> None:
        if not receivers:
            receivers.append(Receiver(sender.link))
        kept.extend(receivers[0].stream(buckets))  # kept, not copied: each bucket must be its own

    try:
        for r in range(3):
            for i, (_, t) in enumerate(named):
                t.copy_(torch.arange(t.numel()) * (r + 1) + i)
            buckets, tensors = sender.plan(named)
            assert len(buckets) >= 8
            kept: list[list[tuple[str, torch.Tensor]]] = []
            th = threading.Thread(target=receive, args=(buckets, kept))
            th.start()
            assert sender.send(tensors) == sum(t.numel() * 4 for _, t in named)
            th.join(60)
            got = {n: t for bucket in kept for n, t in bucket}
            assert list(got) == [n for n, _ in named]
            for n, t in named:
                assert torch.equal(got[n], t), f"sync {r}: {n} arrived with values it did not have"
    finally:
        sender.close()
