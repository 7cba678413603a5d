from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.core.config.run import TinyModelSpec
from services.models.io.loading import ModelLoadError
from services.models.nets.critic import HEAD_FILE, ValueModel
from services.models.roles.tiny import build_tiny_model
from services.tasks import make_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(warmup_steps=5)
    return build_tiny_model(make_task("arithmetic"), spec, tmp_path_factory.mktemp("m") / "p", seed=2)


def _rollout() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    prompt_ids = torch.tensor([[0, 0, 5, 14, 6, 16], [5, 5, 14, 6, 6, 16]])
    prompt_mask = prompt_ids != 0
    response_ids = torch.tensor([[5, 7, 2, 0], [9, 9, 9, 2]])
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    return prompt_ids, prompt_mask, response_ids, response_mask


def _randomize_head(vm: ValueModel) -> None:
    with torch.no_grad():
        vm.value_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
        vm.value_head.bias.fill_(0.25)


def test_from_policy_starts_every_value_at_zero(policy_path: Path) -> None:
    vm = ValueModel.from_policy(policy_path)
    v = vm.values(*_rollout())
    assert v.shape == (2, 4) and v.dtype == torch.float32
    assert torch.all(v == 0)
    assert not hasattr(vm.backbone, "lm_head")  # the base model, not the causal LM


def test_value_of_token_t_depends_only_on_the_prefix_before_it(policy_path: Path) -> None:
    """Convention: values[:, t] = V(state before response token t) = head(hidden at column P+t-1)."""
    vm = ValueModel.from_policy(policy_path)
    _randomize_head(vm)
    pi, pm, ri, rm = _rollout()
    base = vm.values(pi, pm, ri, rm)
    changed = ri.clone()
    changed[:, 2:] = 11  # rewrite response tokens 2.. : values at t <= 2 must not move
    after = vm.values(pi, pm, changed, rm)
    torch.testing.assert_close(after[:, :3], base[:, :3], atol=1e-6, rtol=0)
    assert not torch.allclose(after[1, 3], base[1, 3])
    # t = 0 is read at the last prompt column: the value of the prompt alone.
    hidden = vm.backbone(input_ids=torch.tensor([[5, 5, 14, 6, 6, 16]])).last_hidden_state[0, -1]
    torch.testing.assert_close(base[1, 0], vm.value_head(hidden).squeeze(), atol=1e-5, rtol=0)


def test_padding_values_are_zero(policy_path: Path) -> None:
    vm = ValueModel.from_policy(policy_path)
    _randomize_head(vm)
    pi, pm, ri, rm = _rollout()
    v = vm.values(pi, pm, ri, rm)
    assert v[0, 3] == 0 and torch.all(v[rm] != 0)


def test_save_load_round_trip_is_exact(policy_path: Path, tmp_path: Path) -> None:
    vm = ValueModel.from_policy(policy_path)
    _randomize_head(vm)
    with torch.no_grad():
        backbone: Any = vm.backbone
        backbone.norm.weight.mul_(1.5)  # a trained backbone differs from the policy
    vm.save(tmp_path / "critic")
    assert (tmp_path / "critic" / HEAD_FILE).is_file() and (tmp_path / "critic" / "model.safetensors").is_file()
    loaded = ValueModel.load(tmp_path / "critic")
    a, b = vm.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(vm.values(*_rollout()), loaded.values(*_rollout()))


def test_values_are_differentiable_through_head_and_backbone(policy_path: Path) -> None:
    vm = ValueModel.from_policy(policy_path)
    _randomize_head(vm)
    vm.values(*_rollout()).pow(2).sum().backward()
    assert vm.value_head.weight.grad is not None and vm.value_head.weight.grad.abs().sum() > 0
    assert vm.backbone.get_input_embeddings().weight.grad is not None


def test_loading_without_a_value_head_file_names_the_dir(policy_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=f"{policy_path} has no {HEAD_FILE}"):
        ValueModel.load(policy_path)
