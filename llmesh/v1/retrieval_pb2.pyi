from llmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpsertRequest(_message.Message):
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

class UpsertProgress(_message.Message):
    __slots__ = ("documents_done", "documents_total", "chunks_done", "done", "collection_version", "document_tokens")
    DOCUMENTS_DONE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_VERSION_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    documents_done: int
    documents_total: int
    chunks_done: int
    done: bool
    collection_version: int
    document_tokens: int
    def __init__(self, documents_done: _Optional[int] = ..., documents_total: _Optional[int] = ..., chunks_done: _Optional[int] = ..., done: _Optional[bool] = ..., collection_version: _Optional[int] = ..., document_tokens: _Optional[int] = ...) -> None: ...

class RetrievalSearchRequest(_message.Message):
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

class RetrievalSearchResponse(_message.Message):
    __slots__ = ("results", "collection_version")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_VERSION_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[_common_pb2.ScoredChunk]
    collection_version: int
    def __init__(self, results: _Optional[_Iterable[_Union[_common_pb2.ScoredChunk, _Mapping]]] = ..., collection_version: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("collection", "tenant", "document_ids")
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    collection: str
    tenant: str
    document_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, collection: _Optional[str] = ..., tenant: _Optional[str] = ..., document_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted_chunks", "collection_version")
    DELETED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_VERSION_FIELD_NUMBER: _ClassVar[int]
    deleted_chunks: int
    collection_version: int
    def __init__(self, deleted_chunks: _Optional[int] = ..., collection_version: _Optional[int] = ...) -> None: ...

class CollectionInfoRequest(_message.Message):
    __slots__ = ("collection", "tenant")
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    collection: str
    tenant: str
    def __init__(self, collection: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class CollectionInfo(_message.Message):
    __slots__ = ("exists", "points", "version", "dimension", "indexed_points", "indexing")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    INDEXED_POINTS_FIELD_NUMBER: _ClassVar[int]
    INDEXING_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    points: int
    version: int
    dimension: int
    indexed_points: int
    indexing: bool
    def __init__(self, exists: _Optional[bool] = ..., points: _Optional[int] = ..., version: _Optional[int] = ..., dimension: _Optional[int] = ..., indexed_points: _Optional[int] = ..., indexing: _Optional[bool] = ...) -> None: ...

class RetrievalEmbedRequest(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, inputs: _Optional[_Iterable[str]] = ...) -> None: ...

class RetrievalEmbedResponse(_message.Message):
    __slots__ = ("vectors", "model", "input_tokens")
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    vectors: _containers.RepeatedCompositeFieldContainer[FloatVector]
    model: str
    input_tokens: int
    def __init__(self, vectors: _Optional[_Iterable[_Union[FloatVector, _Mapping]]] = ..., model: _Optional[str] = ..., input_tokens: _Optional[int] = ...) -> None: ...

class FloatVector(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...
