"""The actor's engine process starts before the actor imports torch (`services.models.engine_boot`):
on an H200 the engine's imports and the actor's ran one after the other, ~30 s of the time to first
step. Real processes: a fresh interpreter spawns the real transformers engine in a child, then builds
the engine the way the actor does and must be handed that very child."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fleet_helpers import EXAMPLE

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from pathlib import Path
from services.core.config import load_config
from services.models import engine_boot
cfg = load_config(sys.argv[1])
engine_boot.start_early(cfg)
early = engine_boot._started
torch_at_spawn = "torch" in sys.modules
if len(sys.argv) > 2:  # the actor asks for another engine than the one started early
    cfg = cfg.model_copy(update={"generation": cfg.generation.model_copy(update={"micro_batch": 3})})
from services.models.engine import SamplingParams
from services.models.factory import make_engine
eng = make_engine(cfg.generation.engine, Path(cfg.models.policy.path),
                  dtype=cfg.generation.engine_dtype(cfg.models.policy.dtype),
                  **cfg.generation.engine_kwargs(cfg.run_dir))
out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0))
# Tensors cross the pipes the torch-free spawn made: torch's reductions apply to them all the same.
from transformers import AutoModelForCausalLM
eng.update_weights(AutoModelForCausalLM.from_pretrained(cfg.models.policy.path).named_parameters(), 1)
assert eng.version == 1
print(json.dumps({"torch_at_spawn": torch_at_spawn, "early_pid": early.proc.pid if early else None,
                  "early_alive": early.proc.is_alive() if early else None,
                  "engine_pid": eng.describe().get("process") if hasattr(eng, "describe") else None,
                  "tokens": len(out[0].token_ids)}))
eng.close()
"""


def _run(tmp_path: Path, model: Path, *extra: str, **generation: Any) -> dict[str, Any]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["run"]["dir"] = str(tmp_path / "run")
    data["models"]["policy"]["path"] = str(model)
    data["generation"].update(generation)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(data))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(cfg), *extra], cwd=REPO, capture_output=True,
                          text=True, timeout=200, env={"RLFLEET_TORCH_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_engine_process_is_spawned_before_torch_is_imported_and_the_actor_is_handed_that_child(
        tmp_path: Path, random_model: Path) -> None:
    out = _run(tmp_path, random_model, process=True)
    assert out["torch_at_spawn"] is False
    assert out["engine_pid"] == out["early_pid"] and out["tokens"] == 3


def test_an_engine_in_the_actors_own_process_starts_nothing_early(tmp_path: Path, random_model: Path) -> None:
    out = _run(tmp_path, random_model, process=False)
    assert out["early_pid"] is None and out["tokens"] == 3


def test_a_child_started_for_another_engine_is_stopped_and_a_new_one_started(
        tmp_path: Path, random_model: Path) -> None:
    out = _run(tmp_path, random_model, "other", process=True)
    assert out["early_pid"] is not None and out["engine_pid"] != out["early_pid"]
    assert out["early_alive"] is False and out["tokens"] == 3


def test_the_early_child_gets_every_engine_option_make_engine_would_pass_it() -> None:
    # engine_boot cannot import the factory (torch); it names make_engine's own arguments instead, and an
    # argument added to make_engine but not there would reach the child as an engine option: the early
    # child would then never match, and every start would spawn a second one.
    import inspect

    from services.models.engine_boot import _FACTORY_ARGS
    from services.models.factory import make_engine

    own = set(inspect.signature(make_engine).parameters) - {"name", "model_path", "dtype", "device", "micro_batch",
                                                             "options"}
    assert own == set(_FACTORY_ARGS)
