"""The actor service: generates rollouts for admitted prompts and trains the policy.

Generation consumes the prompts stream (held by backpressure when the slowest scoring group is
too far behind) and publishes rollouts with behaviour log-probs and the policy version. `Train`
runs the PPO epochs on the trainer's copy of the policy, then syncs the weights into the engine
under the engine lock, so no rollout ever mixes two versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import grpc
from transformers import PreTrainedModel

from services.actor.batching import EngineBatcher
from services.actor.engine_metrics import ReplicaCollector, replica_rows
from services.actor.outbox import Outbox
from services.core.config.run import RunConfig
from services.core.ids import rollout_id as new_rollout_id
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.core.serving.runtime import ServiceRuntime
from services.core.serving.worker import Rejected, StreamWorker
from services.core.transport.bus import Bus, BusUnavailable, Message, bus_options
from services.core.transport.limits import Limits
from services.dist.build import build_model, build_trainer
from services.dist.group import RankGauges, RankGroup
from services.dist.nodes import world_size
from services.dist.protocol import RankError
from services.models.engine import EngineError, GenerationEngine, SamplingParams, completions_to_rollout
from services.models.engines.factory import make_engine
from services.models.engines.replicas import ReplicaEngine
from services.models.io.loading import load_tokenizer
from services.models.nets.logprobs import warm_up_compiled
from services.models.nets.lora import check_only_adapters_train, engine_weights, is_lora
from services.rl.trainer import PolicyTrainer
from services.rl.wire import TrainRequest, WireError, check_schema_version, message, parse_message, rollout_to_proto
from services.workers.servicer import ServiceCalls, invalid
from services.workers.trainable import Trainable, WeightsRefused

log = logging.getLogger("rlfleet.actor")


class Actor:
    def __init__(self, cfg: RunConfig) -> None:
        assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
        self.cfg = cfg
        path = Path(cfg.models.policy.path)
        self.tokenizer = load_tokenizer(path)
        self.compiled = False  # the trainer's warm-up ran (`compile_trainer`)
        engine_kw = dict(dtype=cfg.generation.engine_dtype(cfg.models.policy.dtype),
                         **cfg.generation.engine_kwargs(cfg.run_dir))
        if cfg.generation.starts_beside_trainer(os.environ):
            self.engine = self._start_beside_trainer(cfg, path, engine_kw)
        else:
            # The engine first: its start is the longest (vLLM's compile and memory profiling), it may
            # already be under way (services.models.engines.boot), and vLLM's profiling must not count
            # the trainer's allocations as its own.
            self.engine = make_engine(cfg.generation.engine, path, **engine_kw)
            try:
                self._build_trainer(cfg)
            except BaseException:
                self.engine.close()
                raise
        self.t = Trainable(cfg, "actor", self.policy, self.trainer.opt, limits=self.limits, ranks=self.ranks)
        if self.t.restore():
            self.sync_engine(self.t.version)
        self.outbox = Outbox.open(cfg.run_dir / "outbox" / "actor")
        self.instance = f"actor-{os.getpid()}"
        self.runtime = ServiceRuntime.from_config(
            cfg, "actor", readiness=self.readiness, status=self.status, on_drain=self.on_drain)
        self.metrics = self.runtime.metrics
        if isinstance(self.engine, ReplicaEngine):
            self.metrics.registry.register(ReplicaCollector(self.engine, self.runtime.gpu))
        self.rank_gauges = RankGauges(self.metrics.registry) if self.ranks is not None else None
        self.bus: Bus | None = None
        self.worker: StreamWorker | None = None
        self.engine_lock = asyncio.Lock()  # generation vs weight sync
        self.batcher = EngineBatcher(lambda p, s: self.engine.generate(p, s), self.engine_lock, lambda: self.version,
                                     cfg.generation.batch_messages, registry=self.metrics.registry)
        self.warm: asyncio.Task[None] | None = None  # the trainer's compile (`warming`)
        self.held = False  # backpressure state
        self.fill = 0.0

    def _start_beside_trainer(self, cfg: RunConfig, path: Path, engine_kw: dict[str, Any]) -> GenerationEngine:
        """Start the engine (its process, where vLLM compiles and captures its graphs) while this thread
        builds the trainer and compiles it: the two start-ups overlap instead of adding up. Either
        failing fails the actor; a trainer that fails first leaves the engine to be closed as soon as
        it is up (its process is a daemon besides, and goes with the actor's)."""
        box: dict[str, Any] = {}
        lock = threading.Lock()

        def start() -> None:
            try:
                engine = make_engine(cfg.generation.engine, path, **engine_kw)
            except BaseException as e:  # re-raised on the main thread below
                box["error"] = e
                return
            with lock:
                if "abandoned" not in box:
                    box["engine"] = engine
                    return
            engine.close()

        thread = threading.Thread(target=start, name="engine-start", daemon=True)
        thread.start()
        t0 = time.perf_counter()
        try:
            self._build_trainer(cfg)
            self.compile_trainer()
        except BaseException:
            with lock:
                box["abandoned"] = True
                started = box.pop("engine", None)
            if started is not None:
                started.close()
            raise
        log.info("trainer built while the engine starts", extra={"seconds": round(time.perf_counter() - t0, 1)})
        thread.join()
        if "error" in box:
            raise box["error"]
        return cast(GenerationEngine, box["engine"])

    def _build_trainer(self, cfg: RunConfig) -> None:
        # Several trainer ranks: this process is rank 0 of a group it starts here, on the main
        # thread (followers die with the thread that started them).
        self.ranks = RankGroup(cfg, "actor") if world_size(cfg, "actor") > 1 else None
        if self.ranks is not None:
            self.policy, trainer = self.ranks.trainer.model, self.ranks.trainer.trainer
        else:
            self.policy = build_model(cfg, "actor", cfg.endpoint("actor").device)
            trainer = build_trainer(cfg, "actor", self.policy)
        assert isinstance(trainer, PolicyTrainer) and (isinstance(self.policy, PreTrainedModel) or is_lora(self.policy))
        self.trainer = trainer
        if cfg.models.policy.lora is not None:
            check_only_adapters_train(self.policy, self.trainer.opt)
        # A peft wrapper passes `config` through to its model; peft is imported only by LoRA runs.
        self.vocab = int(cast(PreTrainedModel, self.policy).config.vocab_size)
        self.limits = Limits.for_run(cfg, vocab_size=self.vocab)

    def weights(self) -> Any:
        """(name, tensor) pairs of the whole policy, for the engine: gathered from every rank, or
        merged with its adapters for a LoRA policy."""
        if self.ranks is not None:
            return self.ranks.full_state().items()
        return engine_weights(self.policy)

    # -- runtime callbacks ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.t.version

    async def readiness(self) -> list[str]:
        if self.worker is None:
            return ["connecting to redis"]
        reasons = [] if self.worker.redis_ok else ["redis unreachable"]
        behind = self.t.readiness_reason()
        return reasons + ([behind] if behind else [])

    async def status(self) -> dict[str, Any]:
        w = self.worker
        return {"version": self.version, "checkpoint_version": self.t.checkpoint_version,
                "backpressure": self.held, "fill_ratio": round(self.fill, 3), "handled": w.handled if w else 0,
                "outbox": self.outbox.pending(), **self._engine_status(), **self._rank_status()}

    def _engine_status(self) -> dict[str, Any]:
        if not isinstance(self.engine, ReplicaEngine):
            return {}
        return {"engine_replicas": replica_rows(self.engine, self.runtime.gpu)}

    def _rank_status(self) -> dict[str, Any]:
        if self.ranks is None or self.rank_gauges is None:
            return {}
        ranks = self.ranks.status()
        self.rank_gauges.show(self.ranks.ranks)
        return {"ranks": ranks}

    async def on_drain(self) -> None:
        # Stop taking prompts and finish the batch in hand, let a running Train finish, then
        # checkpoint so the replacement starts at this version.
        if self.worker is not None:
            await self.worker.drain()
        async with self.t.lock:
            await asyncio.to_thread(self.t.save)
        if self.bus is not None:
            with contextlib.suppress(BusUnavailable):
                await self.outbox.flush(self._publish_raw)
            await self.bus.close()
        self.outbox.close()
        await asyncio.to_thread(self.engine.close)  # a process engine's child stops now, not at exit
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.stop)

    # -- backpressure --------------------------------------------------------------------------------
    async def gate(self) -> int:
        """Hold generation while the slowest downstream group is above the high watermark, until it
        falls below the low watermark (hysteresis keeps the actor from flapping); then how many messages
        the next read may take (`flow.room`), so a read of several never overshoots the hold."""
        assert self.bus is not None
        flow = self.cfg.flow
        groups = [*self.cfg.stages(), "controller"]
        while True:
            self.fill = await self.bus.fill_ratio(self.bus.keys.rollouts, groups, flow.stream_capacity)
            self.metrics.fill_ratio.set(self.fill)
            if self.held and self.fill < flow.low_watermark:
                self.held = False
            elif not self.held and self.fill >= flow.high_watermark:
                self.held = True
                log.info("backpressure on", extra={"fill_ratio": round(self.fill, 3)})
            self.metrics.backpressure.set(int(self.held))
            if not self.held or (self.worker is not None and self.worker.stopping):
                return flow.room(self.fill)
            await asyncio.sleep(0.1)

    # -- generation ----------------------------------------------------------------------------------
    def _params(self, s: pb.SamplingParams) -> SamplingParams:
        g = self.cfg.generation
        return SamplingParams(
            temperature=s.temperature or g.temperature, top_p=s.top_p or g.top_p, top_k=s.top_k,
            max_new_tokens=s.max_new_tokens or g.max_new_tokens,
            stop_token_ids=tuple(s.stop_token_ids) or (self.tokenizer.eos_token_id,), seed=s.seed,
            logprobs=g.behaviour_logprobs == "engine",
        )

    async def handle(self, msg: Message) -> None:
        assert self.bus is not None
        batch = parse_message(pb.PromptBatch, msg.data, max_bytes=self.cfg.flow.max_message_bytes)
        self.limits.check_prompt_batch(batch)
        prompts = [list(p.token_ids) for p in batch.prompts]
        params = self._params(batch.sampling)
        await self.wait_for_version(batch)
        with self.metrics.time_stage("generate"):
            got = await self.batcher.generate(prompts, params)
        comps = got.completions
        rollout = completions_to_rollout(
            [p.task_id for p in batch.prompts], prompts, comps, [int(p.group_id) for p in batch.prompts],
            got.version, self.tokenizer.pad_token_id)
        rollout_id = new_rollout_id(batch.batch_id)
        out = rollout_to_proto(rollout, rollout_id, sampling=batch.sampling,
                               finish_reasons=[c.finish_reason for c in comps], generate_seconds=got.seconds)
        data = out.SerializeToString()
        headers = {"kind": "rollout", "batch_id": rollout_id}
        try:
            await self.bus.publish(self.bus.keys.rollouts, data, **headers)
        except BusUnavailable:
            # Generated work is kept, not redone: the outbox publishes it when Redis returns.
            await asyncio.to_thread(self.outbox.put, rollout_id, self.bus.keys.rollouts, data, headers)
            log.warning("redis unavailable; rollout kept in the outbox", extra={"batch_id": rollout_id})
        tokens = int(rollout.response_mask.sum())
        self.metrics.tokens.labels(phase="generate").inc(tokens)
        self.metrics.samples.labels(phase="generate").inc(len(rollout))

    async def wait_for_version(self, batch: pb.PromptBatch) -> None:
        """Never generate under an older policy than the fleet committed or the prompts were admitted
        at: a restarted actor waits here while the controller replays the steps it missed. The wait
        for a message's version is bounded, since it holds the only consumer loop: a version the
        controller has not committed (a hostile message, or an old run's on a reused run name and
        redis.url) is rejected at once, and one not reached within flow.rpc_timeout_s of the actor
        being caught up is rejected then."""
        want = int(batch.version)
        deadline = time.monotonic() + self.cfg.flow.rpc_timeout_s
        checked = 0.0
        while not (self.t.caught_up and self.version >= want):
            now = time.monotonic()
            if now - checked >= 1.0:
                checked = now
                committed = await self.committed_version()
                if want > max(committed, self.version):
                    raise Rejected("version_ahead", f"PromptBatch {batch.batch_id[:40]!r}: version {want} is ahead"
                                                    f" of the run's committed version {committed}")
            if not self.t.caught_up:
                deadline = now + self.cfg.flow.rpc_timeout_s  # replay runs: only a version past it times out
            elif now > deadline:
                raise Rejected("version_timeout", f"PromptBatch {batch.batch_id[:40]!r}: version {want} not"
                                                  f" reached within {self.cfg.flow.rpc_timeout_s:g} s (at"
                                                  f" {self.version})")
            await asyncio.sleep(0.05)

    async def committed_version(self) -> int:
        """The actor version the controller has committed, read now (the cached one lags by up to a
        second). Redis being away raises BusUnavailable: the worker retries the message later."""
        assert self.bus is not None
        self.t.target_version = (await self.bus.get_versions()).get("actor", 0)
        return self.t.target_version

    # -- evaluation ----------------------------------------------------------------------------------
    async def generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateReply:
        """Held-out generation at the version the caller names (Generate): the same engine and
        seeding as training rollouts, but nothing is published, journaled or trained."""
        try:
            check_schema_version(request)
            self.limits.check_generate_request(request)
        except WireError as e:
            await invalid(context, e)
        params = self._params(request.sampling)
        if request.greedy:
            params = replace(params, temperature=0.0)
        prompts = [list(p.token_ids) for p in request.prompts]
        want = int(request.version)
        t0 = time.perf_counter()
        with self.metrics.time_stage("eval_generate"):
            # Under the engine lock the version cannot move between the check and the generation.
            async with self.engine_lock:
                if self.version != want:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"version_mismatch: the actor serves version {self.version}, not {want}")
                comps = await asyncio.to_thread(self.engine.generate, prompts, params)
        reply = message(pb.GenerateReply, version=want, generate_seconds=time.perf_counter() - t0)
        for c in comps:
            reply.completions.add(token_ids=c.token_ids, finish_reason=c.finish_reason)
        return reply

    # -- training ------------------------------------------------------------------------------------
    async def train(self, request: pb.TrainBatch, context: Any) -> pb.TrainResult:
        try:
            res = await self.t.train(request, context, require=("advantages",), apply=self._train_step)
        except RankError as e:
            # The actor is going down (watch_engine sees the broken group): the controller retries
            # the step on its replacement, as after any restart.
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.metrics.policy_version.set(self.version)
        return res

    async def warm_up(self) -> None:
        """The trainer's compile (`algo.compile`) in the background, unless it ran while the engine
        started: it overlaps the first generation and scoring instead of lengthening the first step.
        One rank only: on several, a warm-up would have to run every rank's collectives (they
        compile in their first step)."""
        if not self.compiled:
            await asyncio.to_thread(self.compile_trainer)

    def compile_trainer(self) -> None:
        """The trainer's warm-up (`PolicyTrainer.warm_up`), once; a compile failure is a ConfigError."""
        if self.ranks is None:
            proximal = self.trainer.weights_move_within(self.cfg.samples_per_step)
            warm_up_compiled("actor", partial(self.trainer.warm_up, self.vocab, proximal, self.cfg.samples_per_step,
                                              self.cfg.generation.max_new_tokens))
        self.compiled = True

    def warming(self) -> asyncio.Task[None]:
        """The warm-up task, started by whichever comes first: main() or a call that needs it."""
        if self.warm is None:
            self.warm = asyncio.create_task(self.warm_up())
        return self.warm

    async def warmed_up(self) -> None:
        """Wait for the warm-up before touching the trainer's weights or gradients (it runs forward
        and backward passes on them)."""
        await asyncio.shield(self.warming())

    async def _train_step(self, req: TrainRequest) -> dict[str, float]:
        await self.warmed_up()
        with self.metrics.time_stage("actor_train"):
            if self.ranks is not None:
                stats = await asyncio.to_thread(self.ranks.train, req.rollout, req.step, self.version)
            else:
                stats = await asyncio.to_thread(self.trainer.train_step, req.rollout, req.step, self.version)
        if self.rank_gauges is not None and self.ranks is not None:
            self.rank_gauges.show(self.ranks.ranks)
        with self.metrics.time_stage("weight_sync"):
            weights = await asyncio.to_thread(self.weights)  # gathered before the engine is held
            async with self.engine_lock:
                await asyncio.to_thread(self.engine.update_weights, weights, req.target_version)
        # No await from here until Trainable moves the version: a generation that takes the engine
        # lock in between would label the new weights with the old version.
        m = self.metrics
        m.loss.labels(kind="policy").set(stats.get("policy_loss", 0.0))
        m.samples.labels(phase="train").inc(len(req.rollout))
        m.tokens.labels(phase="train").inc(int(req.rollout.response_mask.sum()))
        return stats

    def sync_engine(self, version: int) -> None:
        """The trainer's weights into the engine (merged there for a LoRA policy, off the event loop)."""
        self.engine.update_weights(self.weights(), version)

    async def update_weights(self, request: pb.UpdateWeightsRequest, context: Any) -> pb.UpdateWeightsResponse:
        """Load a checkpoint path into the trainer and the engine (UpdateWeights): its version must
        not be behind this actor's nor ahead of the run's committed one. The same version again is
        a no-op, as a replayed Train is: one version number always means the same weights."""
        try:
            check_schema_version(request)
            if not request.checkpoint_path:
                raise WireError("missing_field", "UpdateWeightsRequest: checkpoint_path is empty (the engine"
                                " already serves the trainer's in-process weights)")
        except WireError as e:
            await invalid(context, e)
        path, version = Path(request.checkpoint_path), int(request.version)
        t0 = time.perf_counter()
        await self.warmed_up()
        async with self.t.lock:
            try:
                committed = await self.committed_version()
            except BusUnavailable as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the committed version: {e}")
            try:
                self.t.check_weights_version(version, committed)
                if version > self.version:
                    step = await asyncio.to_thread(self.t.load_weights, path, version)
                    weights = await asyncio.to_thread(self.weights)
                    async with self.engine_lock:
                        await asyncio.to_thread(self.engine.update_weights, weights, version)
                        self.t.version, self.t.step = version, step
            except WeightsRefused as e:
                log.warning("update_weights refused", extra={"version": version, "error": str(e)[:300]})
                await context.abort(e.code, str(e))
            if self.t.due():
                await asyncio.to_thread(self.t.save)
        self.metrics.policy_version.set(self.version)
        return message(pb.UpdateWeightsResponse, version=self.version, seconds=time.perf_counter() - t0)

    async def main(self) -> None:
        c = self.cfg
        assert c.redis.url is not None
        self.bus = await Bus.connect(c.redis.url, c.run.name, password=c.redis_password(), **bus_options(c.flow))
        await self.bus.ensure_groups(self.bus.keys.prompts, ["actor"])
        await self.bus.ensure_groups(self.bus.keys.rollouts, [*c.stages(), "controller"])
        self.worker = StreamWorker(self.bus, self.bus.keys.prompts, "actor", self.instance, self.handle,
                                   self.metrics, gate=self.gate, count=c.generation.batch_messages, together=True)
        await self.runtime.refresh_readiness()
        warm = self.warming()
        background = asyncio.create_task(self.housekeeping())
        work = asyncio.create_task(self.worker.run())
        watch = asyncio.create_task(self.watch_engine())
        try:
            pending = {work, watch, warm}
            while True:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # an engine that died fails the service: its supervisor restarts it
                if done - {warm}:  # a finished warm-up leaves the service running
                    break
        finally:
            for task in (background, work, watch, warm):
                task.cancel()

    async def watch_engine(self) -> None:
        """Fail fast when the engine's own process (generation.process) or a trainer rank died."""
        while self.engine.alive and (self.ranks is None or self.ranks.alive):
            await asyncio.sleep(1.0)
        if self.runtime.draining:
            return  # on_drain closed the engine and stopped the ranks: nothing died
        if self.ranks is not None and not self.ranks.alive:
            raise RankError(self.ranks.why_dead())
        if why := getattr(self.engine, "stopped_for", None):  # not dead: stopped, holding weights nobody sent
            raise EngineError(f"the generation engine stopped serving: {why}; the actor stops so that it is restarted")
        which = ""
        if isinstance(self.engine, ReplicaEngine):
            dead = self.engine.dead_replicas()
            which = f" (replica {', '.join(map(str, dead))})" if dead else " (the replicas disagree on the version)"
        raise EngineError(f"the generation engine's process died{which}; the actor stops so that it is restarted")

    async def _publish_raw(self, stream: str, data: bytes, headers: dict[str, str]) -> str:
        assert self.bus is not None
        return await self.bus.publish(stream, data, **headers)

    async def housekeeping(self) -> None:
        """Flush the outbox and follow the fleet's acknowledged version, once a second."""
        assert self.bus is not None
        while True:
            try:
                if self.outbox.pending():
                    sent = await self.outbox.flush(self._publish_raw)
                    if sent:
                        log.info("outbox flushed", extra={"sent": sent, "left": self.outbox.pending()})
                await self.t.follow_committed(self.bus)
            except BusUnavailable:
                pass
            await asyncio.sleep(1.0)


class _ActorServicer(ServiceCalls, pb_grpc.ActorServicer):
    def __init__(self, actor: Actor) -> None:
        super().__init__(actor.runtime, "actor", actor.instance, lambda: actor.version, actor.t)
        self.a = actor

    async def Train(self, request: pb.TrainBatch, context: Any) -> pb.TrainResult:  # noqa: N802
        return await self.a.train(request, context)

    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context: Any) -> pb.UpdateWeightsResponse:  # noqa: N802
        return await self.a.update_weights(request, context)

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateReply:  # noqa: N802
        return await self.a.generate(request, context)


def serve(cfg: RunConfig) -> None:
    actor = Actor(cfg)
    servicer = _ActorServicer(actor)
    actor.runtime.add_grpc_service("rlfleet.v1.Actor", lambda s: pb_grpc.add_ActorServicer_to_server(servicer, s))
    actor.runtime.run(actor.main)
