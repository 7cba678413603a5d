"""Pre-flight: what `rlfleet up` and `rlfleet train --local` check before anything starts.

Each check costs milliseconds and imports neither torch nor transformers, so a run that cannot
work fails in a second or two with one line naming the problem and the fix, instead of a service
failing 15-70 s later. Checked: the run directory is writable and holds no run of the other kind,
the task (its parameters, its dataset, a `reward_fn` module) builds, each model directory is a
model with weights and the policy's tokenizer is present, matches the model's vocabulary and
encodes the task's prompts, and `redis-server` is on the PATH when the launcher must start one.
Ports are checked by `services.core.host.ports` when the launcher assigns them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.core.config.run import ModelSpec, RunConfig
from services.core.observability.trackers import check_trackers
from services.models.roles.paths import model_dir

__all__ = ["PreflightError", "RunState", "check_fleet", "check_local", "check_no_holders", "run_state"]

# Files any of which holds a model's weights; files any of which holds a tokenizer's vocabulary.
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_VOCABS = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


class PreflightError(RuntimeError):
    """A run that cannot start; the message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class RunState:
    """What a run directory already holds: nothing, a fleet run (journal) or a local run (metrics only)."""

    kind: Literal["new", "fleet", "local"]
    step: int = 0  # steps the journal (fleet) or metrics.jsonl (local) has committed


def check_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".rlfleet-write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise PreflightError(f"run directory {run_dir} is not writable ({err.strerror or err}):"
                             " fix its permissions or pick another with --run-dir") from None


def run_state(cfg: RunConfig) -> RunState:
    """Read-only look at what `cfg.run_dir` holds; the journal's step is the truth for a fleet run."""
    run_dir = cfg.run_dir
    journal = cfg.journal_dir
    if (journal / "data.mdb").exists():
        from services.core.journal.journal import Journal, JournalError

        try:
            j = Journal.open(journal, readonly=True, stages=cfg.stages(),
                             trainable=["actor", "critic"] if cfg.algo.needs_critic else ["actor"])
        except (JournalError, OSError):
            # A damaged journal is the controller's to diagnose (it names the file and the fix).
            return RunState("fleet", 0)
        try:
            return RunState("fleet", j.step)
        finally:
            j.close()
    if (run_dir / "fleet.yaml").exists() or journal.is_dir():
        return RunState("fleet", 0)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        steps = 0
        for line in metrics.read_text(errors="replace").splitlines():
            try:
                steps = max(steps, int(json.loads(line).get("step", 0)))
            except (ValueError, AttributeError, TypeError):
                continue
        return RunState("local", steps)
    return RunState("new")


def check_task(cfg: RunConfig) -> Any:
    """Build the task: validates its parameters, loads its dataset and imports a `reward_fn`."""
    from services.tasks import TaskError, load_task

    try:
        return load_task(cfg.task)
    except TaskError as err:
        raise PreflightError(f"{err} (fix the task section of the config)") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PreflightError(f"{path} cannot be read as JSON ({err}): the model directory is damaged") from None
    return data if isinstance(data, dict) else {}


def _model_dir(spec: ModelSpec, role: str, run_dir: Path) -> Path | None:
    """The model directory of `role` when it already exists (checked), None when it will be built."""
    path = model_dir(spec, role, run_dir)
    field = f"models.{role}.path"
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        if spec.gguf_file is not None:  # dequantized into `path` at start-up
            if not Path(spec.gguf_file).is_file():
                raise PreflightError(f"models.{role}.gguf_file: {spec.gguf_file} does not exist")
            return None
        if spec.build is not None:
            return None
        state = "is empty" if path.exists() else "does not exist"
        raise PreflightError(f"{field}: model directory {path} {state}: point {field} at a local transformers"
                             f" model directory, or set models.{role}.build to build a tiny model there")
    if not path.is_dir():
        raise PreflightError(f"{field}: {path} is not a directory: point it at a local transformers model directory")
    if not (path / "config.json").is_file():
        raise PreflightError(f"{field}: {path} has no config.json: it is not a transformers model directory")
    if not any((path / w).is_file() for w in _WEIGHTS) and not list(path.glob("*.safetensors")):
        raise PreflightError(f"{field}: {path} has no weights ({', '.join(_WEIGHTS[::2])}): copy the whole model")
    return path


