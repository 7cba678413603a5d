"""Task and batch identifiers. A task id encodes its dataset index and sample number so any stage
can recover the prompt (and its answer) from the dataset without extra lookups."""

from __future__ import annotations

import re

_TASK = re.compile(r"^t(\d+)-(\d+)$")


def task_id(dataset_index: int, sample_index: int) -> str:
    return f"t{dataset_index}-{sample_index}"


def parse_task_id(tid: str) -> tuple[int, int]:
    m = _TASK.match(tid)
    if m is None:
        raise ValueError(f"malformed task id {tid!r}: expected 't<dataset_index>-<sample_index>'")
    return int(m.group(1)), int(m.group(2))


def batch_id(first_dataset_index: int) -> str:
    return f"b{first_dataset_index}"


def generation_seed(run_seed: int, first_dataset_index: int) -> int:
    """Seed for one prompt message: the same prompts sample the same completions in any process,
    which is what lets the fleet reproduce the local loop exactly."""
    return (run_seed * 1_000_003 + first_dataset_index) % (2**63)
