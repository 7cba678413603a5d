"""Small rollouts that make torch.compile build a step's graphs before the first real step needs them.

Dynamo compiles a graph for the first shapes it sees and, at the second distinct shapes, one graph with
those sizes symbolic that later shapes reuse. Two padded rollouts whose sizes (rows, prompt, response
and their sum) are all distinct and differ between the two leave the dynamic graph built, and a
one-row rollout the graph Dynamo keeps for size 1. Rows without any padding take graphs of their own
(transformers then gives the decoder layers no attention mask: causal attention needs none), one for
several rows and one for a single row. A real batch of any other size, padded or not, then runs
compiled code with no compile in its step (the trainer's `compiles` figure says so per step).
"""

from __future__ import annotations

import torch

from services.rl.batch import Rollout

# (rows, prompt tokens, response tokens, padded): within each of the first two no size equal to another
# (Dynamo would tie their symbols); the third has the one row a remainder micro-batch may have, a size
# Dynamo specialises on, hence a graph of its own. The fourth is padded with every size a multiple of 8,
# as real batches' often are (64-token prompts, 256-token responses): on the GPU a step's first padded
# batch of such sizes compiled one more graph on 2026-12-03 (not reproducible on the CPU), and where
# the dynamic graph already covers it this shape costs one small forward and backward. The last two
# have no padding: equal prompts whose responses all reach max_new_tokens (a synthetic benchmark, or a
# task's first steps).
SHAPES = ((2, 5, 9, True), (3, 11, 17, True), (1, 7, 13, True), (4, 8, 24, True), (2, 6, 10, False),
          (1, 4, 8, False))


def warm_up_rollouts(vocab: int) -> list[Rollout]:
    """Seeded rollouts of `SHAPES` over token ids below `vocab`; a padded one has one left-padded prompt
    and ragged responses (masks as real batches have them), its longest row full width so none is
    trimmed."""
    g = torch.Generator().manual_seed(0)
    out = []
    for b, p, r, padded in SHAPES:
        prompt_mask = torch.ones(b, p, dtype=torch.bool)
        response_mask = torch.ones(b, r, dtype=torch.bool)
        if padded:
            prompt_mask[-1, : p // 2] = False
            response_mask[1:, r - 2 :] = False
        out.append(Rollout(
            task_ids=[f"warm-up-{i}" for i in range(b)], prompt_ids=torch.randint(1, vocab, (b, p), generator=g),
            prompt_mask=prompt_mask, response_ids=torch.randint(1, vocab, (b, r), generator=g),
            response_mask=response_mask, behaviour_logprobs=torch.zeros(b, r),
            group_ids=torch.zeros(b, dtype=torch.long), advantages=torch.randn(b, r, generator=g),
            ref_logprobs=torch.zeros(b, r), versions=torch.zeros(b, dtype=torch.long),
        ))
    return out
