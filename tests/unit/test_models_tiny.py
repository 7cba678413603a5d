"""Tiny model build: warm-up quality, the real loading path, atomic publication, path resolution."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from services.core.config.run import ModelSpec, TinyModelSpec
from services.models.engine import SamplingParams
from services.models.engines.factory import make_engine
from services.models.io.atomic import MARKER, staging_dir
from services.models.io.loading import ModelLoadError, load_causal_lm, load_tokenizer
from services.models.roles.paths import read_model_info, resolve_model_path
from services.models.roles.tiny import build_tiny_model
from services.models.roles.tokenizer import decode_completion, encode_prompt
from services.tasks import make_task
from services.tasks.base import Task

SEED = 0

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def arithmetic() -> Task:
    return make_task("arithmetic")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, arithmetic: Task) -> tuple[Path, float]:
    """The default-spec arithmetic model, built once through `resolve_model_path` (run-dir default)."""
    run_dir = tmp_path_factory.mktemp("run")
    t0 = time.monotonic()
    path = resolve_model_path(ModelSpec(build=TinyModelSpec()), "policy", arithmetic, run_dir, SEED)
    return path, time.monotonic() - t0


def _accuracy(path: Path, task: Task, temperature: float, n: int = 128) -> float:
    tok = load_tokenizer(path)
    engine = make_engine("transformers", path)
    prompts = [task.eval_prompt(i) for i in range(n)]
    comps = engine.generate([encode_prompt(tok, p.text) for p in prompts],
                            SamplingParams(temperature=temperature, max_new_tokens=task.max_new_tokens, seed=SEED))
    return sum(task.reward(p, decode_completion(tok, c.token_ids)) for p, c in zip(prompts, comps, strict=True)) / n


def test_default_build_lands_in_the_run_dir_with_model_tokenizer_and_info(
    built: tuple[Path, float], arithmetic: Task, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path, seconds = built
    assert path.name == "policy" and path.parent.name == "models"
    names = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)  # safetensors only
    info = read_model_info(path)
    assert info is not None
    assert info["task"] == "arithmetic" and info["seed"] == SEED and info["spec"] == TinyModelSpec().model_dump()
    assert seconds < 60  # ~5 s on 2 idle cores; generous for a loaded CI box
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no staging dir left behind


def test_warmed_up_model_is_right_sometimes_but_not_always(built: tuple[Path, float], arithmetic: Task) -> None:
    path, _ = built
    sampled, greedy = _accuracy(path, arithmetic, 1.0), _accuracy(path, arithmetic, 0.0)
    assert 0.05 < sampled < 0.9
    assert 0.05 < greedy < 0.9
    # The reloaded model reproduces the accuracy measured at build time: saving was lossless.
    info = read_model_info(path)
    assert info is not None
    assert info["warmup"]["eval_reward_t1"] == pytest.approx(sampled)
    assert info["warmup"]["eval_reward_greedy"] == pytest.approx(greedy)


def test_reload_goes_through_local_files_and_matches_the_spec(built: tuple[Path, float]) -> None:
    path, _ = built
    model: Any = load_causal_lm(path)
    tok = load_tokenizer(path)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (64, 2, len(tok))
    assert cfg.model_type == "qwen2" and not model.training
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_existing_path_is_returned_without_rebuilding(built: tuple[Path, float], arithmetic: Task) -> None:
    path, _ = built
    before = (path / "model.safetensors").stat().st_mtime_ns
    again = resolve_model_path(ModelSpec(build=TinyModelSpec()), "policy", arithmetic, path.parent.parent, SEED)
    assert again == path and (path / "model.safetensors").stat().st_mtime_ns == before
    assert build_tiny_model(arithmetic, TinyModelSpec(), path, SEED) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before


def test_a_model_built_with_another_spec_is_not_silently_reused(built: tuple[Path, float], arithmetic: Task) -> None:
    path, _ = built
    with pytest.raises(ModelLoadError, match="different spec"):
        resolve_model_path(ModelSpec(path=str(path), build=TinyModelSpec(warmup_steps=3)), "policy", arithmetic,
                           path.parent.parent, SEED)
    with pytest.raises(ModelLoadError, match="different seed"):
        resolve_model_path(ModelSpec(path=str(path), build=TinyModelSpec()), "policy", arithmetic,
                           path.parent.parent, SEED + 1)


def test_missing_path_without_build_spec_names_the_path(tmp_path: Path, arithmetic: Task) -> None:
    missing = tmp_path / "no" / "model"
    with pytest.raises(ModelLoadError) as err:
        resolve_model_path(ModelSpec(path=str(missing)), "policy", arithmetic, tmp_path, SEED)
    assert str(missing) in str(err.value) and "build" in str(err.value)


def test_existing_dir_that_is_not_a_model_is_rejected_by_path(tmp_path: Path, arithmetic: Task) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(ModelLoadError, match=f"{tmp_path / 'junk'} exists but has no config.json"):
        resolve_model_path(ModelSpec(path=str(tmp_path / "junk"), build=TinyModelSpec()), "policy", arithmetic,
                           tmp_path, SEED)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="is empty"):
        resolve_model_path(ModelSpec(path=str(tmp_path / "empty")), "policy", arithmetic, tmp_path, SEED)


def test_loading_a_dir_without_config_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*config.json"):
        load_causal_lm(tmp_path)


def test_unknown_dtype_is_rejected_by_name(built: tuple[Path, float]) -> None:
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'; allowed: float32, bfloat16, float16"):
        load_causal_lm(built[0], dtype="float8")


def test_explicit_path_is_built_there_for_llama_too(tmp_path: Path) -> None:
    task = make_task("sentiment")
    target = tmp_path / "custom" / "policy"
    spec = TinyModelSpec(arch="llama", hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=32,
                         warmup_steps=5)
    path = resolve_model_path(ModelSpec(path=str(target), build=spec), "policy", task, tmp_path, 1)
    assert path == target
    model = load_causal_lm(path)
    assert model.config.model_type == "llama"
    assert json.loads((path / MARKER).read_text())["task"] == "sentiment"


def test_same_seed_builds_identical_weights(tmp_path: Path) -> None:
    task = make_task("arithmetic", {"max_operand": 5})
    spec = TinyModelSpec(hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=16, warmup_steps=3)
    a = load_causal_lm(build_tiny_model(task, spec, tmp_path / "a", seed=7)).state_dict()
    b = load_causal_lm(build_tiny_model(task, spec, tmp_path / "b", seed=7)).state_dict()
    c = load_causal_lm(build_tiny_model(task, spec, tmp_path / "c", seed=8)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_staging_keeps_the_directory_that_appeared_meanwhile(tmp_path: Path) -> None:
    target = tmp_path / "model"
    with staging_dir(target) as tmp:
        (tmp / "ours.txt").write_text("ours")
        target.mkdir()  # another builder publishes first
        (target / MARKER).write_text("{}")
    assert sorted(os.listdir(target)) == [MARKER]
    assert os.listdir(tmp_path) == ["model"]  # our staging dir is gone


def test_a_crash_while_staging_leaves_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "model"
    with pytest.raises(RuntimeError, match="boom"), staging_dir(target) as tmp:
        (tmp / "half.bin").write_text("x")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
