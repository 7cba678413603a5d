from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from transformers import AutoTokenizer

from services.core.config.run import TinyModelSpec
from services.models.io.loading import ModelLoadError, load_tokenizer
from services.models.roles.tiny import build_tiny_model
from services.models.roles.tokenizer import (
    build_tokenizer,
    build_tokenizer_from_vocab,
    decode_completion,
    encode_completion,
    encode_prompt,
)
from services.tasks import make_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_char_tokenizer_round_trips_through_save_and_auto_tokenizer(tmp_path: Path) -> None:
    task = make_task("arithmetic", {"ops": "+-"})
    tok = build_tokenizer(task)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in ("12+7=", "3-19=", "-4", "0"):
        ids = loaded(text)["input_ids"]
        assert ids == tok(text)["input_ids"] and len(ids) == len(text)
        assert loaded.decode(ids) == text
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == ("<pad>", "<s>", "</s>")
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.padding_side == "left"
    assert len(loaded) == len(tok)


def test_word_tokenizer_round_trips_and_decodes_with_spaces(tmp_path: Path) -> None:
    task = make_task("sentiment")
    build_tokenizer(task).save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    text = "the movie was great and wonderful"
    ids = encode_prompt(tok, text)
    assert len(ids) == 6 and tok.unk_token_id not in ids
    assert decode_completion(tok, ids) == text


def test_encoding_adds_no_special_tokens_either_way() -> None:
    tok = build_tokenizer(make_task("arithmetic"))
    assert tok("1+2=", add_special_tokens=True)["input_ids"] == tok("1+2=", add_special_tokens=False)["input_ids"]


def test_completion_encoding_appends_eos_and_decoding_drops_it() -> None:
    tok = build_tokenizer(make_task("arithmetic"))
    ids = encode_completion(tok, "19")
    assert ids[-1] == tok.eos_token_id and len(ids) == 3
    assert decode_completion(tok, [*ids, tok.pad_token_id]) == "19"


def test_unknown_characters_map_to_unk_and_vanish_on_decode() -> None:
    tok = build_tokenizer(make_task("arithmetic"))
    ids = encode_prompt(tok, "1x2")
    assert ids[1] == tok.unk_token_id
    assert decode_completion(tok, ids) == "12"


def test_left_padding_puts_real_tokens_flush_right() -> None:
    tok = build_tokenizer(make_task("arithmetic"))
    batch = tok(["1+1=", "12+13="], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]


def test_bad_vocabulary_entries_are_rejected() -> None:
    with pytest.raises(ValueError, match="single characters"):
        build_tokenizer_from_vocab(["ab"], "char")
    with pytest.raises(ValueError, match="space-free"):
        build_tokenizer_from_vocab(["a b"], "word")


def test_loading_a_tokenizer_from_a_missing_dir_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=str(tmp_path / "nope")):
        load_tokenizer(tmp_path / "nope")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tokenizer_saved_next_to_a_model_loads_faithfully(tmp_path: Path, arch: Literal["qwen2", "llama"]) -> None:
    """AutoTokenizer on a qwen2 model dir swaps in Qwen2's byte-level BPE; load_tokenizer must not."""
    task = make_task("sentiment")
    spec = TinyModelSpec(arch=arch, hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=16,
                         warmup_steps=0)
    path = build_tiny_model(task, spec, tmp_path / arch, seed=0)
    want = build_tokenizer(task)("the movie was great")["input_ids"]
    assert load_tokenizer(path)("the movie was great")["input_ids"] == want
    if arch == "llama":
        auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        assert auto("the movie was great")["input_ids"] == want
