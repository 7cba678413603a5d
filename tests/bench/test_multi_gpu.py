"""bench/multi_gpu.py's plan phase in a dry run: the decoupled 8-GPU config is a valid run config, and
`rlfleet plan` places it (actor 4 GPUs with one engine replica each, critic 2, scorers 2 with one reward
replica per GPU) and writes the Kubernetes GPU patch. The fleet and TRL phases need the GPU host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from services.core.config.run import parse_config

REPO = Path(__file__).resolve().parents[2]


def test_multi_gpu_plan_phase_places_the_decoupled_config(tmp_path: Path) -> None:
    env = {**os.environ, "BENCH_DRY": "1", "BENCH_WORK": str(tmp_path / "work")}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "bench.multi_gpu", "plan", "--gpus", "8", "--out", str(out)],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    plan = json.loads((out / "multi-gpu-plan.json").read_text())["plan"]
    assert {s: plan["services"][s]["gpus"] for s in ("actor", "critic", "reward", "reference")} == \
        {"actor": "0,1,2,3", "critic": "4,5", "reward": "6,7", "reference": "6,7"}
    assert any("reward: 2 replicas on group 'score', one GPU each" in n for n in plan["notes"])
    patch = {d["metadata"]["name"]: d for d in yaml.safe_load_all((out / "multi-gpu.k8s-patch.yaml").read_text())}
    assert patch["actor"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    # What the dry run leaves for its fleet phase is a config the CPU can run (no device groups).
    parse_config(yaml.safe_load((out / "multi-gpu.yaml").read_text()), source="multi-gpu.yaml")
