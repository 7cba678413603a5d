"""A fleet whose actor trains on 2 ranks (a follower process, gloo, FSDP2): step for step the
1-rank run (the single-process loop), DCP checkpoints, and a resume of that run on 1 rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.audit import audit
from services.local import run_local
from services.models.checkpoints.export import load_checkpointed_policy
from services.report import read_metrics
from tests.fleet_helpers import tiny_config

pytestmark = pytest.mark.slow

STEPS = 3


def _run(fleet_factory, cfg) -> list[dict]:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(cfg)
    fleet.start(ready_timeout_s=240)
    assert fleet.supervise(timeout_s=300) == 0
    fleet.stop(grace_s=30)
    # A drained actor stopped its ranks on purpose: it exits 0 without a failure in its log.
    assert fleet.procs["actor"].proc.returncode == 0
    assert "main loop failed" not in (cfg.run_dir / "logs" / "actor.log").read_text()
    return read_metrics(cfg.run_dir / "metrics.jsonl")


def test_two_rank_actor_learns_like_one_rank_and_resumes_on_one_rank(
        tmp_path: Path, tiny_model: Path, fleet_factory) -> None:
    base = {"run": {"max_steps": STEPS}, "checkpoint": {"every": 1}}
    # The 1-rank reference is the single-process loop, which the 1-rank fleet matches step for step
    # (tests/e2e/test_fleet.py).
    one = read_metrics(run_local(tiny_config(tmp_path / "one", tiny_model, **base)))
    two_cfg = tiny_config(tmp_path / "two", tiny_model, services={"actor": {"trainer_ranks": 2}}, **base)
    two = _run(fleet_factory, two_cfg)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two, strict=True):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-4)
        assert b["policy_loss"] == pytest.approx(a["policy_loss"], abs=1e-4)

    # The 2-rank actor's checkpoints are DCP, one shard file per rank, and export to one model.
    adir = two_cfg.checkpoint_dir / "actor"
    latest = adir / (adir / "latest").read_text().strip()
    meta = json.loads((latest / "meta.json").read_text())
    assert meta["layout"] == "dcp" and meta["ranks"] == 2
    assert sorted(p.name for p in (latest / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    model, version, _ = load_checkpointed_policy(tiny_model, latest)
    assert version == STEPS and sum(p.numel() for p in model.parameters()) > 0

    # The same run goes on with a 1-rank actor: it loads the 2-rank DCP checkpoint (resharded).
    more = tiny_config(tmp_path / "two", tiny_model, run={"max_steps": STEPS + 2}, checkpoint={"every": 1})
    rows = _run(fleet_factory, more)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 3))
    report = audit(more.run_dir, finished=True)
    assert report.ok, report.render()
    meta = json.loads((adir / (adir / "latest").read_text().strip() / "meta.json").read_text())
    assert meta.get("layout", "safetensors") == "safetensors" and meta["version"] == STEPS + 2
