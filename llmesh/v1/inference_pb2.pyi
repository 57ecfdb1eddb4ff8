from llmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InferenceRequest(_message.Message):
    __slots__ = ("text", "token_ids", "sampling", "request_id", "response_format", "priority")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    request_id: str
    response_format: _common_pb2.ResponseFormat
    priority: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., response_format: _Optional[_Union[_common_pb2.ResponseFormat, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class InferenceResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "batch_id", "logprobs", "tokens", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    batch_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., batch_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateManyRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: GenerationStart
    cancel: int
    def __init__(self, start: _Optional[_Union[GenerationStart, _Mapping]] = ..., cancel: _Optional[int] = ...) -> None: ...

class GenerationStart(_message.Message):
    __slots__ = ("id", "request", "timeout_seconds", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: InferenceRequest
    timeout_seconds: float
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[InferenceRequest, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerateManyResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[GenerationUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[GenerationUpdate, _Mapping]]] = ...) -> None: ...

class GenerationUpdate(_message.Message):
    __slots__ = ("id", "response", "status_code", "status_message", "status_details")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    id: int
    response: InferenceResponse
    status_code: int
    status_message: str
    status_details: bytes
    def __init__(self, id: _Optional[int] = ..., response: _Optional[_Union[InferenceResponse, _Mapping]] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ..., status_details: _Optional[bytes] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "version", "sha256", "device", "dtype", "max_context_tokens", "max_batch_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    version: str
    sha256: str
    device: str
    dtype: str
    max_context_tokens: int
    max_batch_size: int
    def __init__(self, model_id: _Optional[str] = ..., version: _Optional[str] = ..., sha256: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("min_interval_seconds", "max_interval_seconds")
    MIN_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    min_interval_seconds: float
    max_interval_seconds: float
    def __init__(self, min_interval_seconds: _Optional[float] = ..., max_interval_seconds: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("model_id", "version", "replica", "reported", "running", "max_running", "waiting", "kv_blocks_free", "kv_blocks_total", "block_tokens", "waiting_prompt_tokens", "step_seconds", "prefill_tokens_per_second", "prefix_hit_rate", "prefix_hashes", "sequence", "running_batch", "waiting_batch", "waiting_batch_prompt_tokens")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_BATCH_FIELD_NUMBER: _ClassVar[int]
    WAITING_BATCH_FIELD_NUMBER: _ClassVar[int]
    WAITING_BATCH_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    version: str
    replica: str
    reported: bool
    running: int
    max_running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    block_tokens: int
    waiting_prompt_tokens: int
    step_seconds: float
    prefill_tokens_per_second: float
    prefix_hit_rate: float
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    sequence: int
    running_batch: int
    waiting_batch: int
    waiting_batch_prompt_tokens: int
    def __init__(self, model_id: _Optional[str] = ..., version: _Optional[str] = ..., replica: _Optional[str] = ..., reported: _Optional[bool] = ..., running: _Optional[int] = ..., max_running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., block_tokens: _Optional[int] = ..., waiting_prompt_tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., prefill_tokens_per_second: _Optional[float] = ..., prefix_hit_rate: _Optional[float] = ..., prefix_hashes: _Optional[_Iterable[int]] = ..., sequence: _Optional[int] = ..., running_batch: _Optional[int] = ..., waiting_batch: _Optional[int] = ..., waiting_batch_prompt_tokens: _Optional[int] = ...) -> None: ...
