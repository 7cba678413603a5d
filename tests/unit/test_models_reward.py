from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.core.config.run import ModelSpec, TinyModelSpec
from services.models.io.loading import ModelLoadError
from services.models.roles.paths import resolve_model_path
from services.models.roles.reward_model import RewardModel, build_tiny_reward_model, load_reward_model
from services.tasks import make_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> RewardModel:
    run_dir = tmp_path_factory.mktemp("run")
    # Through the real path: resolve (builds a sequence classifier for role "reward"), then load.
    path = resolve_model_path(ModelSpec(build=TinyModelSpec()), "reward", make_task("sentiment"), run_dir, 3)
    assert path == run_dir / "models" / "reward"
    return load_reward_model(path)


def test_reward_model_loads_with_one_label_and_scores_texts(reward_model: RewardModel) -> None:
    scores = reward_model.score_texts(["the movie was great", "the food is awful", "my day"])
    assert scores.shape == (3,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    assert reward_model.model.config.num_labels == 1


def test_scores_do_not_depend_on_batch_padding(reward_model: RewardModel) -> None:
    seqs = [[4, 5, 6], [7, 8, 9, 10, 11, 12], [13]]
    batch = reward_model.score_ids(seqs)
    alone = torch.cat([reward_model.score_ids([s]) for s in seqs])
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=0)


def test_rollout_layout_scores_equal_the_unpadded_sequences(reward_model: RewardModel) -> None:
    prompt_ids = torch.tensor([[0, 4, 5], [6, 7, 8]])
    prompt_mask = prompt_ids != 0
    response_ids = torch.tensor([[9, 2, 0], [10, 11, 2]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    got = reward_model.score_rollout(prompt_ids, prompt_mask, response_ids, response_mask)
    want = reward_model.score_ids([[4, 5, 9, 2], [6, 7, 8, 10, 11, 2]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    both = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)
    torch.testing.assert_close(reward_model.score_ids(*both), want, atol=1e-5, rtol=0)


def test_micro_batching_gives_the_same_scores(reward_model: RewardModel) -> None:
    seqs = [[4, 5, 6], [7, 8], [9, 10, 11, 12], [13]]
    small = RewardModel(reward_model.model, reward_model.tokenizer, micro_batch=3)
    torch.testing.assert_close(small.score_ids(seqs), reward_model.score_ids(seqs), atol=1e-5, rtol=0)


def test_empty_sequence_is_rejected(reward_model: RewardModel) -> None:
    with pytest.raises(ValueError, match="empty sequence"):
        reward_model.score_ids([[4], []])


def test_tiny_builder_is_seeded(tmp_path: Path) -> None:
    task = make_task("arithmetic")
    a = load_reward_model(build_tiny_reward_model(task, tmp_path / "a", seed=1))
    b = load_reward_model(build_tiny_reward_model(task, tmp_path / "b", seed=1))
    assert torch.equal(a.score_texts(["1+2=3"]), b.score_texts(["1+2=3"]))


def test_missing_reward_model_dir_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=str(tmp_path / "rm")):
        load_reward_model(tmp_path / "rm")
