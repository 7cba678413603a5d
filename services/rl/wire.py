"""Rollouts, scores and training batches to and from their protobuf messages.

Every `*_from_proto` validates before returning: schema version, dtypes, shapes that agree with
each other (the padded layout of services.rl.batch), and finite numbers where NaN or inf would
silently poison a loss. A message that fails raises `WireError` (see codec) so that the consumer
can dead-letter it with `reason` and keep serving.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from google.protobuf.message import DecodeError, Message

from services.core.pb import rlfleet_pb2 as pb
from services.core.transport.codec import SCHEMA_VERSION, WireError, array_from_proto, array_to_proto, tensor_to_proto
from services.rl.batch import Rollout, RolloutArrays

if TYPE_CHECKING:  # torch loads only where a torch tensor is encoded (`_encode`) or decoded (`to_rollout`)
    import torch

    from services.core.transport.limits import Limits

__all__ = [
    "SCHEMA_VERSION",
    "STAGE_FIELDS",
    "RolloutArrays",
    "Scores",
    "TrainArrays",
    "TrainRequest",
    "WireError",
    "check_schema_version",
    "message",
    "parse_message",
    "rollout_to_proto",
    "score_from_proto",
    "score_to_proto",
    "train_arrays_from_proto",
    "train_batch_from_proto",
    "train_batch_to_proto",
    "validate_rollout_arrays",
    "validate_rollout_batch",
]

M = TypeVar("M", bound=Message)

# The ScoreBatch field each scoring stage fills.
STAGE_FIELDS: dict[str, str] = {"reference": "ref_logprobs", "reward": "rewards", "critic": "values"}
# Optional per-token [B, R] float32 tensors of a TrainBatch, and the per-row [B] one.
_TRAIN_TOKEN_FIELDS = ("advantages", "returns", "values", "ref_logprobs")


# -- envelopes -----------------------------------------------------------------------------------


def message(cls: type[M], **fields: Any) -> M:
    """Build a top-level message with the current schema version stamped (forgetting it would
    make every receiver reject the message)."""
    return cls(schema_version=SCHEMA_VERSION, **fields)


def check_schema_version(msg: Message) -> None:
    """Reject a message from a peer speaking another schema (gRPC handlers call this directly,
    since gRPC parses requests itself)."""
    got = msg.schema_version  # type: ignore[attr-defined]
    if got != SCHEMA_VERSION:
        raise WireError("schema_version", f"{type(msg).__name__}: schema_version {got},"
                        f" this build speaks {SCHEMA_VERSION}")


def parse_message(cls: type[M], data: bytes, *, max_bytes: int) -> M:
    """Parse bytes from a stream entry: size limit first (before protobuf allocates anything),
    then protobuf decoding, then the schema version."""
    if len(data) > max_bytes:
        raise WireError("oversized_message", f"{cls.__name__}: {len(data)} bytes exceeds the limit of"
                        f" {max_bytes}")
    msg = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError as err:
        raise WireError("malformed", f"{cls.__name__}: not a valid protobuf message ({err})") from None
    if "schema_version" in cls.DESCRIPTOR.fields_by_name:
        check_schema_version(msg)
    return msg


# -- helpers -------------------------------------------------------------------------------------


Array = np.ndarray[Any, Any]


def _tensor(msg: Any, field: str, owner: str, *, max_bytes: int, dtype: str,
            shape: tuple[int | None, ...]) -> Array:
    if not msg.HasField(field):
        raise WireError("missing_field", f"{owner}: tensor {field!r} is not set")
    return array_from_proto(getattr(msg, field), max_bytes=max_bytes, expect_dtype=dtype,
                            expect_shape=shape, name=field)


def _require_finite(t: Array, name: str, mask: Array | None = None) -> None:
    bad = ~np.isfinite(t)
    if mask is not None:
        bad &= mask
    if bool(bad.any()):
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        pos = f"row {where[0]}" if len(where) == 1 else f"row {where[0]}, column {where[1]}"
        raise WireError("non_finite", f"tensor {name!r}: non-finite value {t[where].item()} at {pos}"
                        f" ({int(bad.sum())} in all)")


def _encode(x: Any, wire_dtype: str, out: Any) -> None:
    """A torch tensor or a numpy array into `out`, cast to `wire_dtype` (a no-op when already so)."""
    if isinstance(x, np.ndarray):
        array_to_proto(x.astype(np.bool_ if wire_dtype == "bool" else wire_dtype, copy=False), out)
    else:
        tensor_to_proto(getattr(x, {"int64": "long", "bool": "bool", "float32": "float"}[wire_dtype])(), out)


def _check_task_ids(task_ids: Sequence[str], owner: str) -> None:
    if any(not t for t in task_ids):
        raise WireError("empty_task_id", f"{owner}: empty task id at row {list(task_ids).index('')}")
    if len(set(task_ids)) != len(task_ids):
        dup, n = Counter(task_ids).most_common(1)[0]
        raise WireError("duplicate_task_id", f"{owner}: task id {dup!r} appears {n} times")


# -- rollouts ------------------------------------------------------------------------------------


def rollout_to_proto(r: Rollout | RolloutArrays, batch_id: str, sampling: Any = None,
                     finish_reasons: Sequence[str] | None = None,
                     generate_seconds: float = 0.0) -> pb.RolloutBatch:
    """Encode the generated part of a rollout (scores travel separately as ScoreBatch). Tensors are
    cast to the wire dtypes (int64 ids, bool masks, float32 log-probs), a no-op when already so."""
    msg = message(pb.RolloutBatch, batch_id=batch_id, task_ids=list(r.task_ids), version=int(r.version),
                  finish_reasons=list(finish_reasons or ()), generate_seconds=float(generate_seconds))
    _encode(r.prompt_ids, "int64", msg.prompt_ids)
    _encode(r.prompt_mask, "bool", msg.prompt_mask)
    _encode(r.response_ids, "int64", msg.response_ids)
    _encode(r.response_mask, "bool", msg.response_mask)
    _encode(r.behaviour_logprobs, "float32", msg.behaviour_logprobs)
    _encode(r.group_ids, "int64", msg.group_ids)
    if r.versions is not None:
        _encode(r.versions, "int64", msg.versions)
    if sampling is not None:
        msg.sampling.CopyFrom(sampling)
    return msg


def validate_rollout_batch(msg: pb.RolloutBatch, max_bytes: int, limits: Limits | None = None, *,
                           max_rows: int | None = None) -> Rollout:
    """`validate_rollout_arrays` as a torch Rollout (what a service that runs a model works on)."""
    return validate_rollout_arrays(msg, max_bytes, limits, max_rows=max_rows).to_rollout()


def validate_rollout_arrays(msg: pb.RolloutBatch, max_bytes: int, limits: Limits | None = None, *,
                            max_rows: int | None = None) -> RolloutArrays:
    """Check a RolloutBatch against the padded layout and return its numpy arrays: B task ids,
    [B, P] int64/bool prompt, [B, R] int64/bool/float32 response, [B] group ids, log-probs finite
    wherever the response mask is set. `max_bytes` bounds each tensor; `limits` adds the run's
    semantics (versions, ids, vocabulary, lengths, at most `max_rows` rows, default one message's)."""
    check_schema_version(msg)
    owner = f"RolloutBatch {msg.batch_id!r}"
    b = len(msg.task_ids)
    _check_task_ids(msg.task_ids, owner)

    def get(field: str, dtype: str, shape: tuple[int | None, ...]) -> Array:
        return _tensor(msg, field, owner, max_bytes=max_bytes, dtype=dtype, shape=shape)

    prompt_ids = get("prompt_ids", "int64", (b, None))
    p = prompt_ids.shape[1]
    response_ids = get("response_ids", "int64", (b, None))
    r = response_ids.shape[1]
    response_mask = get("response_mask", "bool", (b, r))
    logprobs = get("behaviour_logprobs", "float32", (b, r))
    _require_finite(logprobs, "behaviour_logprobs", response_mask)
    versions = get("versions", "int64", (b,)) if msg.HasField("versions") else None
    if msg.finish_reasons and len(msg.finish_reasons) != b:
        raise WireError("shape_mismatch", f"{owner}: {len(msg.finish_reasons)} finish_reasons for {b} rows")
    group_ids = get("group_ids", "int64", (b,))
    if limits is not None:
        limits.check_rollout(msg, prompt_ids, response_ids, group_ids, versions,
                             max_rows=max_rows or limits.rows_per_message)
    return RolloutArrays(
        task_ids=list(msg.task_ids),
        prompt_ids=prompt_ids,
        prompt_mask=get("prompt_mask", "bool", (b, p)),
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=logprobs,
        group_ids=group_ids,
        version=int(msg.version),
        versions=versions,
    )


# -- scores --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scores:
    """One stage's scores for one rollout batch, rows in the order of `task_ids`, as numpy arrays
    (what the controller joins: it never imports torch)."""

    batch_id: str
    stage: str
    task_ids: list[str]
    version: int
    tensor: Array  # reward: [B] float32; reference / critic: [B, R] float32
    score_seconds: float = 0.0
    # stage reward with several weighted rewards: each component's unweighted [B] float32 values.
    components: dict[str, Array] = dataclasses.field(default_factory=dict)
    # stage reward: task id -> reason of each row the reward could not score (its value is 0).
    unscored: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass
class StageScores:
    """What a scoring stage hands to `score_to_proto`: values [B] or [B, R], the reward's named
    components [B], and the rows the reward could not score (task id -> reason; their values are
    placeholders the controller never trains on)."""

    values: torch.Tensor | Array
    components: Mapping[str, torch.Tensor | Array] = dataclasses.field(default_factory=dict)
    unscored: dict[str, str] = dataclasses.field(default_factory=dict)


# The longest reason an unscored row may carry (the journal keeps 500 characters of a dead reason).
MAX_UNSCORED_REASON = 500


def score_to_proto(batch_id: str, stage: str, task_ids: Sequence[str], scores: torch.Tensor | Array, *,
                   version: int = 0, score_seconds: float = 0.0,
                   components: Mapping[str, torch.Tensor | Array] | None = None,
                   unscored: Mapping[str, str] | None = None) -> pb.ScoreBatch:
    """Encode one stage's output (rewards [B], or ref log-probs / values [B, R]) as float32, with
    the reward's components [B] when there are several and the rows it could not score."""
    if stage not in STAGE_FIELDS:
        raise WireError("unknown_stage", f"ScoreBatch {batch_id!r}: unknown stage {stage!r};"
                        f" expected one of {', '.join(STAGE_FIELDS)}")
    msg = message(pb.ScoreBatch, batch_id=batch_id, stage=stage, task_ids=list(task_ids),
                  version=int(version), score_seconds=float(score_seconds))
    _encode(scores, "float32", getattr(msg, STAGE_FIELDS[stage]))
    for name, values in (components or {}).items():
        _encode(values, "float32", msg.reward_components[name])
    for tid, reason in (unscored or {}).items():
        msg.unscored[tid] = reason[:MAX_UNSCORED_REASON]
    return msg


def score_from_proto(msg: pb.ScoreBatch, *, max_bytes: int, expected_stage: str | None = None,
                     expected_rows: int | None = None, expected_cols: int | None = None,
                     limits: Limits | None = None) -> Scores:
    """Validate a ScoreBatch: known stage (and the expected one), exactly that stage's field set,
    float32 of shape [B] (reward) or [B, R] (reference, critic), every value finite; with `limits`,
    task ids of the run's grammar, a version inside the run and R inside max_new_tokens."""
    check_schema_version(msg)
    owner = f"ScoreBatch {msg.batch_id!r}"
    field = STAGE_FIELDS.get(msg.stage)
    if field is None:
        raise WireError("unknown_stage", f"{owner}: unknown stage {msg.stage!r};"
                        f" expected one of {', '.join(STAGE_FIELDS)}")
    if expected_stage is not None and msg.stage != expected_stage:
        raise WireError("stage_mismatch", f"{owner}: stage {msg.stage!r}, expected {expected_stage!r}")
    others = [f for f in STAGE_FIELDS.values() if f != field and msg.HasField(f)]
    if others:
        raise WireError("unexpected_field", f"{owner}: stage {msg.stage!r} must not set {', '.join(others)}")
    b = len(msg.task_ids)
    if expected_rows is not None and b != expected_rows:
        raise WireError("shape_mismatch", f"{owner}: {b} task ids, expected {expected_rows}")
    _check_task_ids(msg.task_ids, owner)
    shape: tuple[int | None, ...] = (b,) if msg.stage == "reward" else (b, expected_cols)
    t = _tensor(msg, field, owner, max_bytes=max_bytes, dtype="float32", shape=shape)
    _require_finite(t, field)
    components = _reward_components(msg, owner, b, max_bytes)
    unscored = _unscored(msg, owner)
    if limits is not None:
        limits.check_reward_components(components, owner)
        limits.check_task_ids(msg.task_ids, owner)
        limits.check_version(int(msg.version), f"{owner}: version")
        if t.ndim == 2 and t.shape[1] > limits.max_new_tokens:
            raise WireError("response_too_long", f"{owner}: {field} has {t.shape[1]} columns, more than"
                            f" generation.max_new_tokens {limits.max_new_tokens}")
    return Scores(batch_id=msg.batch_id, stage=msg.stage, task_ids=list(msg.task_ids),
                  version=int(msg.version), tensor=t, score_seconds=float(msg.score_seconds),
                  components=components, unscored=unscored)


def _unscored(msg: pb.ScoreBatch, owner: str) -> dict[str, str]:
    """Rows of the batch, each with a reason, and not all of them (a batch the reward could not
    score at all is dead-lettered, not published)."""
    if not msg.unscored:
        return {}
    if msg.stage != "reward":
        raise WireError("unexpected_field", f"{owner}: stage {msg.stage!r} must not set unscored")
    rows = set(msg.task_ids)
    for tid, reason in msg.unscored.items():
        if tid not in rows:
            raise WireError("unknown_tasks", f"{owner}: unscored names task {tid[:64]!r}, not a row of the batch")
        if not reason.strip() or len(reason) > MAX_UNSCORED_REASON:
            raise WireError("bad_reason", f"{owner}: unscored task {tid[:64]!r} needs a reason of 1 to"
                            f" {MAX_UNSCORED_REASON} characters, got {len(reason)}")
    if len(msg.unscored) >= len(rows):
        raise WireError("shape_mismatch", f"{owner}: every row is unscored; such a batch is dead-lettered")
    return dict(msg.unscored)


def _reward_components(msg: pb.ScoreBatch, owner: str, rows: int, max_bytes: int) -> dict[str, Array]:
    if not msg.reward_components:
        return {}
    if msg.stage != "reward":
        raise WireError("unexpected_field", f"{owner}: stage {msg.stage!r} must not set reward_components")
    out = {}
    for name, proto in msg.reward_components.items():
        label = f"reward_components[{name[:64]!r}]"
        t = array_from_proto(proto, max_bytes=max_bytes, expect_dtype="float32", expect_shape=(rows,), name=label)
        _require_finite(t, label)
        out[name] = t
    return out


# -- training batches ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainArrays:
    """A decoded TrainBatch in numpy (the controller resuming a journaled step): the rollout carries
    advantages / returns / values / ref_logprobs / rewards when the batch did."""

    step: int
    batch_id: str
    target_version: int
    rollout: RolloutArrays


@dataclass(frozen=True)
class TrainRequest:
    """A decoded TrainBatch as a trainer takes it: `TrainArrays` with a torch rollout."""

    step: int
    batch_id: str
    target_version: int
    rollout: Rollout


def train_batch_to_proto(r: Rollout | RolloutArrays, *, step: int, batch_id: str, target_version: int,
                         sampling: Any = None) -> pb.TrainBatch:
    """Encode a scored rollout plus whatever of advantages, returns, values, ref_logprobs and
    rewards it carries (None fields stay unset)."""
    msg = message(pb.TrainBatch, step=int(step), batch_id=batch_id, target_version=int(target_version))
    msg.rollout.CopyFrom(rollout_to_proto(r, batch_id, sampling=sampling))
    for field in (*_TRAIN_TOKEN_FIELDS, "rewards"):
        t = getattr(r, field)
        if t is not None:
            _encode(t, "float32", getattr(msg, field))
    return msg


def train_batch_from_proto(msg: pb.TrainBatch, max_bytes: int, *,
                           require: Iterable[str] = (), limits: Limits | None = None) -> TrainRequest:
    """`train_arrays_from_proto` with the rollout as torch tensors (sharing the decoded memory)."""
    a = train_arrays_from_proto(msg, max_bytes, require=require, limits=limits)
    return TrainRequest(step=a.step, batch_id=a.batch_id, target_version=a.target_version,
                        rollout=a.rollout.to_rollout())


def train_arrays_from_proto(msg: pb.TrainBatch, max_bytes: int, *,
                            require: Iterable[str] = (), limits: Limits | None = None) -> TrainArrays:
    """Validate a TrainBatch (its rollout as `validate_rollout_arrays`, extra tensors float32 [B, R]
    or [B] and finite). `require` names fields this trainer cannot do without, e.g. ("advantages",);
    `limits` adds the run's semantics (a step's rows, target_version = step + 1 inside the run)."""
    check_schema_version(msg)
    owner = f"TrainBatch {msg.batch_id[:40]!r} (step {msg.step})"
    if limits is not None:
        limits.check_version(int(msg.target_version), f"{owner}: target_version", at_least=1)
        if msg.target_version != msg.step + 1:
            raise WireError("bad_version", f"{owner}: target_version {msg.target_version} is not step + 1")
    for field in require:
        if not msg.HasField(field):
            raise WireError("missing_field", f"{owner}: tensor {field!r} is not set")
    if not msg.HasField("rollout"):
        raise WireError("missing_field", f"{owner}: rollout is not set")
    rollout = validate_rollout_arrays(msg.rollout, max_bytes, limits,
                                      max_rows=limits.samples_per_step if limits else None)
    b, r = rollout.response_ids.shape
    for field in (*_TRAIN_TOKEN_FIELDS, "rewards"):
        if msg.HasField(field):
            shape = (b,) if field == "rewards" else (b, r)
            t = _tensor(msg, field, owner, max_bytes=max_bytes, dtype="float32", shape=shape)
            _require_finite(t, field)
            setattr(rollout, field, t)
    return TrainArrays(step=int(msg.step), batch_id=msg.batch_id, target_version=int(msg.target_version),
                       rollout=rollout)