def _check_tokenizer(path: Path, cfg: RunConfig, task: Any) -> None:
    """The policy's tokenizer sits next to it, fits its embedding and encodes the task's prompts."""
    field = "models.policy.path"
    if not any((path / v).is_file() for v in _VOCABS):
        raise PreflightError(f"{field}: {path} has no tokenizer files ({', '.join(_VOCABS[:3])}, ...): save the"
                             " model's tokenizer into the same directory (tokenizer.save_pretrained)")
    vocab_size = _read_json(path / "config.json").get("vocab_size")
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        return  # a sentencepiece/vocab-file tokenizer: transformers checks it when it loads
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as err:  # the Rust library raises its own exception type
        raise PreflightError(f"{field}: {tok_file} cannot be loaded ({err}): the tokenizer is damaged") from None
    ids = set(tok.get_vocab(with_added_tokens=True).values())
    if not ids:
        raise PreflightError(f"{field}: {tok_file} has an empty vocabulary: save the model's real tokenizer there")
    if isinstance(vocab_size, int) and max(ids) >= vocab_size:
        raise PreflightError(f"{field}: tokenizer in {path} has token id {max(ids)} but the model's vocab_size is"
                             f" {vocab_size}: the tokenizer belongs to another model")
    text = task.prompt(0).text
    if not tok.encode(text, add_special_tokens=False).ids:
        raise PreflightError(f"{field}: tokenizer in {path} encodes the first {task.name} prompt to no tokens:"
                             " the tokenizer does not fit this task")


def _weight_names(path: Path) -> list[str]:
    """The tensor names of a model directory's safetensors weights, from the headers alone."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(_read_json(index).get("weight_map", {}))
    names: list[str] = []
    for f in sorted(path.glob("*.safetensors")):
        try:
            with f.open("rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size)) if 0 < size < 100_000_000 else {}
        except (OSError, ValueError):
            continue  # loading reports a damaged file
        names += [k for k in header if k != "__metadata__"]
    return names


def _check_lora_targets(path: Path, cfg: RunConfig) -> None:
    """A LoRA target no weight of the model is under fails here, in a second; the service checks
    the rest (that it is a linear layer) when it loads the model."""
    lora = cfg.models.policy.lora
    if lora is None or lora.target_modules == "all-linear":
        return
    modules = {part for name in _weight_names(path) for part in name.split(".")[:-1]}
    if not modules:
        return
    for target in lora.target_modules:
        if target not in modules:
            raise PreflightError(f"models.policy.lora.target_modules: the model in {path} has no module named"
                                 f" {target!r}: name its linear layers (e.g. q_proj, v_proj) or use all-linear")


def check_models(cfg: RunConfig, task: Any) -> None:
    policy = _model_dir(cfg.models.policy, "policy", cfg.run_dir)
    if policy is not None:
        _check_tokenizer(policy, cfg, task)
        _check_lora_targets(policy, cfg)
    if cfg.algo.needs_critic and cfg.models.critic is not None:
        _model_dir(cfg.models.critic, "critic", cfg.run_dir)
    if cfg.models.reward is not None:
        _model_dir(cfg.models.reward, "reward", cfg.run_dir)


def check_redis(cfg: RunConfig) -> None:
    if cfg.redis.url is None and shutil.which("redis-server") is None:
        raise PreflightError("redis-server not found on PATH: install it (Debian: apt-get install redis-server;"
                             " `make setup` does this) or set redis.url to a running Redis")


def check_no_holders(run_dir: Path) -> None:
    """No process an earlier `rlfleet up` started on this directory still runs (one killed with
    SIGKILL leaves its services a few seconds to notice; a second fleet beside them would share
    their journal)."""
    from services.core.host.lifeline import holders

    left = holders(run_dir.resolve())
    if left:
        pids = " ".join(h.rsplit(" ", 1)[1] for h in left)
        raise PreflightError(f"{run_dir} is still held by processes of an earlier `rlfleet up`: {', '.join(left)};"
                             f" stop them (kill {pids}) or wait for them to exit, then start again")


def check_local(cfg: RunConfig) -> RunState:
    """Everything `rlfleet train --local` needs before it builds a model."""
    check_run_dir(cfg.run_dir)
    state = run_state(cfg)
    if state.kind == "fleet":
        raise PreflightError(f"{cfg.run_dir} holds a fleet run (`rlfleet up`); train --local would replace its"
                             " metrics.jsonl: pick another --run-dir")
    check_trackers(cfg.run.trackers)
    check_models(cfg, check_task(cfg))
    return state


def check_fleet(cfg: RunConfig) -> RunState:
    """Everything `rlfleet up` needs before it starts Redis or any service (ports come next)."""
    check_run_dir(cfg.run_dir)
    check_no_holders(cfg.run_dir)
    state = run_state(cfg)
    if state.kind == "local":
        raise PreflightError(f"{cfg.run_dir} holds a single-process run (`train --local`, {state.step} steps);"
                             " a fleet would mix its metrics into it: pick another --run-dir")
    check_trackers(cfg.run.trackers)
    check_models(cfg, check_task(cfg))
    check_redis(cfg)
    return state
