"""Admission (services/controller/admission.py) against a real LMDB journal: the staleness window
bounds tasks in flight, every PromptBatch carries the journal's committed version, dead tasks are
replaced, and admission stops once the run has enough tasks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from services.controller.admission import Admission
from services.controller.durable import DurableJournal
from services.core.journal.journal import Journal
from services.core.observability.events import EventLog, iter_events
from services.core.observability.metrics import ServiceMetrics
from services.models.io.light_tokenizer import load_tokenizer
from services.tasks import load_task
from tests.fleet_helpers import tiny_config


@pytest.fixture
def make(tmp_path: Path, tiny_model: Path) -> Any:
    opened: list[tuple[Journal, EventLog]] = []

    def build(**sections: dict[str, Any]) -> Admission:
        base: dict[str, dict[str, Any]] = {
            "algo": {"name": "grpo", "group_size": 2, "kl_coef": 0.0},
            "batch": {"prompts_per_step": 4, "prompts_per_message": 2}, "run": {"max_steps": 3},
        }
        for k, v in sections.items():
            base.setdefault(k, {}).update(v)
        cfg = tiny_config(tmp_path / "run", tiny_model, **base)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        journal = Journal.open(cfg.journal_dir, stages=tuple(cfg.stages()), trainable=("actor",))
        events = EventLog(cfg.run_dir / "events.jsonl")
        opened.append((journal, events))
        return Admission(cfg, journal, DurableJournal(journal), load_tokenizer(tiny_model), load_task(cfg.task),
                         events, ServiceMetrics("controller"))

    yield build
    for journal, events in opened:
        events.close()
        journal.close()


def admit(a: Admission) -> Any:
    return asyncio.run(a.admit_once())


def train(a: Admission, first: int, step: int) -> None:
    """Take the message starting at `first` through generated, scored and trained (step `step`)."""
    task_ids = [t.task_id for t in a.tasks(first)]
    a.journal.mark_generated(task_ids, step - 1, f"b{first}:x")
    for stage in a.cfg.stages():
        a.journal.mark_stage_done(task_ids, stage)
    a.journal.mark_trained(task_ids, step, step - 1, a.cfg.flow.max_staleness)


def test_admission_fills_the_window_then_closes(make: Any) -> None:
    a = make()
    # (max_staleness 0 + 1) * 4 prompts * group 2, + one message less one group: no third message fits
    assert a.cfg.admission_window == 8 + 2
    batches = [admit(a), admit(a)]
    assert [b.batch_id for b in batches] == ["b0", "b2"]
    assert [len(b.prompts) for b in batches] == [4, 4]
    assert [p.task_id for p in batches[0].prompts] == ["t0-0", "t0-1", "t1-0", "t1-1"]
    assert admit(a) is None and not a.open
    assert a.journal.in_flight() == 8 and a.journal.cursor == 4


def test_a_larger_staleness_budget_admits_further_ahead(make: Any) -> None:
    a = make(flow={"max_staleness": 2})
    assert a.cfg.admission_window == 24 + 2
    got = [admit(a) for _ in range(7)]
    assert [b.batch_id if b else None for b in got] == ["b0", "b2", "b4", "b6", "b8", "b10", None]


def test_every_prompt_batch_carries_the_journals_committed_version(make: Any) -> None:
    a = make()
    first = [admit(a), admit(a)]
    assert {b.version for b in first} == {0} and {b.step for b in first} == {0}
    train(a, 0, 1)  # one message is not a step, but the journal commits step 1 all the same
    assert a.journal.step == 1
    b = admit(a)
    assert b is not None and b.batch_id == "b4" and b.version == 1 and b.step == 1
    # A batch rebuilt for re-publishing (watchdog, reconcile) is stamped at today's version.
    assert a.prompt_batch(0).version == 1


def test_dead_tasks_are_replaced_and_admission_stops_when_the_run_has_enough(make: Any) -> None:
    a = make(run={"max_steps": 1})  # 8 usable tasks needed
    assert admit(a) and admit(a) and admit(a) is None
    a.journal.mark_dead([t.task_id for t in a.tasks(2)], "shape_mismatch: test")
    replacement = admit(a)
    assert replacement is not None and replacement.batch_id == "b4"
    train(a, 0, 1)
    assert admit(a) is None, "8 usable tasks admitted (4 dead replaced): nothing more to admit"
    a.events.close()
    admitted = [e for e in iter_events(a.cfg.run_dir / "events.jsonl") if e.kind == "admitted"]
    assert [e.fields["cursor"] for e in admitted] == [0, 2, 4]


def test_with_dynamic_sampling_dropped_groups_are_replaced_until_the_bound_then_admission_refuses(
    make: Any
) -> None:
    from services.rl.dynamic_sampling import DynamicSamplingExhausted

    a = make(algo={"name": "dapo", "group_size": 2, "dynamic_sampling_max_rounds": 1})
    assert a.cfg.admission_window == 8 + 2  # one message less one group on top of the step's 8 tasks
    assert [admit(a).batch_id, admit(a).batch_id, admit(a)] == ["b0", "b2", None]
    ids = [t.task_id for t in a.tasks(0)]
    a.journal.mark_generated(ids, 0, "b0:x")
    a.journal.mark_stage_done(ids, "reward")
    # One all-equal group out: 6 live tasks + a message of 4 fit the window of 10.
    a.journal.mark_dropped(ids[:2], "filtered: all rewards equal (1)", step=1, kind="filtered")
    assert admit(a).batch_id == "b4" and a.journal.prompts_for(1) == 6
    assert admit(a) is None  # 10 live tasks: the window is full
    # Every group of b0 dropped: the 4 groups of b2 and b4 may still fill the step, so nothing more.
    a.journal.mark_dropped(ids[2:], "filtered: all rewards equal (0)", step=1, kind="filtered")
    assert admit(a) is None
    rest = [t.task_id for f in (2, 4) for t in a.tasks(f)]
    a.journal.mark_generated(rest, 0, "b2:x")
    a.journal.mark_stage_done(rest, "reward")
    # b2 dropped too: 4 groups, the bound (max_rounds 1 x 4 prompts); the step would need more.
    a.journal.mark_dropped(rest[:4], "filtered: all rewards equal (1)", step=1, kind="filtered")
    with pytest.raises(DynamicSamplingExhausted, match="step 1 dropped 4 groups"):
        admit(a)
