"""The controller: owns the run. It admits prompts (bounded by the staleness budget), journals every
task, joins rollouts with their scores, computes advantages, drives `Train` on the actor and the
critic in parallel, and records each step. The LMDB journal is the source of truth; Redis is only
transport, so after a restart the controller rebuilds its view from the journal and re-enqueues
whatever is not terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import grpc

from services.controller.assembler import StepAssembler, prompt_batch_of
from services.controller.evaluation import Evaluation
from services.core.bus import Bus, BusUnavailable, Message, bus_options
from services.core.config import RunConfig
from services.core.events import AppendOnlyFile, EventLog
from services.core.ids import batch_id as make_batch_id
from services.core.ids import generation_seed, parse_task_id, task_id
from services.core.journal import JournalFull, TaskSpec
from services.core.limits import Limits
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.core.run_binding import open_run_journal
from services.core.runtime import ServiceRuntime, make_channel, rpc
from services.core.wire import (
    check_schema_version,
    message,
    parse_message,
    score_from_proto,
    train_batch_to_proto,
    validate_rollout_batch,
)
from services.core.worker import Rejected, StreamWorker
from services.models.loading import load_tokenizer
from services.rl import batch as rb
from services.rl.pipeline import compute_advantages
from services.tasks import load_task

log = logging.getLogger("rlfleet.controller")

ROLLOUT = "rollout"  # journal result stage under which the winning rollout of a prompt batch is kept


class Controller:
    def __init__(self, cfg: RunConfig) -> None:
        assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
        self.cfg = cfg
        self.task = load_task(cfg.task)
        self.tokenizer = load_tokenizer(Path(cfg.models.policy.path))
        self.stages = cfg.stages()
        self.limits = Limits.for_run(cfg)
        self.trainable = ["actor", "critic"] if cfg.algo.needs_critic else ["actor"]
        run_dir = cfg.run_dir
        self.journal = open_run_journal(cfg, stages=tuple(self.stages), trainable=tuple(self.trainable))
        self.journal_error: str | None = None
        self.events = EventLog(run_dir / "events.jsonl")
        self.metrics_path = run_dir / "metrics.jsonl"
        self.metrics_file = AppendOnlyFile(self.metrics_path, fsync=False)  # holds rows while the disk is full
        self.assembler = StepAssembler(list(self.stages), cfg.samples_per_step)
        self.runtime = ServiceRuntime.from_config(
            cfg, "controller", readiness=self.readiness, status=self.status, on_drain=self.on_drain)
        self.metrics = self.runtime.metrics
        self.evaluation = Evaluation(cfg, self.task, self.tokenizer, self.metrics, lambda: self._stub("actor"))
        self.bus: Bus | None = None
        self.workers: list[StreamWorker] = []
        # Every step adds exactly one policy version, so the step counter is the version: one
        # source of truth, whatever a crash interrupted.
        self.version = self.journal.step
        self.last: dict[str, Any] = {}
        self.queues: dict[str, int] = {}  # stream depths at the last step, for `rlfleet status`
        self.admission_open = True
        self.done = False
        self.instance = f"controller-{os.getpid()}"
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.t_last_step = time.perf_counter()
        self.replay_locks = {name: asyncio.Lock() for name in self.trainable}
        self.served: dict[str, int] = {}  # last version each trainable service reported serving
        # Prompt batch id -> monotonic time of its last progress (admit, rollout, score): the
        # watchdog re-publishes batches that stall, whatever lost their messages.
        self.progress: dict[str, float] = {}
        # Task state changes (admit, generated/scored, trained, dead) and their events happen one at
        # a time: a dead letter racing its own rollout, or an admission racing the step that made
        # room for it, must never interleave.
        self.state_lock = asyncio.Lock()

    # -- runtime callbacks ---------------------------------------------------------------------------
    async def readiness(self) -> list[str]:
        reasons = []
        if self.bus is None:
            reasons.append("connecting to redis")
        elif any(not w.redis_ok for w in self.workers):
            reasons.append("redis unreachable")
        if not self.journal.has_space(self.cfg.journal.min_free_bytes):
            reasons.append(f"journal disk nearly full ({self.journal.disk_free_bytes()} bytes free)")
        if self.journal_error:
            reasons.append(f"journal: {self.journal_error}")
        return reasons

    async def durable(self, fn: Any, *args: Any) -> Any:
        """A journal write that must happen: retried while the disk is full (the controller is not
        ready meanwhile), never skipped and never half-done (each write is one transaction)."""
        delay = 0.5
        while True:
            try:
                out = await asyncio.to_thread(fn, *args)
                self.journal_error = None
                return out
            except JournalFull as e:
                if self.journal_error is None:
                    log.error("journal full; waiting for space", extra={"error": str(e)[:300]})
                self.journal_error = str(e)[:300]
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def status(self) -> dict[str, Any]:
        return {
            "step": self.journal.step, "max_steps": self.cfg.run.max_steps, "version": self.version,
            "in_flight": self.journal.in_flight(), "admission_open": self.admission_open,
            "done": self.done, "last": self.last, "queues": self.queues,
        }

    async def on_drain(self) -> None:
        for w in self.workers:
            await w.drain()
        for ch in self.channels.values():
            await ch.close()
        if self.bus is not None:
            await self.bus.close()
        self.events.close()
        self.metrics_file.close()
        self.evaluation.close()
        self.journal.close()

    # -- admission -----------------------------------------------------------------------------------
    def _message_tasks(self, first: int) -> list[TaskSpec]:
        g = self.cfg.algo.group_size
        return [TaskSpec(task_id(i, k), i, k, i)
                for i in range(first, first + self.cfg.batch.prompts_per_message) for k in range(g)]

    def _prompt_batch(self, first: int) -> pb.PromptBatch:
        c = self.cfg
        g = c.generation
        stops = sorted({self.tokenizer.eos_token_id, *g.stop_token_ids})
        sampling = pb.SamplingParams(
            temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_new_tokens=g.max_new_tokens,
            stop_token_ids=stops, seed=generation_seed(c.run.seed, first))
        batch = message(pb.PromptBatch, batch_id=make_batch_id(first), version=self.version,
                        sampling=sampling, step=self.journal.step)
        for spec in self._message_tasks(first):
            text = self.task.prompt(spec.dataset_index).text
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            batch.prompts.add(task_id=spec.task_id, token_ids=ids, dataset_index=spec.dataset_index,
                              sample_index=spec.sample_index, group_id=spec.group_id)
        return batch

    async def _publish_prompts(self, first: int) -> None:
        assert self.bus is not None
        data = self._prompt_batch(first).SerializeToString()
        await self.bus.publish(self.bus.keys.prompts, data, kind="prompts", batch_id=make_batch_id(first))

    async def admit_loop(self) -> None:
        c = self.cfg
        budget = (c.flow.max_staleness + 1) * c.samples_per_step
        needed = c.run.max_steps * c.samples_per_step
        while not self.done:
            async with self.state_lock:
                first = await self._admit_once(budget, needed)
            if first is None:
                await asyncio.sleep(0.05)
                continue
            await self._retry_bus(lambda f=first: self._publish_prompts(f))

    async def _admit_once(self, budget: int, needed: int) -> int | None:
        """Admit one prompt message if the staleness budget allows; returns its first dataset index."""
        c = self.cfg
        per_msg = c.batch.prompts_per_message * c.algo.group_size
        can = self.journal.has_space(c.journal.min_free_bytes) and self.journal_error is None
        in_flight = self.journal.in_flight()
        self.metrics.in_flight.set(in_flight)
        first = self.journal.cursor
        self.admission_open = can and in_flight + per_msg <= budget
        self.metrics.admission_open.set(int(self.admission_open))
        # Dead tasks never train, so the run admits replacements for them.
        usable = first * c.algo.group_size - self.journal.counts().get("dead", 0)
        if not self.admission_open or usable >= needed:
            return None
        tasks = self._message_tasks(first)
        try:
            await asyncio.to_thread(self.journal.admit, tasks, first + c.batch.prompts_per_message)
            self.journal_error = None
        except JournalFull as e:
            log.error("journal full; admission stopped until space returns", extra={"error": str(e)[:300]})
            self.journal_error = str(e)[:300]
            await asyncio.sleep(1.0)
            return None
        self.events.emit("admitted", task_ids=[t.task_id for t in tasks], cursor=first)
        self.progress[make_batch_id(first)] = time.monotonic()
        return first

    async def _retry_bus(self, op: Any) -> None:
        """The journal already holds the task; publishing is retried until Redis answers."""
        backoff = 0.2
        while True:
            try:
                await op()
                return
            except BusUnavailable as e:
                log.warning("redis unavailable while publishing; retrying", extra={"error": str(e)})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    # -- joining results -----------------------------------------------------------------------------
    async def on_rollout(self, msg: Message) -> None:
        rbm = parse_message(pb.RolloutBatch, msg.data, max_bytes=self.cfg.flow.max_message_bytes)
        rollout = validate_rollout_batch(rbm, self.cfg.flow.max_message_bytes, self.limits)
        rid = rbm.batch_id
        pbid = prompt_batch_of(rid)
        expected = {t.task_id for t in self._message_tasks(self._first_of(pbid))}
        if set(rollout.task_ids) != expected:
            raise Rejected("unknown_tasks", f"rollout {rid!r} carries task ids that prompt batch {pbid!r} "
                                            "did not admit")
        # First rollout of a prompt batch wins; a regenerated duplicate is dropped.
        if not await self.durable(self.journal.put_result_if_absent, pbid, ROLLOUT, msg.data):
            return
        self.assembler.add_rollout(rid, rollout, order=self._first_of(pbid))
        self.progress[pbid] = time.monotonic()
        await self._sync_states(pbid)

    async def on_score(self, msg: Message) -> None:
        sb = parse_message(pb.ScoreBatch, msg.data, max_bytes=self.cfg.flow.max_message_bytes)
        if sb.stage not in self.stages:
            raise Rejected("unknown_stage", f"score from stage {sb.stage!r}; this run uses {self.stages}")
        scores = score_from_proto(sb, max_bytes=self.cfg.flow.max_message_bytes, expected_stage=sb.stage,
                                  expected_rows=self.cfg.batch.prompts_per_message * self.cfg.algo.group_size,
                                  limits=self.limits)
        if not await self.durable(self.journal.put_result_if_absent, sb.batch_id, sb.stage, msg.data):
            return  # a redelivered score: already counted once
        if self.assembler.add_score(sb.batch_id, sb.stage, scores.tensor):
            pbid = prompt_batch_of(sb.batch_id)
            self.progress[pbid] = time.monotonic()
            if self.assembler.rollout_id_of(pbid) == sb.batch_id:
                await self._sync_states(pbid)

    async def _sync_states(self, pbid: str) -> None:
        """Bring the journal's task states up to what the join knows (generated once the rollout
        is in, scored once every stage is): idempotent, so it also repairs a crash between a
        result write and its state change."""
        async with self.state_lock:
            await self._sync_states_locked(pbid)

    async def _sync_states_locked(self, pbid: str) -> None:
        rid = self.assembler.rollout_id_of(pbid)
        if rid is None:
            return
        version = self.assembler.rollout_of(pbid).version
        complete = self.assembler.has_all_scores(pbid)
        ids = [t.task_id for t in self._message_tasks(self._first_of(pbid))]
        recs = [await asyncio.to_thread(self.journal.get, i) for i in ids]
        states = {r.state for r in recs if r is not None}
        if states & {"dead", "trained"}:
            # Its tasks already ended (a stage dead-lettered the batch): the join forgets it.
            self.assembler.drop(pbid)
            self.progress.pop(pbid, None)
            return
        if "admitted" in states:
            await self.durable(self.journal.mark_generated, ids, version, rid)
            self.events.emit("generated", task_ids=ids, version=version)
        if complete:
            if states & {"admitted", "generated"}:
                for stage in self.stages:
                    await self.durable(self.journal.mark_stage_done, ids, stage)
                self.events.emit("scored", task_ids=ids)
            # Only now may a step take it: its tasks are `scored` in the journal.
            self.assembler.mark_ready(pbid)

    @staticmethod
    def _first_of(prompt_batch_id: str) -> int:
        if not prompt_batch_id.startswith("b") or not prompt_batch_id[1:].isdigit():
            raise Rejected("bad_batch_id", f"malformed batch id {prompt_batch_id!r}")
        return int(prompt_batch_id[1:])

    # -- training ------------------------------------------------------------------------------------
    def _stub(self, name: str) -> Any:
        if name not in self.channels:
            ep = self.cfg.endpoint(name)  # type: ignore[arg-type]
            self.channels[name] = make_channel(ep.host, ep.grpc_port, self.cfg.flow.max_message_bytes)
        ch = self.channels[name]
        return pb_grpc.ActorStub(ch) if name == "actor" else pb_grpc.CriticStub(ch)

    async def _call_train(self, name: str, batch: pb.TrainBatch) -> pb.TrainResult:
        """Train is idempotent (keyed by target version), so it is retried while the service is away
        (restarting, being swapped) for up to flow.rpc_timeout_s; a service that restarted behind
        the fleet answers FAILED_PRECONDITION and is replayed first."""
        deadline = time.monotonic() + self.cfg.flow.rpc_timeout_s
        delay = 0.2
        while True:
            try:
                return await rpc(self._stub(name).Train, batch, timeout_s=self.cfg.flow.rpc_timeout_s,
                                 idempotent=True, retries=0, token=self.cfg.token())
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    await self.replay(name)
                    continue
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                        or time.monotonic() > deadline:
                    raise
                log.warning("train call failed; retrying", extra={"service": name, "code": e.code().name})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _train(self, name: str, batch: pb.TrainBatch) -> pb.TrainResult:
        async with self.replay_locks[name]:
            pass  # never interleave a new step with a replay in progress
        return await self._call_train(name, batch)

    async def _state(self, name: str) -> pb.ServiceState:
        return await rpc(self._stub(name).GetState, message(pb.GetStateRequest), timeout_s=5.0,
                         idempotent=True, retries=1, token=self.cfg.token())

    async def replay(self, name: str) -> int:
        """Bring a service that restarted from an older checkpoint back to the journal's version by
        re-sending the training batches after its version, oldest first. Returns steps replayed."""
        async with self.replay_locks[name]:
            state = await self._state(name)
            have = int(state.version)
            batches = await asyncio.to_thread(self.journal.batches_after, have)
            n = 0
            for step, raw in batches:
                if step > self.version:
                    break
                batch = parse_message(pb.TrainBatch, raw, max_bytes=self.cfg.flow.max_message_bytes)
                await self._call_train(name, batch)
                n += 1
            if n:
                log.info("replayed training batches", extra={"service": name, "from_version": have, "steps": n})
            return n

    async def sync_loop(self) -> None:
        """Watch the trainable services: record the versions they serve and the checkpoints they
        acknowledge (pruning replay batches no one needs), and replay one that fell behind."""
        while not self.done:
            for name in self.trainable:
                try:
                    state = await self._state(name)
                except grpc.aio.AioRpcError:
                    continue  # away (restarting); Train retries cover it
                v = int(state.version)
                # A replacement that is still catching up (not ready) is not serving its version.
                if state.state == "ready" and self.served.get(name) != v:
                    self.served[name] = v
                    self.events.emit("version_served", service=name, version=v)
                ckpt = int(state.gauges.get("checkpoint_version", 0))
                if ckpt > self.journal.checkpoint_steps.get(name, 0):
                    await asyncio.to_thread(self.journal.prune_batches, name, ckpt)
                    self.events.emit("checkpoint", service=name, version=ckpt, step=ckpt)
                if v < self.version and not self.replay_locks[name].locked():
                    await self.replay(name)
            await asyncio.sleep(1.0)

    async def watchdog(self) -> None:
        """Re-publish prompt batches that made no progress for flow.resend_after_s: their prompts
        when no rollout arrived, else the winning rollout for the stages still missing."""
        assert self.bus is not None
        limit = self.cfg.flow.resend_after_s
        while not self.done:
            await asyncio.sleep(min(1.0, limit / 4))
            now = time.monotonic()
            for pbid, t in list(self.progress.items()):
                if now - t < limit:
                    continue
                self.progress[pbid] = now
                raw = await asyncio.to_thread(self.journal.get_result, pbid, ROLLOUT)
                # A batch still queued behind a slow consumer is not lost: publishing it again would
                # only deepen that queue. Lost messages (Redis restarted empty) leave no backlog.
                stream, groups = ((self.bus.keys.prompts, ["actor"]) if raw is None
                                  else (self.bus.keys.rollouts, self.cfg.stages()))
                with contextlib.suppress(BusUnavailable):
                    if await self.bus.backlog(stream, groups) > 0:
                        continue
                log.warning("batch stalled; publishing again", extra={"batch_id": pbid, "has_rollout": raw is not None})
                if raw is None:
                    await self._retry_bus(lambda f=self._first_of(pbid): self._publish_prompts(f))
                else:
                    rid = self.assembler.rollout_id_of(pbid) or pbid
                    await self._retry_bus(lambda r=raw, i=rid: self.bus.publish(  # type: ignore[union-attr]
                        self.bus.keys.rollouts, r, kind="rollout", batch_id=i))

    async def on_dead(self, msg: Message) -> None:
        """A message some stage gave up on: its tasks end `dead` with the reason (never lost), and
        admission replaces them. Dead letters that name no batch of ours are only counted."""
        reason = msg.headers.get("reason") or "dead-lettered"
        bid = msg.headers.get("h.batch_id", "")
        self.metrics.dead_letters.labels(reason=reason.split(":", 1)[0][:40]).inc()
        if not bid:
            return
        pbid = prompt_batch_of(bid)
        try:
            first = self._first_of(pbid)
        except Rejected:
            return
        winner = self.assembler.rollout_id_of(pbid)
        if ":" in bid and winner is not None and winner != bid:
            return  # a duplicate rollout of this batch was rejected; the one that counts is intact
        ids = [t.task_id for t in self._message_tasks(first)]
        async with self.state_lock:
            recs = [await asyncio.to_thread(self.journal.get, i) for i in ids]
            # Scored tasks have every result they need; only unfinished ones can die of this.
            live = [r.task_id for r in recs if r is not None and r.state in ("admitted", "generated")]
            if not live:
                return
            # A stage that rejected a batch for good (NaN reward, wrong shape...) would reject it again.
            await self.durable(self.journal.mark_dead, live, reason[:500])
            for tid in live:
                self.events.emit("dead", task_id=tid, reason=reason[:500])
            self.assembler.drop(pbid)
            self.progress.pop(pbid, None)
        log.warning("tasks dead", extra={"batch_id": pbid, "tasks": len(live), "reason": reason[:200]})

    async def step_loop(self) -> None:
        c = self.cfg
        stored = await asyncio.to_thread(self.journal.get_batch, self.journal.step + 1)
        if stored is not None and self.journal.step < c.run.max_steps:
            # Crashed mid-step last time: finish exactly that step, not a re-assembled one.
            await self.resume_step(stored)
        while self.journal.step < c.run.max_steps:
            parts = self.assembler.take_step()
            if parts is None:
                await asyncio.sleep(0.02)
                continue
            for rid, _ in parts:
                self.progress.pop(prompt_batch_of(rid), None)
            await self.train_step([r for _, r in parts])
        self.done = True

    async def resume_step(self, raw: bytes) -> None:
        batch = parse_message(pb.TrainBatch, raw, max_bytes=self.cfg.flow.max_message_bytes)
        r = validate_rollout_batch(batch.rollout, self.cfg.flow.max_message_bytes)
        for first in sorted({parse_task_id(t)[0] - parse_task_id(t)[0] % self.cfg.batch.prompts_per_message
                             for t in r.task_ids}):
            self.assembler.drop(make_batch_id(first))
            self.progress.pop(make_batch_id(first), None)
        log.info("resuming a journaled step", extra={"step": int(batch.step) + 1})
        await self._commit_step(batch, r, stats={"resumed": 1.0}, t0=time.perf_counter())

    async def train_step(self, parts: list[rb.Rollout]) -> None:
        c = self.cfg
        step = self.journal.step
        t0 = time.perf_counter()
        r = rb.concat(parts, pad_id=self.tokenizer.pad_token_id)
        stats = compute_advantages(r, c.algo, c.generation.max_new_tokens)
        batch = train_batch_to_proto(r, step=step, batch_id=f"s{step}", target_version=self.version + 1)
        # Journaled before any Train call: a crash from here on resumes exactly this step.
        await self.durable(self.journal.put_batch, step + 1, batch.SerializeToString())
        await self._commit_step(batch, r, stats, t0)

    async def _commit_step(self, batch: pb.TrainBatch, r: rb.Rollout, stats: dict[str, float], t0: float) -> None:
        c = self.cfg
        step = int(batch.step)
        target = int(batch.target_version)
        t_adv = time.perf_counter()
        calls = [self._train("actor", batch)]
        if c.algo.needs_critic:
            calls.append(self._train("critic", batch))
        results = await asyncio.gather(*calls)
        t_train = time.perf_counter()
        gen_versions = r.versions.tolist() if r.versions is not None else [r.version] * len(r)
        async with self.state_lock:
            await self.durable(self.journal.mark_trained, r.task_ids, step + 1, target - 1, c.flow.max_staleness)
            self.events.emit("trained", step=step + 1, task_ids=r.task_ids, version=target - 1,
                             generated_versions=gen_versions)
        for name in self.trainable:
            await self.durable(self.journal.set_version, name, target)
        with contextlib.suppress(BusUnavailable):
            await self.bus.set_versions({n: target for n in self.trainable})  # type: ignore[union-attr]
        staleness = target - 1 - min(gen_versions)
        self.version = target
        for res in results:
            stats.update({k: float(v) for k, v in res.stats.items()})
        now = time.perf_counter()
        tokens = int(r.response_mask.sum())
        elapsed = now - self.t_last_step
        self.t_last_step = now
        depths = await self._depths()
        if "reward_mean" not in stats and r.rewards is not None:
            stats["reward_mean"] = float(r.rewards.float().mean())
        row = {
            "step": step + 1, "time": time.time(), "version": self.version, **stats, "tokens": tokens,
            "samples": len(r),
            "tokens_per_s": tokens / elapsed, "samples_per_s": len(r) / elapsed,
            "advantage_s": t_adv - t0, "train_s": t_train - t_adv, "step_s": elapsed, "staleness": staleness,
            **{f"queue_{k}": v for k, v in depths.items()},
        }
        # Held-out evaluation at the version just committed; its time is not the next step's.
        row.update(await self.evaluation.after_step(step + 1, self.version))
        self.t_last_step = time.perf_counter()
        self.metrics_file.append((json.dumps(row) + "\n").encode())
        self.last = {k: row[k] for k in ("step", "reward_mean", "tokens_per_s", "staleness") if k in row}
        if "kl" in row:
            self.last["kl"] = row["kl"]
        m = self.metrics
        m.policy_version.set(self.version)
        m.staleness.set(staleness)
        if "reward_mean" in stats:
            m.reward_mean.set(stats["reward_mean"])
        if "kl" in stats:
            m.kl.set(stats["kl"])
        m.loss.labels(kind="policy").set(stats.get("policy_loss", 0.0))
        m.samples.labels(phase="train").inc(len(r))
        m.tokens.labels(phase="train").inc(tokens)
        m.stage_latency.labels(stage="step").observe(elapsed)
        self.events.emit("resources", queue_depths=depths, rss_bytes=_rss_bytes(), disk_bytes=self.journal.usage())

    async def _depths(self) -> dict[str, int]:
        assert self.bus is not None
        try:
            # Fully acknowledged entries are dropped so stream length tracks real backlog; trimming
            # never passes an entry some group still needs.
            for stream in (self.bus.keys.prompts, self.bus.keys.rollouts, self.bus.keys.scores):
                await self.bus.trim_acked(stream)
            depths = await self.bus.stream_depths()
        except BusUnavailable:
            return {}
        for k, v in depths.items():
            self.metrics.queue_depth.labels(stream=k, group="all").set(v)
        self.queues = depths
        return depths

    # -- crash recovery -----------------------------------------------------------------------------
    def _backfill_metrics(self) -> None:
        """metrics.jsonl keeps one row per step: a step committed to the journal just before a
        crash, whose row was never written, gets a row saying so."""
        from services.report import read_metrics

        text = self.metrics_path.read_text() if self.metrics_path.exists() else ""
        last = max((int(r.get("step", 0)) for r in read_metrics(self.metrics_path)), default=0)
        with self.metrics_path.open("a") as f:
            if text and not text.endswith("\n"):
                f.write("\n")  # a row torn by the crash stays unreadable instead of gluing onto the next
            for step in range(last + 1, self.journal.step + 1):
                f.write(json.dumps({"step": step, "version": step, "recovered": 1.0}) + "\n")

    async def reconcile(self) -> None:
        """Rebuild the in-memory join from the journal and re-enqueue prompt batches whose rollout
        never arrived; scores already journaled are restored, the rest will be redelivered."""
        pending = await asyncio.to_thread(self.journal.non_terminal)
        batches: dict[int, list[Any]] = {}
        for rec in pending:
            batches.setdefault(rec.dataset_index - rec.dataset_index % self.cfg.batch.prompts_per_message,
                               []).append(rec)
        for first in sorted(batches):
            pbid = make_batch_id(first)
            raw = await asyncio.to_thread(self.journal.get_result, pbid, ROLLOUT)
            if raw is None:
                self.progress[pbid] = time.monotonic()
                await self._retry_bus(lambda f=first: self._publish_prompts(f))
                continue
            self.progress[pbid] = time.monotonic()
            rbm = parse_message(pb.RolloutBatch, raw, max_bytes=self.cfg.flow.max_message_bytes)
            rollout = validate_rollout_batch(rbm, self.cfg.flow.max_message_bytes)
            self.assembler.add_rollout(rbm.batch_id, rollout, order=first)
            for stage in self.stages:
                s_raw = await asyncio.to_thread(self.journal.get_result, rbm.batch_id, stage)
                if s_raw is not None:
                    sb = parse_message(pb.ScoreBatch, s_raw, max_bytes=self.cfg.flow.max_message_bytes)
                    self.assembler.add_score(rbm.batch_id, stage,
                                             score_from_proto(sb, max_bytes=self.cfg.flow.max_message_bytes).tensor)
            await self._sync_states(pbid)
        if batches:
            log.info("reconciled journal", extra={"non_terminal_tasks": len(pending), "batches": len(batches)})

    async def main(self) -> None:
        c = self.cfg
        assert c.redis.url is not None
        self.bus = await Bus.connect(c.redis.url, c.run.name, password=c.redis_password(), **bus_options(c.flow))
        keys = self.bus.keys
        await self.bus.ensure_groups(keys.prompts, ["actor"])
        await self.bus.ensure_groups(keys.rollouts, [*self.stages, "controller"])
        await self.bus.ensure_groups(keys.scores, ["controller"])
        await self.bus.ensure_groups(keys.dead, ["controller"])
        await self.bus.set_versions({n: self.version for n in self.trainable})
        await self.reconcile()
        self._backfill_metrics()
        self.workers = [
            StreamWorker(self.bus, keys.rollouts, "controller", self.instance, self.on_rollout, self.metrics,
                         count=8),
            StreamWorker(self.bus, keys.scores, "controller", self.instance, self.on_score, self.metrics,
                         count=16),
            StreamWorker(self.bus, keys.dead, "controller", self.instance, self.on_dead, self.metrics, count=16),
        ]
        await self.runtime.refresh_readiness()
        tasks = [asyncio.create_task(w.run()) for w in self.workers]
        tasks.append(asyncio.create_task(self.admit_loop()))
        tasks.append(asyncio.create_task(self.sync_loop()))
        tasks.append(asyncio.create_task(self.watchdog()))
        await self.evaluation.before_training(self.journal.step)
        step = asyncio.create_task(self.step_loop())
        done, _ = await asyncio.wait([step, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()  # a crashed consumer or admission loop fails the controller fast
        log.info("run finished", extra={"steps": self.journal.step})
        # Returning from main drains the service and exits 0: the launcher reads that as "done".


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class _ControllerServicer(pb_grpc.ControllerServicer):
    def __init__(self, ctl: Controller) -> None:
        self.c = ctl

    async def GetState(self, request: pb.GetStateRequest, context: Any) -> pb.ServiceState:  # noqa: N802
        check_schema_version(request)
        return message(pb.ServiceState, service="controller", instance_id=self.c.instance,
                       state=self.c.runtime.state, version=self.c.version, step=self.c.journal.step)

    async def Drain(self, request: pb.DrainRequest, context: Any) -> pb.DrainResponse:  # noqa: N802
        check_schema_version(request)
        self.c.runtime.request_drain("rpc")
        return message(pb.DrainResponse, accepted=True, state="draining")


def serve(cfg: RunConfig) -> None:
    ctl = Controller(cfg)
    servicer = _ControllerServicer(ctl)
    ctl.runtime.add_grpc_service("rlfleet.v1.Controller",
                                 lambda s: pb_grpc.add_ControllerServicer_to_server(servicer, s))
    ctl.runtime.run(ctl.main)

