"""Rollout / score / train messages: round trips through bytes, and one test per bad message."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from services.core.pb import rlfleet_pb2 as pb
from services.rl.batch import Rollout
from services.rl.wire import (
    SCHEMA_VERSION,
    WireError,
    check_schema_version,
    message,
    parse_message,
    rollout_to_proto,
    score_from_proto,
    score_to_proto,
    train_arrays_from_proto,
    train_batch_from_proto,
    train_batch_to_proto,
    validate_rollout_batch,
)

MB = 1 << 20
B, P, R = 4, 3, 5


def make_rollout(versions: bool = False) -> Rollout:
    g = torch.Generator().manual_seed(0)
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]],
                                 dtype=torch.bool)
    logprobs = torch.where(response_mask, -torch.rand(B, R, generator=g), torch.zeros(()))
    logprobs[2, 3] = float("nan")  # padding may hold anything: only masked positions are checked
    return Rollout(
        task_ids=[f"t{i}" for i in range(B)],
        prompt_ids=torch.randint(0, 100, (B, P), generator=g),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]], dtype=torch.bool),
        response_ids=torch.randint(0, 100, (B, R), generator=g),
        response_mask=response_mask,
        behaviour_logprobs=logprobs,
        group_ids=torch.tensor([7, 7, 9, 9]),
        version=3,
        versions=torch.tensor([3, 3, 4, 4]) if versions else None,
    )


def assert_same_rollout(a: Rollout, b: Rollout) -> None:
    assert a.task_ids == b.task_ids and a.version == b.version
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "versions",
                 "ref_logprobs", "values", "rewards", "advantages", "returns"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert torch.equal(a.behaviour_logprobs.view(torch.int32), b.behaviour_logprobs.view(torch.int32))


@pytest.mark.parametrize("versions", [False, True])
def test_rollout_round_trip_through_bytes(versions: bool) -> None:
    r = make_rollout(versions)
    sampling = pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=R, stop_token_ids=[2],
                                 seed=11)
    data = rollout_to_proto(r, "b-1", sampling=sampling, finish_reasons=["length", "stop", "stop", "stop"],
                            generate_seconds=1.5).SerializeToString()
    msg = parse_message(pb.RolloutBatch, data, max_bytes=MB)
    assert msg.schema_version == SCHEMA_VERSION and msg.batch_id == "b-1"
    assert msg.sampling.top_k == 5 and msg.finish_reasons[0] == "length" and msg.generate_seconds == 1.5
    assert_same_rollout(validate_rollout_batch(msg, MB), r)


def test_empty_rollout_round_trips() -> None:
    ids, mask = torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.bool)
    r = Rollout(task_ids=[], prompt_ids=ids, prompt_mask=mask, response_ids=ids, response_mask=mask,
                behaviour_logprobs=torch.zeros(0, 0), group_ids=torch.zeros(0, dtype=torch.long))
    msg = parse_message(pb.RolloutBatch, rollout_to_proto(r, "empty").SerializeToString(), max_bytes=MB)
    assert_same_rollout(validate_rollout_batch(msg, MB), r)


@pytest.mark.parametrize(("stage", "shape"), [("reward", (B,)), ("reference", (B, R)), ("critic", (B, R))])
def test_score_round_trip(stage: str, shape: tuple[int, ...]) -> None:
    t = torch.randn(shape)
    data = score_to_proto("b-1", stage, [f"t{i}" for i in range(B)], t, version=2, score_seconds=0.25)
    msg = parse_message(pb.ScoreBatch, data.SerializeToString(), max_bytes=MB)
    s = score_from_proto(msg, max_bytes=MB, expected_stage=stage, expected_rows=B, expected_cols=R)
    assert (s.stage, s.batch_id, s.version, s.score_seconds) == (stage, "b-1", 2, 0.25)
    # numpy, bit for bit: the controller joins scores without importing torch
    assert s.task_ids == [f"t{i}" for i in range(B)] and isinstance(s.tensor, np.ndarray)
    assert s.tensor.dtype == np.float32 and np.array_equal(s.tensor, t.numpy())


def test_train_batch_round_trip() -> None:
    r = make_rollout(versions=True)
    r.advantages, r.returns, r.values = torch.randn(B, R), torch.randn(B, R), torch.randn(B, R)
    r.rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    data = train_batch_to_proto(r, step=4, batch_id="train-4", target_version=5).SerializeToString()
    msg = parse_message(pb.TrainBatch, data, max_bytes=MB)
    req = train_batch_from_proto(msg, MB, require=("advantages",))
    assert (req.step, req.batch_id, req.target_version) == (4, "train-4", 5)
    assert_same_rollout(req.rollout, r)


def test_train_batch_round_trip_in_numpy_is_the_same_batch() -> None:
    """The controller encodes a TrainBatch from numpy and decodes a journaled one into numpy; the
    trainer decodes the same bytes into the same values as tensors."""
    r = make_rollout(versions=True)
    r.advantages, r.values, r.ref_logprobs = torch.randn(B, R), torch.randn(B, R), torch.randn(B, R)
    r.rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    a = r.arrays()
    assert all(isinstance(getattr(a, f), np.ndarray) for f in ("prompt_ids", "advantages", "rewards", "versions"))
    data = train_batch_to_proto(a, step=4, batch_id="train-4", target_version=5).SerializeToString()
    assert data == train_batch_to_proto(r, step=4, batch_id="train-4", target_version=5).SerializeToString()
    msg = parse_message(pb.TrainBatch, data, max_bytes=MB)
    back = train_arrays_from_proto(msg, MB, require=("advantages",))
    assert (back.step, back.target_version) == (4, 5) and back.rollout.returns is None
    assert_same_rollout(back.rollout.to_rollout(), r)
    assert_same_rollout(train_batch_from_proto(msg, MB).rollout, r)


def test_train_batch_missing_required_field_rejected() -> None:
    msg = train_batch_to_proto(make_rollout(), step=0, batch_id="x", target_version=1)
    with pytest.raises(WireError) as exc:
        train_batch_from_proto(msg, MB, require=("returns",))
    assert exc.value.reason == "missing_field" and "'returns'" in str(exc.value)


# -- malformed messages --------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"\x12\x05ab", b"\xff" * 11, b"\x0b"])
def test_malformed_protobuf_rejected(data: bytes) -> None:
    with pytest.raises(WireError) as exc:
        parse_message(pb.RolloutBatch, data, max_bytes=MB)
    assert exc.value.reason == "malformed"
    assert "RolloutBatch: not a valid protobuf message" in str(exc.value)


def test_oversized_message_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    data = rollout_to_proto(make_rollout(), "big").SerializeToString()

    def no_parse(*a: object) -> None:
        raise AssertionError("parsed before checking the size")

    monkeypatch.setattr(pb.RolloutBatch, "ParseFromString", no_parse)
    with pytest.raises(WireError) as exc:
        parse_message(pb.RolloutBatch, data, max_bytes=64)
    assert exc.value.reason == "oversized_message"
    assert f"RolloutBatch: {len(data)} bytes exceeds the limit of 64" in str(exc.value)


@pytest.mark.parametrize("version", [0, 2, 999])
def test_unknown_schema_version_rejected(version: int) -> None:
    msg = rollout_to_proto(make_rollout(), "b-1")
    msg.schema_version = version
    with pytest.raises(WireError) as exc:
        parse_message(pb.RolloutBatch, msg.SerializeToString(), max_bytes=MB)
    assert exc.value.reason == "schema_version"
    assert f"RolloutBatch: schema_version {version}, this build speaks {SCHEMA_VERSION}" == str(exc.value)
    with pytest.raises(WireError):
        check_schema_version(pb.GetStateRequest())  # a gRPC request that forgot to stamp it
    check_schema_version(message(pb.GetStateRequest))


@pytest.mark.parametrize(("bad", "shown"), [(float("nan"), "nan"), (float("inf"), "inf"),
                                            (float("-inf"), "-inf")])
def test_nan_reward_rejected(bad: float, shown: str) -> None:
    rewards = torch.tensor([1.0, 0.0, bad, 1.0])
    msg = score_to_proto("b-1", "reward", [f"t{i}" for i in range(B)], rewards)
    with pytest.raises(WireError) as exc:
        score_from_proto(msg, max_bytes=MB, expected_stage="reward", expected_rows=B, expected_cols=None)
    assert exc.value.reason == "non_finite"
    assert str(exc.value).startswith(f"tensor 'rewards': non-finite value {shown} at row 2")


def test_infinite_reward_rejected() -> None:
    msg = score_to_proto("b-1", "reward", ["a", "b"], torch.tensor([float("inf"), 1.0]))
    with pytest.raises(WireError) as exc:
        score_from_proto(msg, max_bytes=MB, expected_rows=2)
    assert exc.value.reason == "non_finite"
    assert "tensor 'rewards': non-finite value inf at row 0" in str(exc.value)


def test_non_finite_logprob_under_mask_rejected() -> None:
    r = make_rollout()
    r.behaviour_logprobs[1, 1] = float("-inf")
    with pytest.raises(WireError) as exc:
        validate_rollout_batch(rollout_to_proto(r, "b-1"), MB)
    assert exc.value.reason == "non_finite"
    assert "tensor 'behaviour_logprobs': non-finite value -inf at row 1, column 1" in str(exc.value)


def test_wrong_tensor_shape_rejected() -> None:
    msg = rollout_to_proto(make_rollout(), "b-1")
    msg.response_mask.CopyFrom(pb.Tensor(dtype="bool", shape=[B, R + 1], data=b"\x01" * (B * (R + 1))))
    with pytest.raises(WireError) as exc:
        validate_rollout_batch(msg, MB)
    assert exc.value.reason == "shape_mismatch"
    assert str(exc.value) == f"tensor 'response_mask': shape ({B}, {R + 1}), expected ({B}, {R})"

    values = score_to_proto("b-1", "critic", [f"t{i}" for i in range(B)], torch.zeros(B, R - 1))
    with pytest.raises(WireError) as exc:
        score_from_proto(values, max_bytes=MB, expected_stage="critic", expected_rows=B, expected_cols=R)
    assert exc.value.reason == "shape_mismatch" and "'values'" in str(exc.value)


def test_rows_disagreeing_with_task_ids_rejected() -> None:
    msg = rollout_to_proto(make_rollout(), "b-1")
    msg.task_ids.append("extra")
    with pytest.raises(WireError) as exc:
        validate_rollout_batch(msg, MB)
    assert exc.value.reason == "shape_mismatch" and "'prompt_ids'" in str(exc.value)


def test_wrong_tensor_dtype_rejected() -> None:
    r = make_rollout()
    msg = rollout_to_proto(r, "b-1")
    msg.group_ids.CopyFrom(pb.Tensor(dtype="int32", shape=[B], data=b"\0" * 4 * B))
    with pytest.raises(WireError) as exc:
        validate_rollout_batch(msg, MB)
    assert exc.value.reason == "dtype_mismatch" and "'group_ids'" in str(exc.value)


def test_missing_tensor_rejected() -> None:
    msg = rollout_to_proto(make_rollout(), "b-1")
    msg.ClearField("behaviour_logprobs")
    with pytest.raises(WireError) as exc:
        validate_rollout_batch(msg, MB)
    assert exc.value.reason == "missing_field" and "'behaviour_logprobs'" in str(exc.value)


def test_duplicate_task_id_rejected() -> None:
    msg = rollout_to_proto(make_rollout(), "b-1")
    msg.task_ids[3] = "t0"
    with pytest.raises(WireError) as exc:
        validate_rollout_batch(msg, MB)
    assert exc.value.reason == "duplicate_task_id" and "'t0'" in str(exc.value)


def test_score_stage_is_checked() -> None:
    msg = score_to_proto("b-1", "reward", ["a"], torch.ones(1))
    with pytest.raises(WireError) as exc:
        score_from_proto(msg, max_bytes=MB, expected_stage="critic", expected_rows=1, expected_cols=R)
    assert exc.value.reason == "stage_mismatch"
    msg.values.CopyFrom(pb.Tensor(dtype="float32", shape=[1, 1], data=b"\0" * 4))
    with pytest.raises(WireError) as exc:
        score_from_proto(msg, max_bytes=MB, expected_stage="reward", expected_rows=1, expected_cols=None)
    assert exc.value.reason == "unexpected_field" and "values" in str(exc.value)
    msg.stage = "judge"
    with pytest.raises(WireError) as exc:
        score_from_proto(msg, max_bytes=MB)
    assert exc.value.reason == "unknown_stage"


# -- nothing is unpickled ------------------------------------------------------------------------

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "joblib"}


def unpickling_sites(source: str, filename: str) -> list[str]:
    """Imports of pickle-family modules, `torch.load` without `weights_only=True`, and
    `numpy.load(allow_pickle=True)`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
            if node.module == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{filename}:{line}: from torch import load")
        else:
            names = []
        found += [f"{filename}:{line}: import {n}" for n in names if n in PICKLE_MODULES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            owner = ast.unparse(node.func.value)
            kw = {k.arg: k.value for k in node.keywords}
            if owner == "torch":
                safe = kw.get("weights_only")
                if not (isinstance(safe, ast.Constant) and safe.value is True):
                    found.append(f"{filename}:{line}: torch.load without weights_only=True")
            elif owner in ("np", "numpy"):
                bad = kw.get("allow_pickle")
                if bad is not None and not (isinstance(bad, ast.Constant) and bad.value is False):
                    found.append(f"{filename}:{line}: numpy.load with allow_pickle")
    return found


def test_unpickling_scanner_finds_the_patterns() -> None:
    bad = ("import pickle\nfrom dill import loads\nimport torch\nimport numpy as np\n"
           "torch.load('x')\ntorch.load('x', weights_only=False)\nnp.load('x', allow_pickle=True)\n"
           "torch.load('x', weights_only=True)\n")
    assert len(unpickling_sites(bad, "bad.py")) == 5


def test_nothing_is_unpickled() -> None:
    root = Path(__file__).resolve().parents[2] / "services"
    files = sorted(root.rglob("*.py"))
    assert files, f"no sources under {root}"
    found = [hit for f in files for hit in unpickling_sites(f.read_text(), str(f.relative_to(root.parent)))]
    assert not found, "unpickling in services/:\n" + "\n".join(found)


def test_reward_components_round_trip_with_the_total() -> None:
    parts = {"correct": torch.tensor([1.0, 0.0, 1.0, 0.0]), "format": torch.tensor([0.5, 0.5, 0.0, 1.0])}
    total = parts["correct"] + 0.2 * parts["format"]
    msg = score_to_proto("b-1", "reward", [f"t{i}" for i in range(B)], total, components=parts)
    s = score_from_proto(parse_message(pb.ScoreBatch, msg.SerializeToString(), max_bytes=MB), max_bytes=MB,
                         expected_stage="reward", expected_rows=B)
    assert set(s.components) == {"correct", "format"}
    assert all(np.array_equal(s.components[k], v.numpy()) for k, v in parts.items())


@pytest.mark.parametrize(("values", "reason"), [(torch.tensor([1.0, float("nan"), 0.0, 0.0]), "non_finite"),
                                                (torch.tensor([1.0, 0.0]), "shape_mismatch")])
def test_bad_reward_component_rejected_naming_it(values: torch.Tensor, reason: str) -> None:
    msg = score_to_proto("b-1", "reward", [f"t{i}" for i in range(B)], torch.zeros(B),
                         components={"correct": torch.zeros(B), "format": values})
    with pytest.raises(WireError) as exc:
        score_from_proto(msg, max_bytes=MB, expected_stage="reward", expected_rows=B)
    assert exc.value.reason == reason and "reward_components['format']" in str(exc.value)


def test_reward_components_on_another_stage_rejected() -> None:
    msg = score_to_proto("b-1", "critic", [f"t{i}" for i in range(B)], torch.zeros(B, R))
    tensor = score_to_proto("b-1", "reward", ["t0"] * B, torch.zeros(B), components={"x": torch.zeros(B)})
    msg.reward_components["x"].CopyFrom(tensor.reward_components["x"])
    with pytest.raises(WireError) as exc:
        score_from_proto(msg, max_bytes=MB, expected_stage="critic", expected_rows=B)
    assert exc.value.reason == "unexpected_field"
