from llmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheScope(_message.Message):
    __slots__ = ("model", "tenant", "collection", "collection_version", "sampling", "shape", "retrieval_top_k", "retrieval_min_score")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_TOP_K_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_MIN_SCORE_FIELD_NUMBER: _ClassVar[int]
    model: str
    tenant: str
    collection: str
    collection_version: int
    sampling: _common_pb2.SamplingParams
    shape: bytes
    retrieval_top_k: int
    retrieval_min_score: float
    def __init__(self, model: _Optional[str] = ..., tenant: _Optional[str] = ..., collection: _Optional[str] = ..., collection_version: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., shape: _Optional[bytes] = ..., retrieval_top_k: _Optional[int] = ..., retrieval_min_score: _Optional[float] = ...) -> None: ...

class CacheLookupRequest(_message.Message):
    __slots__ = ("prompt", "scope", "allow_semantic")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SEMANTIC_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    scope: CacheScope
    allow_semantic: bool
    def __init__(self, prompt: _Optional[str] = ..., scope: _Optional[_Union[CacheScope, _Mapping]] = ..., allow_semantic: _Optional[bool] = ...) -> None: ...

class CachedAnswer(_message.Message):
    __slots__ = ("text", "finish_reason", "usage", "sources")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    sources: _containers.RepeatedCompositeFieldContainer[_common_pb2.ScoredChunk]
    def __init__(self, text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., sources: _Optional[_Iterable[_Union[_common_pb2.ScoredChunk, _Mapping]]] = ...) -> None: ...

class CacheLookupResponse(_message.Message):
    __slots__ = ("hit", "tier", "similarity", "answer", "key", "degraded", "collection_version")
    HIT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_VERSION_FIELD_NUMBER: _ClassVar[int]
    hit: bool
    tier: _common_pb2.CacheTier
    similarity: float
    answer: CachedAnswer
    key: str
    degraded: bool
    collection_version: int
    def __init__(self, hit: _Optional[bool] = ..., tier: _Optional[_Union[_common_pb2.CacheTier, str]] = ..., similarity: _Optional[float] = ..., answer: _Optional[_Union[CachedAnswer, _Mapping]] = ..., key: _Optional[str] = ..., degraded: _Optional[bool] = ..., collection_version: _Optional[int] = ...) -> None: ...

class CacheLookupBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[CacheLookupRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[CacheLookupRequest, _Mapping]]] = ...) -> None: ...

class CacheLookupBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CacheLookupResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[CacheLookupResponse, _Mapping]]] = ...) -> None: ...

class CacheStoreRequest(_message.Message):
    __slots__ = ("prompt", "scope", "answer", "ttl_seconds")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    scope: CacheScope
    answer: CachedAnswer
    ttl_seconds: int
    def __init__(self, prompt: _Optional[str] = ..., scope: _Optional[_Union[CacheScope, _Mapping]] = ..., answer: _Optional[_Union[CachedAnswer, _Mapping]] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class CacheStoreResponse(_message.Message):
    __slots__ = ("key", "stored")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    key: str
    stored: bool
    def __init__(self, key: _Optional[str] = ..., stored: _Optional[bool] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("tenant", "key", "collection", "model", "all")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    key: str
    collection: str
    model: str
    all: bool
    def __init__(self, tenant: _Optional[str] = ..., key: _Optional[str] = ..., collection: _Optional[str] = ..., model: _Optional[str] = ..., all: _Optional[bool] = ...) -> None: ...

class InvalidateResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStatsResponse(_message.Message):
    __slots__ = ("entries", "exact_hits", "semantic_hits", "misses", "rejections", "degraded")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    EXACT_HITS_FIELD_NUMBER: _ClassVar[int]
    SEMANTIC_HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    entries: int
    exact_hits: int
    semantic_hits: int
    misses: int
    rejections: int
    degraded: bool
    def __init__(self, entries: _Optional[int] = ..., exact_hits: _Optional[int] = ..., semantic_hits: _Optional[int] = ..., misses: _Optional[int] = ..., rejections: _Optional[int] = ..., degraded: _Optional[bool] = ...) -> None: ...
