from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("task_id", "token_ids", "dataset_index", "sample_index", "group_id")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DATASET_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    dataset_index: int
    sample_index: int
    group_id: int
    def __init__(self, task_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., dataset_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., group_id: _Optional[int] = ...) -> None: ...

class PromptBatch(_message.Message):
    __slots__ = ("schema_version", "batch_id", "version", "prompts", "sampling", "step")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    batch_id: str
    version: int
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    step: int
    def __init__(self, schema_version: _Optional[int] = ..., batch_id: _Optional[str] = ..., version: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...

class RolloutBatch(_message.Message):
    __slots__ = ("schema_version", "batch_id", "task_ids", "version", "prompt_ids", "prompt_mask", "response_ids", "response_mask", "behaviour_logprobs", "group_ids", "sampling", "finish_reasons", "generate_seconds", "versions")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MASK_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    batch_id: str
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    version: int
    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    behaviour_logprobs: Tensor
    group_ids: Tensor
    sampling: SamplingParams
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    generate_seconds: float
    versions: Tensor
    def __init__(self, schema_version: _Optional[int] = ..., batch_id: _Optional[str] = ..., task_ids: _Optional[_Iterable[str]] = ..., version: _Optional[int] = ..., prompt_ids: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_mask: _Optional[_Union[Tensor, _Mapping]] = ..., response_ids: _Optional[_Union[Tensor, _Mapping]] = ..., response_mask: _Optional[_Union[Tensor, _Mapping]] = ..., behaviour_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., group_ids: _Optional[_Union[Tensor, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., finish_reasons: _Optional[_Iterable[str]] = ..., generate_seconds: _Optional[float] = ..., versions: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ScoreBatch(_message.Message):
    __slots__ = ("schema_version", "batch_id", "stage", "task_ids", "version", "ref_logprobs", "rewards", "values", "score_seconds", "reward_components", "unscored")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    class UnscoredEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SCORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    UNSCORED_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    batch_id: str
    stage: str
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    version: int
    ref_logprobs: Tensor
    rewards: Tensor
    values: Tensor
    score_seconds: float
    reward_components: _containers.MessageMap[str, Tensor]
    unscored: _containers.ScalarMap[str, str]
    def __init__(self, schema_version: _Optional[int] = ..., batch_id: _Optional[str] = ..., stage: _Optional[str] = ..., task_ids: _Optional[_Iterable[str]] = ..., version: _Optional[int] = ..., ref_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., rewards: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., score_seconds: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, Tensor]] = ..., unscored: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TrainBatch(_message.Message):
    __slots__ = ("schema_version", "step", "batch_id", "target_version", "rollout", "advantages", "returns", "values", "ref_logprobs", "rewards")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    step: int
    batch_id: str
    target_version: int
    rollout: RolloutBatch
    advantages: Tensor
    returns: Tensor
    values: Tensor
    ref_logprobs: Tensor
    rewards: Tensor
    def __init__(self, schema_version: _Optional[int] = ..., step: _Optional[int] = ..., batch_id: _Optional[str] = ..., target_version: _Optional[int] = ..., rollout: _Optional[_Union[RolloutBatch, _Mapping]] = ..., advantages: _Optional[_Union[Tensor, _Mapping]] = ..., returns: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., ref_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., rewards: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TrainResult(_message.Message):
    __slots__ = ("schema_version", "step", "version", "stats", "train_seconds", "replayed")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    step: int
    version: int
    stats: _containers.ScalarMap[str, float]
    train_seconds: float
    replayed: bool
    def __init__(self, schema_version: _Optional[int] = ..., step: _Optional[int] = ..., version: _Optional[int] = ..., stats: _Optional[_Mapping[str, float]] = ..., train_seconds: _Optional[float] = ..., replayed: _Optional[bool] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("schema_version", "version", "checkpoint_path")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    version: int
    checkpoint_path: str
    def __init__(self, schema_version: _Optional[int] = ..., version: _Optional[int] = ..., checkpoint_path: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("schema_version", "version", "seconds")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    version: int
    seconds: float
    def __init__(self, schema_version: _Optional[int] = ..., version: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("schema_version",)
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    def __init__(self, schema_version: _Optional[int] = ...) -> None: ...

class ServiceState(_message.Message):
    __slots__ = ("schema_version", "service", "instance_id", "state", "version", "step", "gauges")
    class GaugesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GAUGES_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    service: str
    instance_id: str
    state: str
    version: int
    step: int
    gauges: _containers.ScalarMap[str, float]
    def __init__(self, schema_version: _Optional[int] = ..., service: _Optional[str] = ..., instance_id: _Optional[str] = ..., state: _Optional[str] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., gauges: _Optional[_Mapping[str, float]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("schema_version", "deadline_s")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    deadline_s: float
    def __init__(self, schema_version: _Optional[int] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("schema_version", "accepted", "state")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    accepted: bool
    state: str
    def __init__(self, schema_version: _Optional[int] = ..., accepted: _Optional[bool] = ..., state: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("schema_version", "version", "prompts", "sampling", "greedy")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    version: int
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    greedy: bool
    def __init__(self, schema_version: _Optional[int] = ..., version: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., greedy: _Optional[bool] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("schema_version", "version", "completions", "generate_seconds")
    class Completion(_message.Message):
        __slots__ = ("token_ids", "finish_reason")
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        finish_reason: str
        def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    version: int
    completions: _containers.RepeatedCompositeFieldContainer[GenerateReply.Completion]
    generate_seconds: float
    def __init__(self, schema_version: _Optional[int] = ..., version: _Optional[int] = ..., completions: _Optional[_Iterable[_Union[GenerateReply.Completion, _Mapping]]] = ..., generate_seconds: _Optional[float] = ...) -> None: ...
