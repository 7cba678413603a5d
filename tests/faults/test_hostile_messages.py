"""Well-formed messages with hostile content in a real fleet's streams: every one ends in the
dead-letter stream with a reason naming the field, in every consumer group that reads it; no
service restarts; the run completes its steps and `rlfleet audit` passes.

The fleet runs on a persistent `redis.url` that still holds an old run of the same name (a prompt
batch at a version this run has not reached, and its acknowledged versions): the actor must reject
it instead of waiting for that version inside its only consumer loop. The hostile messages sit in
the streams before the fleet starts: every consumer group starts at id 0, so each is delivered
before any of the run's own traffic, however fast the run goes, and nothing can finish around it."""

from __future__ import annotations

import math
import re
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from services.audit import audit
from services.core.config.run import RunConfig
from services.core.host.redis_proc import RedisProcess
from services.core.pb import rlfleet_pb2 as pb
from services.fleet import Fleet
from services.report import read_metrics
from services.rl.batch import Rollout
from services.rl.wire import message, rollout_to_proto, score_to_proto
from tests.fleet_helpers import tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 4


def _config(run_dir: Path, model: Path, redis_url: str) -> RunConfig:
    """PPO with KL, so every service (reference, reward, critic, actor, controller) reads hostile input."""
    return tiny_config(run_dir, model, run={"max_steps": STEPS},
                       algo={"name": "ppo", "group_size": 2, "kl_coef": 0.05, "kl_in": "reward", "minibatch_size": 16},
                       batch={"prompts_per_step": 8, "prompts_per_message": 4},
                       flow={"resend_after_s": 4.0, "reclaim_idle_ms": 1500, "rpc_timeout_s": 120.0},
                       redis={"url": redis_url})


def _prompts(first: int, n_prompts: int = 4, group: int = 2, **fields: Any) -> pb.PromptBatch:
    """A PromptBatch as the controller would build it for dataset indices first.., then `fields`."""
    b = message(pb.PromptBatch, batch_id=f"b{first}", version=0, step=0,
                sampling=pb.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, seed=7))
    for i in range(first, first + n_prompts):
        for k in range(group):
            b.prompts.add(task_id=f"t{i}-{k}", token_ids=[3, 4, 5], dataset_index=i, sample_index=k, group_id=i)
    for name, value in fields.items():
        target: Any = b
        *path, leaf = name.split(".")
        for p in path:
            target = getattr(target, p)
        if isinstance(value, list):
            getattr(target, leaf)[:] = value
        else:
            setattr(target, leaf, value)
    return b


