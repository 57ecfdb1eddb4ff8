"""What one request may cost, decided on its bytes before it is parsed.

A protobuf message's parsed size is not its wire size: an empty element of a repeated message
field is two bytes on the wire and about a hundred once parsed, so a request at the receive
limit can take fifty times that limit in memory and tens of milliseconds of one core before a
single field is checked. Each method therefore gets

- a byte limit of its own, sized to what the method needs (`RequestLimit.max_bytes`), and
- element counts checked on a *shallow* parse: the same message with every repeated message
  field (maps included, whose entries are messages on the wire) read as `repeated bytes`. Each
  element is then a view of its bytes, not a message, and an element count is a `len()`. Nested
  counts (the tool calls of one turn) are read the same way from each counted element.

Only a request whose counts are within bounds is parsed in full; anything else is refused with
INVALID_ARGUMENT naming the field, in time proportional to the bytes that came (C code), never
to what they would have become.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from llmesh.errors import InvalidArgument

_SHALLOW_POOL = descriptor_pool.DescriptorPool()
_SHALLOW_CLASSES: dict[str, type[Message]] = {}
_SHALLOW_PACKAGE = "llmesh.shallow"
# Below this size a request is parsed in full at once (at most ~50x it in memory, microseconds):
# the shallow parse would cost more than it saves.
COUNT_ABOVE_BYTES = 1024


def repeated_paths(descriptor: Any, prefix: str = "", seen: frozenset[str] = frozenset()) -> list[str]:
    """Every repeated field (maps included) reachable from `descriptor`, as dotted paths
    ("messages", "messages.tool_calls", "sampling.logit_bias"). Map entries are not descended into."""
    found: list[str] = []
    for f in descriptor.fields:
        path = f"{prefix}{f.name}"
        if _is_repeated(f):
            found.append(path)
        if f.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(f) and f.message_type.full_name not in seen:
            found.extend(repeated_paths(f.message_type, f"{path}.", seen | {descriptor.full_name}))
    return found


def _is_repeated(f: Any) -> bool:
    return bool(f.is_repeated)


def _is_map(f: Any) -> bool:
    return f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def _shallow_class(descriptor: Any) -> type[Message]:
    """`descriptor` with every message-typed field (singular, repeated, map) as bytes of the
    same number: parsing it allocates a view per element, nothing more."""
    cls = _SHALLOW_CLASSES.get(descriptor.full_name)
    if cls is not None:
        return cls
    name = "M" + descriptor.full_name.replace(".", "_")
    proto = descriptor_pb2.DescriptorProto(name=name)
    for f in descriptor.fields:
        added = proto.field.add(name=f.name, number=f.number)
        repeated = _is_repeated(f)
        added.label = (
            descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
            if repeated
            else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
        )
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            added.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
        elif f.type == FieldDescriptor.TYPE_ENUM:
            added.type = descriptor_pb2.FieldDescriptorProto.TYPE_INT32  # the same varint on the wire
        else:
            added.type = f.type  # type: ignore[assignment]
            if repeated and f.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
                # Scalars stay as they are (packed or not: both parse); only their count matters.
                added.options.packed = True
        if f.type == FieldDescriptor.TYPE_STRING:
            # No UTF-8 check here: the full parse that follows makes it.
            added.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    file_proto = descriptor_pb2.FileDescriptorProto(
        name=f"{_SHALLOW_PACKAGE}/{name}.proto", package=_SHALLOW_PACKAGE, syntax="proto3"
    )
    file_proto.message_type.append(proto)
    _SHALLOW_POOL.Add(file_proto)
    shallow = _SHALLOW_POOL.FindMessageTypeByName(f"{_SHALLOW_PACKAGE}.{name}")
    cls = message_factory.GetMessageClass(shallow)
    _SHALLOW_CLASSES[descriptor.full_name] = cls
    return cls


@dataclass(frozen=True)
class _Node:
    """The counts to check in one message type: field name -> (max elements, node for each element)."""

    descriptor: Any
    counts: dict[str, tuple[int | None, _Node | None]] = field(default_factory=dict)

    def check(self, raw: bytes, prefix: str, bad: list[tuple[str, str]]) -> None:
        shallow = _shallow_class(self.descriptor).FromString(raw)
        for name, (most, child) in self.counts.items():
            f = self.descriptor.fields_by_name[name]
            path = f"{prefix}{name}"
            if _is_repeated(f):
                values = getattr(shallow, name)
                if most is not None and len(values) > most:
                    bad.append((path, f"at most {most} {'entries' if _is_map(f) else 'elements'}"))
                    continue
                if child is not None:
                    for i, element in enumerate(values):
                        child.check(element, f"{path}[{i}].", bad)
                        if bad:
                            return
            elif child is not None:
                child.check(getattr(shallow, name), f"{path}.", bad)
            if bad:
                return


def _build(descriptor: Any, counts: Mapping[str, int]) -> _Node:
    node = _Node(descriptor)
    nested: dict[str, dict[str, int]] = {}
    for path, most in counts.items():
        head, _, rest = path.partition(".")
        if head not in descriptor.fields_by_name:
            raise ValueError(f"{descriptor.full_name} has no field {head!r}")
        if rest:
            nested.setdefault(head, {})[rest] = most
        else:
            if not _is_repeated(descriptor.fields_by_name[head]):
                raise ValueError(f"{descriptor.full_name}.{head} is not repeated")
            node.counts[head] = (most, None)
    for head, inner in nested.items():
        f = descriptor.fields_by_name[head]
        if f.type != FieldDescriptor.TYPE_MESSAGE or _is_map(f):
            raise ValueError(f"{descriptor.full_name}.{head} has no fields to count")
        own = node.counts.get(head, (None, None))[0]
        node.counts[head] = (own, _build(f.message_type, inner))
    return node


@dataclass(frozen=True)
class RequestLimit:
    """What one method accepts before its request is parsed: at most `max_bytes` (named by
    `setting` in the refusal), and at most `counts[path]` elements in each counted repeated field
    ("messages", "messages.tool_calls"). A repeated field of messages or strings that is not
    counted is refused at construction: every element a caller sends counts toward some limit."""

    message: type[Message]
    max_bytes: int
    setting: str
    counts: Mapping[str, int] = field(default_factory=dict)
    # Repeated scalar fields (packed numbers: a few bytes each, parsed into flat arrays) may be
    # left to the byte limit and the handler's own check.
    _root: _Node = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        descriptor: Any = self.message.DESCRIPTOR
        uncounted = [p for p in repeated_paths(descriptor) if p not in self.counts and not _scalar(descriptor, p)]
        if uncounted:
            raise ValueError(f"{descriptor.full_name}: no count limit for {', '.join(uncounted)}")
        object.__setattr__(self, "_root", _build(descriptor, self.counts))

    def refusal(self, raw: bytes, method: str) -> InvalidArgument | None:
        """Why `raw` is refused unparsed, or None when it may be parsed in full."""
        if len(raw) > self.max_bytes:
            # Named by the field that holds most of it, as far as a bounded look can tell.
            where, _ = largest_field(self.message.DESCRIPTOR, raw)
            return InvalidArgument(
                [(where, f"request is {len(raw)} bytes; {method} takes at most {self.max_bytes} ({self.setting})")]
            )
        if len(raw) <= COUNT_ABOVE_BYTES:
            return None
        bad: list[tuple[str, str]] = []
        try:
            self._root.check(raw, "", bad)
        except DecodeError:
            return None  # the full parse says what is wrong with it
        return InvalidArgument(bad) if bad else None


def _scalar(descriptor: Any, path: str) -> bool:
    f: Any = None
    current = descriptor
    for part in path.split("."):
        f = current.fields_by_name[part]
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            current = f.message_type
    return f is not None and f.type not in (
        FieldDescriptor.TYPE_MESSAGE,
        FieldDescriptor.TYPE_STRING,
        FieldDescriptor.TYPE_BYTES,
    )


# How far `largest_field` looks: fields read per message, and messages descended into.
_LOOK_FIELDS = 64
_LOOK_DEPTH = 4


def largest_field(descriptor: Any, data: bytes) -> tuple[str, int]:
    """The path of the field holding most of `raw`'s bytes ("tools[0].parameters") and its size,
    read from the wire format without parsing: at most _LOOK_FIELDS fields of each message on
    the way down, so it costs the same whatever the request holds. ("", 0) when nothing is found."""
    path, size = "", 0
    raw = memoryview(data)  # descending looks at slices of it, never copies
    for _ in range(_LOOK_DEPTH):
        sizes: dict[int, int] = {}
        biggest: dict[int, tuple[int, int, int]] = {}  # number -> (size, start, index) of its biggest element
        counts: dict[int, int] = {}
        for number, key_start, start, end in _fields(raw, _LOOK_FIELDS):
            sizes[number] = sizes.get(number, 0) + end - key_start
            index = counts.get(number, 0)
            counts[number] = index + 1
            if end - start > biggest.get(number, (-1, 0, 0))[0]:
                biggest[number] = (end - start, start, index)
        if not sizes:
            break
        number = max(sizes, key=lambda n: sizes[n])
        f = descriptor.fields_by_number.get(number)
        if f is None:
            break
        element_size, start, index = biggest[number]
        repeated = _is_repeated(f)
        if repeated and not _is_map(f) and f.type == FieldDescriptor.TYPE_MESSAGE and sizes[number] < 2 * element_size:
            # One element holds most of it: name the element and look inside it.
            path, size = f"{path}{f.name}[{index}]", element_size
        else:
            path, size = f"{path}{f.name}", sizes[number]
            if repeated or f.type != FieldDescriptor.TYPE_MESSAGE:
                break
        if f.type != FieldDescriptor.TYPE_MESSAGE or _is_map(f):
            break
        descriptor = f.message_type
        raw = raw[start : start + element_size]
        path += "."
    return path.rstrip("."), size


def _fields(raw: bytes | memoryview, most: int) -> list[tuple[int, int, int, int]]:
    """The first `most` fields of a message's wire bytes: (number, key start, payload start,
    payload end). Stops quietly at anything malformed (the full parse reports it)."""
    found: list[tuple[int, int, int, int]] = []
    i, n = 0, len(raw)
    while i < n and len(found) < most:
        key_start = i
        key, i = _varint(raw, i)
        if i < 0:
            break
        number, kind = key >> 3, key & 7
        if kind == 0:
            _, end = _varint(raw, i)
            if end < 0:
                break
            start = i
        elif kind == 1:
            start, end = i, i + 8
        elif kind == 5:
            start, end = i, i + 4
        elif kind == 2:
            length, start = _varint(raw, i)
            if start < 0:
                break
            end = start + length
        else:
            break
        if end > n:
            break
        found.append((number, key_start, start, end))
        i = end
    return found


def _varint(raw: bytes | memoryview, i: int) -> tuple[int, int]:
    """The varint at `i` and the index after it; (0, -1) when it runs off the end or past 10 bytes."""
    value = shift = 0
    for j in range(i, min(i + 10, len(raw))):
        byte = raw[j]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, j + 1
        shift += 7
    return 0, -1
