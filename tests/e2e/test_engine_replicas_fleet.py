"""A fleet whose actor generates on two engine replicas learns step for step like the single-process
loop with its one in-process engine (max_staleness 0, one seed): the replicas change where rollouts
are generated, not what they are."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.local import run_local
from services.report import read_metrics
from tests.fleet_helpers import tiny_config

pytestmark = pytest.mark.slow


def test_two_engine_replicas_learn_exactly_like_the_local_loop(tmp_path: Path, tiny_model: Path,
                                                               fleet_factory) -> None:
    steps = 3
    run_local(tiny_config(tmp_path / "local", tiny_model, run={"max_steps": steps}))
    cfg = tiny_config(tmp_path / "fleet", tiny_model, run={"max_steps": steps}, generation={"replicas": 2})
    fleet = fleet_factory(cfg)
    fleet.start(ready_timeout_s=180)
    actor = fleet.procs["actor"].proc.pid
    kids = Path(f"/proc/{actor}/task/{actor}/children").read_text().split()
    assert sum(b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes() for k in kids) == 2
    assert fleet.supervise(timeout_s=240) == 0
    local, remote = read_metrics(tmp_path / "local" / "metrics.jsonl"), read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in remote] == list(range(1, steps + 1))
    for a, b in zip(local, remote, strict=True):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-4)
        assert b["response_len_mean"] == pytest.approx(a["response_len_mean"], abs=1e-9)
