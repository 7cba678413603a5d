"""The named fault points tests pause a controller at: off unless armed, several armed at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.core.faults import ENV, armed, fault_dir, fault_point


def test_an_unarmed_point_returns_at_once_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    asyncio.run(asyncio.wait_for(fault_point(tmp_path, "trained", 3), timeout=1))
    monkeypatch.setenv(ENV, "trained@4, step_journaled@3")
    asyncio.run(asyncio.wait_for(fault_point(tmp_path, "trained", 3), timeout=1))
    assert not fault_dir(tmp_path).exists()


def test_each_comma_separated_point_pauses_until_released_and_only_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "step_journaled@3, trained@5,")
    assert armed() == {"step_journaled@3", "trained@5"}

    async def hit(point: str, step: int) -> None:
        task = asyncio.create_task(fault_point(tmp_path, point, step))
        reached = fault_dir(tmp_path) / f"{point}@{step}.reached"
        for _ in range(100):
            if reached.exists():
                break
            await asyncio.sleep(0.01)
        assert reached.exists() and not task.done(), "an armed point pauses"
        (fault_dir(tmp_path) / f"{point}@{step}.release").write_text("go")
        await asyncio.wait_for(task, timeout=2)
        await asyncio.wait_for(fault_point(tmp_path, point, step), timeout=1)  # passed once reached

    asyncio.run(hit("step_journaled", 3))
    asyncio.run(hit("trained", 5))
