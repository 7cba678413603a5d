"""Prompts from real files and `datasets` datasets: field mapping, deterministic index -> row,
held-out rows, and a clear error for every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.core.config.run import ConfigError, TaskSection, parse_config
from services.tasks import PromptError, TaskError, load_task
from services.tasks.dataset import DatasetTask

ROOT = Path(__file__).resolve().parents[2]


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"question": f"{i}+{i}=", "solution": str(2 * i), "level": i % 3, "topic": f"t{i}"} for i in range(n)]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _task(**kw: Any) -> DatasetTask:
    task = load_task(TaskSection(**kw))
    assert isinstance(task, DatasetTask)
    return task


def _base(path: Path, **kw: Any) -> dict[str, Any]:
    return {"source": "jsonl", "path": str(path), "prompt_field": "question", "answer_field": "solution",
            "eval_size": 4, **kw}


def test_jsonl_rows_become_prompts_with_the_answer_and_every_other_field_mapped_by_name(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", _rows(12))
    task = _task(**_base(path, fields={"difficulty": "level"}))
    assert task.field_names == ("answer", "difficulty", "topic")
    p = task.prompt(0)
    i = int(p.text.split("+")[0])
    assert p.text == f"{i}+{i}=" and p.answer == str(2 * i)
    assert dict(p.fields) == {"difficulty": i % 3, "topic": f"t{i}"}
    assert p.reward_fields()["answer"] == str(2 * i)
    assert str(path) in p.origin and f"row {i}" in p.origin


def test_relative_data_paths_are_pinned_to_absolute_ones_at_parse_time(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _jsonl(tmp_path / "train.jsonl", _rows(8))
    monkeypatch.chdir(tmp_path)
    cfg = parse_config({"task": {"source": "jsonl", "path": "train.jsonl", "reward_path": "r.py"}})
    assert cfg.task.path == str(tmp_path / "train.jsonl")
    assert cfg.task.reward_path == str(tmp_path / "r.py")


def test_parquet_and_csv_files_give_the_same_prompts_as_jsonl(tmp_path: Path) -> None:
    import pandas as pd

    rows = _rows(10)
    frame = pd.DataFrame(rows)
    frame.to_parquet(tmp_path / "d.parquet")
    frame.to_csv(tmp_path / "d.csv", index=False)
    _jsonl(tmp_path / "d.jsonl", rows)
    got = {}
    for src, name in (("jsonl", "d.jsonl"), ("parquet", "d.parquet"), ("csv", "d.csv")):
        t = _task(**_base(tmp_path / name, source=src))
        got[src] = [(t.prompt(i).text, t.prompt(i).answer) for i in range(12)]
    assert got["jsonl"] == got["parquet"] == got["csv"]


def test_index_to_prompt_is_deterministic_and_each_epoch_visits_every_training_row_once(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", _rows(20))
    a, b = _task(**_base(path, seed=3)), _task(**_base(path, seed=3))
    n = 16  # 20 rows, 4 held out
    first = [a.prompt(i).text for i in range(n)]
    second = [a.prompt(i).text for i in range(n, 2 * n)]
    assert first == [b.prompt(i).text for i in range(n)]  # another process, same cursor -> same prompt
    assert sorted(first) == sorted(second) and len(set(first)) == n
    assert first != second  # each epoch is shuffled anew
    ordered = _task(**_base(path, shuffle=False))
    texts = [ordered.prompt(i).text for i in range(n)]
    assert texts == sorted(texts, key=lambda t: int(t.split("+")[0]))


def test_held_out_rows_are_never_trained_on_and_follow_the_seed(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", _rows(40))
    task = _task(**_base(path, eval_size=8, seed=1))
    held = {task.eval_prompt(i).text for i in range(8)}
    train = {task.prompt(i).text for i in range(64)}
    assert task.eval_count == 8 and len(held) == 8
    assert not held & train and len(train) == 32
    other = _task(**_base(path, eval_size=8, seed=2))
    assert {other.eval_prompt(i).text for i in range(8)} != held


def test_a_named_held_out_file_is_the_eval_split_and_all_training_rows_train(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", _rows(6))
    test = _jsonl(tmp_path / "test.jsonl", [{"question": "q9", "solution": "9", "level": 0, "topic": "x"}] * 2)
    task = _task(**_base(train, eval_path=str(test), eval_size=64))
    assert task.eval_count == 2
    assert task.eval_prompt(0).text == "q9" and task.eval_prompt(3).text == "q9"  # past eval_count: repeats
    assert len({task.prompt(i).text for i in range(6)}) == 6


def test_chat_message_prompts_keep_the_conversation(tmp_path: Path) -> None:
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": conv, "answer": "4"}] * 3)
    task = _task(source="jsonl", path=str(path), prompt_field="messages", eval_size=1)
    p = task.prompt(0)
    assert p.messages == tuple(conv) and p.text == "2+2=" and p.answer == "4"


def test_hf_source_reads_a_saved_dataset_and_a_local_parquet_directory(tmp_path: Path) -> None:
    import pandas as pd
    from datasets import Dataset, DatasetDict

    rows = _rows(10)
    saved = DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:3])})
    saved.save_to_disk(tmp_path / "saved")
    t = _task(source="hf", path=str(tmp_path / "saved"), prompt_field="question", answer_field="solution",
              eval_split="test")
    assert t.eval_count == 3 and {t.prompt(i).text for i in range(10)} == {r["question"] for r in rows}
    (tmp_path / "pq" / "data").mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(tmp_path / "pq" / "data" / "train-00000.parquet")
    t2 = _task(source="hf", path=str(tmp_path / "pq"), prompt_field="question", answer_field="solution", eval_size=2)
    assert len({t2.prompt(i).text for i in range(8)}) == 8


def test_a_hub_dataset_without_the_hub_is_one_clear_error(tmp_path: Path) -> None:
    code = ("from services.core.config.run import TaskSection\nfrom services.tasks import load_task, TaskError\n"
            "try:\n    load_task(TaskSection(source='hf', name='nobody/not-cached-anywhere'))\n"
            "except TaskError as e:\n    print('ERR', e)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ERR dataset 'nobody/not-cached-anywhere' is not on this machine and the hub cannot be reached" \
        in out.stdout, out.stdout + out.stderr[-2000:]


# -- bad input ---------------------------------------------------------------------------------------
def test_a_missing_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"task\.path: file '.*nope\.jsonl' not found"):
        _task(**_base(tmp_path / "nope.jsonl"))


def test_an_empty_file_and_an_empty_dataset_are_errors_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(TaskError, match=r"file '.*e\.jsonl' is empty"):
        _task(**_base(tmp_path / "e.jsonl"))
    (tmp_path / "h.csv").write_text("question,solution\n")
    with pytest.raises(TaskError, match=r"h\.csv.*(the dataset is empty|cannot be read)"):
        _task(**_base(tmp_path / "h.csv", source="csv"))


@pytest.mark.parametrize(("key", "column"), [("prompt_field", "prompt"), ("answer_field", "gold"),
                                             ("fields", {"difficulty": "lvl"})])
def test_a_field_that_is_not_in_the_data_names_the_field_and_the_columns(tmp_path: Path, key: str,
                                                                         column: Any) -> None:
    path = _jsonl(tmp_path / "train.jsonl", _rows(8))
    with pytest.raises(TaskError, match=r"is not a field of the data; fields: question, solution, level, topic"):
        _task(**_base(path, **{key: column}))


def test_a_non_string_prompt_column_is_an_error_naming_the_field(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", [{"question": i, "solution": "1"} for i in range(8)])
    with pytest.raises(TaskError, match=r"field 'question' holds int64 values; a prompt must be a string"):
        _task(**_base(path))


def test_a_null_prompt_names_the_row(tmp_path: Path) -> None:
    rows = _rows(8)
    rows[5]["question"] = None
    path = _jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(TaskError, match=r"train\.jsonl \(split 'train'\) row 5: field 'question' is empty"):
        _task(**_base(path))


def test_a_malformed_message_list_is_a_prompt_error_naming_the_row(tmp_path: Path) -> None:
    good = [{"role": "user", "content": "hi"}]
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": good, "answer": "a"}] * 3 + [{"messages": [], "answer": "a"}])
    task = _task(source="jsonl", path=str(path), prompt_field="messages", eval_size=1, shuffle=False)
    bad_index = [i for i in range(3) if task._epoch(0)[i] == 3]
    assert bad_index, "row 3 is a training row"
    with pytest.raises(PromptError, match=r"row 3: field 'messages' is list") as err:
        task.prompt(bad_index[0])
    assert err.value.reason == "bad_prompt"


def test_a_broken_jsonl_line_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "1+1=", "solution": "2"}\n{"question": \n')
    with pytest.raises(TaskError, match=r"task\.path '.*bad\.jsonl': cannot be read as jsonl"):
        _task(**_base(path))


def test_holding_out_every_row_is_an_error_that_says_what_to_change(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", _rows(5))
    with pytest.raises(TaskError, match=r"5 rows, and task\.eval_size 64 would hold out all of them"):
        _task(**_base(path, eval_size=64))


def test_an_unknown_split_lists_the_splits(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", _rows(8))
    with pytest.raises(TaskError, match=r"has no split 'test'; splits: train"):
        _task(**_base(path, eval_split="test"))


def test_config_rejects_a_source_without_its_data_and_data_keys_without_a_source() -> None:
    with pytest.raises(ConfigError, match=r"source 'jsonl' needs the data file"):
        parse_config({"task": {"source": "jsonl"}})
    with pytest.raises(ConfigError, match=r"path: only used with a 'source'"):
        parse_config({"task": {"name": "arithmetic", "path": "x.jsonl"}})
    with pytest.raises(ConfigError, match=r"allowed values: 'arithmetic', 'sentiment', 'synthetic'"):
        parse_config({"task": {"name": "chess"}})
