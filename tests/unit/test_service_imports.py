"""Each service imports what it uses: a service that runs no model starts without torch or
transformers (seconds of imports on a small host, paid at every start and restart), and the text
it reads decodes as transformers would decode it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ["torch", "transformers"]
# server module -> the heavy packages importing it may load
EXPECTED = {
    "services.reward.server": [],  # a reward model imports them when one is configured, not before
    "services.reference.server": ["torch", "transformers"],
    "services.actor.server": ["torch", "transformers"],
    "services.critic.server": ["torch", "transformers"],
    "services.core.host.lifeline": [],  # the wrapper redis-server starts through
}


def _loaded(module: str) -> list[str]:
    code = f"import json, sys\nimport {module}\nprint(json.dumps([p for p in {HEAVY!r} if p in sys.modules]))"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return list(json.loads(p.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", list(EXPECTED))
def test_a_services_server_module_loads_only_the_heavy_packages_it_uses(module: str) -> None:
    assert _loaded(module) == EXPECTED[module]


def test_the_controller_imports_neither_torch_nor_transformers() -> None:
    assert _loaded("services.controller.server") == []


@pytest.mark.parametrize("module", ["services.cli", "services.audit", "services.controller.recovery",
                                    "services.rl.pipeline", "services.rl.wire"])
def test_the_launcher_the_audit_and_the_controllers_data_path_import_neither(module: str) -> None:
    assert _loaded(module) == []


# The controller's work, step by step as a fleet drives it, on the tiny model: start (tokenizer, task,
# journal), admit a prompt message (chat template, encoding), join a rollout and each stage's scores
# from their wire bytes, take the step, concatenate, compute advantages, encode the TrainBatch, decode
# it again as a resumed step does, the step's statistics, the evaluation's prompts and decoding.
CONTROLLER_STEP = """
import asyncio, json, sys
from pathlib import Path
import numpy as np
from services.controller.server import Controller
from services.rl import wire
from services.core.pb import rlfleet_pb2 as pb
from services.rl import batch as rb
from services.rl.dynamic_sampling import judge_groups
from services.rl.pipeline import batch_stats, compute_advantages
from tests.fleet_helpers import tiny_config

run_dir, model, algo = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
cfg = tiny_config(run_dir, model, algo={"name": algo, "group_size": 2, "kl_coef": 0.05, "kl_in": "reward"},
                  batch={"prompts_per_step": 2, "prompts_per_message": 2}, run={"max_steps": 2})
cfg.run_dir.mkdir(parents=True, exist_ok=True)
ctl = Controller(cfg)
mb = 1 << 24
batch = asyncio.run(ctl.admission.admit_once())  # journals the message's tasks
ids = [list(p.token_ids) for p in batch.prompts]
p_w, r_w, b = max(map(len, ids)), 3, len(ids)
prompt = np.zeros((b, p_w), dtype=np.int64)
pmask = np.zeros((b, p_w), dtype=bool)
for i, row in enumerate(ids):
    prompt[i, p_w - len(row):], pmask[i, p_w - len(row):] = row, True
rng = np.random.default_rng(0)
lengths = np.array([[3], [2], [3], [1]])
arrays = rb.RolloutArrays(
    task_ids=[p.task_id for p in batch.prompts], prompt_ids=prompt, prompt_mask=pmask,
    response_ids=rng.integers(4, ctl.limits.vocab_size, (b, r_w)), response_mask=np.arange(r_w)[None, :] < lengths,
    behaviour_logprobs=-rng.random((b, r_w), dtype=np.float32), group_ids=np.array([p.group_id for p in batch.prompts]))
rid = batch.batch_id + ":x"
raw = wire.rollout_to_proto(arrays, rid).SerializeToString()
got = wire.validate_rollout_arrays(wire.parse_message(pb.RolloutBatch, raw, max_bytes=mb), mb, ctl.limits)
ctl.admission.check_rollout(rid, 0, got)
ctl.assembler.add_rollout(rid, got, order=0)
for stage in ctl.stages:
    values = rng.random(b, dtype=np.float32) if stage == "reward" else -rng.random((b, r_w), dtype=np.float32)
    data = wire.score_to_proto(rid, stage, got.task_ids, values).SerializeToString()
    s = wire.score_from_proto(wire.parse_message(pb.ScoreBatch, data, max_bytes=mb), max_bytes=mb, limits=ctl.limits)
    ctl.reward_parts.keep(s)
    ctl.assembler.add_score(rid, stage, s.tensor, s.unscored)
judge_groups(ctl.assembler.scores_of(batch.batch_id)["reward"], got.group_ids, 1e-6)
ctl.assembler.mark_ready(batch.batch_id)
parts = ctl.assembler.take_step()
r = rb.concat([p for _, p in parts], pad_id=ctl.tokenizer.pad_token_id)
g = cfg.generation
stats = compute_advantages(r, cfg.algo, g.max_new_tokens, g.behaviour_logprobs)
data = wire.train_batch_to_proto(r, step=0, batch_id="s0", target_version=1).SerializeToString()
back = wire.train_arrays_from_proto(wire.parse_message(pb.TrainBatch, data, max_bytes=mb), mb).rollout
assert batch_stats(back, cfg.algo, g.max_new_tokens, g.behaviour_logprobs) == stats, stats
assert np.array_equal(back.advantages, r.advantages) and ("kl" in stats)
prompts, held_out = ctl.evaluation._held_out()
assert ctl.tokenizer.batch_decode(held_out, skip_special_tokens=True)
ctl.events.close(); ctl.journal.close()
print(json.dumps([p for p in ("torch", "transformers") if p in sys.modules]))
"""


@pytest.mark.parametrize("algo", ["grpo", "ppo", "reinforce_pp"])
def test_the_controllers_step_runs_without_torch_or_transformers(tmp_path: Path, tiny_model: Path,
                                                                   algo: str) -> None:
    p = subprocess.run([sys.executable, "-c", CONTROLLER_STEP, str(tmp_path / "run"), str(tiny_model), algo],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []


def test_the_reward_services_decoder_reads_completions_as_transformers_does(tiny_model: Path) -> None:
    from services.models.io.loading import load_tokenizer
    from services.models.io.text_decoder import TextDecoder

    light, full = TextDecoder.load(tiny_model), load_tokenizer(tiny_model)
    assert light is not None
    vocab = len(full)
    rows = [list(range(vocab)), [full.eos_token_id, 5, full.pad_token_id, 7], [], [3] * 9,
            [(i * 7919) % vocab for i in range(64)]]
    assert light.batch_decode(rows, skip_special_tokens=True) == full.batch_decode(rows, skip_special_tokens=True)
