"""Each service imports what it uses: a service that runs no model starts without torch or
transformers (seconds of imports on a small host, paid at every start and restart), and the text
it reads decodes as transformers would decode it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ["torch", "transformers"]
# server module -> the heavy packages importing it may load
EXPECTED = {
    "services.reward.server": [],  # a reward model imports them when one is configured, not before
    "services.reference.server": ["torch", "transformers"],
    "services.actor.server": ["torch", "transformers"],
    "services.critic.server": ["torch", "transformers"],
    "services.core.host.lifeline": [],  # the wrapper redis-server starts through
}


def _loaded(module: str) -> list[str]:
    code = f"import json, sys\nimport {module}\nprint(json.dumps([p for p in {HEAVY!r} if p in sys.modules]))"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return list(json.loads(p.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", list(EXPECTED))
def test_a_services_server_module_loads_only_the_heavy_packages_it_uses(module: str) -> None:
    assert _loaded(module) == EXPECTED[module]


@pytest.mark.xfail(reason="issue 33 item 1: the controller's tokenizer (transformers) and its advantages,"
                          " rollouts and wire (torch) are not torch-free yet", strict=True)
def test_the_controller_imports_neither_torch_nor_transformers() -> None:
    assert _loaded("services.controller.server") == []


def test_the_reward_services_decoder_reads_completions_as_transformers_does(tiny_model: Path) -> None:
    from services.models.io.loading import load_tokenizer
    from services.models.io.text_decoder import TextDecoder

    light, full = TextDecoder.load(tiny_model), load_tokenizer(tiny_model)
    assert light is not None
    vocab = len(full)
    rows = [list(range(vocab)), [full.eos_token_id, 5, full.pad_token_id, 7], [], [3] * 9,
            [(i * 7919) % vocab for i in range(64)]]
    assert light.batch_decode(rows, skip_special_tokens=True) == full.batch_decode(rows, skip_special_tokens=True)
