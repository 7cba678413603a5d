"""Task and batch identifiers: the one place that knows their grammar.

A task id encodes its dataset index and sample number so any stage can recover the prompt (and its
answer) from the dataset without extra lookups:

    task        t<dataset_index>-<sample_index>       t12-1
    prompt batch b<first dataset index of its message>  b12   (one PromptBatch message)
    rollout     <prompt batch id>:<generation nonce>   b12:9f3a01c2 (one generation of it)
    train batch s<step, counted from 0>                s3

A message holds `prompts_per_message` consecutive dataset indices, each sampled `group_size` times,
so the dataset index of any task names its message: `first_of_message`.
"""

from __future__ import annotations

import re
import uuid

_TASK = re.compile(r"^t(\d+)-(\d+)$")
_BATCH = re.compile(r"^b(\d+)$")


class BadId(ValueError):
    """An id that breaks the grammar; `reason` makes a consumer dead-letter its message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def task_id(dataset_index: int, sample_index: int) -> str:
    return f"t{dataset_index}-{sample_index}"


def parse_task_id(tid: str) -> tuple[int, int]:
    m = _TASK.match(tid)
    if m is None:
        raise BadId("bad_task_id", f"malformed task id {tid!r}: expected 't<dataset_index>-<sample_index>'")
    return int(m.group(1)), int(m.group(2))


def first_of_message(dataset_index: int, prompts_per_message: int) -> int:
    """The first dataset index of the prompt message that holds `dataset_index`."""
    return dataset_index - dataset_index % prompts_per_message


def message_tasks(first: int, prompts_per_message: int, group_size: int) -> list[tuple[str, int, int]]:
    """(task id, dataset index, sample index) of every task of the message starting at `first`,
    in the order the message carries them."""
    return [(task_id(i, k), i, k) for i in range(first, first + prompts_per_message) for k in range(group_size)]


def batch_id(first_dataset_index: int) -> str:
    return f"b{first_dataset_index}"


def parse_batch_id(prompt_batch_id: str) -> int:
    """The first dataset index of a prompt batch id."""
    m = _BATCH.match(prompt_batch_id)
    if m is None:
        raise BadId("bad_batch_id", f"malformed batch id {prompt_batch_id!r}: expected 'b<first dataset index>'")
    return int(m.group(1))


def rollout_id(prompt_batch_id: str) -> str:
    """A fresh id for one generation of a prompt batch: a regenerated batch (redelivery after an
    actor crash) gets another, so its scores never mix with the first one's."""
    return f"{prompt_batch_id}:{uuid.uuid4().hex[:8]}"


def prompt_batch_of(rollout_or_batch_id: str) -> str:
    """The prompt batch a rollout (or score, or dead letter) belongs to; a prompt batch id maps to itself."""
    return rollout_or_batch_id.split(":", 1)[0]


def is_rollout_id(batch_or_rollout_id: str) -> bool:
    return ":" in batch_or_rollout_id


def train_batch_id(step: int) -> str:
    return f"s{step}"


def generation_seed(run_seed: int, first_dataset_index: int) -> int:
    """Seed for one prompt message: the same prompts sample the same completions in any process,
    which is what lets the fleet reproduce the local loop exactly."""
    return (run_seed * 1_000_003 + first_dataset_index) % (2**63)