def _rollout(first: int, rows: int = 8, r: int = 4) -> Rollout:
    return Rollout(
        task_ids=[f"t{first + i // 2}-{i % 2}" for i in range(rows)],
        prompt_ids=torch.full((rows, 3), 4, dtype=torch.long), prompt_mask=torch.ones(rows, 3, dtype=torch.bool),
        response_ids=torch.full((rows, r), 5, dtype=torch.long), response_mask=torch.ones(rows, r, dtype=torch.bool),
        behaviour_logprobs=torch.full((rows, r), -1.0), group_ids=torch.arange(rows) // 2, version=0)


def _rollout_msg(first: int, tag: str, r: Rollout | None = None, **fields: Any) -> pb.RolloutBatch:
    msg = rollout_to_proto(r or _rollout(first), f"b{first}:{tag}")
    for name, value in fields.items():
        setattr(msg, name, value)
    return msg


def _scores(first: int, tag: str, values: torch.Tensor | None = None, **fields: Any) -> pb.ScoreBatch:
    rows = 8
    msg = score_to_proto(f"b{first}:{tag}", "reward", [f"t{first + i // 2}-{i % 2}" for i in range(rows)],
                         values if values is not None else torch.zeros(rows))
    for name, value in fields.items():
        setattr(msg, name, value)
    return msg


def _hostile() -> list[tuple[str, str, bytes, str]]:
    """(stream, batch id, payload, the field its dead letter must name), each batch id unique."""
    out: list[tuple[str, str, bytes, str]] = []

    def prompts(first: int, field: str, **kw: Any) -> None:
        out.append(("prompts", f"b{first}", _prompts(first, **kw).SerializeToString(), field))

    prompts(900000, "version", version=10**9)  # the actor waited for it forever
    prompts(900004, "version", version=-3)
    prompts(900008, "sampling.temperature", **{"sampling.temperature": -1.0})  # a crash per delivery
    prompts(900012, "sampling.temperature", **{"sampling.temperature": math.nan})
    prompts(900016, "sampling.top_p", **{"sampling.top_p": 5.0})
    prompts(900020, "sampling.top_k", **{"sampling.top_k": 10**6})
    prompts(900024, "sampling.max_new_tokens", **{"sampling.max_new_tokens": 10**6})
    prompts(900028, "sampling.stop_token_ids", **{"sampling.stop_token_ids": [10**6]})
    prompts(900032, "step", step=10**9)
    prompts(900036, "prompts", n_prompts=100)
    bad = _prompts(900140)
    bad.prompts[3].token_ids[:] = [3, 10**6]
    out.append(("prompts", "b900140", bad.SerializeToString(), "token_ids"))
    long = _prompts(900144)
    long.prompts[0].token_ids[:] = [3] * 5000  # beyond the model's 2048 positions
    out.append(("prompts", "b900144", long.SerializeToString(), "token_ids"))
    ids = _prompts(900148)
    ids.prompts[1].task_id = "t900148-x; drop"
    out.append(("prompts", "b900148", ids.SerializeToString(), "task_id"))
    sample = _prompts(900152)
    sample.prompts[0].task_id, sample.prompts[0].sample_index = "t900152-7", 7  # group_size is 2
    out.append(("prompts", "b900152", sample.SerializeToString(), "task_id"))
    group = _prompts(900156)
    group.prompts[0].group_id = 2**64 - 1  # does not fit the int64 group_ids tensor
    out.append(("prompts", "b900156", group.SerializeToString(), "group_id"))
    wrong = _prompts(900160)
    wrong.batch_id = "b900164"  # names tasks it does not carry
    out.append(("prompts", "b900164", wrong.SerializeToString(), "batch_id"))

    def rollouts(first: int, field: str, msg: pb.RolloutBatch) -> None:
        out.append(("rollouts", msg.batch_id, msg.SerializeToString(), field))

    nan = _rollout(910000)
    nan.behaviour_logprobs[2, 1] = math.nan
    rollouts(910000, "behaviour_logprobs", _rollout_msg(910000, "nan", nan))
    vocab = _rollout(910008)
    vocab.response_ids[0, 0] = 10**6  # the reference model's embedding would index out of range
    rollouts(910008, "response_ids", _rollout_msg(910008, "vocab", vocab))
    neg = _rollout(910016)
    neg.prompt_ids[1, 0] = -1
    rollouts(910016, "prompt_ids", _rollout_msg(910016, "negative", neg))
    rollouts(910024, "response_ids", _rollout_msg(910024, "long", _rollout(910024, r=64)))
    rollouts(910032, "version", _rollout_msg(910032, "future", version=10**9))
    dtype = _rollout_msg(910040, "dtype")
    dtype.response_ids.dtype = "float64"  # same byte count, other meaning
    rollouts(910040, "response_ids", dtype)
    tids = _rollout(910048)
    tids.task_ids[5] = "evil"
    rollouts(910048, "task_id", _rollout_msg(910048, "tids", tids))

    def scores(field: str, msg: pb.ScoreBatch) -> None:
        out.append(("scores", msg.batch_id, msg.SerializeToString(), field))

    scores("stage", _scores(920000, "stage", stage="hacker"))
    scores("version", _scores(920008, "future", version=10**9))
    inf = torch.zeros(8)
    inf[3] = math.inf
    scores("rewards", _scores(920016, "inf", values=inf))
    f64 = _scores(920024, "dtype")
    f64.rewards.dtype, f64.rewards.data = "float64", struct.pack("<8d", *([0.0] * 8))
    f64.rewards.shape[:] = [8]
    scores("rewards", f64)
    badtid = _scores(920032, "tid")
    badtid.task_ids[0] = "t920032-99"
    scores("task_id", badtid)
    return out


def _for_the_controller() -> list[tuple[str, bytes, str]]:
    """Rollouts of batches this run admits later (b8 and b12: at first only b0 and b4 fit the
    window), well-formed and inside the run's versions, that only the controller, which knows the
    committed version and what it admitted, can refuse: (batch id, payload, the reason it gives)."""
    ahead = _rollout_msg(8, "ahead", version=3)  # the controller has committed no version yet
    early = _rollout_msg(12, "early", _rollout(12))  # would win over b12's own rollout, then never train
    return [(ahead.batch_id, ahead.SerializeToString(), r"version 3 is ahead of the committed version [01] \+ 1"),
            (early.batch_id, early.SerializeToString(), r"prompt batch 'b12' was never admitted")]


def _stale_run(r: redis.Redis, cfg: RunConfig) -> None:
    """What an earlier run of the same name left in a persistent Redis: a prompt batch for the first
    dataset indices at a version this run has not committed, and that run's versions."""
    prefix = f"rlfleet:{cfg.run.name}"
    old = _prompts(0, version=STEPS, step=STEPS - 1)
    r.xadd(f"{prefix}:prompts", {"data": old.SerializeToString(), "kind": "prompts", "batch_id": "b0"})
    r.hset(f"{prefix}:versions", mapping={"actor": 50, "critic": 50})


def test_hostile_messages_are_dead_lettered_naming_the_field_and_the_run_completes(
    tmp_path: Path, tiny_model: Path, redis_server: RedisProcess, fleet_factory: Any
) -> None:
    cfg = _config(tmp_path / "run", tiny_model, redis_server.url)
    r = redis_server.client()
    _stale_run(r, cfg)
    hostile = _hostile()
    for stream, bid, data, _ in hostile:
        r.xadd(f"rlfleet:{cfg.run.name}:{stream}", {"data": data, "kind": stream, "batch_id": bid})
    controller_only = _for_the_controller()
    for bid, data, _ in controller_only:
        r.xadd(f"rlfleet:{cfg.run.name}:rollouts", {"data": data, "kind": "rollout", "batch_id": bid})
    fleet: Fleet = fleet_factory(cfg, restart_budget=3)
    fleet.start(ready_timeout_s=240)
    result: list[Any] = []
    sup = threading.Thread(target=lambda: result.append(_supervise(fleet)), daemon=True)
    sup.start()
    sup.join(timeout=400)
    assert result and result[0] == 0, f"supervise returned {result}"

    restarted = {n: sp.restarts for n, sp in fleet.procs.items() if sp.restarts}
    assert not restarted, f"a hostile message crashed a service: {restarted}"
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    report = audit(cfg.run_dir, finished=True)
    assert report.ok, report.render()

    dead: dict[tuple[str, str], list[str]] = {}
    for _, fields in r.xrange(f"rlfleet:{cfg.run.name}:dead"):
        key = (fields[b"group"].decode(), fields.get(b"h.batch_id", b"").decode())
        dead.setdefault(key, []).append(fields[b"reason"].decode())
    readers = {"prompts": ["actor"], "rollouts": [*cfg.stages(), "controller"], "scores": ["controller"]}
    missing = []
    for stream, bid, _, field in hostile:
        for group in readers[stream]:
            reasons = dead.get((group, bid), [])
            if not any(field in why for why in reasons):
                missing.append(f"{stream} {bid} in group {group}: want {field!r}, got {reasons}")
    assert not missing, "\n".join(missing)
    for bid, _, want in controller_only:
        reasons = dead.get(("controller", bid), [])
        assert any(re.search(want, why) for why in reasons), f"{bid}: want {want!r}, got {reasons}"
    stale = dead.get(("actor", "b0"), [])
    assert any("version" in why and "ahead" in why for why in stale), f"stale prompt batch: {stale}"


def _supervise(fleet: Fleet) -> int | BaseException:
    try:
        return fleet.supervise(timeout_s=360, poll_s=0.2)
    except BaseException as e:  # surfaced by the assertion on the result
        return e
