from llmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "system_prompt", "sampling", "use_cache", "use_retrieval", "top_k", "collection", "tenant", "lane", "model", "messages", "response_format", "tools", "tool_choice", "n", "raw", "prompt_token_ids")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    USE_CACHE_FIELD_NUMBER: _ClassVar[int]
    USE_RETRIEVAL_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    system_prompt: str
    sampling: _common_pb2.SamplingParams
    use_cache: bool
    use_retrieval: bool
    top_k: int
    collection: str
    tenant: str
    lane: str
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    response_format: _common_pb2.ResponseFormat
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tool]
    tool_choice: _common_pb2.ToolChoice
    n: int
    raw: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt: _Optional[str] = ..., system_prompt: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., use_cache: _Optional[bool] = ..., use_retrieval: _Optional[bool] = ..., top_k: _Optional[int] = ..., collection: _Optional[str] = ..., tenant: _Optional[str] = ..., lane: _Optional[str] = ..., model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., response_format: _Optional[_Union[_common_pb2.ResponseFormat, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[_common_pb2.Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[_common_pb2.ToolChoice, _Mapping]] = ..., n: _Optional[int] = ..., raw: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("hit", "tier", "similarity")
    HIT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    hit: bool
    tier: _common_pb2.CacheTier
    similarity: float
    def __init__(self, hit: _Optional[bool] = ..., tier: _Optional[_Union[_common_pb2.CacheTier, str]] = ..., similarity: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "finish_reason", "usage", "cache", "sources", "trace_id", "model", "degradations", "answered_by", "tool_calls", "logprobs", "choices", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEGRADATIONS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    cache: CacheInfo
    sources: _containers.RepeatedCompositeFieldContainer[_common_pb2.ScoredChunk]
    trace_id: str
    model: str
    degradations: _containers.RepeatedScalarFieldContainer[str]
    answered_by: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., cache: _Optional[_Union[CacheInfo, _Mapping]] = ..., sources: _Optional[_Iterable[_Union[_common_pb2.ScoredChunk, _Mapping]]] = ..., trace_id: _Optional[str] = ..., model: _Optional[str] = ..., degradations: _Optional[_Iterable[str]] = ..., answered_by: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "finish_reason", "tool_calls", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    finish_reason: _common_pb2.FinishReason
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("delta", "final", "index", "logprobs")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    delta: str
    final: GenerateResponse
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, delta: _Optional[str] = ..., final: _Optional[_Union[GenerateResponse, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class IngestRequest(_message.Message):
    __slots__ = ("collection", "tenant", "documents", "chunk_tokens", "overlap_tokens")
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    collection: str
    tenant: str
    documents: _containers.RepeatedCompositeFieldContainer[_common_pb2.Document]
    chunk_tokens: int
    overlap_tokens: int
    def __init__(self, collection: _Optional[str] = ..., tenant: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[_common_pb2.Document, _Mapping]]] = ..., chunk_tokens: _Optional[int] = ..., overlap_tokens: _Optional[int] = ...) -> None: ...

class IngestResponse(_message.Message):
    __slots__ = ("documents", "chunks", "collection_version", "trace_id", "document_tokens")
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    documents: int
    chunks: int
    collection_version: int
    trace_id: str
    document_tokens: int
    def __init__(self, documents: _Optional[int] = ..., chunks: _Optional[int] = ..., collection_version: _Optional[int] = ..., trace_id: _Optional[str] = ..., document_tokens: _Optional[int] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("query", "collection", "tenant", "top_k", "score_threshold", "filter")
    class FilterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    QUERY_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SCORE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    query: str
    collection: str
    tenant: str
    top_k: int
    score_threshold: float
    filter: _containers.ScalarMap[str, str]
    def __init__(self, query: _Optional[str] = ..., collection: _Optional[str] = ..., tenant: _Optional[str] = ..., top_k: _Optional[int] = ..., score_threshold: _Optional[float] = ..., filter: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("results", "trace_id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[_common_pb2.ScoredChunk]
    trace_id: str
    def __init__(self, results: _Optional[_Iterable[_Union[_common_pb2.ScoredChunk, _Mapping]]] = ..., trace_id: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelEntry(_message.Message):
    __slots__ = ("name", "default", "key", "available", "alias_of")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    ALIAS_OF_FIELD_NUMBER: _ClassVar[int]
    name: str
    default: bool
    key: str
    available: bool
    alias_of: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., default: _Optional[bool] = ..., key: _Optional[str] = ..., available: _Optional[bool] = ..., alias_of: _Optional[_Iterable[str]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelEntry]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelEntry, _Mapping]]] = ...) -> None: ...

class PurgeCacheRequest(_message.Message):
    __slots__ = ("tenant", "collection", "model")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    collection: str
    model: str
    def __init__(self, tenant: _Optional[str] = ..., collection: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class PurgeCacheResponse(_message.Message):
    __slots__ = ("removed", "trace_id")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    removed: int
    trace_id: str
    def __init__(self, removed: _Optional[int] = ..., trace_id: _Optional[str] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "model", "tenant")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    model: str
    tenant: str
    def __init__(self, inputs: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("index", "values")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    index: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, index: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "model", "usage", "trace_id")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    model: str
    usage: _common_pb2.Usage
    trace_id: str
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., trace_id: _Optional[str] = ...) -> None: ...
