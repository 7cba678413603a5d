"""Held-out evaluation in the fleet (`run.eval_every`): after the controller commits step s with
s % eval_every == 0 or s == max_steps, and once before training, the actor generates for the
task's held-out prompts at the committed version (its `Generate` call: greedy, then sampled at the
training temperature) and the controller scores the completions with the task's reward, as the
local loop does. The results go to metrics.jsonl (the step's row), Prometheus and samples.jsonl.

Evaluation reads nothing from and writes nothing to the journal, the streams or training, so it
cannot disturb exactly-once or replay; a failed one (actor away, timeout, a prompt that cannot be
encoded) is one log line and is skipped, never a failed step. A configured reward runs in a child
process bounded by `task.reward_timeout_s`, as in the reward service: rows it cannot score are
counted (`eval_unscored`) and the others reported; a reward that times out counts every row.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from services.core.config.run import RunConfig
from services.core.observability.events import AppendOnlyFile
from services.core.observability.metrics import ServiceMetrics
from services.core.pb import rlfleet_pb2 as pb
from services.core.serving.runtime import rpc
from services.reward.worker import RewardStopped, RewardWorker
from services.rl.wire import message
from services.tasks import evaluation as ev
from services.tasks.base import Prompt, Task
from services.tasks.rewards import configured_reward

log = logging.getLogger("rlfleet.controller.eval")

# How long the evaluation before training waits for an actor that is still starting.
_UNAVAILABLE_RETRY_S = 0.1  # a refused call costs a loopback round trip


class EvalFailed(Exception):
    """An evaluation that could not run; the message is the one line logged."""


class Evaluation:
    def __init__(self, cfg: RunConfig, task: Task, tokenizer: Any, metrics: ServiceMetrics,
                 actor_stub: Callable[[], Any]) -> None:
        self.cfg = cfg
        self.task = task
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.actor_stub = actor_stub
        self.n = ev.eval_size(task, cfg.task.eval_size)
        self.reward_model = cfg.models.reward is not None
        self.samples = AppendOnlyFile(cfg.run_dir / ev.SAMPLES_FILE, fsync=False)
        self.before: dict[str, float] = {}
        self._prompts: tuple[list[Prompt], list[list[int]]] | None = None
        self.worker = (RewardWorker(cfg.task, cfg.task.reward_timeout_s)
                       if self.n and not self.reward_model and configured_reward(cfg.task) else None)
        if self.reward_model and self.n:
            log.info("eval reward unavailable: the run's reward is a reward model (models.reward); samples only")

    def due(self, step: int) -> bool:
        every = self.cfg.run.eval_every
        return self.n > 0 and (step == self.cfg.run.max_steps or (every > 0 and step % every == 0))

    async def before_training(self, journal_step: int) -> None:
        """The evaluation of the initial policy (version 0), kept for step 1's row as the local loop does."""
        if journal_step == 0 and self.n > 0:
            self.before = await self.run(0, 0, suffix="_before")

    async def after_step(self, step: int, version: int) -> dict[str, float]:
        """The metrics keys for step `step`'s row, just committed at `version`."""
        row: dict[str, float] = {}
        if step == 1:
            row.update(self.before)
        if self.due(step):
            t0 = time.perf_counter()
            got = await self.run(step, version)
            if got:
                row.update(got, eval_s=time.perf_counter() - t0)
        return row

    async def run(self, step: int, version: int, suffix: str = "") -> dict[str, float]:
        try:
            return await self._run(step, version, suffix)
        except EvalFailed as e:
            log.warning("evaluation skipped", extra={"step": step, "version": version, "error": str(e)[:300]})
        except Exception as e:  # a prompt or reward that cannot be computed, a disk that refuses samples
            log.warning("evaluation skipped", extra={"step": step, "version": version,
                                                     "error": f"{type(e).__name__}: {str(e)[:300]}"})
        return {}

    async def _run(self, step: int, version: int, suffix: str) -> dict[str, float]:
        prompts, ids = await asyncio.to_thread(self._held_out)
        results = {}
        for mode in ev.MODES:
            reply = await self._generate(ids, version, greedy=mode == "greedy", wait=step == 0)
            rows = [list(c.token_ids) for c in reply.completions]
            if len(rows) != len(ids):
                raise EvalFailed(f"the actor returned {len(rows)} completions for {len(ids)} prompts")
            texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
            results[mode] = await asyncio.to_thread(self._evaluate, mode, prompts, texts)
        self.samples.append("".join(ev.sample_lines(step, version, prompts, results)).encode())
        out = ev.metrics_of(results, suffix)
        for mode, res in results.items():
            if res.reward is not None:
                self.metrics.eval_reward.labels(mode=mode).set(res.reward)
            if res.accuracy is not None:
                self.metrics.eval_accuracy.labels(mode=mode).set(res.accuracy)
        log.info("evaluation", extra={"step": step, "version": version, "prompts": len(prompts), **out})
        return out

    def _evaluate(self, mode: ev.Mode, prompts: list[Prompt], texts: list[str]) -> ev.ModeResult:
        scorer = self.worker.score if self.worker is not None else None
        try:
            return ev.evaluate_mode(self.task, mode, prompts, texts, reward_model=self.reward_model, scorer=scorer)
        except RewardStopped as e:
            log.warning("evaluation reward stopped; its rows count unscored",
                        extra={"mode": mode, "reason": e.reason, "error": str(e)[:300]})
            return ev.unscored_result(self.task, mode, texts)

    def _held_out(self) -> tuple[list[Prompt], list[list[int]]]:
        if self._prompts is None:
            prompts = ev.eval_prompts(self.task, self.n)
            self._prompts = prompts, ev.encode_eval_prompts(self.task, self.tokenizer, prompts)
        return self._prompts

    def _request(self, ids: list[list[int]], version: int, greedy: bool) -> pb.GenerateRequest:
        g = self.cfg.generation
        sampling = pb.SamplingParams(
            temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_new_tokens=g.max_new_tokens,
            stop_token_ids=sorted({self.tokenizer.eos_token_id, *g.stop_token_ids}),
            seed=ev.eval_seed(self.cfg.run.seed))
        req = message(pb.GenerateRequest, version=version, sampling=sampling, greedy=greedy)
        for p in ids:
            req.prompts.add(token_ids=p)
        return req

    async def _generate(self, ids: list[list[int]], version: int, *, greedy: bool, wait: bool) -> pb.GenerateReply:
        """Generate is read-only, so retrying it is safe; the evaluation before training also waits
        (up to flow.rpc_timeout_s) for an actor that is still starting."""
        timeout = self.cfg.flow.rpc_timeout_s
        deadline = time.monotonic() + timeout
        req = self._request(ids, version, greedy)
        while True:
            try:
                # One attempt per call: a hung actor costs one timeout, not several.
                reply: pb.GenerateReply = await rpc(self.actor_stub().Generate, req, timeout_s=timeout,
                                                    idempotent=True, retries=0, token=self.cfg.token())
                return reply
            except grpc.aio.AioRpcError as e:
                if wait and e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                    await asyncio.sleep(_UNAVAILABLE_RETRY_S)
                    continue
                raise EvalFailed(f"actor Generate failed: {e.code().name}: {(e.details() or '')[:200]}") from None

    def close(self) -> None:
        self.samples.close()
        if self.worker is not None:
            self.worker.close()
