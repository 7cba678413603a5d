"""bench/padding.py still runs end to end at tiny sizes (no timing assertions): the three modes train
the same minibatch, and the waste it reports is what the trainer's plans compute."""

from __future__ import annotations

import json
from pathlib import Path

from bench import padding

TINY = ["--lengths", "lognormal", "--minibatch", "12", "--micro", "4", "--hidden", "16", "--layers", "1",
        "--heads", "2", "--vocab", "64", "--repeats", "1", "--max-new-tokens", "48", "--completion-median", "12",
        "--prompt-median", "10", "--max-prompt-tokens", "32"]


def test_padding_benchmark_writes_waste_and_times_for_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "padding.json"
    assert padding.main([*TINY, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    real = res["real_tokens"]
    assert real == sum(res["lengths"]["prompt"]) + sum(res["lengths"]["completion"])
    modes = res["modes"]
    assert set(modes) == set(padding.MODES)
    fixed = modes["fixed"]
    assert fixed["computed"] == 12 * res["rollout_width"] and fixed["forwards"] == 3
    for m in modes.values():
        assert m["computed"] >= real and len(m["seconds"]) == 1 and m["time"]["median"] > 0
        assert m["padding_waste"] == 1 - real / m["computed"]
    # mixed lengths: each step removes padding (packing never computes more than one row per sequence)
    assert fixed["computed"] > modes["budget"]["computed"] >= modes["packed"]["computed"]
