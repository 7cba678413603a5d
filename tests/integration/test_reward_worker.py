"""The reward's child process (services.reward.worker), for real: a reward that hangs costs its
timeout, its process is killed and a fresh one scores the next batch; a reward that kills its own
process is a named failure too; and a child outlives no parent, even one SIGKILLed mid-hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.core.config.run import TaskSection
from services.core.host.ports import pid_alive
from services.reward.worker import RewardStopped, RewardWorker
from services.tasks import load_task
from tests.fleet_helpers import gone

ROOT = Path(__file__).resolve().parents[2]
HANGS = TaskSection(name="arithmetic", reward_fn="tests.faults.chaos_rewards:hangs_on_index_5")


def test_a_hanging_reward_times_out_with_its_reason_and_a_fresh_process_scores_the_next_batch() -> None:
    task = load_task(HANGS)
    worker = RewardWorker(HANGS, timeout_s=1.0)
    try:
        good = [task.prompt(i) for i in (0, 1, 2)]
        assert worker.score(good, [p.answer for p in good]).total == [1.0, 1.0, 1.0]
        assert worker._proc is not None
        first = worker._proc.pid
        t0 = time.monotonic()
        with pytest.raises(RewardStopped) as err:
            worker.score([task.prompt(i) for i in (4, 5)], ["x", "y"])
        assert 1.0 <= time.monotonic() - t0 < 5.0
        assert err.value.reason == "reward_timeout" and "task.reward_timeout_s (1s)" in str(err.value)
        assert not pid_alive(first), "the hung process was killed"
        assert worker.score(good, [p.answer for p in good]).total == [1.0, 1.0, 1.0]
        assert worker.restarts == 1 and worker._proc is not None and worker._proc.pid != first
    finally:
        worker.close()


def test_a_reward_that_kills_its_process_is_reward_crashed(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text("import os\n\ndef die(prompt, completion):\n    os._exit(3)\n")
    section = TaskSection(name="arithmetic", reward_fn=f"{tmp_path / 'r.py'}:die")
    worker = RewardWorker(section, timeout_s=30.0)
    try:
        task = load_task(section)
        with pytest.raises(RewardStopped) as err:
            worker.score([task.prompt(0)], ["1"])
        assert err.value.reason == "reward_crashed"
    finally:
        worker.close()


def test_the_reward_process_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    code = ("import sys, time\n"
            "from services.core.config.run import TaskSection\n"
            "from services.reward.worker import RewardWorker\n"
            "from services.tasks import load_task\n"
            f"s = TaskSection(name='arithmetic', reward_fn={HANGS.reward_fn!r})\n"
            "w = RewardWorker(s, timeout_s=600)\n"
            "w.start(); w._wait_ready(); print(w._proc.pid, flush=True)\n"
            "w.score([load_task(s).prompt(5)], ['x'])\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the child is now inside the hanging reward
        assert pid_alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert gone(child, within_s=5), "the reward process outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
