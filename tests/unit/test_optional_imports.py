"""The services run on the base install: importing any of them pulls in none of the optional extras
(LoRA, trackers, tasks, vLLM, TRL), which only a run that configures them imports. The base Docker
images install the base dependencies only (the extras images add tasks, track and lora), so an
unconditional import there is a service that cannot start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = ["services.controller.server", "services.actor.server", "services.critic.server",
            "services.reward.server", "services.reference.server", "services.prepare", "services.cli",
            "services.fleet", "services.audit"]
OPTIONAL = ["peft", "wandb", "mlflow", "tensorboard", "datasets", "reasoning_gym", "math_verify", "vllm", "trl",
            "gguf"]


def test_importing_the_services_pulls_in_no_optional_extra() -> None:
    code = (f"import importlib, json, sys\nfor m in {SERVICES!r}:\n    importlib.import_module(m)\n"
            f"print(json.dumps(sorted(p for p in {OPTIONAL!r} if p in sys.modules)))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []
