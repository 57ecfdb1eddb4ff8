"""Bad inputs for every public gateway RPC: crafted raw requests (empty, oversize, negative,
NaN/inf, invalid UTF-8, wrong wire types, unknown fields, huge repeated fields), random bytes and
mutations of valid requests, and how to send one unparsed."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from bench.harness.wire import f_bytes, f_fixed32_bits, f_fixed64, f_float, f_varint, map_entry, tag, varint

GATEWAY = "/llmesh.v1.Gateway/"
GENERATE, STREAM, INGEST, SEARCH = (GATEWAY + m for m in ("Generate", "GenerateStream", "Ingest", "Search"))
EXPECTED_BAD_INPUT_CODES = frozenset({"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED"})


@dataclass(frozen=True)
class BadInput:
    method: str
    label: str
    payload: bytes

    @property
    def stream(self) -> bool:
        return self.method == STREAM


INVALID_UTF8 = {
    "utf8_lone_continuation": b"ok\x80ok",
    "utf8_ff": b"\xff\xfe",
    "utf8_truncated": b"abc\xe2\x82",
    "utf8_overlong_slash": b"\xc0\xaf",
    "utf8_surrogate": b"\xed\xa0\x80",
    "utf8_above_max": b"\xf4\x90\x80\x80",
    "utf8_5_byte": b"\xf8\x88\x80\x80\x80",
}
ODD_VALID_STRINGS = {
    "empty": b"",
    "whitespace": b" \t\n\r ",
    "nul_and_controls": b"a\x00b\x01\x1b[31mc",
    "rtl_and_zero_width": "\u202eevil\u200b\ufeff".encode(),
    "emoji_4k": ("\U0001f600" * 4000).encode(),
}
STRING_OVERSIZE = {"oversize_40k": b"a" * 40_000}
STRING_HEAVY = {"oversize_2mb": b"word " * 400_000}
VARINT_VALUES = {
    "negative_1": -1,
    "negative_min_int32": -(2**31),
    "u32_overflow": 2**32,
    "u32_max": 2**32 - 1,
    "i64_max": 2**63 - 1,
    "u64_max": 2**64 - 1,
}
FLOAT_VALUES = {
    "nan": math.nan,
    "inf": math.inf,
    "neg_inf": -math.inf,
    "negative": -1.0,
    "neg_zero": -0.0,
    "float_max": 3.4e38,
    "denormal": 1e-45,
}
FLOAT_BITS = {"nan_payload": 0x7FC00001, "signalling_nan": 0x7F800001, "neg_nan": 0xFFC00000}


def _wrong_wire_types(field_number: int, kind: str) -> dict[str, bytes]:
    """The field sent with a wire type its declared type cannot take."""
    wrong = {
        "as_fixed64": f_fixed64(field_number, 7),
        "as_group_start": tag(field_number, 3),
        "as_group_pair": tag(field_number, 3) + tag(field_number, 4),
        "as_wire_type_6": tag(field_number, 6) + b"\x01",
        "as_wire_type_7": tag(field_number, 7) + b"\x01",
        "truncated_length": tag(field_number, 2) + varint(100) + b"short",
        "length_past_2gb": tag(field_number, 2) + varint(2**31 + 5) + b"x",
        "truncated_varint": tag(field_number, 0) + b"\xff\xff",
        "varint_11_bytes": tag(field_number, 0) + b"\xff" * 10 + b"\x01",
    }
    if kind in ("string", "message", "map"):
        wrong["as_varint"] = f_varint(field_number, 5)
        wrong["as_fixed32"] = f_fixed32_bits(field_number, 5)
    elif kind == "float":
        wrong["as_varint"] = f_varint(field_number, 5)
        wrong["as_bytes"] = f_bytes(field_number, b"1.5")
    else:  # varint kinds
        wrong["as_bytes_garbage"] = f_bytes(field_number, b"\xff\xff\xff")  # packed-looking but corrupt
        wrong["as_fixed32"] = f_fixed32_bits(field_number, 5)
    return wrong


def _field_variants(field_number: int, kind: str, heavy: bool) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    if kind == "string":
        values = {**ODD_VALID_STRINGS, **INVALID_UTF8, **STRING_OVERSIZE}
        out.update({name: f_bytes(field_number, v) for name, v in values.items()})
        if heavy:
            out.update({name: f_bytes(field_number, v) for name, v in STRING_HEAVY.items()})
    elif kind in ("uint32", "uint64", "bool"):
        out.update({name: f_varint(field_number, v) for name, v in VARINT_VALUES.items()})
        if kind == "bool":
            out["bool_2"] = f_varint(field_number, 2)
    elif kind == "float":
        out.update({name: f_float(field_number, v) for name, v in FLOAT_VALUES.items()})
        out.update({name: f_fixed32_bits(field_number, v) for name, v in FLOAT_BITS.items()})
    out.update(_wrong_wire_types(field_number, kind))
    return out


SAMPLING_FIELDS = {
    "max_new_tokens": (1, "uint32"),
    "temperature": (2, "float"),
    "top_p": (3, "float"),
    "seed": (4, "uint64"),
    "stop": (5, "string"),
    "ignore_eos": (6, "bool"),
}
GENERATE_FIELDS = {
    "prompt": (1, "string"),
    "system_prompt": (2, "string"),
    "use_cache": (4, "bool"),
    "use_retrieval": (5, "bool"),
    "top_k": (6, "uint32"),
    "collection": (7, "string"),
    "tenant": (8, "string"),
    "lane": (9, "string"),
}
INGEST_FIELDS = {
    "collection": (1, "string"),
    "tenant": (2, "string"),
    "chunk_tokens": (4, "uint32"),
    "overlap": (5, "uint32"),
}
DOCUMENT_FIELDS = {"id": (1, "string"), "text": (2, "string")}
SEARCH_FIELDS = {
    "query": (1, "string"),
    "collection": (2, "string"),
    "tenant": (3, "string"),
    "top_k": (4, "uint32"),
    "score_threshold": (5, "float"),
}
FUZZ_COLLECTION = "fuzz"


def _base_generate(prompt: bytes = b"Say hi.", sampling: bytes | None = None) -> bytes:
    sampling = f_varint(1, 4) if sampling is None else sampling
    return f_bytes(1, prompt) + f_bytes(3, sampling) + f_varint(4, 0) + f_bytes(7, FUZZ_COLLECTION)


def _base_sampling() -> bytes:
    return f_varint(1, 4)


def _base_document(doc_id: bytes = b"d1", text: bytes = b"hello fuzz world") -> bytes:
    return f_bytes(1, doc_id) + f_bytes(2, text)


def _base_ingest(document: bytes | None = None) -> bytes:
    return f_bytes(1, FUZZ_COLLECTION) + f_bytes(3, _base_document() if document is None else document)


def _base_search() -> bytes:
    return f_bytes(1, b"hello") + f_bytes(2, FUZZ_COLLECTION)


def crafted_inputs(heavy: bool = True) -> list[BadInput]:
    """Hand-made bad requests for every public gateway RPC. `heavy` adds the multi-megabyte ones."""
    out: list[BadInput] = []
    gen_methods = (GENERATE, STREAM)

    def add(methods: Iterable[str], label: str, payload: bytes) -> None:
        out.extend(BadInput(m, label, payload) for m in methods)

    for method in (*gen_methods, INGEST, SEARCH):
        add([method], "empty_message", b"")
        add([method], "unknown_field_varint", f_varint(99, 1))
        add([method], "unknown_field_bytes", f_bytes(1000, b"\xff\xfe"))
        add([method], "unknown_field_max_number", f_varint(2**29 - 1, 3))
        add([method], "field_number_0", tag(0, 0) + b"\x01")
        add([method], "unknown_enum_like_value", f_varint(77, 2**31 - 1))
        add([method], "stray_group_end", tag(12, 4))
        add([method], "only_a_tag", tag(1, 2))
    # GenerateRequest: every top-level field, then every SamplingParams field.
    for name, (number, kind) in GENERATE_FIELDS.items():
        # Appended after a valid request: a later scalar or string field replaces the earlier one.
        for variant, encoded in _field_variants(number, kind, heavy and name == "prompt").items():
            add(gen_methods, f"{name}:{variant}", _base_generate() + encoded)
    for name, (number, kind) in SAMPLING_FIELDS.items():
        for variant, encoded in _field_variants(number, kind, False).items():
            add(gen_methods, f"sampling.{name}:{variant}", _base_generate(sampling=_base_sampling() + encoded))
    add(gen_methods, "sampling:as_varint", f_bytes(1, b"hi") + f_varint(3, 1))
    add(gen_methods, "sampling:garbage", f_bytes(1, b"hi") + f_bytes(3, b"\xff\xff\xff\xff"))
    add(gen_methods, "sampling:twice_merged", _base_generate() + f_bytes(3, f_varint(1, 2**32 - 1)))
    add(gen_methods, "lane:unknown", _base_generate() + f_bytes(9, b"urgent"))
    add(gen_methods, "lane:batch", _base_generate() + f_bytes(9, b"batch"))
    add(gen_methods, "sampling.stop:5_items", _base_generate(sampling=_base_sampling() + f_bytes(5, b"x") * 5))
    add(gen_methods, "sampling.stop:100k_items", _base_generate(sampling=_base_sampling() + f_bytes(5, b"x") * 100_000))
    add(gen_methods, "sampling.stop:20k_empty", _base_generate(sampling=_base_sampling() + f_bytes(5, b"") * 20_000))
    add(gen_methods, "prompt:repeated_50k", f_bytes(1, b"hi") * 50_000 + f_bytes(3, _base_sampling()))
    add(gen_methods, "max_new_tokens_512_temp_2", _base_generate(sampling=f_varint(1, 512) + f_float(2, 2.0)))
    if heavy:
        add(gen_methods, "oversize_message_9mb", f_bytes(1, b"a" * (9 * 1024 * 1024)))
    # IngestRequest, Document.
    for name, (number, kind) in INGEST_FIELDS.items():
        for variant, encoded in _field_variants(number, kind, False).items():
            add([INGEST], f"{name}:{variant}", _base_ingest() + encoded)
    for name, (number, kind) in DOCUMENT_FIELDS.items():
        for variant, encoded in _field_variants(number, kind, heavy and name == "text").items():
            add([INGEST], f"documents.{name}:{variant}", _base_ingest(_base_document() + encoded))
    add([INGEST], "documents:garbage", f_bytes(1, FUZZ_COLLECTION) + f_bytes(3, b"\xff\xff\xff"))
    add([INGEST], "documents:as_varint", f_bytes(1, FUZZ_COLLECTION) + f_varint(3, 9))
    add([INGEST], "documents:50k_empty", f_bytes(3, b"") * 50_000)
    add([INGEST], "documents:20k_duplicate_ids", f_bytes(3, _base_document()) * 20_000)
    add([INGEST], "documents.text:over_1mib", _base_ingest(_base_document(text=b"z " * 600_000)))
    add(
        [INGEST],
        "documents.metadata:10k_keys",
        _base_ingest(_base_document() + b"".join(map_entry(3, f"k{i}", "v") for i in range(10_000))),
    )
    add([INGEST], "documents.metadata:bad_utf8_key", _base_ingest(_base_document() + map_entry(3, b"\xff", b"v")))
    add([INGEST], "documents.metadata:bad_utf8_value", _base_ingest(_base_document() + map_entry(3, b"k", b"\xc0\xaf")))
    add([INGEST], "documents.metadata:empty_key", _base_ingest(_base_document() + map_entry(3, b"", b"v")))
    add([INGEST], "documents.metadata:quote_key", _base_ingest(_base_document() + map_entry(3, b'a"b', b"v")))
    add([INGEST], "documents.metadata:entry_garbage", _base_ingest(_base_document() + f_bytes(3, b"\x0a\x09")))
    add([INGEST], "chunk_tokens_1_overlap_1", _base_ingest() + f_varint(4, 1) + f_varint(5, 1))
    add([INGEST], "chunk_tokens_over_max", _base_ingest() + f_varint(4, 100_000))
    # SearchRequest.
    for name, (number, kind) in SEARCH_FIELDS.items():
        for variant, encoded in _field_variants(number, kind, heavy and name == "query").items():
            add([SEARCH], f"{name}:{variant}", _base_search() + encoded)
    add([SEARCH], "filter:bad_utf8_key", _base_search() + map_entry(6, b"\xff", b"v"))
    add([SEARCH], "filter:bad_utf8_value", _base_search() + map_entry(6, b"k", b"\xed\xa0\x80"))
    add([SEARCH], "filter:empty_key", _base_search() + map_entry(6, b"", b"v"))
    add([SEARCH], "filter:100k_entries", _base_search() + b"".join(map_entry(6, f"k{i}", "v") for i in range(100_000)))
    add([SEARCH], "filter:entry_garbage", _base_search() + f_bytes(6, b"\xff"))
    return out


def _mutate(payload: bytes, rng: random.Random) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:  # flip a bit
            i = min(pos, len(data) - 1)
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # insert random bytes
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2 and data:  # delete a run
            del data[pos : pos + rng.randint(1, 4)]
        elif op == 3:  # truncate
            del data[pos:]
        else:  # overwrite a byte with a boundary value
            if data:
                data[min(pos, len(data) - 1)] = rng.choice((0x00, 0x7F, 0x80, 0xFF, 0xC0, 0xED))
    return bytes(data)


def random_inputs(count: int, rng: random.Random) -> list[BadInput]:
    """Random bytes and mutations of valid requests, spread over the four RPCs."""
    bases = {GENERATE: _base_generate(), STREAM: _base_generate(), INGEST: _base_ingest(), SEARCH: _base_search()}
    out = []
    methods = list(bases)
    for i in range(count):
        method = methods[i % len(methods)]
        if rng.random() < 0.4:
            out.append(BadInput(method, "random_bytes", rng.randbytes(rng.randint(1, 200))))
        else:
            out.append(BadInput(method, "mutated_valid", _mutate(bases[method], rng)))
    return out


def bad_inputs(count: int, seed: int = 7, heavy: bool = True) -> list[BadInput]:
    crafted = crafted_inputs(heavy)
    return crafted + random_inputs(max(0, count - len(crafted)), random.Random(seed))


async def send_raw(channel: grpc.aio.Channel, item: BadInput, timeout: float) -> tuple[str, str]:
    """(status code name, details) of one raw call; OK for a reply."""
    try:
        if item.stream:
            call = channel.unary_stream(item.method)(item.payload, timeout=timeout)
            async for _ in call:
                pass
        else:
            await channel.unary_unary(item.method)(item.payload, timeout=timeout)
        return "OK", ""
    except grpc.aio.AioRpcError as err:
        return err.code().name, err.details() or ""
