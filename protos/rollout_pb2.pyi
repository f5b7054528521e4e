from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed", "reasoning_budget", "ignore_eos", "return_routes")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REASONING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTES_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    reasoning_budget: int
    ignore_eos: bool
    return_routes: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., reasoning_budget: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., return_routes: _Optional[bool] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("sample_id", "token_ids", "group_size", "sampling", "is_eval", "min_version", "episode")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    IS_EVAL_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    group_size: int
    sampling: SamplingParams
    is_eval: bool
    min_version: int
    episode: Episode
    def __init__(self, sample_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., is_eval: _Optional[bool] = ..., min_version: _Optional[int] = ..., episode: _Optional[_Union[Episode, _Mapping]] = ...) -> None: ...

class Episode(_message.Message):
    __slots__ = ("env", "task_json", "max_turns", "max_tokens", "max_observation_chars")
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OBSERVATION_CHARS_FIELD_NUMBER: _ClassVar[int]
    env: str
    task_json: str
    max_turns: int
    max_tokens: int
    max_observation_chars: int
    def __init__(self, env: _Optional[str] = ..., task_json: _Optional[str] = ..., max_turns: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_observation_chars: _Optional[int] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("version", "start_token", "end_token")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_FIELD_NUMBER: _ClassVar[int]
    version: int
    start_token: int
    end_token: int
    def __init__(self, version: _Optional[int] = ..., start_token: _Optional[int] = ..., end_token: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "version_start", "version_end", "version_spans", "first_token_s", "generation_s", "forced_positions", "turns", "observations", "env_reward", "routed_experts", "routed_layers", "routed_k", "routed_id_bytes")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_START_FIELD_NUMBER: _ClassVar[int]
    VERSION_END_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_S_FIELD_NUMBER: _ClassVar[int]
    FORCED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    ENV_REWARD_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_K_FIELD_NUMBER: _ClassVar[int]
    ROUTED_ID_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    version_start: int
    version_end: int
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    first_token_s: float
    generation_s: float
    forced_positions: _containers.RepeatedScalarFieldContainer[int]
    turns: int
    observations: int
    env_reward: float
    routed_experts: bytes
    routed_layers: int
    routed_k: int
    routed_id_bytes: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., version_start: _Optional[int] = ..., version_end: _Optional[int] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., first_token_s: _Optional[float] = ..., generation_s: _Optional[float] = ..., forced_positions: _Optional[_Iterable[int]] = ..., turns: _Optional[int] = ..., observations: _Optional[int] = ..., env_reward: _Optional[float] = ..., routed_experts: _Optional[bytes] = ..., routed_layers: _Optional[int] = ..., routed_k: _Optional[int] = ..., routed_id_bytes: _Optional[int] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("sample_id", "completions", "engine_id", "prompt", "queue_s", "lease_s")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    engine_id: str
    prompt: Prompt
    queue_s: float
    lease_s: float
    def __init__(self, sample_id: _Optional[str] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., engine_id: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., queue_s: _Optional[float] = ..., lease_s: _Optional[float] = ...) -> None: ...
