"""Prompt text and token ids: the one place a prompt becomes what the policy sees.

With a tokenizer that has a chat template (and `task.chat` on), a prompt is rendered as a
conversation: the task's system prompt (unless the row brings its own), then the row's messages or
one user turn holding its text, with the generation prompt appended. Without a template, or with
`chat: false`, the prompt is its raw text (after the system prompt and a newline, when one is set).
The rendered text is tokenized without adding special tokens: a template writes its own BOS, and
the tiny models' tokenizers have none. These ids are what the actor generates from and what the
controller journals with each rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.tasks.base import Prompt, PromptError, Task


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def uses_chat(task: Task, tokenizer: Any) -> bool:
    return bool(getattr(task, "chat", True)) and has_chat_template(tokenizer)


def raw_text(task: Task, prompt: Prompt) -> str:
    """A prompt as plain text (no chat template)."""
    if prompt.messages is not None:
        raise PromptError(f"{prompt.where()}: the prompt is a list of chat messages, which needs a tokenizer with a"
                          " chat template and task.chat on", prompt.index)
    system = getattr(task, "system_prompt", None)
    return f"{system}\n{prompt.text}" if system else prompt.text


def messages_of(task: Task, prompt: Prompt) -> list[dict[str, Any]]:
    msgs = [dict(m) for m in prompt.messages] if prompt.messages is not None else [
        {"role": "user", "content": prompt.text}]
    system = getattr(task, "system_prompt", None)
    if system and not any(m.get("role") == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": system})
    return msgs


def render_prompt(task: Task, tokenizer: Any, prompt: Prompt) -> str:
    """The prompt's text as the policy sees it; a template that fails is a `PromptError` naming the row."""
    if not uses_chat(task, tokenizer):
        return raw_text(task, prompt)
    try:
        text = tokenizer.apply_chat_template(messages_of(task, prompt), tokenize=False, add_generation_prompt=True)
    except Exception as err:  # Jinja errors, raise_exception() in the template, bad message shapes
        raise PromptError(f"{prompt.where()}: the chat template failed: {type(err).__name__}: {err}",
                          prompt.index) from None
    if not isinstance(text, str):
        raise PromptError(f"{prompt.where()}: the chat template returned {type(text).__name__}, expected text",
                          prompt.index)
    return text


def encode_prompt(task: Task, tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of one prompt (see the module docstring)."""
    ids = [int(i) for i in tokenizer(render_prompt(task, tokenizer, prompt), add_special_tokens=False)["input_ids"]]
    if not ids:
        raise PromptError(f"{prompt.where()}: the prompt encodes to no tokens", prompt.index)
    return ids


def encode_prompts(task: Task, tokenizer: Any, indices: Sequence[int], *, held_out: bool = False) -> list[list[int]]:
    """Token ids of training prompts `indices` (or held-out ones), in order."""
    get = task.eval_prompt if held_out else task.prompt
    return [encode_prompt(task, tokenizer, get(i)) for i in indices]
