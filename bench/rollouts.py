"""The random rollout the benchmarks (and the tests that measure the same code) feed a trainer or a
scorer: token ids in the rollout layout of given lengths, no model involved."""

from __future__ import annotations

from typing import Any

import torch

from services.rl.batch import Rollout


def random_rollout(
    plen: list[int], rlen: list[int], vocab: int, seed: int = 0, *, low: int = 3, group_size: int = 1,
    behaviour: bool = False, advantages: bool = False, **fields: Any,
) -> Rollout:
    """Row i has a prompt of `plen[i]` tokens, left-padded, and a response of `rlen[i]` tokens,
    right-padded; ids are drawn from [low, vocab), 0 on padding; rows form groups of `group_size`
    (task ids t0, t1, ...). `behaviour`: negative behaviour log-probs (else zeros); `advantages`:
    standard normal ones; both 0 on padding. One generator seeded `seed` draws prompts, responses,
    then those, so the tokens of a seed are the same whatever else is asked for. `fields` go to the
    Rollout as they are (version, versions, ...)."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = len(plen), max(plen), max(rlen)
    pm = torch.arange(p)[None, :] >= p - torch.tensor(plen)[:, None]
    rm = torch.arange(r)[None, :] < torch.tensor(rlen)[:, None]
    prompt_ids = torch.randint(low, vocab, (b, p), generator=g) * pm
    response_ids = torch.randint(low, vocab, (b, r), generator=g) * rm
    logprobs = -torch.rand(b, r, generator=g) * rm if behaviour else torch.zeros(b, r)
    return Rollout(
        task_ids=[f"t{i}" for i in range(b)], prompt_ids=prompt_ids, prompt_mask=pm, response_ids=response_ids,
        response_mask=rm, behaviour_logprobs=logprobs, group_ids=torch.arange(b) // group_size,
        advantages=torch.randn(b, r, generator=g) * rm if advantages else None, **fields,
    )
