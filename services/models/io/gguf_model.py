"""Models from GGUF files: dequantized once into a `save_pretrained` directory every service loads."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from services.models.io.atomic import MARKER, is_complete, read_model_info, staging_dir
from services.models.io.loading import ModelLoadError, check_vocab

log = logging.getLogger(__name__)

GGUF_KIND = "gguf"


def _gguf_source(gguf: Path) -> dict[str, Any]:
    gguf = Path(gguf)
    if not gguf.is_file():
        state = "is not a file" if gguf.exists() else "does not exist"
        raise ModelLoadError(f"GGUF file {gguf} {state}")
    # Path and size identify the file well enough to refuse a copy of another one; hashing a
    # multi-gigabyte file at every start-up would cost more than the check is worth.
    return {"kind": GGUF_KIND, "source": str(gguf.resolve()), "bytes": gguf.stat().st_size}


def load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer from one GGUF file, dequantized to float32 (trainable, saveable).

    Slow (about a minute for 135M parameters on two cores): see `materialize_gguf`."""
    from transformers import GgufConfig

    gguf = Path(gguf)
    _gguf_source(gguf)
    try:
        import gguf as _gguf_lib  # noqa: F401  (transformers needs it and says so only deep in a traceback)
    except ImportError:
        raise ModelLoadError(f"loading {gguf} needs the 'gguf' package: pip install gguf") from None
    folder = str(gguf.parent)
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf.name, local_files_only=True,
            quantization_config=GgufConfig(dequantize=True), dtype=torch.float32,
        )
    except Exception as err:
        raise ModelLoadError(f"cannot load a causal LM from the GGUF file {gguf}: {type(err).__name__}: {err}") from err
    not_float = sorted({str(p.dtype) for p in model.parameters() if not p.is_floating_point()})
    if not_float:
        raise ModelLoadError(f"{gguf} loaded with non-float parameters ({', '.join(not_float)}): not trainable")
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return model, tok


def materialize_gguf(gguf: Path, out_dir: Path, role: str = "policy") -> Path:
    """Dequantize `gguf` once into the `save_pretrained` directory `out_dir` (weights, config,
    tokenizer and chat template); returns `out_dir`. An existing copy of the same file is reused, so
    every service of a run loads the fast copy; a directory holding anything else is an error."""
    out_dir = Path(out_dir)
    want = _gguf_source(gguf)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        info = read_model_info(out_dir) if out_dir.is_dir() else None
        if info is None or info.get("kind") != GGUF_KIND:
            raise ModelLoadError(f"models.{role}: {out_dir} already holds something other than a copy of {gguf};"
                                 f" point models.{role}.path at an empty or new directory")
        if info.get("source") != want["source"] or info.get("bytes") != want["bytes"]:
            raise ModelLoadError(f"models.{role}: {out_dir} holds a copy of {info.get('source')}, not of {gguf};"
                                 f" delete it to convert again, or point models.{role}.path elsewhere")
        log.info("GGUF copy of %s already at %s", gguf, out_dir)
        return out_dir
    t0 = time.monotonic()
    log.info("dequantizing %s into %s (once per run directory)", gguf, out_dir)
    model, tok = load_gguf(gguf)
    check_vocab(tok, int(model.get_input_embeddings().weight.shape[0]), str(gguf))  # type: ignore[index]
    with staging_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        info = {**want, "role": role, "build_seconds": round(time.monotonic() - t0, 3)}
        (tmp / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True))
    if not is_complete(out_dir):
        raise ModelLoadError(f"models.{role}: {out_dir} was not written")
    log.info("dequantized %s into %s in %.1fs", gguf, out_dir, time.monotonic() - t0)
    return out_dir

