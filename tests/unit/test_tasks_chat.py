"""Prompts rendered through a real tokenizer's chat template (the tiny char-level tokenizer with a
Jinja template set on it), raw text with `chat: false`, and a failing template named by row."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from services.core.config.run import TaskSection
from services.models.roles.tokenizer import build_tokenizer_from_vocab
from services.tasks import PromptError, load_task
from services.tasks.base import Prompt
from services.tasks.chat import encode_prompt, encode_prompts, render_prompt

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
FAILING = "{% for m in messages %}{% if m['role'] == 'user' and 'boom' in m['content'] %}" \
          "{{ raise_exception('no boom allowed') }}{% endif %}{{ m['content'] }}{% endfor %}"


def _tokenizer(template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    tok = build_tokenizer_from_vocab([*string.printable.strip(), " ", "\n"], "char")
    if template is not None:
        tok.chat_template = template
    return tok


def test_a_prompt_is_rendered_through_the_chat_template_with_the_system_prompt_and_generation_prompt() -> None:
    task = load_task(TaskSection(name="arithmetic", system_prompt="Answer with digits."))
    tok = _tokenizer()
    p = task.prompt(0)
    text = render_prompt(task, tok, p)
    assert text == f"<s><|system|>Answer with digits.\n<|user|>{p.text}\n<|assistant|>"
    ids = encode_prompt(task, tok, p)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id  # the template's BOS, parsed as the special token, not as text
    assert tok.unk_token_id not in ids


def test_the_chat_template_survives_save_and_reload_and_renders_the_same_ids(tmp_path: Path) -> None:
    task = load_task(TaskSection(name="arithmetic"))
    tok = _tokenizer()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert encode_prompts(task, again, [0, 1, 2]) == encode_prompts(task, tok, [0, 1, 2])


def test_chat_false_and_a_tokenizer_without_a_template_train_on_the_raw_text() -> None:
    off = load_task(TaskSection(name="arithmetic", chat=False))
    p = off.prompt(3)
    assert render_prompt(off, _tokenizer(), p) == p.text
    on = load_task(TaskSection(name="arithmetic"))
    assert encode_prompt(on, _tokenizer(None), p) == _tokenizer(None)(p.text, add_special_tokens=False)["input_ids"]
    sys_raw = load_task(TaskSection(name="arithmetic", chat=False, system_prompt="Sum:"))
    assert render_prompt(sys_raw, _tokenizer(), p) == f"Sum:\n{p.text}"


def test_a_row_that_brings_its_own_system_message_keeps_it(tmp_path: Path) -> None:
    conv = [{"role": "system", "content": "mine"}, {"role": "user", "content": "1+1="}]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"messages": conv, "answer": "2"}) + "\n" for _ in range(3)))
    task = load_task(TaskSection(source="jsonl", path=str(path), prompt_field="messages", eval_size=1,
                                 system_prompt="theirs"))
    assert render_prompt(task, _tokenizer(), task.prompt(0)) == "<s><|system|>mine\n<|user|>1+1=\n<|assistant|>"


def test_chat_messages_without_a_template_are_an_error_naming_the_row(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "x"}], "answer": "2"}) + "\n"
                            for _ in range(3)))
    task = load_task(TaskSection(source="jsonl", path=str(path), prompt_field="messages", eval_size=1))
    with pytest.raises(PromptError, match=r"c\.jsonl \(split 'train'\) row \d: the prompt is a list of chat messages"):
        encode_prompt(task, _tokenizer(None), task.prompt(0))


def test_a_chat_template_that_fails_is_a_prompt_error_naming_the_row() -> None:
    task = load_task(TaskSection(name="arithmetic"))
    bad = Prompt(index=7, text="boom", answer="", origin="data.jsonl row 7")
    with pytest.raises(PromptError, match=r"data\.jsonl row 7: the chat template failed: .*no boom allowed") as err:
        encode_prompt(task, _tokenizer(FAILING), bad)
    assert err.value.reason == "bad_prompt" and err.value.index == 7
    assert encode_prompt(task, _tokenizer(FAILING), task.prompt(0))  # other rows still render
