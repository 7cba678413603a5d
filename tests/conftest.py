from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.core.config.run import load_config
from services.core.host.redis_proc import RedisProcess, start_redis
from services.core.host.zygote import Zygote
from services.core.serving.entry import quiet_torch
from services.fleet import Fleet
from services.models.roles.paths import resolve_model_path
from services.prefork import ENV as ZYGOTE_ENV
from services.prefork import start_zygote
from services.tasks import load_task
from tests.fleet_helpers import EXAMPLE

quiet_torch()

UNIT = Path(__file__).resolve().parent / "unit"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shares-host", choices=("only", "none"), default=None,
        help="only: just the tests that may share the host's cores (tests/unit and those marked"
             " shares_host), to run two at a time; none: just the others, which run one at a time")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mode = config.getoption("--shares-host")
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        if item.path.is_relative_to(UNIT):
            item.add_marker(pytest.mark.shares_host)
        shares = item.get_closest_marker("shares_host") is not None
        (keep if mode is None or shares == (mode == "only") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core box: one intra-op thread is ~10x faster than two contending.
    Modules of tiny-model tests opt in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A real redis-server on a free loopback port, AOF on, private to one test."""
    rp = start_redis(tmp_path / "redis")
    try:
        yield rp
    finally:
        rp.stop(kill=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default's tiny model, built (with its warm-up) once per test session."""
    cfg = load_config(EXAMPLE)
    out = tmp_path_factory.mktemp("model") / "policy"
    spec = cfg.models.policy.model_copy(update={"path": str(out)})
    return resolve_model_path(spec, "policy", load_task(cfg.task), out.parent, cfg.run.seed)


@pytest.fixture(scope="session")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded task's tiny model with random weights (no warm-up): EOS is rare, so every row
    runs to max_new_tokens and a change of weights shows in what it samples."""
    from services.core.config.run import TinyModelSpec
    from services.models.roles.tiny import build_tiny_model
    from services.tasks import make_task

    return build_tiny_model(make_task("arithmetic"), TinyModelSpec(warmup_steps=0),
                            tmp_path_factory.mktemp("random") / "m", seed=0)


@pytest.fixture(scope="session")
def shared_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote | None]:
    """One zygote for the session's fleets (`services.prefork`): each forks its actor, reference and
    critic from it rather than from a zygote of its own, whose imports (~6 s of CPU, on a 2-core host
    as long as the rest of the start together) would pace every fleet's start. `rlfleet up` in a
    subprocess, and Fleets made without this fixture, still start their own. None with RLFLEET_ZYGOTE=0."""
    if os.environ.get(ZYGOTE_ENV) == "0":
        yield None
        return
    zygote = start_zygote(tmp_path_factory.mktemp("zygote") / "zygote.log")
    try:
        yield zygote
    finally:
        zygote.stop()


@pytest.fixture
def fleet_factory(shared_zygote: Zygote | None) -> Iterator[Any]:
    """Fleets started by a test are always stopped, whatever the test did; they fork from the
    session's zygote."""
    started: list[Fleet] = []

    def make(cfg: Any, **kw: Any) -> Fleet:
        f = Fleet(cfg, zygote=shared_zygote, **kw)
        started.append(f)
        return f

    yield make
    for f in started:
        f.stop(grace_s=10)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, so that what writes there really runs out of disk (skipped without root and mount(8))."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8); cannot simulate a full filesystem")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"mounting a 2 MiB tmpfs is not permitted here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
