"""Generate (held-out evaluation) against a real actor process: it answers at the version it serves
with exactly what the local loop's engine generates, publishes nothing, and refuses a version it
does not serve and input outside the run with the field named."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.core.pb import rlfleet_pb2 as pb
from services.core.redis_proc import start_redis
from services.core.wire import message
from services.models.engine import SamplingParams
from services.models.factory import make_engine
from services.models.loading import load_tokenizer
from tests.fleet_helpers import tiny_config
from tests.integration.test_update_weights import ActorProc

pytestmark = pytest.mark.timeout(600)

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
