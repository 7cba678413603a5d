"""Admission: which prompt message enters the run next, and the PromptBatch that carries it.

The staleness budget bounds the run: at most `cfg.admission_window` tasks are in flight, so
generation runs at most `flow.max_staleness` steps ahead of training. A batch is stamped with the
journal's committed version at the moment it is admitted, under the controller's state lock, which
a step holds while it commits: admission never stamps a version the controller is leaving.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.controller.durable import DurableJournal
from services.controller.sampling import check_bound
from services.core import ids
from services.core.config.run import RunConfig
from services.core.journal.journal import Journal, JournalFull, TaskSpec
from services.core.observability.events import EventLog
from services.core.observability.metrics import ServiceMetrics
from services.core.pb import rlfleet_pb2 as pb
from services.core.serving.worker import Rejected
from services.rl.batch import RolloutArrays
from services.rl.wire import message
from services.tasks.base import PromptError, Task
from services.tasks.chat import encode_prompt

log = logging.getLogger("rlfleet.controller")


class BadPrompts(Exception):
    """A row of the message `batch_id` cannot become a prompt (e.g. its chat template fails): the
    message's tasks end dead with `reason` and admission replaces them; the run goes on."""

    def __init__(self, batch_id: str, err: PromptError) -> None:
        super().__init__(str(err))
        self.batch_id, self.reason = batch_id, f"{err.reason}: {err}"


class Admission:
    def __init__(self, cfg: RunConfig, journal: Journal, durable: DurableJournal, tokenizer: Any, task: Task,
                 events: EventLog, metrics: ServiceMetrics) -> None:
        self.cfg, self.journal, self.durable = cfg, journal, durable
        self.tokenizer, self.task = tokenizer, task
        self.events, self.metrics = events, metrics
        self.open = True
        # Every step adds exactly one policy version, so the journal's step counter is the version.
        self.needed = cfg.run.max_steps * cfg.samples_per_step

    def tasks(self, first: int) -> list[TaskSpec]:
        c = self.cfg
        return [TaskSpec(tid, i, k, i)
                for tid, i, k in ids.message_tasks(first, c.batch.prompts_per_message, c.algo.group_size)]

    def check_rollout(self, rid: str, first: int, rollout: RolloutArrays) -> None:
        """A rollout may join only with what this run admitted: the tasks of its prompt batch, once
        journaled, each in its prompt's group, at no version past the step being committed
        (committed + 1: a later one was never trained, and would fail the staleness check when its
        step commits). Raises `Rejected` (a dead letter naming the field) otherwise."""
        pbid, specs = ids.batch_id(first), self.tasks(first)
        if set(rollout.task_ids) != {t.task_id for t in specs}:
            raise Rejected("unknown_tasks", f"rollout {rid!r} carries task ids that prompt batch {pbid!r} "
                                            "did not admit")
        committed = self.journal.step
        newest = max([rollout.version, *(rollout.versions.tolist() if rollout.versions is not None else [])])
        if newest > committed + 1:
            raise Rejected("bad_version", f"rollout {rid!r}: version {newest} is ahead of the committed version"
                                          f" {committed} + 1")
        if self.journal.get(specs[0].task_id) is None:  # it would win over the batch's own, then never train
            raise Rejected("unknown_tasks", f"rollout {rid!r}: prompt batch {pbid!r} was never admitted")
        group = {t.task_id: t.group_id for t in specs}
        if any(group[t] != g for t, g in zip(rollout.task_ids, rollout.group_ids.tolist(), strict=True)):
            raise Rejected("bad_group_ids", f"rollout {rid!r}: group_ids do not name each task's prompt")

    def prompt_batch(self, first: int) -> pb.PromptBatch:
        """The message for the prompts starting at `first`, at the journal's committed version; its
        prompts rendered through the chat template exactly as the journal will record them."""
        c = self.cfg
        g = c.generation
        stops = sorted({self.tokenizer.eos_token_id, *g.stop_token_ids})
        sampling = pb.SamplingParams(
            temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_new_tokens=g.max_new_tokens,
            stop_token_ids=stops, seed=ids.generation_seed(c.run.seed, first))
        step = self.journal.step
        batch = message(pb.PromptBatch, batch_id=ids.batch_id(first), version=step, sampling=sampling, step=step)
        encoded: dict[int, list[int]] = {}
        for spec in self.tasks(first):
            if spec.dataset_index not in encoded:
                try:
                    encoded[spec.dataset_index] = encode_prompt(self.task, self.tokenizer,
                                                                self.task.prompt(spec.dataset_index))
                except PromptError as err:
                    raise BadPrompts(batch.batch_id, err) from err
            token_ids = encoded[spec.dataset_index]
            batch.prompts.add(task_id=spec.task_id, token_ids=token_ids, dataset_index=spec.dataset_index,
                              sample_index=spec.sample_index, group_id=spec.group_id)
        return batch

    async def admit_once(self) -> pb.PromptBatch | None:
        """Admit one prompt message if the staleness budget allows and journal it; returns the
        message to publish. Call with the controller's state lock held."""
        c = self.cfg
        per_msg = c.batch.prompts_per_message * c.algo.group_size
        can = self.journal.has_space(c.journal.min_free_bytes) and self.durable.error is None
        in_flight = self.journal.in_flight()
        self.metrics.in_flight.set(in_flight)
        first = self.journal.cursor
        self.open = can and in_flight + per_msg <= c.admission_window
        self.metrics.admission_open.set(int(self.open))
        # Dead and dropped tasks never train, so the run admits replacements for them.
        counts = self.journal.counts()
        usable = first * c.algo.group_size - counts.get("dead", 0) - counts.get("dropped", 0)
        if not self.open or usable >= self.needed:
            return None
        if c.algo.dynamic_sampling:
            check_bound(self.journal, self.journal.step + 1, c.algo.group_size, c.batch.prompts_per_step,
                        c.algo.dynamic_sampling_max_rounds)
        tasks = self.tasks(first)
        try:
            await asyncio.to_thread(self.journal.admit, tasks, first + c.batch.prompts_per_message)
            self.durable.error = None
        except JournalFull as e:
            # Not retried in place: admission simply stays closed until a write succeeds again.
            log.error("journal full; admission stopped until space returns", extra={"error": str(e)[:300]})
            self.durable.failed(e)
            await asyncio.sleep(1.0)
            return None
        self.events.emit("admitted", task_ids=[t.task_id for t in tasks], cursor=first)
        return self.prompt_batch(first)
