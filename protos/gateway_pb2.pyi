from protos import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SyncPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_PHASE_UNSPECIFIED: _ClassVar[SyncPhase]
    SYNC_PHASE_READY: _ClassVar[SyncPhase]
    SYNC_PHASE_LOADED: _ClassVar[SyncPhase]
    SYNC_PHASE_FAILED: _ClassVar[SyncPhase]
SYNC_PHASE_UNSPECIFIED: SyncPhase
SYNC_PHASE_READY: SyncPhase
SYNC_PHASE_LOADED: SyncPhase
SYNC_PHASE_FAILED: SyncPhase

class RunSettings(_message.Message):
    __slots__ = ("model_family", "mapping", "dtype", "transport", "rendezvous_address", "backends", "adapter")
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    MAPPING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    model_family: str
    mapping: str
    dtype: str
    transport: str
    rendezvous_address: str
    backends: _containers.RepeatedScalarFieldContainer[str]
    adapter: str
    def __init__(self, model_family: _Optional[str] = ..., mapping: _Optional[str] = ..., dtype: _Optional[str] = ..., transport: _Optional[str] = ..., rendezvous_address: _Optional[str] = ..., backends: _Optional[_Iterable[str]] = ..., adapter: _Optional[str] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("settings",)
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    settings: RunSettings
    def __init__(self, settings: _Optional[_Union[RunSettings, _Mapping]] = ...) -> None: ...

class ConfigureReply(_message.Message):
    __slots__ = ("settings", "current_version")
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    settings: RunSettings
    current_version: int
    def __init__(self, settings: _Optional[_Union[RunSettings, _Mapping]] = ..., current_version: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("name", "backend", "device_count", "tp_size", "model_family", "dtype", "transports", "weight_version", "host", "adapter")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    name: str
    backend: str
    device_count: int
    tp_size: int
    model_family: str
    dtype: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    weight_version: int
    host: str
    adapter: str
    def __init__(self, name: _Optional[str] = ..., backend: _Optional[str] = ..., device_count: _Optional[int] = ..., tp_size: _Optional[int] = ..., model_family: _Optional[str] = ..., dtype: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., weight_version: _Optional[int] = ..., host: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class SyncDirective(_message.Message):
    __slots__ = ("pending", "target_version", "params", "seq")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PENDING_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    pending: bool
    target_version: int
    params: _containers.ScalarMap[str, str]
    seq: int
    def __init__(self, pending: _Optional[bool] = ..., target_version: _Optional[int] = ..., params: _Optional[_Mapping[str, str]] = ..., seq: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("accepted", "refusal_reason", "engine_id", "settings", "current_version", "sync", "heartbeat_interval_s", "heartbeat_timeout_s", "lease_seconds", "retry", "engine_key")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_REASON_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KEY_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    refusal_reason: str
    engine_id: str
    settings: RunSettings
    current_version: int
    sync: SyncDirective
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    lease_seconds: float
    retry: bool
    engine_key: str
    def __init__(self, accepted: _Optional[bool] = ..., refusal_reason: _Optional[str] = ..., engine_id: _Optional[str] = ..., settings: _Optional[_Union[RunSettings, _Mapping]] = ..., current_version: _Optional[int] = ..., sync: _Optional[_Union[SyncDirective, _Mapping]] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., lease_seconds: _Optional[float] = ..., retry: _Optional[bool] = ..., engine_key: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("engine_id", "active_prompts", "wait_s", "known_target", "engine_key")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    KNOWN_TARGET_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KEY_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    active_prompts: int
    wait_s: float
    known_target: int
    engine_key: str
    def __init__(self, engine_id: _Optional[str] = ..., active_prompts: _Optional[int] = ..., wait_s: _Optional[float] = ..., known_target: _Optional[int] = ..., engine_key: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("sync", "current_version", "shutting_down")
    SYNC_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHUTTING_DOWN_FIELD_NUMBER: _ClassVar[int]
    sync: SyncDirective
    current_version: int
    shutting_down: bool
    def __init__(self, sync: _Optional[_Union[SyncDirective, _Mapping]] = ..., current_version: _Optional[int] = ..., shutting_down: _Optional[bool] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("engine_id", "max_prompts", "timeout_s", "engine_key")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KEY_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    max_prompts: int
    timeout_s: float
    engine_key: str
    def __init__(self, engine_id: _Optional[str] = ..., max_prompts: _Optional[int] = ..., timeout_s: _Optional[float] = ..., engine_key: _Optional[str] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("lease_id", "prompts", "expires_in_s", "sync", "shutting_down", "backpressure")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    SHUTTING_DOWN_FIELD_NUMBER: _ClassVar[int]
    BACKPRESSURE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.Prompt]
    expires_in_s: float
    sync: SyncDirective
    shutting_down: bool
    backpressure: bool
    def __init__(self, lease_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[_rollout_pb2.Prompt, _Mapping]]] = ..., expires_in_s: _Optional[float] = ..., sync: _Optional[_Union[SyncDirective, _Mapping]] = ..., shutting_down: _Optional[bool] = ..., backpressure: _Optional[bool] = ...) -> None: ...

class ReturnRequest(_message.Message):
    __slots__ = ("engine_id", "lease_id", "groups", "released_sample_ids", "engine_key")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KEY_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    lease_id: str
    groups: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.RolloutGroup]
    released_sample_ids: _containers.RepeatedScalarFieldContainer[str]
    engine_key: str
    def __init__(self, engine_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[_rollout_pb2.RolloutGroup, _Mapping]]] = ..., released_sample_ids: _Optional[_Iterable[str]] = ..., engine_key: _Optional[str] = ...) -> None: ...

class ReturnReply(_message.Message):
    __slots__ = ("accepted", "dropped", "dropped_reason", "released")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    dropped: int
    dropped_reason: str
    released: int
    def __init__(self, accepted: _Optional[int] = ..., dropped: _Optional[int] = ..., dropped_reason: _Optional[str] = ..., released: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("engine_id", "version", "phase", "error", "serving", "engine_key", "seq")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KEY_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    version: int
    phase: SyncPhase
    error: str
    serving: bool
    engine_key: str
    seq: int
    def __init__(self, engine_id: _Optional[str] = ..., version: _Optional[int] = ..., phase: _Optional[_Union[SyncPhase, str]] = ..., error: _Optional[str] = ..., serving: _Optional[bool] = ..., engine_key: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class AckReply(_message.Message):
    __slots__ = ("sync",)
    SYNC_FIELD_NUMBER: _ClassVar[int]
    sync: SyncDirective
    def __init__(self, sync: _Optional[_Union[SyncDirective, _Mapping]] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("engine_id", "engine_key")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KEY_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    engine_key: str
    def __init__(self, engine_id: _Optional[str] = ..., engine_key: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ("returned_prompts",)
    RETURNED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    returned_prompts: int
    def __init__(self, returned_prompts: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("prompts", "timeout_s")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.Prompt]
    timeout_s: float
    def __init__(self, prompts: _Optional[_Iterable[_Union[_rollout_pb2.Prompt, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted", "pending_train", "pending_eval")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PENDING_TRAIN_FIELD_NUMBER: _ClassVar[int]
    PENDING_EVAL_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    pending_train: int
    pending_eval: int
    def __init__(self, accepted: _Optional[int] = ..., pending_train: _Optional[int] = ..., pending_eval: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("max_groups", "min_groups", "timeout_s")
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MIN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    max_groups: int
    min_groups: int
    timeout_s: float
    def __init__(self, max_groups: _Optional[int] = ..., min_groups: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.RolloutGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[_rollout_pb2.RolloutGroup, _Mapping]]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("version", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    version: int
    params: _containers.ScalarMap[str, str]
    def __init__(self, version: _Optional[int] = ..., params: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PublishReply(_message.Message):
    __slots__ = ("engine_ids",)
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineSyncState(_message.Message):
    __slots__ = ("engine_id", "version", "phase", "error", "serving")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    version: int
    phase: SyncPhase
    error: str
    serving: bool
    def __init__(self, engine_id: _Optional[str] = ..., version: _Optional[int] = ..., phase: _Optional[_Union[SyncPhase, str]] = ..., error: _Optional[str] = ..., serving: _Optional[bool] = ...) -> None: ...

class WaitSyncRequest(_message.Message):
    __slots__ = ("version", "phase", "timeout_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    phase: SyncPhase
    timeout_s: float
    def __init__(self, version: _Optional[int] = ..., phase: _Optional[_Union[SyncPhase, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitSyncReply(_message.Message):
    __slots__ = ("done", "engines")
    DONE_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    done: bool
    engines: _containers.RepeatedCompositeFieldContainer[EngineSyncState]
    def __init__(self, done: _Optional[bool] = ..., engines: _Optional[_Iterable[_Union[EngineSyncState, _Mapping]]] = ...) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ("source", "step", "values", "engine_key")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KEY_FIELD_NUMBER: _ClassVar[int]
    source: str
    step: int
    values: _containers.ScalarMap[str, float]
    engine_key: str
    def __init__(self, source: _Optional[str] = ..., step: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ..., engine_key: _Optional[str] = ...) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "name", "backend", "host", "device_count", "tp_size", "weight_version", "sync_phase", "last_seen_s", "leased_prompts", "active_prompts", "groups_returned", "completions_returned", "tokens_returned", "sync_version", "sync_error", "serving")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_PHASE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    LEASED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    SYNC_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_ERROR_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    name: str
    backend: str
    host: str
    device_count: int
    tp_size: int
    weight_version: int
    sync_phase: SyncPhase
    last_seen_s: float
    leased_prompts: int
    active_prompts: int
    groups_returned: int
    completions_returned: int
    tokens_returned: int
    sync_version: int
    sync_error: str
    serving: bool
    def __init__(self, engine_id: _Optional[str] = ..., name: _Optional[str] = ..., backend: _Optional[str] = ..., host: _Optional[str] = ..., device_count: _Optional[int] = ..., tp_size: _Optional[int] = ..., weight_version: _Optional[int] = ..., sync_phase: _Optional[_Union[SyncPhase, str]] = ..., last_seen_s: _Optional[float] = ..., leased_prompts: _Optional[int] = ..., active_prompts: _Optional[int] = ..., groups_returned: _Optional[int] = ..., completions_returned: _Optional[int] = ..., tokens_returned: _Optional[int] = ..., sync_version: _Optional[int] = ..., sync_error: _Optional[str] = ..., serving: _Optional[bool] = ...) -> None: ...

class QueueDepths(_message.Message):
    __slots__ = ("pending_eval", "pending_train", "leased_prompts", "ready_groups", "rollout_capacity")
    PENDING_EVAL_FIELD_NUMBER: _ClassVar[int]
    PENDING_TRAIN_FIELD_NUMBER: _ClassVar[int]
    LEASED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    READY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    pending_eval: int
    pending_train: int
    leased_prompts: int
    ready_groups: int
    rollout_capacity: int
    def __init__(self, pending_eval: _Optional[int] = ..., pending_train: _Optional[int] = ..., leased_prompts: _Optional[int] = ..., ready_groups: _Optional[int] = ..., rollout_capacity: _Optional[int] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("prompts_submitted", "prompts_leased", "groups_returned", "groups_fetched", "groups_dropped_late", "prompts_released", "leases_expired", "engines_lost", "requests_rejected", "prompts_abandoned")
    PROMPTS_SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_LEASED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DROPPED_LATE_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ENGINES_LOST_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_ABANDONED_FIELD_NUMBER: _ClassVar[int]
    prompts_submitted: int
    prompts_leased: int
    groups_returned: int
    groups_fetched: int
    groups_dropped_late: int
    prompts_released: int
    leases_expired: int
    engines_lost: int
    requests_rejected: int
    prompts_abandoned: int
    def __init__(self, prompts_submitted: _Optional[int] = ..., prompts_leased: _Optional[int] = ..., groups_returned: _Optional[int] = ..., groups_fetched: _Optional[int] = ..., groups_dropped_late: _Optional[int] = ..., prompts_released: _Optional[int] = ..., leases_expired: _Optional[int] = ..., engines_lost: _Optional[int] = ..., requests_rejected: _Optional[int] = ..., prompts_abandoned: _Optional[int] = ...) -> None: ...

class MetricsReport(_message.Message):
    __slots__ = ("source", "step", "age_s", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    source: str
    step: int
    age_s: float
    values: _containers.ScalarMap[str, float]
    def __init__(self, source: _Optional[str] = ..., step: _Optional[int] = ..., age_s: _Optional[float] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("current_version", "settings", "engines", "queues", "counters", "completions_per_s", "tokens_per_s", "uptime_s", "metrics", "shutting_down")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SHUTTING_DOWN_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    settings: RunSettings
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    queues: QueueDepths
    counters: Counters
    completions_per_s: float
    tokens_per_s: float
    uptime_s: float
    metrics: _containers.RepeatedCompositeFieldContainer[MetricsReport]
    shutting_down: bool
    def __init__(self, current_version: _Optional[int] = ..., settings: _Optional[_Union[RunSettings, _Mapping]] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., queues: _Optional[_Union[QueueDepths, _Mapping]] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., completions_per_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., uptime_s: _Optional[float] = ..., metrics: _Optional[_Iterable[_Union[MetricsReport, _Mapping]]] = ..., shutting_down: _Optional[bool] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
