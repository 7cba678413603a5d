"""Recover: what the controller does for batches that lost their messages. At start-up it rebuilds
the in-memory join from the journal (`reconcile`); while running, it re-publishes batches that made
no progress (`watchdog`). Both only re-send what the journal already holds, so neither can count
anything twice."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from services.controller.admission import BadPrompts
from services.core import ids
from services.core.pb import rlfleet_pb2 as pb
from services.core.transport.bus import BusUnavailable
from services.rl.wire import parse_message, score_from_proto, validate_rollout_arrays

if TYPE_CHECKING:
    from services.controller.state import RecoveryHost

log = logging.getLogger("rlfleet.controller")

ROLLOUT = "rollout"  # journal result stage under which the winning rollout of a prompt batch is kept


async def watchdog(ctl: RecoveryHost) -> None:
    """Re-publish prompt batches that made no progress for flow.resend_after_s: their prompts
    when no rollout arrived, else the winning rollout for the stages still missing."""
    assert ctl.bus is not None
    bus, limit = ctl.bus, ctl.cfg.flow.resend_after_s
    while ctl.running:
        await ctl.pause(min(1.0, limit / 4))
        now = time.monotonic()
        for pbid, t in list(ctl.progress.items()):
            if now - t < limit or not ctl.running:
                continue
            ctl.progress[pbid] = now
            raw = await asyncio.to_thread(ctl.journal.get_result, pbid, ROLLOUT)
            # A batch still queued behind a slow consumer is not lost: publishing it again would
            # only deepen that queue. Lost messages (Redis restarted empty) leave no backlog.
            stream, groups = ((bus.keys.prompts, ["actor"]) if raw is None
                              else (bus.keys.rollouts, ctl.cfg.stages()))
            try:
                if await bus.backlog(stream, groups) > 0:
                    continue
            except BusUnavailable:
                pass
            log.warning("batch stalled; publishing again", extra={"batch_id": pbid, "has_rollout": raw is not None})
            if raw is None:
                try:
                    async with ctl.state_lock:
                        prompts = ctl.admission.prompt_batch(ids.parse_batch_id(pbid))
                except BadPrompts as bad:
                    await ctl.bad_prompts(bad)
                    continue
                await ctl.publish_prompts(prompts)
            else:
                await ctl.publish_rollout(ctl.assembler.rollout_id_of(pbid) or pbid, raw)


async def reconcile(ctl: RecoveryHost) -> None:
    """Rebuild the in-memory join from the journal and re-enqueue prompt batches whose rollout
    never arrived; scores already journaled are restored, the rest will be redelivered."""
    max_bytes, per_msg = ctl.cfg.flow.max_message_bytes, ctl.cfg.batch.prompts_per_message
    pending = await asyncio.to_thread(ctl.journal.non_terminal)
    batches: dict[int, list[Any]] = {}
    for rec in pending:
        batches.setdefault(ids.first_of_message(rec.dataset_index, per_msg), []).append(rec)
    for first in sorted(batches):
        pbid = ids.batch_id(first)
        ctl.progress[pbid] = time.monotonic()
        raw = await asyncio.to_thread(ctl.journal.get_result, pbid, ROLLOUT)
        if ctl.sampling is not None:
            ctl.assembler.expect(pbid, first)
        if raw is None:
            try:
                await ctl.publish_prompts(ctl.admission.prompt_batch(first))
            except BadPrompts as bad:  # admitted, then the controller died before ending them dead
                await ctl.bad_prompts(bad)
            continue
        rbm = parse_message(pb.RolloutBatch, raw, max_bytes=max_bytes)
        ctl.assembler.add_rollout(rbm.batch_id, validate_rollout_arrays(rbm, max_bytes), order=first)
        for stage in ctl.stages:
            s_raw = await asyncio.to_thread(ctl.journal.get_result, rbm.batch_id, stage)
            if s_raw is not None:
                sb = parse_message(pb.ScoreBatch, s_raw, max_bytes=max_bytes)
                scores = score_from_proto(sb, max_bytes=max_bytes)
                ctl.reward_parts.keep(scores)
                ctl.assembler.add_score(rbm.batch_id, stage, scores.tensor, scores.unscored)
        await ctl.sync_states(pbid)
    if batches:
        log.info("reconciled journal", extra={"non_terminal_tasks": len(pending), "batches": len(batches)})

