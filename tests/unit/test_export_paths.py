"""`rlfleet export` on a run read through another mount point: a compose run's fleet.yaml records the
container's run directory (/var/lib/rlfleet/run), the host mounts that volume elsewhere."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.models.checkpoints.export import _fleet_policy_and_checkpoints, find_base

ROOT = Path(__file__).resolve().parents[2]


def _fleet_yaml(run_dir: Path, **policy: str) -> None:
    data = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    data["run"]["dir"] = "/var/lib/rlfleet/run"
    data["models"]["policy"] = dict(policy)
    run_dir.mkdir(parents=True)
    (run_dir / "fleet.yaml").write_text(yaml.safe_dump(data))


def test_paths_inside_the_recorded_run_dir_are_found_under_the_one_given(tmp_path: Path) -> None:
    run_dir = tmp_path / "data" / "run"
    _fleet_yaml(run_dir, path="/var/lib/rlfleet/run/models/policy")
    path, checkpoints, _ = _fleet_policy_and_checkpoints(run_dir)
    assert (path, checkpoints) == (run_dir / "models" / "policy", run_dir / "checkpoints")
    assert find_base(run_dir) == run_dir / "models" / "policy"


def test_paths_outside_the_recorded_run_dir_are_kept(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _fleet_yaml(run_dir, path="/models/smollm2")
    path, checkpoints, _ = _fleet_policy_and_checkpoints(run_dir)
    assert (path, checkpoints) == (Path("/models/smollm2"), run_dir / "checkpoints")
