"""What a message may hold in this run: the semantic half of validation.

`wire` checks that a message is well-formed (schema, dtypes, shapes that agree, finite numbers);
this module checks that a well-formed message makes sense for the run that receives it: versions
the controller could have committed, sampling parameters the trainer's log-probs assume, ids of
the run's grammar, token ids inside the vocabulary, lengths inside the model and the config.

Every failure is a `WireError` whose reason is a stable tag and whose message names the field, so
the consumer dead-letters the message (its tasks end dead and are replaced) and keeps serving.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.core.config.run import RunConfig
from services.core.ids import batch_id as make_batch_id
from services.core.ids import parse_task_id
from services.core.pb import rlfleet_pb2 as pb
from services.core.transport.codec import WireError

# Ids travel as uint64 in Prompt but as int64 tensors in a RolloutBatch.
_INT64_MAX = 2**63 - 1
FINISH_REASONS = frozenset({"stop", "length", "abort"})


@dataclass(frozen=True)
class Limits:
    vocab_size: int  # token ids must be in [0, vocab_size)
    max_version: int  # no policy version beyond the run's last step
    max_new_tokens: int  # R
    max_prompt_tokens: int  # P
    group_size: int
    prompts_per_message: int
    samples_per_step: int
    temperature: float
    # The names of the run's reward components when it has several (task.rewards); else empty.
    reward_names: frozenset[str] = frozenset()
    # Most prompts one Generate (held-out evaluation) call may carry: the run's task.eval_size.
    max_eval_prompts: int = 0

    @property
    def rows_per_message(self) -> int:
        return self.prompts_per_message * self.group_size

    @classmethod
    def for_run(cls, cfg: RunConfig, vocab_size: int | None = None) -> Limits:
        """The limits of `cfg`'s run; the vocabulary and context length come from the policy's
        config.json (the embedding's rows bound every token id any stage feeds a model)."""
        info = _model_config(Path(cfg.models.policy.path)) if cfg.models.policy.path else {}
        vocab = vocab_size or int(info.get("vocab_size") or 0)
        if vocab <= 0:
            raise ValueError(f"cannot tell the vocabulary size of the policy at {cfg.models.policy.path}")
        g = cfg.generation
        positions = int(info.get("max_position_embeddings") or 0)
        max_prompt = positions - g.max_new_tokens if positions > g.max_new_tokens else 1 << 20
        return cls(vocab_size=vocab, max_version=cfg.run.max_steps, max_new_tokens=g.max_new_tokens,
                   max_prompt_tokens=max_prompt, group_size=cfg.algo.group_size,
                   prompts_per_message=cfg.batch.prompts_per_message, samples_per_step=cfg.samples_per_step,
                   temperature=g.temperature, max_eval_prompts=cfg.task.eval_size)

    # -- scalars ------------------------------------------------------------------------------------
    def check_version(self, value: int, where: str, *, at_least: int = 0) -> None:
        if not at_least <= value <= self.max_version:
            raise WireError("bad_version", f"{where}: {value} is outside [{at_least}, {self.max_version}]"
                            " (no policy version beyond the run's last step)")

    def check_task_ids(self, task_ids: Sequence[str], owner: str) -> list[tuple[int, int]]:
        out = []
        for tid in task_ids:
            try:
                index, sample = parse_task_id(tid)
            except ValueError:
                raise WireError("bad_task_id", f"{owner}: task_id {tid[:40]!r} is not 't<index>-<sample>'") from None
            if index > _INT64_MAX or sample >= self.group_size:
                raise WireError("bad_task_id", f"{owner}: task_id {tid[:40]!r} is outside the run (sample index"
                                f" below group_size {self.group_size}, dataset index below 2**63)")
            out.append((index, sample))
        return out

    def check_reward_components(self, components: Mapping[str, Any], owner: str) -> None:
        """Components are the configured rewards, all of them or none."""
        if components and set(components) != self.reward_names:
            got = ", ".join(sorted(n[:64] for n in components)[:8])
            want = ", ".join(sorted(self.reward_names)) or "none (a single reward)"
            raise WireError("bad_reward_components", f"{owner}: reward_components {got} are not the run's"
                            f" rewards: {want}")

    def check_token_ids(self, t: Any, field: str, owner: str) -> None:
        """`t`: a torch tensor or a numpy array of token ids."""
        if math.prod(t.shape) and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            raise WireError("bad_token_ids", f"{owner}: {field} holds ids outside the vocabulary"
                            f" [0, {self.vocab_size})")

    # -- messages -----------------------------------------------------------------------------------
    def check_prompt_batch(self, msg: pb.PromptBatch) -> None:
        """A PromptBatch as the controller builds it: a batch id of the run's grammar, at most one
        message's rows of well-formed tasks, prompts inside the vocabulary and the context, the
        run's sampling parameters, a version and step inside the run. Waiting for the version is
        the actor's business."""
        owner = f"PromptBatch {msg.batch_id[:40]!r}"
        n = len(msg.prompts)
        if not 1 <= n <= self.rows_per_message:
            raise WireError("bad_prompts", f"{owner}: prompts has {n} entries, expected 1 to"
                            f" {self.rows_per_message} (prompts_per_message x group_size)")
        self.check_version(int(msg.version), f"{owner}: version")
        if not 0 <= msg.step <= self.max_version:
            raise WireError("bad_step", f"{owner}: step {msg.step} is outside [0, {self.max_version}]")
        parsed = self.check_task_ids([p.task_id for p in msg.prompts], owner)
        if len({p.task_id for p in msg.prompts}) != n:
            raise WireError("bad_task_id", f"{owner}: task_id repeats")
        first = min(i for i, _ in parsed)
        if msg.batch_id != make_batch_id(first) or any(i >= first + self.prompts_per_message for i, _ in parsed):
            raise WireError("bad_batch_id", f"{owner}: batch_id does not name the tasks it carries")
        for p, (index, sample) in zip(msg.prompts, parsed, strict=True):
            if (p.dataset_index, p.sample_index) != (index, sample) or p.group_id > _INT64_MAX:
                raise WireError("bad_task_id", f"{owner}: prompt {p.task_id!r}: dataset_index, sample_index"
                                " or group_id disagree with its task_id")
            if not 1 <= len(p.token_ids) <= self.max_prompt_tokens:
                raise WireError("prompt_too_long", f"{owner}: prompt {p.task_id!r}: token_ids has"
                                f" {len(p.token_ids)} tokens, expected 1 to {self.max_prompt_tokens}")
            if min(p.token_ids) < 0 or max(p.token_ids) >= self.vocab_size:
                raise WireError("bad_token_ids", f"{owner}: prompt {p.task_id!r}: token_ids outside the"
                                f" vocabulary [0, {self.vocab_size})")
        self.check_sampling(msg.sampling, owner)

    def check_generate_request(self, msg: pb.GenerateRequest) -> None:
        """A Generate (evaluation) call: at most the run's held-out prompts, each inside the
        vocabulary and the context, the run's sampling parameters, a version inside the run."""
        owner = "GenerateRequest"
        n = len(msg.prompts)
        if not 1 <= n <= self.max_eval_prompts:
            raise WireError("bad_prompts", f"{owner}: prompts has {n} entries, expected 1 to"
                            f" {self.max_eval_prompts} (task.eval_size)")
        self.check_version(int(msg.version), f"{owner}: version")
        for k, p in enumerate(msg.prompts):
            if not 1 <= len(p.token_ids) <= self.max_prompt_tokens:
                raise WireError("prompt_too_long", f"{owner}: prompt {k}: token_ids has {len(p.token_ids)}"
                                f" tokens, expected 1 to {self.max_prompt_tokens}")
            if min(p.token_ids) < 0 or max(p.token_ids) >= self.vocab_size:
                raise WireError("bad_token_ids", f"{owner}: prompt {k}: token_ids outside the vocabulary"
                                f" [0, {self.vocab_size})")
        self.check_sampling(msg.sampling, owner)

    def check_sampling(self, s: pb.SamplingParams, owner: str) -> None:
        """0 means "the run's default" (proto3 cannot tell unset from 0). The temperature must be
        the run's: the trainer recomputes log-probs at that temperature, so rollouts sampled at
        another one would carry behaviour log-probs of a different distribution."""
        t = float(s.temperature)
        if t != 0.0 and not (math.isfinite(t) and math.isclose(t, self.temperature, rel_tol=1e-6)):
            raise WireError("bad_sampling", f"{owner}: sampling.temperature {t} is not the run's"
                            f" generation.temperature {self.temperature}")
        if not (math.isfinite(s.top_p) and 0.0 <= s.top_p <= 1.0):
            raise WireError("bad_sampling", f"{owner}: sampling.top_p {s.top_p} is outside (0, 1]")
        if not 0 <= s.top_k <= self.vocab_size:
            raise WireError("bad_sampling", f"{owner}: sampling.top_k {s.top_k} is outside"
                            f" [0, {self.vocab_size}]")
        if not 0 <= s.max_new_tokens <= self.max_new_tokens:
            raise WireError("bad_sampling", f"{owner}: sampling.max_new_tokens {s.max_new_tokens} is outside"
                            f" [1, {self.max_new_tokens}] (generation.max_new_tokens)")
        if any(not 0 <= x < self.vocab_size for x in s.stop_token_ids):
            raise WireError("bad_sampling", f"{owner}: sampling.stop_token_ids outside the vocabulary"
                            f" [0, {self.vocab_size})")

    def check_rollout(self, msg: pb.RolloutBatch, prompt_ids: Any, response_ids: Any,
                      group_ids: Any, versions: Any | None, *, max_rows: int) -> None:
        """The id tensors as torch tensors or numpy arrays."""
        owner = f"RolloutBatch {msg.batch_id[:40]!r}"
        b, r = response_ids.shape
        if not 1 <= b <= max_rows:
            raise WireError("bad_rows", f"{owner}: task_ids has {b} rows, expected 1 to {max_rows}")
        if r > self.max_new_tokens:
            raise WireError("response_too_long", f"{owner}: response_ids has {r} columns, more than"
                            f" generation.max_new_tokens {self.max_new_tokens}")
        if prompt_ids.shape[1] > self.max_prompt_tokens:
            raise WireError("prompt_too_long", f"{owner}: prompt_ids has {prompt_ids.shape[1]} columns, more"
                            f" than the {self.max_prompt_tokens} the model's context leaves")
        self.check_task_ids(msg.task_ids, owner)
        self.check_token_ids(prompt_ids, "prompt_ids", owner)
        self.check_token_ids(response_ids, "response_ids", owner)
        if int(group_ids.min()) < 0:
            raise WireError("bad_group_ids", f"{owner}: group_ids holds a negative id")
        self.check_version(int(msg.version), f"{owner}: version")
        if versions is not None and (int(versions.min()) < 0 or int(versions.max()) > self.max_version):
            raise WireError("bad_version", f"{owner}: versions holds a version outside [0, {self.max_version}]")
        bad = [f for f in msg.finish_reasons if f not in FINISH_REASONS]
        if bad:
            raise WireError("bad_finish_reason", f"{owner}: finish_reasons holds {bad[0][:20]!r}; expected one"
                            f" of {', '.join(sorted(FINISH_REASONS))}")


def _model_config(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
