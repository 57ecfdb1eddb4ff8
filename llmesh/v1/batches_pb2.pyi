from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BatchFile(_message.Message):
    __slots__ = ("id", "bytes", "created_at", "filename", "purpose")
    ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    def __init__(self, id: _Optional[str] = ..., bytes: _Optional[int] = ..., created_at: _Optional[int] = ..., filename: _Optional[str] = ..., purpose: _Optional[str] = ...) -> None: ...

class CreateFileRequest(_message.Message):
    __slots__ = ("filename", "purpose", "content", "tenant")
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    filename: str
    purpose: str
    content: bytes
    tenant: str
    def __init__(self, filename: _Optional[str] = ..., purpose: _Optional[str] = ..., content: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class FileRequest(_message.Message):
    __slots__ = ("file_id", "tenant")
    FILE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    file_id: str
    tenant: str
    def __init__(self, file_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class FileContent(_message.Message):
    __slots__ = ("content",)
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    content: bytes
    def __init__(self, content: _Optional[bytes] = ...) -> None: ...

class DeleteFileResponse(_message.Message):
    __slots__ = ("id", "deleted")
    ID_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    id: str
    deleted: bool
    def __init__(self, id: _Optional[str] = ..., deleted: _Optional[bool] = ...) -> None: ...

class CreateBatchRequest(_message.Message):
    __slots__ = ("input_file_id", "endpoint", "completion_window", "metadata", "tenant")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INPUT_FILE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: _containers.ScalarMap[str, str]
    tenant: str
    def __init__(self, input_file_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., completion_window: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., tenant: _Optional[str] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("batch_id", "tenant")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    tenant: str
    def __init__(self, batch_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class ListBatchesRequest(_message.Message):
    __slots__ = ("after", "limit", "tenant")
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    after: str
    limit: int
    tenant: str
    def __init__(self, after: _Optional[str] = ..., limit: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class BatchRequestCounts(_message.Message):
    __slots__ = ("total", "completed", "failed")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    total: int
    completed: int
    failed: int
    def __init__(self, total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class BatchError(_message.Message):
    __slots__ = ("code", "message", "line")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    line: int
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., line: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "endpoint", "input_file_id", "completion_window", "status", "output_file_id", "error_file_id", "request_counts", "metadata", "errors", "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    INPUT_FILE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FILE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FILE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COUNTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    FINALIZING_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    FAILED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_AT_FIELD_NUMBER: _ClassVar[int]
    CANCELLING_AT_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str
    error_file_id: str
    request_counts: BatchRequestCounts
    metadata: _containers.ScalarMap[str, str]
    errors: _containers.RepeatedCompositeFieldContainer[BatchError]
    created_at: int
    in_progress_at: int
    expires_at: int
    finalizing_at: int
    completed_at: int
    failed_at: int
    expired_at: int
    cancelling_at: int
    cancelled_at: int
    def __init__(self, id: _Optional[str] = ..., endpoint: _Optional[str] = ..., input_file_id: _Optional[str] = ..., completion_window: _Optional[str] = ..., status: _Optional[str] = ..., output_file_id: _Optional[str] = ..., error_file_id: _Optional[str] = ..., request_counts: _Optional[_Union[BatchRequestCounts, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., errors: _Optional[_Iterable[_Union[BatchError, _Mapping]]] = ..., created_at: _Optional[int] = ..., in_progress_at: _Optional[int] = ..., expires_at: _Optional[int] = ..., finalizing_at: _Optional[int] = ..., completed_at: _Optional[int] = ..., failed_at: _Optional[int] = ..., expired_at: _Optional[int] = ..., cancelling_at: _Optional[int] = ..., cancelled_at: _Optional[int] = ...) -> None: ...

class ListBatchesResponse(_message.Message):
    __slots__ = ("data", "has_more")
    DATA_FIELD_NUMBER: _ClassVar[int]
    HAS_MORE_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[Batch]
    has_more: bool
    def __init__(self, data: _Optional[_Iterable[_Union[Batch, _Mapping]]] = ..., has_more: _Optional[bool] = ...) -> None: ...
