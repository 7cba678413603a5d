"""Small rollouts that make torch.compile build a step's graphs before the first real step needs them.

Dynamo compiles a graph for the first shapes it sees and, at the second distinct shapes, one graph with
those sizes symbolic that later shapes reuse. Two padded rollouts whose sizes (rows, prompt, response
and their sum) are all distinct and differ between the two leave the dynamic graph built, and a
one-row rollout the graph Dynamo keeps for size 1. Rows without any padding take graphs of their own
(transformers then gives the decoder layers no attention mask: causal attention needs none), one for
several rows and one for a single row. A real batch of any other size, padded or not, then runs
compiled code with no compile in its step (the trainer's `compiles` figure says so per step).

Inductor also decides some fusions by size: on the GPU it fuses a backward pass's row and column
reductions (RMSNorm's) only when rows x tokens x hidden >= 5 MiB elements, and that decision is a guard
of the graph. Small rollouts alone leave the graphs for the small side, so a step's first batch past the
threshold compiled again (1.5B on the H200, 2026-12-03 16:33: 9 s in step 1, 13 s in step 2, cold).
`full_size` rollouts, as many rows as a step's largest micro-batch with a full-length response, build
the other side, padded and not.
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


# Prompt tokens of the full-size rollouts: few (a real prompt is rarely shorter), and the width a
# multiple of 8 as `SHAPES`' aligned row is (Inductor guards on it too).
FULL_PROMPT = 8


def full_prompt(response_tokens: int) -> int:
    """Prompt tokens of a full-size rollout: `FULL_PROMPT`, or up to 7 more to align the width."""
    return FULL_PROMPT + (-response_tokens) % 8


def full_size(rows: int, response_tokens: int) -> tuple[tuple[int, int, int, bool], ...]:
    """Shapes of `rows` rows with `response_tokens`-token responses, padded and unpadded: no larger
    than a real micro-batch of that many rows whose prompts have `full_prompt` tokens or more."""
    if rows < 1 or response_tokens < 1:
        return ()
    prompt = full_prompt(response_tokens)
    return (rows, prompt, response_tokens, True), (rows, prompt, response_tokens, False)


def warm_up_rollouts(vocab: int, full: tuple[int, int] | None = None) -> list[Rollout]:
    """Seeded rollouts of `SHAPES`, and with `full` (rows, response tokens) of `full_size`'s, over token
    ids below `vocab`; a padded one has one left-padded prompt and ragged responses (masks as real
    batches have them), its longest row full width so none is trimmed."""
    g = torch.Generator().manual_seed(0)
    out = []
    for b, p, r, padded in SHAPES + (full_size(*full) if full else ()):
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
