"""A fleet trained on the user's own data file with the user's own reward file: every service loads
the JSONL through `datasets`, the reward service imports the reward by path (nothing on
PYTHONPATH points at it), and a row whose reward is NaN ends dead with that reason while the run
goes on."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from services.audit import audit
from services.core.journal.journal import Journal
from services.report import read_metrics
from tests.fleet_helpers import tiny_config

pytestmark = pytest.mark.slow

REWARD = '''
import math

def reward(completions, answer, poison, **kw):
    return [math.nan if p else (1.0 if c.strip() == a else 0.0) for c, a, p in zip(completions, answer, poison)]
'''


@pytest.mark.timeout(900)
def test_a_fleet_trains_on_a_jsonl_file_with_a_reward_file_and_a_nan_row_ends_dead(
    tmp_path: Path, tiny_model: Path, fleet_factory
) -> None:
    # Prompts in the tiny arithmetic model's alphabet, so its warm-up policy already scores.
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "poison": a == 3 and b == 4}
            for a in range(8) for b in range(5)]
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "data" / "my_reward.py").write_text(textwrap.dedent(REWARD))
    cfg = tiny_config(
        tmp_path / "run", tiny_model, run={"max_steps": 2}, algo={"kl_coef": 0.0},
        models={"policy": {"path": str(tiny_model)}},
        task={"name": None, "params": {}, "source": "jsonl", "path": str(data), "eval_size": 8,
              "reward_path": str(tmp_path / "data" / "my_reward.py")})
    fleet = fleet_factory(cfg)
    fleet.start(ready_timeout_s=300)
    assert fleet.supervise(timeout_s=600) == 0
    metrics = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert any(m["reward_mean"] > 0 for m in metrics), "the user's reward saw the answers"
    with Journal.open(cfg.journal_dir, readonly=True) as j:
        dead = [t for t in j.iter_tasks() if t.state == "dead"]
    assert dead, "the poisoned row was admitted in the first epoch"
    assert all("non_finite_reward" in (t.reason or "") and "reward 'reward' returned a non-finite" in (t.reason or "")
               for t in dead)
    assert audit(cfg.run_dir, finished=True).ok
