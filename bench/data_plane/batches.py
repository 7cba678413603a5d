"""The synthetic RolloutBatch every path moves: a realistic padded rollout, what the actor does to
publish it and a scoring stage to read it back, and the raw stream entry of the same bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bench.data_plane.config import TENSORS
from services.core.ids import task_id
from services.core.pb import rlfleet_pb2 as pb
from services.rl import wire
from services.rl.batch import Rollout


@dataclass
class Batch:
    """One generated batch as the actor holds it before publishing."""

    rollout: Rollout
    finish_reasons: list[str]
    sampling: pb.SamplingParams


def make_batch(
    seqs: int, prompt_len: int, response_len: int, group_size: int, *, seed: int = 0, vocab: int = 151_936,
    pad_id: int = 0, eos_id: int = 1,
) -> Batch:
    """A realistic padded rollout: groups of `group_size` samples share a left-padded prompt of
    3/4..1 x `prompt_len` tokens; responses are right-padded, a quarter of them hit the length limit
    and the rest stop earlier; behaviour log-probs are negative on generated tokens, 0 on padding."""
    if min(seqs, prompt_len, response_len, group_size) < 1:
        raise ValueError("seqs, prompt_len, response_len and group_size must all be >= 1")
    g = torch.Generator().manual_seed(seed)
    n_groups = -(-seqs // group_size)
    group_of = torch.arange(seqs, dtype=torch.long) // group_size
    p_len = torch.randint(max(1, (3 * prompt_len) // 4), prompt_len + 1, (n_groups,), generator=g)[group_of]
    prompt_mask = torch.arange(prompt_len)[None, :] >= (prompt_len - p_len)[:, None]
    prompts = torch.randint(2, vocab, (n_groups, prompt_len), generator=g)[group_of]
    prompt_ids = prompts.masked_fill(~prompt_mask, pad_id)

    r_len = torch.randint(1, response_len + 1, (seqs,), generator=g)
    r_len = torch.where(torch.rand(seqs, generator=g) < 0.25, torch.tensor(response_len), r_len)
    response_mask = torch.arange(response_len)[None, :] < r_len[:, None]
    response_ids = torch.randint(2, vocab, (seqs, response_len), generator=g)
    stopped = r_len < response_len
    response_ids[stopped, r_len[stopped] - 1] = eos_id
    response_ids = response_ids.masked_fill(~response_mask, pad_id)
    logprobs = (-torch.empty(seqs, response_len).exponential_(generator=g)).masked_fill(~response_mask, 0.0)

    rollout = Rollout(
        task_ids=[task_id(int(gi), i % group_size) for i, gi in enumerate(group_of.tolist())],
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=logprobs,
        group_ids=group_of.clone(),
        version=3,
    )
    finish = ["stop" if bool(s) else "length" for s in stopped]
    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=response_len,
                                 stop_token_ids=[eos_id], seed=seed)
    return Batch(rollout=rollout, finish_reasons=finish, sampling=sampling)


def encode_rollout(batch: Batch, batch_id: str) -> bytes:
    """What the actor does before `Bus.publish`."""
    msg = wire.rollout_to_proto(batch.rollout, batch_id, sampling=batch.sampling,
                                finish_reasons=batch.finish_reasons, generate_seconds=1.0)
    return msg.SerializeToString()


def decode_rollout(data: bytes, max_bytes: int) -> Rollout:
    """What a scoring stage (or the controller) does with a delivered entry."""
    msg = wire.parse_message(pb.RolloutBatch, data, max_bytes=max_bytes)
    return wire.validate_rollout_batch(msg, max_bytes)


def same_rollout(a: Rollout, b: Rollout) -> bool:
    return (
        a.task_ids == b.task_ids
        and a.version == b.version
        and all(torch.equal(getattr(a, n), getattr(b, n)) for n in TENSORS)
    )


def raw_fields(batch_id: str, data: bytes) -> dict[bytes, bytes]:
    """The stream entry the Bus writes (its headers, then the payload), for the raw peer."""
    return {b"kind": b"rollout", b"batch_id": batch_id.encode(), b"data": data}


def stream_entries(resp: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Entries of a single-stream XREADGROUP reply (RESP2: [[stream, [(id, fields), ...]]])."""
    return [(rid, fields) for _stream, entries in resp or [] for rid, fields in entries]
