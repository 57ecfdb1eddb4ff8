"""The protobuf wire format written by hand: messages the Python protobuf refuses to build
(wrong wire types, invalid UTF-8, fields past their limits) for the bad-input scenarios and the
hostile-input bench."""

from __future__ import annotations

import struct


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative numbers: two's complement, 10 bytes, as protobuf encodes int64 -1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    return varint((field_number << 3) | wire_type)


def f_varint(field_number: int, value: int) -> bytes:
    return tag(field_number, 0) + varint(value)


def f_bytes(field_number: int, value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return tag(field_number, 2) + varint(len(data)) + data


def f_float(field_number: int, value: float) -> bytes:
    return tag(field_number, 5) + struct.pack("<f", value)


def f_fixed32_bits(field_number: int, bits: int) -> bytes:
    return tag(field_number, 5) + struct.pack("<I", bits)


def f_fixed64(field_number: int, value: int) -> bytes:
    return tag(field_number, 1) + struct.pack("<Q", value & ((1 << 64) - 1))


def map_entry(field_number: int, key: bytes | str, value: bytes | str) -> bytes:
    return f_bytes(field_number, f_bytes(1, key) + f_bytes(2, value))
