"""Read a run back from each experiment tracker with that library's own reader, for the tests:
TensorBoard's event accumulator, W&B's `wandb leet inspect --json` (it reads offline `.wandb`
transaction logs), MLflow's client. Each returns {step: {key: value}} and the logged config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from services.core.observability.trackers import read_state, row_metrics
from services.report import read_metrics

Rows = dict[int, dict[str, float]]


def expected_rows(run_dir: Path) -> Rows:
    """What every tracker must hold: each metrics.jsonl row's numbers, by step."""
    return {int(r["step"]): row_metrics(r) for r in read_metrics(run_dir / "metrics.jsonl")}


def tensorboard_rows(log_dir: Path) -> tuple[Rows, dict[str, Any]]:
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.plugins.hparams import metadata as hp
    from tensorboard.util import tensor_util

    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    rows: Rows = {}
    for tag in acc.Tags()["tensors"]:
        for e in acc.Tensors(tag):
            rows.setdefault(e.step, {})[tag] = float(tensor_util.make_ndarray(e.tensor_proto).item())
    content = acc.PluginTagToContent(hp.PLUGIN_NAME)[hp.SESSION_START_INFO_TAG]
    start = hp.parse_session_start_info_plugin_data(content)
    params = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    return rows, params


def wandb_rows(wandb_parent: Path) -> tuple[Rows, dict[str, Any], list[str]]:
    """Every offline run folder under WANDB_PARENT/wandb (a resumed run has one per process),
    merged by step; also the config and the run ids."""
    rows: Rows = {}
    config: dict[str, Any] = {}
    ids = []
    for log in sorted((wandb_parent / "wandb").glob("offline-run-*/run-*.wandb")):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                             capture_output=True, text=True, timeout=120, check=True,
                             env=dict(os.environ, WANDB_SILENT="true"))
        for line in out.stdout.splitlines():
            rec = json.loads(line)
            if rec["type"] == "run":
                ids.append(rec["run"]["run_id"])
                config.update(rec["run"].get("config", {}).get("update", {}))
            elif rec["type"] == "history":
                item = rec["history"]["item"]
                rows[int(rec["history"]["step"]["num"])] = {
                    k: float(v) for k, v in item.items() if not k.startswith("_")}
    return rows, config, ids


def mlflow_rows(run_dir: Path, uri: str, keys: set[str]) -> tuple[Rows, dict[str, str], str]:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    run_id = read_state(run_dir)["mlflow_run_id"]
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    rows: Rows = {}
    for key in set(run.data.metrics) | keys:
        for m in client.get_metric_history(run_id, key):
            rows.setdefault(m.step, {})[key] = m.value
    return rows, dict(run.data.params), run.info.status
