from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.core.config import RunConfig, load_config, parse_config
from services.fleet import Fleet
from services.models.loading import resolve_model_path
from services.tasks import load_task

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default's tiny model, built (with its warm-up) once per test session."""
    cfg = load_config(EXAMPLE)
    out = tmp_path_factory.mktemp("model") / "policy"
    spec = cfg.models.policy.model_copy(update={"path": str(out)})
    return resolve_model_path(spec, "policy", load_task(cfg.task), out.parent, cfg.run.seed)


def tiny_config(run_dir: Path, model: Path, **sections: dict[str, Any]) -> RunConfig:
    """The embedded default with free ports, a private run dir and the session's model."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["run"]["dir"] = str(run_dir)
    data["models"]["policy"]["path"] = str(model)
    data["services"] = {n: {"grpc_port": 0, "http_port": 0}
                        for n in ("controller", "actor", "critic", "reward", "reference")}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return parse_config(data, source="test config")


@pytest.fixture
def fleet_factory() -> Iterator[Any]:
    started: list[Fleet] = []

    def make(cfg: RunConfig, **kw: Any) -> Fleet:
        f = Fleet(cfg, **kw)
        started.append(f)
        return f

    yield make
    for f in started:
        f.stop(grace_s=10)
