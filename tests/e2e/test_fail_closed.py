"""Start-up fails closed and clearly: a secret the config names but the environment lacks, and a
journal that does not belong to the run's checkpoints, each stop the fleet (and a service started
by hand) before anything runs, with one line naming the variable or the file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from services.core.config.run import RunConfig
from services.report import read_metrics
from tests.fleet_helpers import tiny_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECRETS = {"security": {"token_env": "RLF_FC_TOKEN"}, "redis": {"password_env": "RLF_FC_REDIS_PW"}}


def write_config(cfg: RunConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def run_cli(args: list[str], env: dict[str, str], timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = {**env, "PYTHONPATH": str(REPO), "COLUMNS": "400"}  # rich must not wrap the line we look for
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout_s,
                          cwd=REPO, stdin=subprocess.DEVNULL)


def clean_env(**set_vars: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RLF_FC_TOKEN", "RLF_FC_REDIS_PW")}
    env.update(set_vars)
    return env


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize(("token", "missing"),
                         [(None, "RLF_FC_TOKEN"), ("", "RLF_FC_TOKEN"), ("t0k", "RLF_FC_REDIS_PW")],
                         ids=["token-unset", "token-empty", "password-unset"])
def test_rlfleet_up_refuses_to_start_without_a_configured_secret(
    token: str | None, missing: str, tmp_path: Path, tiny_model: Path
) -> None:
    cfg = tiny_config(tmp_path / "run", tiny_model, run={"max_steps": 2}, **SECRETS)
    path = write_config(cfg, tmp_path / "cfg.yaml")
    env = clean_env() if token is None else clean_env(RLF_FC_TOKEN=token)
    t0 = time.monotonic()
    res = run_cli(["-m", "services.cli", "up", "--config", str(path)], env)
    assert res.returncode != 0, res.stdout + res.stderr
    assert time.monotonic() - t0 < 60, "it should fail before starting anything"
    [line] = error_lines(res.stderr)
    assert missing in line and ("unset" in line or "empty" in line), line
    assert "Traceback" not in res.stdout + res.stderr
    assert not (cfg.run_dir / "redis").exists() and not (cfg.run_dir / "services").exists(), "something started"


def test_a_service_started_by_hand_refuses_to_start_without_a_configured_secret(
    tmp_path: Path, tiny_model: Path
) -> None:
    cfg = tiny_config(tmp_path / "run", tiny_model, redis={"url": "redis://127.0.0.1:1/0", **SECRETS["redis"]},
                      security=SECRETS["security"])
    path = write_config(cfg, tmp_path / "fleet.yaml")
    for service, env, missing in (("reward", clean_env(RLF_FC_REDIS_PW="pw"), "RLF_FC_TOKEN"),
                                  ("controller", clean_env(RLF_FC_TOKEN="t0k"), "RLF_FC_REDIS_PW")):
        res = run_cli(["-m", f"services.{service}", "--config", str(path)], env, timeout_s=60)
        assert res.returncode == 2, (service, res.stderr[-2000:])
        [line] = [x for x in error_lines(res.stderr) if missing in x]
        assert "unset" in line and "Traceback" not in res.stderr, line


def test_a_deleted_or_truncated_journal_is_a_start_up_error_naming_it(
    tmp_path: Path, tiny_model: Path, fleet_factory
) -> None:
    cfg = tiny_config(tmp_path / "run", tiny_model, run={"max_steps": 2}, checkpoint={"every": 1})
    fleet = fleet_factory(cfg)
    fleet.start(ready_timeout_s=180)
    assert fleet.supervise(timeout_s=240) == 0
    fleet.stop()
    assert [r["step"] for r in read_metrics(cfg.run_dir / "metrics.jsonl")] == [1, 2]
    fleet_yaml = cfg.run_dir / "fleet.yaml"
    data = cfg.journal_dir / "data.mdb"
    ckpts = sorted(p.name for p in (cfg.checkpoint_dir / "actor").iterdir())

    data.write_bytes(b"")  # truncated
    res = run_cli(["-m", "services.controller", "--config", str(fleet_yaml)], os.environ.copy(), timeout_s=90)
    assert res.returncode == 2, res.stderr[-2000:]
    [line] = [x for x in error_lines(res.stderr) if str(data) in x]
    assert "empty" in line and "Traceback" not in res.stderr, res.stderr[-2000:]

    shutil.rmtree(cfg.journal_dir)  # deleted: `rlfleet up` on the run fails at start, naming it
    path = write_config(cfg, tmp_path / "cfg.yaml")
    res = run_cli(["-m", "services.cli", "up", "--config", str(path), "--max-steps", "4", "--restart-budget", "0",
                   "--ready-timeout", "120"], os.environ.copy(), timeout_s=300)
    assert res.returncode != 0
    assert f"journal {data} is missing" in res.stdout + res.stderr, (res.stdout + res.stderr)[-3000:]
    assert not cfg.journal_dir.exists(), "the journal was recreated at step 0"
    assert [r["step"] for r in read_metrics(cfg.run_dir / "metrics.jsonl")] == [1, 2], "it trained"
    assert sorted(p.name for p in (cfg.checkpoint_dir / "actor").iterdir()) == ckpts
