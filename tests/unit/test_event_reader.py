"""The one reader of events.jsonl: what it yields and what it counts as skipped, for the audit."""

from __future__ import annotations

from pathlib import Path

from services.core.observability.events import EventLog, EventReader


def test_reader_counts_unreadable_lines_and_flags_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventLog(path, fsync=False) as log:
        log.emit("scored", task_ids=["a"])
    with path.open("ab") as f:
        f.write(b'not json\n{"ts": NaN, "kind": "scored", "task_ids": ["x"]}\n{"ts": true, "kind": "scored"}\n')
        f.write(b'{"ts": 3, "kind": "scored", "task_ids": ["b"]}\n{"ts": 4, "kind": "sco')
    reader = EventReader(path, quiet=True)
    assert [e.fields["task_ids"] for e in reader] == [["a"], ["b"]]
    assert (reader.lines, reader.unreadable, reader.torn) == (5, 3, True)
    # Iterating again starts the counts over rather than adding to them.
    assert len(list(reader)) == 2 and (reader.lines, reader.unreadable) == (5, 3)


def test_reader_stops_at_the_size_it_saw_when_it_started(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventLog(path, fsync=False) as log:
        log.emit("scored", task_ids=["a"])
        log.emit("scored", task_ids=["b"])
        reader = iter(EventReader(path))
        first = next(reader)
        log.emit("scored", task_ids=["late"])  # a live writer appends while the audit reads
        rest = list(reader)
    assert [e.fields["task_ids"] for e in [first, *rest]] == [["a"], ["b"]]
    assert [e.fields["task_ids"] for e in EventLog.read(path)] == [["a"], ["b"], ["late"]]


def test_a_whole_clean_log_has_nothing_skipped(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventLog(path, fsync=False) as log:
        log.emit("dead", task_id="t", reason="poison")
    reader = EventReader(path)
    assert len(list(reader)) == 1
    assert (reader.lines, reader.unreadable, reader.torn) == (1, 0, False)
    missing = EventReader(tmp_path / "absent.jsonl")
    assert list(missing) == [] and (missing.lines, missing.torn) == (0, False)
