"""Writes that meet a full disk hold or degrade, never crash and never corrupt: the event log and
metrics lines (held in order until space returns), log records (counted, never raised), checkpoints
(refused whole, the previous one stays latest). Each test fills a real 2 MiB tmpfs."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from services.core.observability.events import AppendOnlyFile, EventLog, iter_events
from services.core.observability.logs import setup_logging
from services.models.checkpoints.checkpoint import CheckpointDiskFull, latest_meta, load_latest, save_checkpoint


def fill(fs: Path) -> Path:
    filler = fs / "filler"
    with filler.open("ab", buffering=0) as f:
        for chunk in (64 << 10, 4 << 10, 256, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)
    return filler


def test_events_on_a_full_disk_are_held_in_order_and_written_when_space_returns(small_fs: Path) -> None:
    log = EventLog(small_fs / "events.jsonl")
    log.emit("scored", task_ids=["t0"])
    filler = fill(small_fs)
    pad = ["x" * 100] * 4  # past the page the file already has: a write needs new disk space
    for i in range(1, 50):
        log.emit("scored", task_ids=[f"t{i}", *pad])  # does not raise
    assert log.held_bytes > 0
    # What reached the disk (the file's last page may still take a few lines) is whole and in order.
    raw = (small_fs / "events.jsonl").read_bytes()
    on_disk = [e.fields["task_ids"][0] for e in iter_events(small_fs / "events.jsonl")]
    assert raw.endswith(b"\n") and on_disk == [f"t{i}" for i in range(len(on_disk))] and len(on_disk) < 50
    filler.unlink()
    log.emit("scored", task_ids=["t50", *pad])
    assert log.held_bytes == 0
    log.close()
    assert [e.fields["task_ids"][0] for e in iter_events(small_fs / "events.jsonl")] == [f"t{i}" for i in range(51)]


def test_a_second_appender_is_never_cut_by_a_failed_write(small_fs: Path) -> None:
    path = small_fs / "metrics.jsonl"
    out = AppendOnlyFile(path, fsync=False)
    out.append(b'{"step": 1}\n')
    with path.open("a") as other:  # the controller back-fills rows through its own handle
        other.write('{"step": 2}\n')
    filler = fill(small_fs)
    assert out.append(b'{"step": 3}\n' * 1000) is False
    filler.unlink()
    assert out.flush() is True
    out.close()
    rows = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert rows == [1, 2, *[3] * 1000]


def test_log_records_on_a_full_disk_are_dropped_and_counted_not_raised(small_fs: Path) -> None:
    stream = (small_fs / "service.log").open("w", buffering=1)
    errors = io.StringIO()
    logger = setup_logging("diskfull", stream=stream)
    try:
        logger.info("before")
        filler = fill(small_fs)
        with contextlib.redirect_stderr(errors):
            for i in range(200):
                logger.info("while full", extra={"i": i})
        filler.unlink()
        logger.info("after")
    finally:
        for h in list(logging.getLogger().handlers):
            if getattr(h, "_rlfleet", False):
                logging.getLogger().removeHandler(h)
        with contextlib.suppress(OSError):
            stream.close()
    assert "Traceback" not in errors.getvalue()  # no traceback per record onto a full disk
    lines = [json.loads(x) for x in (small_fs / "service.log").read_text().splitlines() if x.startswith("{")]
    msgs = [x["msg"] for x in lines]
    assert msgs[0] == "before" and msgs[-1] == "after"
    # Every record whose write failed is counted; the stream's buffer may still have written some.
    notes = [x["failed_writes"] for x in lines if x["msg"] == "log records may be lost: the disk was full"]
    written = sum(m == "while full" for m in msgs)
    assert notes and written < 200 and sum(notes) >= 200 - written


def test_a_checkpoint_on_a_full_disk_is_refused_whole_and_the_previous_stays_latest(small_fs: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    save_checkpoint(small_fs, "actor", 1, 1, model, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    filler = fill(small_fs)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(CheckpointDiskFull, match=r"disk is full.*previous checkpoint stays latest"):
        save_checkpoint(small_fs, "actor", 2, 2, model, None)
    assert latest_meta(small_fs, "actor").version == 1  # type: ignore[union-attr]
    assert not [p for p in (small_fs / "actor").iterdir() if p.name.startswith(".v")], "half-written files left"
    filler.unlink()
    fresh = nn.Linear(64, 64)
    assert load_latest(small_fs, "actor", fresh, None).version == 1  # type: ignore[union-attr]
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    save_checkpoint(small_fs, "actor", 2, 2, model, None)  # space is back: it works again
    assert latest_meta(small_fs, "actor").version == 2  # type: ignore[union-attr]
