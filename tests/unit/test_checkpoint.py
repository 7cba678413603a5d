"""Crash-safe checkpoints: exact round trips (tied causal LM, value model, AdamW), crashes at every
durability step and under kill -9, fallback past a damaged checkpoint, monotonic versions, pruning."""

from __future__ import annotations

import inspect
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

import services.models.checkpoints.checkpoint as ckpt
from services.models.checkpoints.checkpoint import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    latest_meta,
    load_latest,
    prune,
    save_checkpoint,
    verify_checkpoint,
)
from services.models.nets.critic import ValueModel

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- helpers -----------------------------------------------------------------------------------


def tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)


def lm_step(model: Qwen2ForCausalLM, opt: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, 32, (3, 7), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            assert_same_state(a[k], b[k])
        else:
            assert a[k] == b[k], k


def mlp(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model whose AdamW already has state (one step taken)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def fill(model: nn.Module, opt: torch.optim.Optimizer, v: int) -> None:
    """Every tensor of checkpoint `v` holds the value `v`, so a checkpoint mixing two saves is caught
    by one comparison. The kill -9 child below runs this very function (its source is sent along)."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(v))
    for st in opt.state.values():
        for t in st.values():
            t.fill_(float(v))


def holds(model: nn.Module, opt: torch.optim.Optimizer, v: int) -> bool:
    tensors = [*model.parameters(), *(t for st in opt.state.values() for t in st.values())]
    return all(bool((t == float(v)).all()) for t in tensors)


def save_filled(root: Path, v: int, model: nn.Module, opt: torch.optim.Optimizer) -> Path:
    fill(model, opt, v)
    return save_checkpoint(root, "actor", v, 10 * v, model, opt)


def dot_entries(root: Path, service: str = "actor") -> list[str]:
    return sorted(p.name for p in (root / service).iterdir() if p.name.startswith(".") and p.name != ".lock")


# -- round trips -------------------------------------------------------------------------------


def test_tied_causal_lm_and_adamw_resume_bit_identically(tmp_path: Path) -> None:
    model = tiny_qwen2(seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    lm_step(model, opt, seed=1)
    lm_step(model, opt, seed=2)
    path = save_checkpoint(tmp_path, "actor", version=2, step=5, model=model, optimizer=opt)

    assert path == tmp_path / "actor" / "v00000002"
    assert (tmp_path / "actor" / "latest").read_text().strip() == "v00000002"
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json", "model.safetensors", "optimizer.json", "optimizer.safetensors"
    ]
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["service"], meta["version"], meta["step"]) == ("actor", 2, 5)
    assert set(meta["files"]) == {"model.safetensors", "optimizer.json", "optimizer.safetensors"}
    opt_doc = json.loads((path / "optimizer.json").read_text())
    assert opt_doc["state"]["0"]["step"] == {"$scalar": 2.0, "dtype": "float32"}  # step counts in JSON
    assert opt_doc["param_groups"][0]["lr"] == 3e-3

    # Uninterrupted training takes one more step ...
    lm_step(model, opt, seed=3)
    # ... and a restarted service (other init, other lr until the checkpoint says otherwise) too.
    resumed = tiny_qwen2(seed=123)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.5)
    got = load_latest(tmp_path, "actor", resumed, resumed_opt)
    assert got is not None and (got.version, got.step, got.path) == (2, 5, path)
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight  # still tied, in place
    lm_step(resumed, resumed_opt, seed=3)

    assert_same_state(model.state_dict(), resumed.state_dict())
    assert_same_state(opt.state_dict(), resumed_opt.state_dict())


def test_value_model_round_trip(tmp_path: Path) -> None:
    policy_dir = tmp_path / "policy"
    tiny_qwen2(seed=0).save_pretrained(policy_dir)
    vm = ValueModel.from_policy(policy_dir)
    with torch.no_grad():
        vm.value_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(vm.parameters(), lr=1e-3)
    ids = torch.randint(1, 32, (2, 4), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    vm.values(ids, mask, ids, mask).pow(2).mean().backward()
    opt.step()
    save_checkpoint(tmp_path / "ckpt", "critic", 1, 1, vm, opt)

    restored = ValueModel.from_policy(policy_dir)  # fresh zero head, untrained backbone
    restored_opt = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    meta = load_latest(tmp_path / "ckpt", "critic", restored, restored_opt)
    assert meta is not None and meta.service == "critic" and meta.version == 1
    assert_same_state(vm.state_dict(), restored.state_dict())
    assert_same_state(opt.state_dict(), restored_opt.state_dict())
    assert torch.equal(vm.values(ids, mask, ids, mask), restored.values(ids, mask, ids, mask))


def test_no_checkpoint_returns_none(tmp_path: Path) -> None:
    model, opt = mlp()
    assert load_latest(tmp_path, "actor", model, opt) is None
    assert latest_meta(tmp_path, "actor") is None
    assert prune(tmp_path, "actor") == []


def test_checkpoint_that_does_not_fit_the_modules_raises_mismatch_without_fallback(tmp_path: Path) -> None:
    model, opt = mlp()
    save_filled(tmp_path, 1, model, opt)
    save_checkpoint(tmp_path, "actor", 2, 20, model, optimizer=None)
    with pytest.raises(CheckpointMismatch, match="holds no optimizer state"):
        load_latest(tmp_path, "actor", model, opt)  # not silently v1: that would skip a version
    other = nn.Sequential(nn.Linear(8, 4))
    with pytest.raises(CheckpointMismatch, match=r"model\.safetensors does not fit Sequential"):
        load_latest(tmp_path, "actor", other)
    assert load_latest(tmp_path, "actor", model) is not None  # weights only is fine


# -- crashes -----------------------------------------------------------------------------------


class Crash(BaseException):
    """A simulated kill: BaseException, so no `except Exception` in the code under test eats it."""


def test_crash_at_every_durability_step_leaves_old_or_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crash v2's save right before each fsync/rename it performs. Cleanup handlers are disabled
    (rmtree is a no-op), so the leftovers are those of a real crash. `latest` must name v1 until the
    pointer's rename and v2 after it, and either must load completely."""
    ops: list[str] = []
    crash_at: list[int] = [-1]
    real = {name: getattr(os, name) for name in ("fsync", "rename", "replace")}

    def wrap(name: str) -> Callable[..., Any]:
        def op(*args: Any, **kwargs: Any) -> Any:
            if len(ops) == crash_at[0]:
                raise Crash(f"crash before {name} #{len(ops)}")
            ops.append(name)
            return real[name](*args, **kwargs)

        return op

    model, opt = mlp()
    save_filled(tmp_path / "count", 1, model, opt)
    with monkeypatch.context() as m:
        for name in real:
            m.setattr(os, name, wrap(name))
        save_filled(tmp_path / "count", 2, model, opt)
    total, pointer_op = len(ops), ops.index("replace")
    assert total >= 8 and ops.count("rename") == 1

    for k in range(total):
        root = tmp_path / f"crash{k}"
        save_filled(root, 1, model, opt)
        ops.clear()
        crash_at[0] = k
        with monkeypatch.context() as m:
            for name in real:
                m.setattr(os, name, wrap(name))
            m.setattr(shutil, "rmtree", lambda *a, **kw: None)
            with pytest.raises(Crash):
                save_filled(root, 2, model, opt)
        crash_at[0] = -1

        fresh, fresh_opt = mlp(seed=9)
        meta = load_latest(root, "actor", fresh, fresh_opt)
        want = 2 if k > pointer_op else 1
        assert meta is not None and meta.version == want, f"crash before op {k} ({ops})"
        assert meta.step == 10 * want and holds(fresh, fresh_opt, want)
        # The service restarts and saves v2 again over whatever the crash left; leftovers go.
        save_filled(root, 2, model, opt)
        assert dot_entries(root) == []
        meta = load_latest(root, "actor", fresh, fresh_opt)
        assert meta is not None and meta.version == 2 and holds(fresh, fresh_opt, 2)


# A zygote: imports torch once, then per line on stdin forks a child that saves versions in a loop
# until it is killed. It spares every round the seconds of importing torch; forking is safe because
# the zygote runs torch on one thread only, so no thread pool exists to be torn by fork.
SAVE_ZYGOTE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    from torch import nn
    from services.models.checkpoints.checkpoint import latest_meta, prune, save_checkpoint
    """
) + inspect.getsource(fill) + textwrap.dedent(
    """
    def save_loop(root):
        print("pid", os.getpid(), flush=True)
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(192, 192) for _ in range(6)])  # ~0.9 MB, ~2.7 MB with AdamW
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 192)).sum().backward()
        opt.step()
        meta = latest_meta(root, "actor")
        v = 0 if meta is None else meta.version + 1
        while True:
            fill(model, opt, v)
            save_checkpoint(root, "actor", v, 10 * v, model, opt)
            print(v, flush=True)  # acknowledged
            prune(root, "actor", keep=2)
            v += 1

    torch.set_num_threads(1)
    # Warm up here, once: the first AdamW pulls in lazy imports worth a second and a half of CPU.
    warm = nn.Linear(2, 2)
    warm(torch.ones(1, 2)).sum().backward()
    torch.optim.AdamW(warm.parameters()).step()
    for _ in sys.stdin:
        pid = os.fork()
        if pid == 0:
            save_loop(Path(sys.argv[1]))
        os.waitpid(pid, 0)
        print("reaped", flush=True)
    """
)


def test_kill_9_mid_save_always_leaves_a_complete_latest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root, rng = tmp_path / "ckpt", random.Random(0)
    model = nn.Sequential(*[nn.Linear(192, 192) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 192)).sum().backward()
    opt.step()
    zygote = subprocess.Popen(
        [sys.executable, "-c", SAVE_ZYGOTE, str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    acked = -1
    try:
        for _round in range(6):
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            tag, pid = zygote.stdout.readline().split()
            assert tag == "pid"
            for _ in range(1 + rng.randrange(3)):
                acked = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.0, 0.03))  # the next save is under way: kill somewhere inside it
            os.kill(int(pid), signal.SIGKILL)
            while (line := zygote.stdout.readline().strip()) != "reaped":
                assert line, f"zygote died (rc={zygote.poll()})"
                acked = int(line)  # acknowledged before the kill landed

            with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
                meta = load_latest(root, "actor", model, opt)
            assert meta is not None and meta.version >= acked, "an acknowledged checkpoint was lost"
            assert meta.step == 10 * meta.version and holds(model, opt, meta.version), "half a checkpoint"
            assert not caplog.records, "the latest checkpoint needed a fallback after a plain crash"
    finally:
        zygote.stdin.close()
        if zygote.wait(timeout=10) != 0:
            zygote.kill()
        zygote.stdout.close()
    prune(root, "actor", keep=2)
    assert dot_entries(root) == [] and len(list((root / "actor").glob("v*"))) == 2


# -- damage and fallback -----------------------------------------------------------------------


def test_damaged_latest_falls_back_to_the_previous_checkpoint_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = mlp()
    for v in (1, 2, 3):
        save_filled(tmp_path, v, model, opt)
    v3, v2 = tmp_path / "actor" / "v00000003", tmp_path / "actor" / "v00000002"
    data = bytearray((v3 / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of a weight: same size, only the hash can tell
    (v3 / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=f"{v3 / 'model.safetensors'} has sha256"):
        verify_checkpoint(v3)

    fresh, fresh_opt = mlp(seed=5)
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        meta = load_latest(tmp_path, "actor", fresh, fresh_opt)
    assert meta is not None and meta.version == 2 and holds(fresh, fresh_opt, 2)
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "v00000003/model.safetensors" in warnings and "falling back" in warnings

    (v2 / "optimizer.json").unlink()  # a missing file is named too
    with pytest.raises(CheckpointCorrupt, match=f"{v2 / 'optimizer.json'} is missing"):
        verify_checkpoint(v2)
    meta = load_latest(tmp_path, "actor", fresh, fresh_opt)
    assert meta is not None and meta.version == 1 and holds(fresh, fresh_opt, 1)

    (tmp_path / "actor" / "v00000001" / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="no intact checkpoint of actor") as err:
        load_latest(tmp_path, "actor", fresh, fresh_opt)
    assert "v00000001/meta.json cannot be read" in str(err.value)

    # Saving the damaged latest version again rewrites it instead of trusting it.
    save_filled(tmp_path, 3, model, opt)
    meta = load_latest(tmp_path, "actor", fresh, fresh_opt)
    assert meta is not None and meta.version == 3 and holds(fresh, fresh_opt, 3)


def test_versions_are_monotonic(tmp_path: Path) -> None:
    model, opt = mlp()
    first = save_filled(tmp_path, 5, model, opt)
    with pytest.raises(CheckpointError, match=r"refusing to save actor version 4.*version 5 is already"):
        save_filled(tmp_path, 4, model, opt)
    # The same version again (drain right after a periodic checkpoint) is a no-op ...
    created = json.loads((first / "meta.json").read_text())["created_at"]
    assert save_checkpoint(tmp_path, "actor", 5, 50, model, opt) == first
    assert json.loads((first / "meta.json").read_text())["created_at"] == created
    # ... but not when it claims another step.
    with pytest.raises(CheckpointError, match="already checkpointed at step 50"):
        save_checkpoint(tmp_path, "actor", 5, 51, model, opt)
    save_checkpoint(tmp_path, "actor", 6, 60, model, optimizer=None)
    with pytest.raises(CheckpointError, match="already checkpointed without optimizer state"):
        save_checkpoint(tmp_path, "actor", 6, 60, model, opt)
    meta = latest_meta(tmp_path, "actor")
    assert meta is not None and (meta.version, meta.step, meta.has_optimizer) == (6, 60, False)


def test_prune_keeps_the_latest_and_its_newest_fallbacks(tmp_path: Path) -> None:
    model, opt = mlp()
    for v in range(1, 6):
        save_filled(tmp_path, v, model, opt)
    sdir = tmp_path / "actor"
    # Leftovers of crashed saves: an unacknowledged newer version and a half-written temp dir.
    shutil.copytree(sdir / "v00000005", sdir / "v00000009")
    (sdir / ".v00000006.tmp-abc").mkdir()

    removed = prune(tmp_path, "actor", keep=2)
    assert sorted(p.name for p in removed) == ["v00000001", "v00000002", "v00000003", "v00000009"]
    assert sorted(p.name for p in sdir.glob("v*")) == ["v00000004", "v00000005"]
    assert dot_entries(tmp_path) == []
    prune(tmp_path, "actor", keep=1)
    assert sorted(p.name for p in sdir.glob("v*")) == ["v00000005"]  # never the latest
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune(tmp_path, "actor", keep=0)
    meta = load_latest(tmp_path, "actor", model, opt)
    assert meta is not None and meta.version == 5
