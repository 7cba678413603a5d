from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.core.entry import quiet_torch
from services.core.redis_proc import RedisProcess, start_redis

quiet_torch()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A real redis-server on a free loopback port, AOF on, private to one test."""
    rp = start_redis(tmp_path / "redis")
    try:
        yield rp
    finally:
        rp.stop(kill=True)
