"""Prompts from data: JSONL/JSON, Parquet and CSV files, or a `datasets` dataset (a hub id when the
host is online, or a local dataset directory), read through the `datasets` library.

Rows are addressed by index so the journal's integer cursor keeps resume and replay working:
training index i is row `order(epoch)[i % n]` of the training rows, with `epoch = i // n` and each
epoch's order a shuffle seeded by `task.seed` (or file order). The held-out rows are a named split,
or `eval_size` rows drawn out of the training split by the same seed and never trained on.

The prompt column holds a string or a list of chat messages ({role, content}); the answer column
(optional) a string or number; every other column travels with the prompt to the reward, under its
name or the one `fields` maps it to. Everything checkable from the schema is checked at load, with
the file, field or row named; a row that still cannot be used raises `PromptError` when it is read.
"""

from __future__ import annotations

import glob
import logging
import os
import random
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.tasks.base import BaseTask, Prompt, PromptError, TaskError, TokenizerKind

if TYPE_CHECKING:
    from datasets import Dataset

    from services.core.config.run import TaskSection

log = logging.getLogger("rlfleet.tasks.dataset")

_BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}


def _quiet_datasets() -> None:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def _check_file(path: str, what: str) -> None:
    matches = glob.glob(path) if glob.has_magic(path) else ([path] if os.path.exists(path) else [])
    if not matches:
        raise TaskError(f"task.{what}: file {path!r} not found")
    for m in matches:
        if os.path.isdir(m):
            raise TaskError(f"task.{what}: {m!r} is a directory; give the data file (or a glob)")
        if os.path.getsize(m) == 0:
            raise TaskError(f"task.{what}: file {m!r} is empty")


