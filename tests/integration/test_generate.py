"""Generate (held-out evaluation) against a real actor process: it answers at the version it serves
with exactly what the local loop's engine generates, publishes nothing, and refuses a version it
does not serve and input outside the run with the field named."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.controller.evaluation import Evaluation
from services.core.host.redis_proc import start_redis
from services.core.observability.metrics import ServiceMetrics
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.core.transport.rpc import make_channel
from services.models.engine import SamplingParams
from services.models.engines.factory import make_engine
from services.models.io.loading import load_tokenizer
from services.rl.wire import message
from services.tasks import load_task
from services.tasks.evaluation import read_samples
from tests.fleet_helpers import tiny_config
from tests.integration.test_update_weights import ActorProc

# Real processes, but no fleet and no time bound: it runs beside the unit tests (make test-unit).
pytestmark = [pytest.mark.timeout(600), pytest.mark.shares_host]

EVAL_SIZE = 4
PROMPTS = [[3, 4, 5], [6, 7, 8, 9], [5, 5]]


@pytest.fixture(scope="module")
def actor(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[ActorProc]:
    redis = start_redis(tmp_path_factory.mktemp("redis"))
    cfg = tiny_config(tmp_path_factory.mktemp("gen") / "run", tiny_model, run={"max_steps": 10},
                      redis={"url": redis.url}, task={"eval_size": EVAL_SIZE})
    a = ActorProc(cfg, redis)
    try:
        yield a
    finally:
        a.stop()
        redis.stop(kill=True)


def _request(version: int = 0, prompts: list[list[int]] = PROMPTS, greedy: bool = False,
             **sampling: float) -> pb.GenerateRequest:
    s = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 4, "seed": 7, **sampling}
    req = message(pb.GenerateRequest, version=version, greedy=greedy, sampling=pb.SamplingParams(**s))
    for p in prompts:
        req.prompts.add(token_ids=p)
    return req


def _refused(actor: ActorProc, req: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        actor.stub.Generate(req, timeout=60)
    return err.value


@pytest.mark.parametrize("greedy", [True, False])
def test_generate_matches_the_local_engine_and_publishes_nothing(actor: ActorProc, tiny_model: Path,
                                                                 greedy: bool) -> None:
    reply = actor.stub.Generate(_request(greedy=greedy), timeout=120)
    engine = make_engine("transformers", tiny_model)
    # A request that names no stop ids stops at the tokenizer's EOS.
    stops = (load_tokenizer(tiny_model).eos_token_id,)
    want = engine.generate(PROMPTS, SamplingParams(temperature=0.0 if greedy else 1.0, max_new_tokens=4,
                                                   stop_token_ids=stops, seed=7))
    assert reply.version == 0
    assert [list(c.token_ids) for c in reply.completions] == [c.token_ids for c in want]
    assert [c.finish_reason for c in reply.completions] == [c.finish_reason for c in want]
    key = f"rlfleet:{actor.cfg.run.name}"
    assert actor.redis.xlen(f"{key}:rollouts") == 0  # evaluation never reaches the streams
    assert actor.version() == 0


def test_generate_at_a_version_the_actor_does_not_serve_is_failed_precondition(actor: ActorProc) -> None:
    err = _refused(actor, _request(version=3))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "version_mismatch" in (err.details() or "") and "serves version 0" in (err.details() or "")


@pytest.mark.parametrize(("req", "reason", "field"), [
    (_request(temperature=0.5), "bad_sampling", "sampling.temperature"),
    (_request(max_new_tokens=99), "bad_sampling", "sampling.max_new_tokens"),
    (_request(top_p=1.5), "bad_sampling", "sampling.top_p"),
    (_request(prompts=[[3, 10**6]]), "bad_token_ids", "token_ids"),
    (_request(prompts=[[]]), "prompt_too_long", "token_ids"),
    (_request(prompts=[]), "bad_prompts", "prompts"),
    (_request(prompts=[[3, 4]] * (EVAL_SIZE + 1)), "bad_prompts", "task.eval_size"),
    (_request(version=11), "bad_version", "version"),
], ids=["temperature", "max_new_tokens", "top_p", "token_outside_vocab", "empty_prompt", "no_prompts",
        "more_than_eval_size", "version_beyond_run"])
def test_generate_refuses_input_outside_the_run_naming_the_field(actor: ActorProc, req: pb.GenerateRequest,
                                                                 reason: str, field: str) -> None:
    err = _refused(actor, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in (err.details() or "") and field in (err.details() or "")
    assert actor.version() == 0


# -- the controller's side: services.controller.evaluation against the same real actor ------------
def _evaluate(actor: ActorProc, tiny_model: Path, port: int, version: int,
              rpc_timeout_s: float = 30.0) -> tuple[dict[str, float], ServiceMetrics, Path]:
    cfg = actor.cfg.model_copy(update={"flow": actor.cfg.flow.model_copy(update={"rpc_timeout_s": rpc_timeout_s})})
    metrics = ServiceMetrics("controller")
    task = load_task(cfg.task)

    async def go() -> dict[str, float]:
        channel = make_channel("127.0.0.1", port, cfg.flow.max_message_bytes)
        ev = Evaluation(cfg, task, load_tokenizer(tiny_model), metrics, lambda: pb_grpc.ActorStub(channel))
        try:
            return await ev.run(2, version)
        finally:
            ev.close()
            await channel.close()

    return asyncio.run(go()), metrics, cfg.run_dir / "samples.jsonl"


def _actor_port(actor: ActorProc) -> int:
    return int(json.loads((actor.cfg.run_dir / "services" / "actor.json").read_text())["grpc_port"])


def test_controller_evaluation_scores_both_modes_sets_gauges_and_appends_samples(actor: ActorProc,
                                                                                 tiny_model: Path) -> None:
    samples = actor.cfg.run_dir / "samples.jsonl"
    samples.unlink(missing_ok=True)
    row, metrics, _ = _evaluate(actor, tiny_model, _actor_port(actor), version=0)
    assert set(row) == {"eval_reward", "eval_reward_greedy", "eval_accuracy", "eval_accuracy_greedy"}
    lines = read_samples(samples)
    assert len(lines) == 2 * EVAL_SIZE and {s["step"] for s in lines} == {2}
    greedy = [s["reward"] for s in lines if s["mode"] == "greedy"]
    assert row["eval_reward_greedy"] == pytest.approx(sum(greedy) / len(greedy))
    # arithmetic's reward is 0/1, so accuracy is the mean reward
    assert row["eval_accuracy_greedy"] == pytest.approx(row["eval_reward_greedy"])
    def gauge(name: str, mode: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"mode": mode, "service": "controller"})

    for mode, key in (("greedy", "eval_reward_greedy"), ("sampled", "eval_reward")):
        assert gauge("rlfleet_eval_reward", mode) == pytest.approx(row[key])
    assert gauge("rlfleet_eval_accuracy", "greedy") == pytest.approx(row["eval_accuracy_greedy"])

def test_a_failed_controller_evaluation_is_one_log_line_and_no_row(actor: ActorProc, tiny_model: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    samples = actor.cfg.run_dir / "samples.jsonl"
    samples.unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING, logger="rlfleet.controller.eval"):
        wrong_version, _, _ = _evaluate(actor, tiny_model, _actor_port(actor), version=5)
        with socket.socket() as s:  # a port nobody listens on: the actor is away
            s.bind(("127.0.0.1", 0))
            away = s.getsockname()[1]
        unreachable, _, _ = _evaluate(actor, tiny_model, away, version=0, rpc_timeout_s=2.0)
    assert wrong_version == {} and unreachable == {}
    skipped = [r for r in caplog.records if r.getMessage() == "evaluation skipped"]
    assert len(skipped) == 2
    assert "FAILED_PRECONDITION" in skipped[0].error and "UNAVAILABLE" in skipped[1].error  # type: ignore[attr-defined]
    assert not read_samples(samples)
