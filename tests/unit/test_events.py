"""The append-only JSONL event log the audit replays."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from services.core.observability.events import EVENT_FIELDS, Event, EventLog

REPO = Path(__file__).resolve().parents[2]


def test_events_round_trip_in_order(tmp_path: Path) -> None:
    path = tmp_path / "run" / "events.jsonl"
    with EventLog(path) as log:
        log.emit("admitted", task_ids=["a", "b"], cursor=1, ts=10.0)
        log.emit("trained", step=1, task_ids=["a", "b"], version=0, generated_versions=[0, 0])
        log.emit_many(
            [
                Event("checkpoint", {"service": "actor", "version": 1, "step": 1}),
                Event("version_served", {"service": "actor", "version": 1}),
            ]
        )
    events = EventLog.read(path)
    assert [e.kind for e in events] == ["admitted", "trained", "checkpoint", "version_served"]
    assert events[0] == Event("admitted", {"task_ids": ["a", "b"], "cursor": 1}, 10.0)
    assert events[1].fields["generated_versions"] == [0, 0]
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"ts": 10.0, "kind": "admitted", "task_ids": ["a", "b"], "cursor": 1}


def test_every_audit_kind_is_accepted_with_its_fields(tmp_path: Path) -> None:
    sample: dict[str, Any] = {
        "task_ids": ["t"],
        "cursor": 1,
        "version": 0,
        "step": 1,
        "generated_versions": [0],
        "service": "actor",
        "task_id": "t",
        "reason": "poison",
        "queue_depths": {"prompts": 3},
        "rss_bytes": 1,
        "disk_bytes": 2,
    }
    with EventLog(tmp_path / "e.jsonl", fsync=False) as log:
        for kind, need in EVENT_FIELDS.items():
            log.emit(kind, **{f: sample[f] for f in need})
    assert [e.kind for e in EventLog.read(tmp_path / "e.jsonl")] == list(EVENT_FIELDS)


def test_unknown_kind_or_missing_field_is_refused_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventLog(path) as log:
        with pytest.raises(ValueError, match="unknown event kind 'trianed'"):
            log.emit("trianed", step=1)
        with pytest.raises(ValueError, match=r"dead event lacks fields \['reason'\]"):
            log.emit("dead", task_id="t")
        with pytest.raises(ValueError, match="reserved"):
            log.emit_many([Event("dead", {"task_id": "t", "reason": "x", "kind": "oops"})])
    assert path.read_bytes() == b""


def test_reader_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventLog(path) as log:
        log.emit("dead", task_id="t1", reason="poison")
    with path.open("ab") as f:
        f.write(b'{"ts": 2.0, "kind": "dead", "task_id": "t2", "rea')  # crash mid-write
    assert [e.fields["task_id"] for e in EventLog.read(path)] == ["t1"]


def test_reader_skips_garbage_lines_and_reads_a_missing_file_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    path.write_bytes(
        b'{"ts":1,"kind":"scored","task_ids":["a"]}\nnot json\n[1,2]\n{"kind":"scored"}\n\xff\xfe\n'
        b'{"ts":2,"kind":"scored","task_ids":["b"]}\n'
    )
    assert [e.fields["task_ids"] for e in EventLog.read(path)] == [["a"], ["b"]]
    assert EventLog.read(tmp_path / "absent.jsonl") == []


def test_reopening_cuts_a_torn_tail_so_new_events_start_on_a_clean_line(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventLog(path) as log:
        log.emit("scored", task_ids=["a"])
    with path.open("ab") as f:
        f.write(b'{"ts":2,"kind":"sco')
    with EventLog(path) as log:
        log.emit("scored", task_ids=["b"])
    assert [e.fields["task_ids"] for e in EventLog.read(path)] == [["a"], ["b"]]
    assert path.read_bytes().count(b"\n") == 2


def test_events_written_before_kill_9_survive_and_the_log_stays_readable(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    writer = textwrap.dedent(
        """
        import sys
        from services.core.observability.events import EventLog
        log = EventLog(sys.argv[1])
        for i in range(1_000_000):
            log.emit("scored", task_ids=[f"t{i}"] * 50)
            print(i, flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", writer, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None
    acked = -1
    for _ in range(30):
        line = proc.stdout.readline()
        assert line, f"writer died early (rc={proc.poll()})"
        acked = int(line)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    got = [e.fields["task_ids"][0] for e in EventLog.read(path)]
    assert got[: acked + 1] == [f"t{i}" for i in range(acked + 1)]  # every acknowledged event, in order
    assert got == [f"t{i}" for i in range(len(got))]  # and nothing out of order or duplicated


def test_closed_log_refuses_writes(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl")
    log.close()
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.emit("scored", task_ids=["a"])