def _hub_offline_message(name: str, err: BaseException) -> str:
    why = "HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") else (
        str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
    return f"dataset {name!r} is not on this machine and the hub cannot be reached ({why})"


def load_splits(section: TaskSection) -> tuple[dict[str, Dataset], str]:
    """The dataset's splits and a label naming where they came from (for error messages)."""
    _quiet_datasets()
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    source = section.source
    if source in _BUILDERS:
        assert section.path is not None
        _check_file(section.path, "path")
        files: dict[str, str] = {section.split: section.path}
        if section.eval_path is not None:
            _check_file(section.eval_path, "eval_path")
            files[section.eval_split or "test"] = section.eval_path
        label = section.path
        try:
            loaded: Any = load_dataset(_BUILDERS[source], data_files=files)
        except Exception as err:
            cause = err.__cause__ or err
            raise TaskError(f"task.path {label!r}: cannot be read as {source}: {type(cause).__name__}:"
                            f" {str(cause)[:300]}") from None
    else:  # "hf"
        name = section.path or section.name
        assert name is not None
        label = name
        local = Path(name).expanduser()
        try:
            if local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
                loaded = load_from_disk(str(local))  # written by save_to_disk
            elif local.exists() or name.startswith((".", "/", "~")):
                if not local.exists():
                    raise TaskError(f"task.path: dataset directory {name!r} not found")
                loaded = load_dataset(str(local), section.subset)
            else:
                loaded = load_dataset(name, section.subset)
        except TaskError:
            raise
        except ConnectionError as err:
            raise TaskError(_hub_offline_message(name, err)) from None
        except FileNotFoundError as err:
            raise TaskError(f"dataset {name!r} not found: {str(err)[:300]}") from None
        except Exception as err:
            raise TaskError(f"dataset {name!r} cannot be loaded: {type(err).__name__}: {str(err)[:300]}") from None
    if isinstance(loaded, Dataset):
        loaded = DatasetDict({section.split: loaded})
    return dict(loaded.items()), label


def _first_null(ds: Dataset, column: str) -> int | None:
    import pyarrow.compute as pc

    col = ds.data.column(column)
    if col.null_count == 0:
        return None
    return int(pc.index(pc.is_null(col), True).as_py())


def _check_prompt_feature(ds: Dataset, column: str, where: str) -> None:
    from datasets import List, Sequence, Value

    feat = ds.features[column]
    if isinstance(feat, Value):
        if feat.dtype not in ("string", "large_string"):
            raise TaskError(f"{where}: field {column!r} holds {feat.dtype} values; a prompt must be a string"
                            " or a list of chat messages")
        return
    inner = getattr(feat, "feature", None) if isinstance(feat, List | Sequence) else None
    keys = set(inner) if isinstance(inner, dict) else set()
    if not {"role", "content"} <= keys:
        raise TaskError(f"{where}: field {column!r} is not a string or a list of chat messages with"
                        f" 'role' and 'content' (got {feat})")


class DatasetTask(BaseTask):
    """A task whose prompts (and reference answers) are rows of a dataset."""

    tokenizer_kind: TokenizerKind = "char"

    def __init__(self, section: TaskSection) -> None:
        super().__init__()
        self.section = section
        self.chat, self.system_prompt = section.chat, section.system_prompt
        splits, self.label = load_splits(section)
        self.name = section.name or f"{section.source}:{Path(self.label).name}"
        self._train = self._split(splits, section.split, "split")
        eval_name = section.eval_split or ("test" if section.eval_path is not None else None)
        self._eval = self._split(splits, eval_name, "eval_split") if eval_name is not None else None
        self._where_train = f"{self.label} (split {section.split!r})"
        self._where_eval = f"{self.label} (split {eval_name!r})" if eval_name else self._where_train
        self._validate(self._train, self._where_train)
        if self._eval is not None:
            self._validate(self._eval, self._where_eval)
        self._rows = self._holdout()
        self.field_names = tuple(sorted(self._field_map().keys() | ({"answer"} if section.answer_field else set())))
        self.eval_count = len(self._eval_rows)
        self.max_prompt_tokens, self.max_new_tokens = self._lengths()
        self.params = {k: v for k, v in section.model_dump(mode="json").items()
                       if k in ("source", "name", "path", "eval_path", "subset", "split", "eval_split",
                                "prompt_field", "answer_field", "fields", "system_prompt", "shuffle", "seed",
                                "eval_size")}
        log.info("dataset %s: %d training rows, %d held out", self.label, len(self._rows), self.eval_count)

    # -- loading and checks --------------------------------------------------------------------------
    def _split(self, splits: Mapping[str, Dataset], name: str, key: str) -> Dataset:
        if name not in splits:
            raise TaskError(f"task.{key}: {self.label!r} has no split {name!r}; splits: {', '.join(sorted(splits))}")
        return splits[name]

    def _field_map(self) -> dict[str, str]:
        """Reward keyword -> column, for every column but the prompt and the answer."""
        s = self.section
        cols = [c for c in self._train.column_names if c not in (s.prompt_field, s.answer_field)]
        renamed = {col: kw for kw, col in s.fields.items()}
        return {renamed.get(c, c): c for c in cols}

    def _validate(self, ds: Dataset, where: str) -> None:
        s = self.section
        if len(ds) == 0:
            raise TaskError(f"{where}: the dataset is empty")
        cols = ds.column_names
        wanted = [("prompt_field", s.prompt_field)] + ([("answer_field", s.answer_field)] if s.answer_field else [])
        wanted += [(f"fields.{kw}", col) for kw, col in s.fields.items()]
        for key, col in wanted:
            if col not in cols:
                hint = " (answer_field: null for prompts without a reference answer)" if key == "answer_field" else ""
                raise TaskError(f"{where}: task.{key} {col!r} is not a field of the data; fields: {', '.join(cols)}"
                                + hint)
        clash = sorted(set(s.fields) & ({"answer", "completions", "prompts", "prompt", "completion"}))
        if clash:
            raise TaskError(f"task.fields: {', '.join(map(repr, clash))} is reserved for the reward's own arguments")
        _check_prompt_feature(ds, s.prompt_field, where)
        for col in [s.prompt_field] + ([s.answer_field] if s.answer_field else []):
            row = _first_null(ds, col)
            if row is not None:
                raise TaskError(f"{where} row {row}: field {col!r} is empty (null)")

    def _holdout(self) -> list[int]:
        """Training row numbers; sets `_eval_rows` (rows of the eval split, or held out of training)."""
        s = self.section
        n = len(self._train)
        if self._eval is not None:
            self._eval_rows = list(range(min(s.eval_size, len(self._eval))))
            return list(range(n))
        if s.eval_size >= n:
            raise TaskError(f"{self._where_train}: {n} rows, and task.eval_size {s.eval_size} would hold out all of"
                            " them; lower eval_size or give an eval_split / eval_path")
        order = list(range(n))
        random.Random(f"rlfleet/dataset/{s.seed}/holdout").shuffle(order)
        self._eval_rows = order[: s.eval_size]
        return sorted(order[s.eval_size:])

    def _lengths(self) -> tuple[int, int]:
        """Longest prompt and answer in characters (a char-level tiny model's token counts), read
        from the Arrow columns at once rather than row by row."""
        import pyarrow as pa
        import pyarrow.compute as pc

        s = self.section

        def longest(column: str) -> int | None:
            col = self._train.data.column(column)
            if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
                col = pc.cast(col, pa.string()) if pa.types.is_integer(col.type) or pa.types.is_floating(
                    col.type) else None
            if col is None:
                return None
            m = pc.max(pc.utf8_length(col)).as_py()
            return int(m) if m is not None else None

        system = len(s.system_prompt) + 1 if s.system_prompt else 0
        prompt = longest(s.prompt_field)
        answer = longest(s.answer_field) if s.answer_field else None
        return (prompt + system if prompt is not None else 512), (answer + 1 if answer is not None else 64)

    # -- index -> prompt -----------------------------------------------------------------------------
    @lru_cache(maxsize=2)  # noqa: B019 (one task per process: the cache lives as long as it does)
    def _epoch(self, epoch: int) -> list[int]:
        rows = list(self._rows)
        if self.section.shuffle:
            random.Random(f"rlfleet/dataset/{self.section.seed}/epoch/{epoch}").shuffle(rows)
        return rows

    def _check_index(self, index: int) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise TaskError(f"task '{self.name}': prompt index must be a non-negative int, got {index!r}")

    def prompt(self, index: int) -> Prompt:
        self._check_index(index)
        epoch, pos = divmod(index, len(self._rows))
        return self._prompt_of(self._train, self._epoch(epoch)[pos], index, self._where_train)

    def eval_prompt(self, index: int) -> Prompt:
        """The index-th held-out prompt; indices past `eval_count` repeat them."""
        self._check_index(index)
        if not self._eval_rows:
            raise TaskError(f"task '{self.name}': no held-out prompts (task.eval_size is 0)")
        ds = self._eval if self._eval is not None else self._train
        return self._prompt_of(ds, self._eval_rows[index % len(self._eval_rows)], index, self._where_eval)

    def _prompt_of(self, ds: Dataset, row_no: int, index: int, where: str) -> Prompt:
        s = self.section
        row = ds[row_no]
        origin = f"{where} row {row_no}"
        raw = row[s.prompt_field]
        messages = None
        if isinstance(raw, str):
            text = raw
        elif isinstance(raw, list) and raw and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in raw):
            messages = tuple({"role": m["role"], "content": m["content"]} for m in raw)
            users = [m["content"] for m in messages if m["role"] == "user"]
            text = users[-1] if users else messages[-1]["content"]
        else:
            raise PromptError(f"{origin}: field {s.prompt_field!r} is {type(raw).__name__}"
                              f" {str(raw)[:80]!r}, expected a string or a list of chat messages", index)
        answer = ""
        if s.answer_field:
            a = row[s.answer_field]
            if isinstance(a, bool) or not isinstance(a, str | int | float):
                raise PromptError(f"{origin}: field {s.answer_field!r} is {type(a).__name__}, expected a string"
                                  " or a number", index)
            answer = str(a)
        fields = {kw: row[col] for kw, col in self._field_map().items()}
        return Prompt(index=index, text=text, answer=answer, messages=messages, fields=fields, origin=origin)

    # -- reward and tiny models ----------------------------------------------------------------------
    def _reward(self, prompt: Prompt, completion: str) -> float:
        if not self.section.answer_field:
            raise TaskError(f"task '{self.name}' has no answer_field, so no built-in reward; set task.reward_fn,"
                            " task.reward_path or task.rewards")
        return 1.0 if completion.strip() == prompt.answer.strip() else 0.0

    def _texts(self) -> list[tuple[str, str]]:
        from services.tasks.chat import raw_text

        return [(raw_text(self, p), p.answer) for p in (self.prompt(i) for i in range(len(self._rows)))]

    def sft_example(self, index: int) -> tuple[str, str]:
        from services.tasks.chat import raw_text

        p = self.prompt(index)
        return raw_text(self, p), p.answer

    def vocab(self) -> list[str]:
        """Every character of the training prompts and answers: what a tiny char-level model needs."""
        chars: set[str] = set()
        for text, answer in self._texts():
            chars.update(text)
            chars.update(answer)
        return sorted(chars)
