from llmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens", "model")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    model: str
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("ids", "skip_special_tokens", "model")
    IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    model: str
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class CountRequest(_message.Message):
    __slots__ = ("texts", "model")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    model: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ...) -> None: ...

class CountResponse(_message.Message):
    __slots__ = ("counts", "total")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    total: int
    def __init__(self, counts: _Optional[_Iterable[int]] = ..., total: _Optional[int] = ...) -> None: ...

class ApplyChatTemplateRequest(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tokenize", "model", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    add_generation_prompt: bool
    tokenize: bool
    model: str
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tool]
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tokenize: _Optional[bool] = ..., model: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[_common_pb2.Tool, _Mapping]]] = ...) -> None: ...

class ApplyChatTemplateResponse(_message.Message):
    __slots__ = ("text", "ids", "token_count", "tool_format", "template_renders_tools")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_RENDERS_TOOLS_FIELD_NUMBER: _ClassVar[int]
    text: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    token_count: int
    tool_format: str
    template_renders_tools: bool
    def __init__(self, text: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ..., token_count: _Optional[int] = ..., tool_format: _Optional[str] = ..., template_renders_tools: _Optional[bool] = ...) -> None: ...

class GetChatTemplateRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetChatTemplateResponse(_message.Message):
    __slots__ = ("template", "special_tokens")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    template: str
    special_tokens: _containers.ScalarMap[str, str]
    def __init__(self, template: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ChunkRequest(_message.Message):
    __slots__ = ("text", "chunk_tokens", "overlap_tokens", "model", "max_chunks")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chunk_tokens: int
    overlap_tokens: int
    model: str
    max_chunks: int
    def __init__(self, text: _Optional[str] = ..., chunk_tokens: _Optional[int] = ..., overlap_tokens: _Optional[int] = ..., model: _Optional[str] = ..., max_chunks: _Optional[int] = ...) -> None: ...

class TextChunk(_message.Message):
    __slots__ = ("text", "token_start", "token_count", "char_start", "char_end")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHAR_START_FIELD_NUMBER: _ClassVar[int]
    CHAR_END_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_start: int
    token_count: int
    char_start: int
    char_end: int
    def __init__(self, text: _Optional[str] = ..., token_start: _Optional[int] = ..., token_count: _Optional[int] = ..., char_start: _Optional[int] = ..., char_end: _Optional[int] = ...) -> None: ...

class ChunkResponse(_message.Message):
    __slots__ = ("chunks", "total_tokens")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TextChunk]
    total_tokens: int
    def __init__(self, chunks: _Optional[_Iterable[_Union[TextChunk, _Mapping]]] = ..., total_tokens: _Optional[int] = ...) -> None: ...
