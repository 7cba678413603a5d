"""vLLM start-up options (issue 16): CUDA-graph capture sizes limited to the run's batch and a compile
cache under the run directory, from the config to the `LLM(...)` arguments (vLLM itself cannot run here)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from services.core.config.run import parse_config
from services.models.engine import EngineError
from services.models.engines.factory import make_engine
from services.models.engines.vllm_adapter import capture_sizes, compile_options


def test_default_config_passes_no_new_vllm_options() -> None:
    kw = parse_config({"generation": {"engine": "vllm", "device": "cuda"}}).generation.engine_kwargs(Path("/r"))
    assert "cudagraph_max_batch" not in kw and "compile_cache_dir" not in kw


def test_vllm_options_reach_the_engine_kwargs_with_the_cache_under_the_run_dir(tmp_path: Path) -> None:
    cfg = parse_config({"run": {"dir": str(tmp_path / "run")},
                        "generation": {"engine": "vllm", "device": "cuda",
                                       "vllm": {"cudagraph_max_batch": 256, "compile_cache_dir": "cache/vllm"}}})
    kw = cfg.generation.engine_kwargs(cfg.run_dir)
    assert kw["cudagraph_max_batch"] == 256
    assert kw["compile_cache_dir"] == str(cfg.run_dir / "cache" / "vllm")
    absolute = parse_config({"generation": {"engine": "vllm", "vllm": {"compile_cache_dir": "/srv/cache"}}})
    assert absolute.generation.engine_kwargs(cfg.run_dir)["compile_cache_dir"] == "/srv/cache"


def test_prefix_caching_is_on_unless_the_config_turns_it_off_and_reaches_the_engine_by_its_own_name() -> None:
    import inspect

    from services.models.engines.vllm_engine import VLLMEngine

    on = parse_config({"generation": {"engine": "vllm", "device": "cuda"}}).generation.engine_kwargs()
    off = parse_config({"generation": {"engine": "vllm", "vllm": {"prefix_caching": False}}}).generation.engine_kwargs()
    assert on["enable_prefix_caching"] is True and off["enable_prefix_caching"] is False
    assert "enable_prefix_caching" in inspect.signature(VLLMEngine.from_path).parameters
    with pytest.raises(Exception, match="prefix_caching"):
        parse_config({"generation": {"engine": "vllm", "vllm": {"prefix_caching": "sometimes"}}})


def test_capture_sizes_are_vllms_defaults_up_to_the_run_batch() -> None:
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(100) == [1, 2, 4, *range(8, 97, 8), 100]
    assert capture_sizes(1) == [1]
    assert capture_sizes(4096)[-2:] == [512, 4096]
    with pytest.raises(EngineError, match="cudagraph_max_batch"):
        capture_sizes(0)


def test_compile_options_keep_other_compilation_settings_and_key_the_cache_root(tmp_path: Path) -> None:
    kwargs, env = compile_options(16, str(tmp_path / "c"), {"compilation_config": {"level": 3}})
    assert kwargs == {"compilation_config": {"level": 3, "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}}
    assert env == {"VLLM_CACHE_ROOT": str((tmp_path / "c").resolve())} and (tmp_path / "c").is_dir()
    assert compile_options(None, None, {}) == ({}, {})


def test_a_replicas_compile_cache_goes_under_the_configured_root_else_under_vllms_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, env = compile_options(None, str(tmp_path / "c"), {}, subdir="replica1")
    assert env == {"VLLM_CACHE_ROOT": str((tmp_path / "c" / "replica1").resolve())}
    # Without a configured root vLLM resolves its own (VLLM_CACHE_ROOT, XDG_CACHE_HOME, ~/.cache);
    # vLLM cannot be installed on a CPU host, so its `envs` module stands in with the root it resolved.
    monkeypatch.setitem(sys.modules, "vllm.envs", types.SimpleNamespace(VLLM_CACHE_ROOT=str(tmp_path / "v")))
    _, env = compile_options(None, None, {}, subdir="replica2")
    assert env == {"VLLM_CACHE_ROOT": str((tmp_path / "v" / "replica2").resolve())}
    assert (tmp_path / "v" / "replica2").is_dir()


def test_transformers_engine_refuses_the_vllm_options(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="takes no options; got compile_cache_dir, cudagraph_max_batch"):
        make_engine("transformers", tmp_path, cudagraph_max_batch=8, compile_cache_dir="x")
