"""The controller: owns the run. It admits prompts (bounded by the staleness budget), journals every
task, joins rollouts with their scores, computes advantages, drives `Train` on the actor and the
critic in parallel, and records each step. The LMDB journal is the source of truth; Redis is only
transport, so after a restart the controller rebuilds its view from the journal and re-enqueues
whatever is not terminal.

Reads as admit -> join -> step -> recover; the calls to the trainable services live in
trainables.py, the step's metrics and gauges in recording.py, admission's arithmetic in admission.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from services.controller import recovery
from services.controller.admission import Admission, BadPrompts
from services.controller.assembler import StepAssembler
from services.controller.components import ComponentMeans, reward_names
from services.controller.durable import DurableJournal
from services.controller.evaluation import Evaluation
from services.controller.recording import StepRecorder
from services.controller.recovery import ROLLOUT
from services.controller.sampling import FleetSampling
from services.controller.trainables import Trainables
from services.controller.unscored import end_unscored
from services.core import ids
from services.core.config.run import RunConfig
from services.core.faults import fault_point
from services.core.journal.run_binding import open_run_journal
from services.core.observability.events import EventLog
from services.core.observability.trackers import Trackers
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.core.retry import Policy
from services.core.serving.runtime import ServiceRuntime
from services.core.serving.worker import Rejected, StreamWorker
from services.core.transport.bus import Bus, BusUnavailable, Message, bus_options
from services.core.transport.limits import Limits
from services.models.io.light_tokenizer import load_tokenizer
from services.rl import batch as rb
from services.rl.pipeline import batch_stats, compute_advantages
from services.rl.wire import (
    check_schema_version,
    message,
    parse_message,
    score_from_proto,
    train_arrays_from_proto,
    train_batch_to_proto,
    validate_rollout_arrays,
)
from services.tasks import load_task

log = logging.getLogger("rlfleet.controller")

# The journal already holds what is being published: keep trying until Redis answers.
UNTIL_REDIS = Policy(retry_on=(BusUnavailable,), initial_s=0.2, max_s=5.0)


def _first_of(prompt_batch_id: str) -> int:
    try:
        return ids.parse_batch_id(prompt_batch_id)
    except ids.BadId as e:
        raise Rejected(e.reason, str(e)) from None


class Controller:
    def __init__(self, cfg: RunConfig) -> None:
        assert cfg.models.policy.path is not None, "the launcher resolves models.policy.path"
        self.cfg = cfg
        self.tokenizer = load_tokenizer(Path(cfg.models.policy.path))
        self.stages = cfg.stages()
        task = load_task(cfg.task)
        self.limits = dataclasses.replace(Limits.for_run(cfg), reward_names=reward_names(task, cfg))
        self.reward_parts = ComponentMeans()  # each task's reward components until its step is recorded
        self.trainable = ["actor", "critic"] if cfg.algo.needs_critic else ["actor"]
        self.journal = open_run_journal(cfg, stages=tuple(self.stages), trainable=tuple(self.trainable))
        self.durable = DurableJournal(self.journal)
        self.events = EventLog(cfg.run_dir / "events.jsonl")
        self.runtime = ServiceRuntime.from_config(
            cfg, "controller", readiness=self.readiness, status=self.status, on_drain=self.on_drain)
        self.metrics = self.runtime.metrics
        self.admission = Admission(cfg, self.journal, self.durable, self.tokenizer, task, self.events, self.metrics)
        ds = cfg.algo.dynamic_sampling
        self.assembler = StepAssembler(list(self.stages), cfg.samples_per_step, cfg.algo.group_size if ds else None)
        self.sampling = FleetSampling(self) if ds else None
        self.surplus = self.sampling or FleetSampling(self)  # leftovers of split batches: see unscored.py
        self.trainables = Trainables(cfg, self.trainable, self.journal, self.events, lambda: self.version)
        self.recorder = StepRecorder(cfg.run_dir / "metrics.jsonl", self.metrics, self.events, self.journal,
                                     trackers=Trackers(cfg, run_id=self.journal.run_id or cfg.run.name))
        self.evaluation = Evaluation(cfg, task, self.tokenizer, self.metrics, lambda: self.trainables.stub("actor"))
        self.bus: Bus | None = None
        self.workers: list[StreamWorker] = []
        self.loops: list[asyncio.Task[None]] = []
        self.done, self.stopping = False, asyncio.Event()  # stopping: a drain asked the loops to end
        self.instance = f"controller-{os.getpid()}"
        # The highest version published in Redis for the trainables to catch up to; never lowered.
        # Publishes go one at a time so an older value can never land after a newer one.
        self.published = 0
        self.publish_lock = asyncio.Lock()
        # Prompt batch id -> monotonic time of its last progress (admit, rollout, score): the
        # watchdog re-publishes batches that stall, whatever lost their messages.
        self.progress: dict[str, float] = {}
        # Task state changes (admit, generated/scored, trained, dead) and their events happen one at
        # a time: a dead letter racing its own rollout, or an admission racing the step that made
        # room for it, must never interleave. A step commits under it, so the version admission
        # stamps is always the journal's committed one.
        self.state_lock = asyncio.Lock()

    @property
    def version(self) -> int:
        """Every step adds exactly one policy version, so the journal's step counter is the version:
        one source of truth, advanced in the same transaction that commits the step."""
        return self.journal.step

    @property
    def running(self) -> bool:
        return not self.done and not self.stopping.is_set()

    # -- runtime callbacks ---------------------------------------------------------------------------
    async def readiness(self) -> list[str]:
        reasons = []
        if self.bus is None:
            reasons.append("connecting to redis")
        elif any(not w.redis_ok for w in self.workers):
            reasons.append("redis unreachable")
        if not self.journal.has_space(self.cfg.journal.min_free_bytes):
            reasons.append(f"journal disk nearly full ({self.journal.disk_free_bytes()} bytes free)")
        if self.durable.error:
            reasons.append(f"journal: {self.durable.error}")
        return reasons

    async def status(self) -> dict[str, Any]:
        return {
            "step": self.journal.step, "max_steps": self.cfg.run.max_steps, "version": self.version,
            "in_flight": self.journal.in_flight(), "dropped": self.journal.counts()["dropped"],
            "admission_open": self.admission.open,
            "done": self.done, "last": self.recorder.last, "queues": self.recorder.queues,
        }

    async def on_drain(self) -> None:
        # The loops write to the journal: they end (a step in progress finishes) before it closes.
        self.stopping.set()
        for w in self.workers:
            await w.drain()
        if self.loops:
            ended, late = await asyncio.wait(self.loops, timeout=self.cfg.flow.rpc_timeout_s)
            for t in late:
                t.cancel()
            if late:
                log.warning("loops still running at drain; cancelled", extra={"loops": [t.get_name() for t in late]})
                ended |= (await asyncio.wait(late, timeout=5.0))[0]
            for t in ended:
                err = None if t.cancelled() else t.exception()
                if err is not None and not isinstance(err, BusUnavailable):  # Redis away at a drain is no failure
                    log.error("loop failed while draining", extra={"loop": t.get_name(), "error": repr(err)[:300]})
        await self.trainables.close()
        if self.bus is not None:
            await self.bus.close()
        self.events.close()
        self.recorder.close()
        self.evaluation.close()
        self.journal.close()

    async def pause(self, seconds: float) -> None:
        """Sleep that a drain cuts short."""
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)
        except TimeoutError:
            pass

    async def _publish(self, what: str, op: Any) -> None:
        await UNTIL_REDIS.call(op, what=what, stop=self.stopping)

    # -- admit ---------------------------------------------------------------------------------------
    async def admit_loop(self) -> None:
        while self.running:
            async with self.state_lock:
                try:
                    batch = await self.admission.admit_once()
                    failed: BadPrompts | None = None
                except BadPrompts as bad:
                    batch, failed = None, bad
                if batch is not None:
                    self.progress[batch.batch_id] = time.monotonic()
                    if self.sampling is not None:  # a step takes no group of a later batch before it
                        self.assembler.expect(batch.batch_id, _first_of(batch.batch_id))
            if failed is not None:
                await self.bad_prompts(failed)
                continue
            if batch is None:
                await self.pause(0.05)
                continue
            await self.publish_prompts(batch)

    async def bad_prompts(self, bad: BadPrompts) -> None:
        self.metrics.dead_letters.labels(reason=bad.reason.split(":", 1)[0][:40]).inc()
        await self.kill_batch(bad.batch_id, bad.reason)

    async def publish_prompts(self, batch: pb.PromptBatch) -> None:
        assert self.bus is not None
        bus, data = self.bus, batch.SerializeToString()
        await self._publish("publish prompts", lambda: bus.publish(
            bus.keys.prompts, data, kind="prompts", batch_id=batch.batch_id))

    async def publish_rollout(self, rid: str, data: bytes) -> None:
        assert self.bus is not None
        bus = self.bus
        await self._publish("publish rollout", lambda: bus.publish(bus.keys.rollouts, data, kind="rollout",
                                                                   batch_id=rid))

    # -- join ----------------------------------------------------------------------------------------
    async def on_rollout(self, msg: Message) -> None:
        rbm = parse_message(pb.RolloutBatch, msg.data, max_bytes=self.cfg.flow.max_message_bytes)
        rollout = validate_rollout_arrays(rbm, self.cfg.flow.max_message_bytes, self.limits)
        rid = rbm.batch_id
        pbid = ids.prompt_batch_of(rid)
        first = _first_of(pbid)
        await asyncio.to_thread(self.admission.check_rollout, rid, first, rollout)
        # First rollout of a prompt batch wins; a regenerated duplicate is dropped.
        if not await self.durable(self.journal.put_result_if_absent, pbid, ROLLOUT, msg.data):
            return
        self.assembler.add_rollout(rid, rollout, order=first)
        self.progress[pbid] = time.monotonic()
        await self.sync_states(pbid)

    async def on_score(self, msg: Message) -> None:
        sb = parse_message(pb.ScoreBatch, msg.data, max_bytes=self.cfg.flow.max_message_bytes)
        if sb.stage not in self.stages:
            raise Rejected("unknown_stage", f"score from stage {sb.stage!r}; this run uses {self.stages}")
        scores = score_from_proto(sb, max_bytes=self.cfg.flow.max_message_bytes, expected_stage=sb.stage,
                                  expected_rows=self.cfg.batch.prompts_per_message * self.cfg.algo.group_size,
                                  limits=self.limits)
        if not await self.durable(self.journal.put_result_if_absent, sb.batch_id, sb.stage, msg.data):
            return  # a redelivered score: already counted once
        self.reward_parts.keep(scores)
        if self.assembler.add_score(sb.batch_id, sb.stage, scores.tensor, scores.unscored):
            pbid = ids.prompt_batch_of(sb.batch_id)
            self.progress[pbid] = time.monotonic()
            if self.assembler.rollout_id_of(pbid) == sb.batch_id:
                await self.sync_states(pbid)

    async def sync_states(self, pbid: str) -> None:
        """Bring the journal's task states up to what the join knows (generated once the rollout
        is in, scored once every stage is): idempotent, so it also repairs a crash between a
        result write and its state change."""
        async with self.state_lock:
            rid = self.assembler.rollout_id_of(pbid)
            if rid is None:
                return
            version = self.assembler.rollout_of(pbid).version
            complete = self.assembler.has_all_scores(pbid)
            task_ids = [t.task_id for t in self.admission.tasks(_first_of(pbid))]
            recs = [await asyncio.to_thread(self.journal.get, i) for i in task_ids]
            states = {r.state for r in recs if r is not None}
            if states and all(r is not None and r.is_terminal for r in recs):
                # Its tasks already ended (a stage dead-lettered the batch, steps trained it): forget it.
                self.assembler.drop(pbid)
                self.progress.pop(pbid, None)
                return
            # A batch's groups may end one by one (unscored rows, dropped, or trained by a step).
            self.assembler.exclude(pbid, [r.group_id for r in recs if r is not None and r.is_terminal])
            if "admitted" in states:
                await self.durable(self.journal.mark_generated, task_ids, version, rid)
                self.events.emit("generated", task_ids=task_ids, version=version)
            if complete:
                ended = await end_unscored(self, pbid, recs)
                if ended is None:  # every group had a row the reward could not score: forgotten
                    return
                if states & {"admitted", "generated"}:
                    for stage in self.stages:
                        await self.durable(self.journal.mark_stage_done, task_ids, stage)
                    self.events.emit("scored", task_ids=[t for t in task_ids if t not in ended])
                if self.sampling is not None:
                    await self.sampling.judge(pbid)
                # Only now may a step take it: its tasks are `scored` in the journal.
                self.assembler.mark_ready(pbid)

    async def on_dead(self, msg: Message) -> None:
        """A message some stage gave up on: its tasks end `dead` with the reason (never lost), and
        admission replaces them. Dead letters that name no batch of ours are only counted."""
        reason = msg.headers.get("reason") or "dead-lettered"
        bid = msg.headers.get("h.batch_id", "")
        self.metrics.dead_letters.labels(reason=reason.split(":", 1)[0][:40]).inc()
        if not bid:
            return
        pbid = ids.prompt_batch_of(bid)
        try:
            first = _first_of(pbid)
        except Rejected:
            return
        winner = self.assembler.rollout_id_of(pbid)
        if ids.is_rollout_id(bid) and winner is not None and winner != bid:
            return  # a duplicate rollout of this batch was rejected; the one that counts is intact
        await self.kill_batch(pbid, reason, first)

    async def kill_batch(self, pbid: str, reason: str, first: int | None = None) -> None:
        """End a prompt batch's unfinished tasks `dead` with `reason`; admission replaces them."""
        task_ids = [t.task_id for t in self.admission.tasks(_first_of(pbid) if first is None else first)]
        async with self.state_lock:
            recs = [await asyncio.to_thread(self.journal.get, i) for i in task_ids]
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

    # -- step ----------------------------------------------------------------------------------------
    async def step_loop(self) -> None:
        c = self.cfg
        stored = await asyncio.to_thread(self.journal.get_batch, self.journal.step + 1)
        if stored is not None and self.journal.step < c.run.max_steps:
            # Crashed mid-step last time: finish exactly that step, not a re-assembled one.
            await self.resume_step(stored)
        while self.journal.step < c.run.max_steps and not self.stopping.is_set():
            parts = self.assembler.take_step()
            if parts is None:
                await self.pause(0.02)
                continue
            for rid, _ in parts:
                self.progress.pop(ids.prompt_batch_of(rid), None)
            await self.train_step([r for _, r in parts])
        self.done = self.journal.step >= c.run.max_steps

    async def resume_step(self, raw: bytes) -> None:
        batch = parse_message(pb.TrainBatch, raw, max_bytes=self.cfg.flow.max_message_bytes)
        r = train_arrays_from_proto(batch, self.cfg.flow.max_message_bytes).rollout
        per_msg = self.cfg.batch.prompts_per_message
        groups: dict[int, set[int]] = {}
        for t in r.task_ids:
            index = ids.parse_task_id(t)[0]
            groups.setdefault(ids.first_of_message(index, per_msg), set()).add(index)
        for first, taken in sorted(groups.items()):
            pbid = ids.batch_id(first)
            self.assembler.exclude(pbid, sorted(taken))  # group id == dataset index
            if not self.assembler.kept_groups(pbid):
                self.assembler.drop(pbid)
                self.progress.pop(pbid, None)
        log.info("resuming a journaled step", extra={"step": int(batch.step) + 1})
        # The batch holds rewards and advantages, so the row keeps its figures; the reward's
        # per-component means were not journaled and are missing from it.
        g = self.cfg.generation
        stats = {**batch_stats(r, self.cfg.algo, g.max_new_tokens, g.behaviour_logprobs), "resumed": 1.0}
        await self._commit_step(batch, r, stats=stats, t0=time.perf_counter())

    async def train_step(self, parts: list[rb.RolloutArrays]) -> None:
        step = self.journal.step
        t0 = time.perf_counter()
        r = rb.concat(parts, pad_id=self.tokenizer.pad_token_id)
        g = self.cfg.generation
        stats = compute_advantages(r, self.cfg.algo, g.max_new_tokens, g.behaviour_logprobs)
        stats.update(self.reward_parts.take(r.task_ids))
        batch = train_batch_to_proto(r, step=step, batch_id=ids.train_batch_id(step), target_version=step + 1)
        # Journaled before any Train call: a crash from here on resumes exactly this step.
        await self.durable(self.journal.put_batch, step + 1, batch.SerializeToString())
        await self._commit_step(batch, r, stats, t0)

    async def _commit_step(self, batch: pb.TrainBatch, r: rb.RolloutArrays, stats: dict[str, float], t0: float) -> None:
        """Train every trainable service on the journaled batch, then commit the step. The order is
        what keeps versions monotonic across any crash: Redis learns the new version (what a
        restarted trainable catches up to before it serves) before the journal commits it, so Redis
        never says less than the journal; the journal commits tasks, step counter (the version
        admission stamps) and acknowledged versions under the state lock, so no admission sees half
        a step."""
        assert self.bus is not None
        c, bus, run_dir = self.cfg, self.bus, self.cfg.run_dir
        done_step, target = int(batch.step) + 1, int(batch.target_version)
        await fault_point(run_dir, "step_journaled", done_step)
        t_adv = time.perf_counter()
        results = await asyncio.gather(*(self.trainables.train(n, batch) for n in self.trainable))
        t_train = time.perf_counter()
        await fault_point(run_dir, "trained", done_step)
        await self._publish_versions(target)
        await fault_point(run_dir, "versions_published", done_step)
        gen_versions = r.versions.tolist() if r.versions is not None else [r.version] * len(r)
        async with self.state_lock:
            await self.durable(self.journal.mark_trained, r.task_ids, done_step, target - 1, c.flow.max_staleness)
            for name in self.trainable:
                await self.durable(self.journal.set_version, name, target)
            self.events.emit("trained", step=done_step, task_ids=r.task_ids, version=target - 1,
                             generated_versions=gen_versions)
            await self.surplus.after_commit()
            if self.sampling is not None:
                stats.update(self.sampling.step_stats(done_step))
        await fault_point(run_dir, "journal_committed", done_step)
        for res in results:
            stats.update({k: float(v) for k, v in res.stats.items()})
        # Held-out evaluation at the version just committed, in this step's row; its time is
        # counted in neither this step's throughput nor the next one's.
        t_eval = time.perf_counter()
        stats.update(await self.evaluation.after_step(done_step, target))
        await self.recorder.record(bus, step=done_step, version=target, r=r, stats=stats,
                                   staleness=target - 1 - min(gen_versions),
                                   times={"advantage_s": t_adv - t0, "train_s": t_train - t_adv},
                                   paused_s=time.perf_counter() - t_eval)

    async def sync_loop(self) -> None:
        """Watch the trainable services once a second, and keep the version they catch up to in
        Redis (an emptied Redis gets it back within a second)."""
        while self.running:
            with contextlib.suppress(BusUnavailable):
                async with self.publish_lock:
                    await self._set_versions()
            await self.trainables.watch_once()
            await self.pause(1.0)

    async def _set_versions(self) -> None:
        assert self.bus is not None
        await self.bus.set_versions({n: self.published for n in self.trainable})

    async def _publish_versions(self, version: int) -> None:
        """Make `version` what the trainables catch up to, retried until Redis answers."""
        async with self.publish_lock:
            self.published = max(self.published, version)
            await self._publish("publish versions", self._set_versions)

    # -- recover -------------------------------------------------------------------------------------
    async def repair_versions(self) -> None:
        """A committed step means every trainable acknowledged its version (Train returned before
        the commit); a crash between the commit's writes may have left an acknowledgement unwritten."""
        acked = self.journal.versions
        for name in self.trainable:
            if acked.get(name, 0) < self.version:
                await self.durable(self.journal.set_version, name, self.version)

    async def main(self) -> None:
        c = self.cfg
        assert c.redis.url is not None
        self.bus = await Bus.connect(c.redis.url, c.run.name, password=c.redis_password(), **bus_options(c.flow))
        keys = self.bus.keys
        await self.bus.ensure_groups(keys.prompts, ["actor"])
        await self.bus.ensure_groups(keys.rollouts, [*self.stages, "controller"])
        await self.bus.ensure_groups(keys.scores, ["controller"])
        await self.bus.ensure_groups(keys.dead, ["controller"])
        await self.repair_versions()
        self.published = self.version
        await self._set_versions()
        await recovery.reconcile(self)
        self.recorder.backfill()
        await self.recorder.start_trackers()
        self.workers = [
            StreamWorker(self.bus, keys.rollouts, "controller", self.instance, self.on_rollout, self.metrics,
                         count=8),
            StreamWorker(self.bus, keys.scores, "controller", self.instance, self.on_score, self.metrics,
                         count=16),
            StreamWorker(self.bus, keys.dead, "controller", self.instance, self.on_dead, self.metrics, count=16),
        ]
        await self.runtime.refresh_readiness()
        self.loops = [asyncio.create_task(w.run(), name=f"consume {w.stream}") for w in self.workers]
        self.loops += [asyncio.create_task(self.admit_loop(), name="admit"),
                       asyncio.create_task(self.sync_loop(), name="sync"),
                       asyncio.create_task(recovery.watchdog(self), name="watchdog")]
        await self.evaluation.before_training(self.journal.step)
        step = asyncio.create_task(self.step_loop(), name="step")
        self.loops.append(step)
        done, _ = await asyncio.wait(self.loops, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if not t.cancelled():
                t.result()  # a crashed consumer or admission loop fails the controller fast
        if self.stopping.is_set():
            log.info("stopped by drain", extra={"steps": self.journal.step})
            return
        self.done = True  # the step loop finished the run: the other loops end too
        log.info("run finished", extra={"steps": self.journal.step})
        # Returning from main drains the service and exits 0: the launcher reads that as "done".


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
