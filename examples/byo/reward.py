"""Rewards for examples/byo/config.yaml. Each gets a whole batch of completions at once, and every
column of the data row (mapped by name) as a keyword list of the same length."""

from __future__ import annotations


def correct(completions: list[str], answer: list[str], **fields: list[object]) -> list[float]:
    """1 for the exact answer, else 0."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def brevity(completions: list[str], level: list[str], **fields: list[object]) -> list[float]:
    """Prefer answers no longer than they need to be: one digit, or two after a carry."""
    return [1.0 if len(c.strip()) <= (2 if lv == "carry" else 1) else 0.0
            for c, lv in zip(completions, level, strict=True)]
