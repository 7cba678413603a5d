"""UpdateWeights against a real actor process: a checkpoint directory (as `save_checkpoint` writes it)
or a `save_pretrained` directory reaches the trainer and the engine (the next rollout's behaviour
log-probs are the loaded model's), and a path, shape or version the run cannot accept is refused
with the version unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml

from services.core.config.run import RunConfig
from services.core.host.redis_proc import RedisProcess
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.models.checkpoints.checkpoint import save_checkpoint
from services.models.io.loading import load_causal_lm
from services.models.nets.logprobs import response_logprobs
from services.rl.trainer import PolicyTrainer
from services.rl.wire import message, validate_rollout_batch
from tests.fleet_helpers import tiny_config

# Real processes, but no fleet and no time bound: it runs beside the unit tests (make test-unit).
pytestmark = [pytest.mark.timeout(600), pytest.mark.shares_host]


class ActorProc:
    def __init__(self, cfg: RunConfig, redis: RedisProcess) -> None:
        self.cfg = cfg
        self.redis = redis.client()
        path = cfg.run_dir / "fleet.yaml"
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        self.log = (cfg.run_dir / "actor.out").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.actor", "--config", str(path)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        state = cfg.run_dir / "services" / "actor.json"
        deadline = time.monotonic() + 240
        while not (state.exists() and json.loads(state.read_text()).get("state") == "ready"):
            assert self.proc.poll() is None, (cfg.run_dir / "actor.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the actor never became ready"
            time.sleep(0.2)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{json.loads(state.read_text())['grpc_port']}")
        self.stub = pb_grpc.ActorStub(self.channel)
        self.seq = 0

    def commit(self, version: int) -> None:
        """What the controller publishes once it has committed `version`."""
        self.redis.hset(f"rlfleet:{self.cfg.run.name}:versions", mapping={"actor": version})

    def update(self, path: Path | str, version: int) -> pb.UpdateWeightsResponse:
        req = message(pb.UpdateWeightsRequest, version=version, checkpoint_path=str(path))
        return self.stub.UpdateWeights(req, timeout=120)

    def version(self) -> int:
        return int(self.stub.GetState(message(pb.GetStateRequest), timeout=10).version)

    def generate(self, version: int) -> Any:
        """Publish one prompt batch admitted at `version`; return the rollout the actor publishes."""
        first = 4 * self.seq
        self.seq += 1
        batch = message(pb.PromptBatch, batch_id=f"b{first}", version=version, step=max(version - 1, 0),
                        sampling=pb.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, seed=first))
        for i in range(first, first + 4):
            for k in range(2):
                batch.prompts.add(task_id=f"t{i}-{k}", token_ids=[3 + i % 5, 4, 5], dataset_index=i,
                                  sample_index=k, group_id=i)
        key = f"rlfleet:{self.cfg.run.name}"
        self.redis.xadd(f"{key}:prompts", {"data": batch.SerializeToString(), "kind": "prompts",
                                           "batch_id": batch.batch_id})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for _, fields in self.redis.xrange(f"{key}:rollouts"):
                if fields[b"batch_id"].decode().startswith(f"{batch.batch_id}:"):
                    rb = pb.RolloutBatch()
                    rb.ParseFromString(fields[b"data"])
                    return validate_rollout_batch(rb, self.cfg.flow.max_message_bytes)
            time.sleep(0.2)
        raise AssertionError(f"no rollout for {batch.batch_id}")

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def actor(tmp_path: Path, tiny_model: Path, redis_server: RedisProcess) -> Iterator[ActorProc]:
    cfg = tiny_config(tmp_path / "run", tiny_model, run={"max_steps": 10}, redis={"url": redis_server.url},
                      algo={"group_size": 2}, batch={"prompts_per_step": 8, "prompts_per_message": 4})
    a = ActorProc(cfg, redis_server)
    try:
        yield a
    finally:
        a.stop()


def _perturbed(tiny_model: Path) -> torch.nn.Module:
    model = load_causal_lm(tiny_model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


def _logprobs(model: torch.nn.Module, r: Any) -> torch.Tensor:
    with torch.no_grad():
        lp = response_logprobs(model, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, temperature=1.0)
    return lp[r.response_mask]


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details() or ""


def test_update_weights_loads_a_checkpoint_into_the_engine_and_refuses_what_the_run_cannot_accept(
    actor: ActorProc, tiny_model: Path, tmp_path: Path
) -> None:
    perturbed = _perturbed(tiny_model)
    trainer = PolicyTrainer(perturbed, actor.cfg.algo, 1.0, seed=0)
    ckpt = save_checkpoint(tmp_path / "ckpts", "actor", 3, 2, perturbed, trainer.opt)

    # Ahead of what the controller committed: refused, nothing changes.
    actor.commit(2)
    code, why = _code(lambda: actor.update(ckpt, 3))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "ahead" in why
    assert actor.version() == 0

    actor.commit(3)
    assert actor.update(ckpt, 3).version == 3
    assert actor.version() == 3
    r = actor.generate(version=3)
    assert r.version == 3
    torch.testing.assert_close(r.behaviour_logprobs[r.response_mask], _logprobs(perturbed, r), atol=1e-4, rtol=1e-4)
    original = load_causal_lm(tiny_model)
    assert not torch.allclose(r.behaviour_logprobs[r.response_mask], _logprobs(original, r), atol=1e-2)

    # Backwards, a missing path, a checkpoint of another version, another architecture: refused.
    actor.commit(5)
    code, why = _code(lambda: actor.update(ckpt, 2))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "backwards" in why
    code, why = _code(lambda: actor.update(tmp_path / "nowhere", 4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "nowhere" in why
    code, why = _code(lambda: actor.update(ckpt, 4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "version 3, not 4" in why
    other = tmp_path / "other"
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(vocab_size=18, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    code, why = _code(lambda: actor.update(other, 4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "shape" in why
    code, why = _code(lambda: actor.update("", 4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "checkpoint_path" in why
    assert actor.version() == 3

    # A save_pretrained directory (the original model) at the committed version: the actor is caught
    # up again and serves it (behind the committed version it would serve nothing).
    assert actor.update(tiny_model, 5).version == 5
    assert actor.update(tiny_model, 5).version == 5  # the same version again is a no-op
    r = actor.generate(version=5)
    assert r.version == 5
    torch.testing.assert_close(r.behaviour_logprobs[r.response_mask], _logprobs(original, r), atol=1e-4, rtol=1e-4)
