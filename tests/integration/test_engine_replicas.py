"""An actor process with two engine replicas (generation.replicas: 2, transformers engines in child
processes on the CPU): its rollouts are the one-engine rollouts of the same seeds, a weight sync
reaches both replicas, both score like the trainer, /metrics and status show each replica, and a
replica killed with -9 fails the actor fast. The weights travel as they do to replicas pinned to GPUs
of their own (`weight_transfer: collective`, gloo here, NCCL there); the e2e fleet test
(tests/e2e/test_engine_replicas_fleet.py) runs the default, by reference."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.core.host.redis_proc import RedisProcess
from services.models.checkpoints.checkpoint import save_checkpoint
from services.models.engine import SamplingParams
from services.models.engines.factory import make_engine
from services.models.io.loading import load_tokenizer
from services.rl.trainer import PolicyTrainer
from tests.fleet_helpers import gone, tiny_config
from tests.integration.test_update_weights import ActorProc, _logprobs, _perturbed

pytestmark = pytest.mark.timeout(600)


def _replica_pids(actor_pid: int) -> list[int]:
    kids = Path(f"/proc/{actor_pid}/task/{actor_pid}/children").read_text().split()
    return sorted(int(p) for p in kids if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())


def _status(actor: ActorProc) -> dict[str, Any]:
    state = json.loads((actor.cfg.run_dir / "services" / "actor.json").read_text())
    return httpx.get(f"http://127.0.0.1:{state['http_port']}/v1/status", timeout=10).json()  # type: ignore[no-any-return]


def _metrics(actor: ActorProc) -> str:
    state = json.loads((actor.cfg.run_dir / "services" / "actor.json").read_text())
    return httpx.get(f"http://127.0.0.1:{state['http_port']}/metrics", timeout=10).text


def _same_as_one_engine(r: Any, engine: Any, tiny_model: Path, seed: int) -> None:
    """The rollout's rows are what one engine generates for the batch's prompts with the batch's seed."""
    prompts = [[int(t) for t, m in zip(row, mask, strict=True) if m]
               for row, mask in zip(r.prompt_ids.tolist(), r.prompt_mask.tolist(), strict=True)]
    stops = (load_tokenizer(tiny_model).eos_token_id,)
    want = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=stops, seed=seed))
    got = [[int(t) for t, m in zip(row, mask, strict=True) if m]
           for row, mask in zip(r.response_ids.tolist(), r.response_mask.tolist(), strict=True)]
    assert got == [c.token_ids for c in want]
    torch.testing.assert_close(r.behaviour_logprobs[r.response_mask],
                               torch.tensor([x for c in want for x in c.logprobs]), atol=1e-5, rtol=0)


def test_two_replicas_generate_like_one_engine_sync_together_and_a_dead_one_fails_the_actor(
    tmp_path: Path, tiny_model: Path, redis_server: RedisProcess
) -> None:
    cfg = tiny_config(tmp_path / "run", tiny_model, run={"max_steps": 10}, redis={"url": redis_server.url},
                      algo={"group_size": 2}, batch={"prompts_per_step": 8, "prompts_per_message": 4},
                      generation={"replicas": 2, "weight_transfer": "collective"})
    actor = ActorProc(cfg, redis_server)
    try:
        replicas = _replica_pids(actor.proc.pid)
        assert len(replicas) == 2, "the actor did not start one process per replica"
        one = make_engine("transformers", tiny_model)  # the one-engine reference, in this process

        r = actor.generate(version=0)  # 8 rows: rows 0-3 on replica 0, 4-7 on replica 1
        _same_as_one_engine(r, one, tiny_model, seed=0)

        perturbed = _perturbed(tiny_model)
        opt = PolicyTrainer(perturbed, cfg.algo, 1.0).opt
        ckpt = save_checkpoint(tmp_path / "ckpts", "actor", 1, 1, perturbed, opt)
        actor.commit(1)
        assert actor.update(ckpt, 1).version == 1
        rows = _status(actor)["detail"]["engine_replicas"]
        assert [(x["replica"], x["version"], x["alive"]) for x in rows] == [(0, 1, True), (1, 1, True)]
        assert {x["weight_transfer"] for x in rows} == {"collective"}
        assert sorted(x["pid"] for x in rows) == replicas

        r = actor.generate(version=1)
        assert r.version == 1
        # Every row (half from each replica) is scored like the trainer's copy of the new weights...
        torch.testing.assert_close(r.behaviour_logprobs[r.response_mask], _logprobs(perturbed, r),
                                   atol=1e-4, rtol=1e-4)
        # ...and sampled as one engine holding them samples the batch.
        one.update_weights(perturbed.state_dict().items(), 1)
        _same_as_one_engine(r, one, tiny_model, seed=4)

        rows = _status(actor)["detail"]["engine_replicas"]
        assert all(x["tokens"] > 0 and x["memory_bytes"] > 0 for x in rows), rows
        assert all("gpus" not in x for x in rows)  # the CPU: GPU fields absent, not zero
        text = _metrics(actor)
        for rep in ("0", "1"):
            assert f'rlfleet_engine_replica_tokens_total{{replica="{rep}",service="actor"}}' in text
            assert f'rlfleet_engine_replica_version{{replica="{rep}",service="actor"}} 1.0' in text
        assert "rlfleet_engine_replica_gpu_memory_bytes{" not in text

        # Replicas start together, so their pids need not follow their order: status says which is which.
        pid = {x["replica"]: x["pid"] for x in rows}
        os.kill(pid[1], signal.SIGKILL)
        t0 = time.monotonic()
        code = actor.proc.wait(timeout=60)
        assert time.monotonic() - t0 < 30, "the actor outlived its dead replica"
        assert code != 0
        out = (cfg.run_dir / "actor.out").read_text()
        assert "replica 1" in out, out[-3000:]
        assert gone(pid[0], within_s=10), "the surviving replica outlived the actor"
    finally:
        actor.stop()
