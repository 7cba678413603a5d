"""The three experiment-tracker backends behind `services.core.observability.trackers`: TensorBoard event files,
a Weights & Biases run and an MLflow run. Each imports its library only when a run starts it, so a
run without trackers never pays for (or needs) the import.

Resume, where the library allows it (`first_step` > 1 means the run already logged the steps
before it):
* TensorBoard: the same log directory, and a writer opened with `purge_step=first_step`, so
  TensorBoard drops whatever an earlier process logged at or after that step.
* W&B: the run id is the rlfleet run's id and `resume="allow"`: online, the server continues the
  run; offline, each process writes its own `offline-run-*` folder under that id, and
  `wandb sync` of the folders uploads them into the one run.
* MLflow: the MLflow run id is kept in RUN_DIR/trackers.json under the rlfleet run id; a resumed
  run reopens that MLflow run (status RUNNING again). MLflow parameters cannot change once
  logged, so a parameter whose value changed on resume (`--max-steps` extending the run) keeps
  its first value.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.core.config.trackers import MlflowSpec, TensorBoardSpec, WandbSpec

# Lengths a flattened hyper-parameter may reach before it is cut (MLflow refuses longer values).
MAX_PARAM_CHARS = 6000
_MLFLOW_BATCH = 100  # parameters per log_batch call (MLflow's limit)


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, spec: TensorBoardSpec, run_dir: Path) -> None:
        self.dir = Path(spec.dir) if spec.dir else run_dir / "tensorboard"
        self.writer: Any = None

    def start(self, run_name: str, config: dict[str, Any], run_id: str, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(self.dir), purge_step=first_step)
        # The HPARAMS tab's record, in this run's own event file (add_hparams would open a second run).
        for summary in hparams(dict(flat_params(config)), {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            # float64 tensors: the values read back are the metrics.jsonl floats, not float32 copies.
            self.writer.add_scalar(key, value, step, new_style=True, double_precision=True)
        self.writer.flush()  # a row a crash would lose is a row the file does not have

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, spec: WandbSpec, run_dir: Path) -> None:
        self.spec = spec
        self.dir = Path(spec.dir) if spec.dir else run_dir
        self.run: Any = None

    def start(self, run_name: str, config: dict[str, Any], run_id: str, first_step: int) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            silent=True, console="off", x_disable_stats=True, x_disable_machine_info=True, disable_git=True,
            save_code=False, x_save_requirements=False, disable_job_creation=True,
            # wandb-core writes the run's file every 15 s by default: a killed controller would lose
            # that much of the run from it (metrics.jsonl keeps everything); 1 s bounds the loss.
            x_transaction_log_flush_interval=1.0)
        self.run = wandb.init(
            project=self.spec.project, entity=self.spec.entity, mode=self.spec.mode, dir=str(self.dir),
            name=run_name, id=run_id, resume="allow", config=config, settings=settings, reinit="create_new")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # commit now: W&B otherwise holds a step's row until the next step arrives.
        self.run.log(metrics, step=step, commit=True)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, spec: MlflowSpec, run_dir: Path, saved_run_id: str | None) -> None:
        self.spec = spec
        self.uri = spec.tracking_uri or f"file:{(run_dir / 'mlruns').resolve()}"
        self.saved_run_id = saved_run_id  # the MLflow run this rlfleet run logged to before a restart
        self.client: Any = None
        self.run_id: str | None = None

    def start(self, run_name: str, config: dict[str, Any], run_id: str, first_step: int) -> None:
        if self.uri.startswith("file:"):
            # MLflow 3 asks for this opt-in before it uses a file store; the config asked for one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if self.saved_run_id is not None:
            self.run_id = self.saved_run_id
            self.client.update_run(self.run_id, status="RUNNING")
            logged = set(self.client.get_run(self.run_id).data.params)
        else:
            exp = self.client.get_experiment_by_name(self.spec.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.spec.experiment)
            run = self.client.create_run(exp_id, run_name=run_name, tags={"rlfleet.run_id": run_id})
            self.run_id, logged = run.info.run_id, set()
        params = [Param(k, str(v)) for k, v in flat_params(config) if k not in logged]
        for i in range(0, len(params), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _MLFLOW_BATCH])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in metrics.items()])

    def finish(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)


def flat_params(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The config as `section.key` hyper-parameters with scalar values (lists and None as text)."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from flat_params(value, prefix=f"{name}.")
        elif isinstance(value, bool | int | float) or (isinstance(value, str) and len(value) <= MAX_PARAM_CHARS):
            yield name, value
        else:
            yield name, str(value)[:MAX_PARAM_CHARS]
