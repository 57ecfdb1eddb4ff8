"""Property test of "what shapes an answer": random request pairs that differ in exactly one field
that shapes the answer never share a cache entry (exact key, or the scope the semantic tier
filters on), and pairs that differ only in what cannot change the answer always do.

The fields are read from the contract (GenerateRequest and SamplingParams descriptors), so a field
added to either is exercised without editing this file: as shaping, through the generic mutation
(`generic_change`), unless it is listed in NOT_SHAPING. A new field whose generic change the
gateway refuses needs an entry in CHANGES (how to change it validly) or, for a field with
equivalent spellings, in SAME (spellings that must share an entry).

Seed: LLMESH_TEST_SEED (default fixed); the seed is in every failure message.
"""

from __future__ import annotations

import os
import random
import string
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from llmesh.errors import InvalidArgument
from llmesh.v1 import common_pb2, gateway_pb2
from services.cache.keys import Scope, entry_key, normalize_prompt
from services.gateway import core
from services.gateway.core import DEFAULT_SYSTEM_PROMPT, GatewayConfig, validate

SEED = int(os.environ.get("LLMESH_TEST_SEED", "20261201"))
PAIRS = 400
CONFIG = GatewayConfig(
    default_collection="docs",
    default_top_k=4,
    min_context_score=0.2,
    max_prompt_bytes=32 * 1024,
    max_prompt_tokens=4096,
    max_new_tokens=1024,
    default_max_new_tokens=128,
)
# Collections that exist with chunks in them (others: no retrieval happens); their version.
FILLED = {"docs": 7, "kb": 3, "manual": 12}
MODELS = ("", "small", "large")

# Fields that do not shape the answer: changing them never changes the entry.
NOT_SHAPING = {"lane"}
# Fields not compared at all here: whether the cache is used, and n (n > 1 never uses it; n 0 or 1
# is one answer, see SAME).
NOT_COMPARED = {"use_cache", "n"}

Request = gateway_pb2.GenerateRequest


def words(rng: random.Random, n: int = 4) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(n))


def random_sampling(rng: random.Random) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(max_new_tokens=rng.choice([0, 8, 64, 128, 512]))
    if rng.random() < 0.5:
        s.temperature = rng.choice([0.3, 0.7, 1.0, 1.5])
        s.top_p = rng.choice([0.0, 0.5, 0.9, 1.0])
        if rng.random() < 0.5:
            s.seed = rng.randint(0, 2**32)
    s.stop.extend(rng.sample(["\n", "###", "END", "</s>"], rng.randint(0, 2)))
    s.ignore_eos = rng.random() < 0.1
    return s


def random_request(rng: random.Random) -> Request:
    request = Request(
        prompt=words(rng, rng.randint(1, 8)) + rng.choice(["", "?", "."]),
        system_prompt=rng.choice(["", "", "Answer in French.", "Answer with a number only.", words(rng)]),
        top_k=rng.choice([0, 1, 4, 8]),
        collection=rng.choice(["", "docs", "kb", "manual", "empty"]),
        tenant=rng.choice(["", "acme", "beta"]),
        lane=rng.choice(["", "interactive", "batch"]),
        model=rng.choice(MODELS),
    )
    request.sampling.CopyFrom(random_sampling(rng))
    if rng.random() < 0.5:
        request.use_retrieval = rng.random() < 0.7
    if rng.random() < 0.2:
        request.tools.extend(TOOLS)
        request.tool_choice.CopyFrom(rng.choice(CHOICES))
    return request


def key_of(request: Request) -> tuple[str, str]:
    """(exact key, scope digest the semantic tier filters on) of a request, through the gateway's
    validation and scope and the cache's own keys."""
    plan = validate(request, CONFIG)
    model = f"{plan.model}:fake@0123456789abcdef/bfloat16" if plan.model else "fake@0123456789abcdef/bfloat16"
    retrieving = plan.use_retrieval and plan.collection in FILLED
    collection, version = (plan.collection, FILLED[plan.collection]) if retrieving else ("", 0)
    gateway = SimpleNamespace(config=CONFIG)
    scope = Scope.of(core.Gateway.cache_scope(gateway, plan, model, collection, version))  # type: ignore[arg-type]
    return entry_key(normalize_prompt(plan.prompt), scope), scope.digest()


def retrieving(request: Request) -> bool:
    plan = validate(request, CONFIG)
    return plan.use_retrieval and plan.collection in FILLED


def sampled(request: Request) -> bool:
    return request.sampling.temperature > 0


# ----- changes that must give another entry: field -> (applies to this request?, change it)

Change = tuple[Callable[[Request], bool], Callable[[Request, random.Random], None]]


def _other(rng: random.Random, current: object, choices: list[object]) -> object:
    return rng.choice([c for c in choices if c != current])


def _set_system(r: Request, rng: random.Random) -> None:
    effective = r.system_prompt or DEFAULT_SYSTEM_PROMPT
    r.system_prompt = _other(rng, effective, ["Answer in French.", "Answer with a number only.", "Be terse."])  # type: ignore[assignment]


def _set_max_new(r: Request, rng: random.Random) -> None:
    effective = r.sampling.max_new_tokens or CONFIG.default_max_new_tokens
    r.sampling.max_new_tokens = _other(rng, effective, [8, 64, 128, 512])  # type: ignore[assignment]


def _set_temperature(r: Request, rng: random.Random) -> None:
    r.sampling.temperature = _other(rng, round(r.sampling.temperature, 3), [0.0, 0.3, 0.7, 1.0, 1.5])  # type: ignore[assignment]


def _set_top_p(r: Request, rng: random.Random) -> None:
    effective = r.sampling.top_p if 0 < r.sampling.top_p < 1 else 1.0
    new = _other(rng, round(effective, 3), [0.5, 0.9, 1.0])
    r.sampling.top_p = new  # type: ignore[assignment]


def _set_seed(r: Request, rng: random.Random) -> None:
    if r.sampling.HasField("seed") and rng.random() < 0.3:
        r.sampling.ClearField("seed")
    else:
        r.sampling.seed = r.sampling.seed + 1 if r.sampling.HasField("seed") else rng.randint(0, 99)


def _set_stop(r: Request, rng: random.Random) -> None:
    current = set(r.sampling.stop)
    choices = [s for s in (["STOP"], ["\n"], [], ["\n", "STOP"]) if set(s) != current]
    del r.sampling.stop[:]
    r.sampling.stop.extend(rng.choice(choices))


def _set_tenant(r: Request, rng: random.Random) -> None:
    r.tenant = _other(rng, r.tenant or "default", ["default", "acme", "beta", "gamma"])  # type: ignore[assignment]


def _set_collection(r: Request, rng: random.Random) -> None:
    r.collection = _other(rng, r.collection or CONFIG.default_collection, list(FILLED))  # type: ignore[assignment]


def _set_top_k(r: Request, rng: random.Random) -> None:
    r.top_k = _other(rng, r.top_k or CONFIG.default_top_k, [1, 4, 8, 20])  # type: ignore[assignment]


def _converse(r: Request, rng: random.Random) -> None:
    """The same question after an earlier exchange (or another earlier exchange)."""
    question = r.prompt or r.messages[-1].content
    system = r.system_prompt or (r.messages[0].content if r.messages and r.messages[0].role == "system" else "")
    del r.messages[:]
    if system:
        r.messages.add(role="system", content=system)
    r.messages.add(role="user", content="earlier " + words(rng, 2))
    r.messages.add(role="assistant", content=words(rng, 3))
    r.messages.add(role="user", content=question)
    r.prompt, r.system_prompt = "", ""


FORMATS = [
    common_pb2.ResponseFormat(type="json_object"),
    common_pb2.ResponseFormat(type="json_schema", json_schema='{"type": "object"}'),
    common_pb2.ResponseFormat(type="json_schema", json_schema='{"type": "array"}', strict=True),
    common_pb2.ResponseFormat(type="regex", regex="[0-9]+"),
    common_pb2.ResponseFormat(type="choice", choices=["yes", "no"]),
]


def _set_format(r: Request, rng: random.Random) -> None:
    current = r.response_format if r.HasField("response_format") else None
    r.response_format.CopyFrom(_other(rng, current, FORMATS))  # type: ignore[arg-type]


TOOLS = [
    common_pb2.Tool(name="weather", parameters='{"type": "object", "properties": {"city": {"type": "string"}}}'),
    common_pb2.Tool(name="search", description="Search the web."),
]
CHOICES = [
    common_pb2.ToolChoice(mode="required"),
    common_pb2.ToolChoice(mode="function", function="weather"),
    common_pb2.ToolChoice(mode="function", function="search"),
    common_pb2.ToolChoice(mode="none"),
]


def tool_call(r: Request) -> bool:
    return r.tool_choice.mode in ("required", "function")


def _set_tools(r: Request, rng: random.Random) -> None:
    if not r.tools:
        r.tools.extend(TOOLS)
        r.tool_choice.CopyFrom(common_pb2.ToolChoice(mode="none"))
    else:
        r.tools[-1].description = r.tools[-1].description + " " + words(rng, 1)


def _set_choice(r: Request, rng: random.Random) -> None:
    r.tool_choice.CopyFrom(_other(rng, r.tool_choice, CHOICES))  # type: ignore[arg-type]


def _set_float(r: Request, name: str, choices: list[float], rng: random.Random) -> None:
    """Another of `choices` (all exact in float32) for a sampling field."""
    setattr(r.sampling, name, _other(rng, getattr(r.sampling, name), choices))


def _flip_retrieval(r: Request, rng: random.Random) -> None:
    r.use_retrieval = not validate(r, CONFIG).use_retrieval


always: Callable[[Request], bool] = lambda r: True  # noqa: E731

CHANGES: dict[str, Change] = {
    "prompt": (always, lambda r, rng: setattr(r, "prompt", r.prompt + " " + words(rng, 1))),
    "system_prompt": (always, _set_system),
    "model": (always, lambda r, rng: setattr(r, "model", _other(rng, r.model, list(MODELS)))),
    "tenant": (always, _set_tenant),
    "collection": (retrieving, _set_collection),
    "use_retrieval": (retrieving, _flip_retrieval),
    "top_k": (retrieving, _set_top_k),
    "sampling.max_new_tokens": (always, _set_max_new),
    "sampling.temperature": (always, _set_temperature),
    "sampling.top_p": (sampled, _set_top_p),
    "sampling.seed": (sampled, _set_seed),
    "sampling.stop": (always, _set_stop),
    "messages": (always, _converse),
    "response_format": (lambda r: not tool_call(r), _set_format),
    "tools": (always, _set_tools),
    "tool_choice": (lambda r: bool(r.tools), _set_choice),
    "sampling.top_k": (sampled, lambda r, rng: setattr(r.sampling, "top_k", r.sampling.top_k + rng.randint(1, 50))),
    "sampling.min_p": (
        sampled,
        lambda r, rng: setattr(r.sampling, "min_p", _other(rng, r.sampling.min_p, [0.0, 0.05, 0.25])),
    ),
    "sampling.repetition_penalty": (
        always,
        lambda r, rng: setattr(
            r.sampling, "repetition_penalty", _other(rng, r.sampling.repetition_penalty or 1.0, [1.0, 1.25, 1.5])
        ),
    ),
    "sampling.presence_penalty": (
        always,
        lambda r, rng: setattr(
            r.sampling, "presence_penalty", _other(rng, r.sampling.presence_penalty, [0.0, 0.5, -1.0])
        ),
    ),
    "sampling.frequency_penalty": (
        always,
        lambda r, rng: _set_float(r, "frequency_penalty", [0.0, 0.5, -1.0], rng),
    ),
    "sampling.stop_token_ids": (always, lambda r, rng: r.sampling.stop_token_ids.append(1000 + rng.randint(0, 99))),
    "sampling.logit_bias": (
        always,
        lambda r, rng: r.sampling.logit_bias.__setitem__(rng.randint(0, 999), rng.choice([-5.0, 2.5, 100.0])),
    ),
    # Only with logprobs (alone it is refused); a request with logprobs never uses the cache, but
    # its key still differs.
    "sampling.top_logprobs": (
        always,
        lambda r, rng: (
            setattr(r.sampling, "logprobs", True),
            setattr(r.sampling, "top_logprobs", _other(rng, r.sampling.top_logprobs, [1, 3, 20])),
        ),
    ),
    "sampling.ignore_eos": (always, lambda r, rng: setattr(r.sampling, "ignore_eos", not r.sampling.ignore_eos)),
    "sampling.min_new_tokens": (always, lambda r, rng: setattr(r.sampling, "min_new_tokens", 1)),
    # The same text as a raw completion (no template, no system prompt) and as token ids.
    "raw": (always, lambda r, rng: _make_raw(r)),
    "prompt_token_ids": (always, lambda r, rng: _make_raw(r, [rng.randint(0, 999) for _ in range(4)])),
}


def _make_raw(request: Request, ids: list[int] | None = None) -> None:
    request.raw = True
    for name in ("system_prompt", "messages", "tools", "tool_choice"):
        request.ClearField(name)
    if ids:
        request.ClearField("prompt")
        request.use_retrieval = False
        request.prompt_token_ids.extend(ids)


# ----- changes that must keep the entry: name -> (applies?, change)

SAME: dict[str, Change] = {
    "lane": (always, lambda r, rng: setattr(r, "lane", _other(rng, r.lane, ["", "interactive", "batch"]))),
    "prompt whitespace and final mark": (
        always,
        lambda r, rng: setattr(r, "prompt", "  " + r.prompt.rstrip("?.") + rng.choice(["", "?", "."]) + " \n"),
    ),
    "system_prompt default spelled out": (
        lambda r: r.system_prompt in ("", DEFAULT_SYSTEM_PROMPT),
        lambda r, rng: setattr(r, "system_prompt", "" if r.system_prompt else DEFAULT_SYSTEM_PROMPT),
    ),
    "tenant default spelled out": (
        lambda r: r.tenant in ("", "default"),
        lambda r, rng: setattr(r, "tenant", "" if r.tenant else "default"),
    ),
    "max_new_tokens default spelled out": (
        lambda r: r.sampling.max_new_tokens in (0, CONFIG.default_max_new_tokens),
        lambda r, rng: setattr(
            r.sampling, "max_new_tokens", 0 if r.sampling.max_new_tokens else CONFIG.default_max_new_tokens
        ),
    ),
    "greedy top_p and seed": (
        lambda r: not sampled(r),
        lambda r, rng: (setattr(r.sampling, "top_p", rng.choice([0.1, 0.5, 1.0])), setattr(r.sampling, "seed", 5)),
    ),
    "greedy top_k and min_p": (
        lambda r: not sampled(r),
        lambda r, rng: (setattr(r.sampling, "top_k", 40), setattr(r.sampling, "min_p", 0.1)),
    ),
    "repetition penalty 1 or 0": (
        lambda r: r.sampling.repetition_penalty in (0.0, 1.0),
        lambda r, rng: setattr(r.sampling, "repetition_penalty", 1.0 - r.sampling.repetition_penalty),
    ),
    "a zero logit bias": (always, lambda r, rng: r.sampling.logit_bias.__setitem__(5000 + rng.randint(0, 9), 0.0)),
    "top_p 0 or 1": (
        lambda r: sampled(r) and r.sampling.top_p in (0.0, 1.0),
        lambda r, rng: setattr(r.sampling, "top_p", 1.0 - r.sampling.top_p),
    ),
    "stop order and repeats": (
        always,
        lambda r, rng: (
            r.sampling.stop.extend(list(r.sampling.stop)),
            r.sampling.stop.reverse(),
        ),
    ),
    "n 1 spelled out": (
        lambda r: r.n in (0, 1),
        lambda r, rng: setattr(r, "n", 1 - r.n),
    ),
    "a question as one turn": (
        always,
        lambda r, rng: (
            r.messages.extend(
                ([common_pb2.ChatMessage(role="system", content=r.system_prompt)] if r.system_prompt else [])
                + [common_pb2.ChatMessage(role="user", content=r.prompt)]
            ),
            setattr(r, "prompt", ""),
            setattr(r, "system_prompt", ""),
        ),
    ),
    "response_format text spelled out": (
        always,
        lambda r, rng: r.response_format.CopyFrom(common_pb2.ResponseFormat(type=rng.choice(["", "text"]))),
    ),
    "collection default spelled out": (
        lambda r: r.collection in ("", CONFIG.default_collection),
        lambda r, rng: setattr(r, "collection", "" if r.collection else CONFIG.default_collection),
    ),
    "top_k default spelled out": (
        lambda r: r.top_k in (0, CONFIG.default_top_k),
        lambda r, rng: setattr(r, "top_k", 0 if r.top_k else CONFIG.default_top_k),
    ),
    "retrieval settings without retrieval": (
        lambda r: not retrieving(r),
        lambda r, rng: (setattr(r, "top_k", rng.choice([1, 8])), setattr(r, "use_retrieval", False)),
    ),
}


def generic_change(message: object, field: object, rng: random.Random) -> None:
    """Some other valid-looking value for a field the tables above do not know (a new field)."""
    fd = field  # a FieldDescriptor
    name = fd.name  # type: ignore[attr-defined]
    if is_repeated(fd):
        target = getattr(message, name)
        if fd.message_type is not None:  # type: ignore[attr-defined]
            target.add()
        else:
            target.append(_scalar(fd, rng))
        return
    if fd.message_type is not None:  # type: ignore[attr-defined]
        sub = getattr(message, name)
        sub.SetInParent()
        subfields = list(sub.DESCRIPTOR.fields)
        if subfields:
            generic_change(sub, rng.choice(subfields), rng)
        return
    current = getattr(message, name)
    value = _scalar(fd, rng)
    while value == current:
        value = _scalar(fd, rng)
    setattr(message, name, value)


def is_repeated(fd: object) -> bool:
    """FieldDescriptor.label went away in protobuf 7 (is_repeated replaced it)."""
    if hasattr(fd, "is_repeated"):
        return bool(fd.is_repeated)
    return bool(fd.label == fd.LABEL_REPEATED)  # type: ignore[attr-defined]


def _scalar(fd: object, rng: random.Random) -> object:
    t = fd.type  # type: ignore[attr-defined]
    if t == fd.TYPE_STRING:  # type: ignore[attr-defined]
        return words(rng, 2)
    if t == fd.TYPE_BOOL:  # type: ignore[attr-defined]
        return rng.random() < 0.5
    if t in (fd.TYPE_FLOAT, fd.TYPE_DOUBLE):  # type: ignore[attr-defined]
        return rng.choice([0.25, 0.5, 0.75])
    if t == fd.TYPE_ENUM:  # type: ignore[attr-defined]
        return rng.choice([v.number for v in fd.enum_type.values])  # type: ignore[attr-defined]
    if t == fd.TYPE_BYTES:  # type: ignore[attr-defined]
        return rng.randbytes(4)
    return rng.randint(1, 20)


def shaping_fields() -> list[str]:
    """Every field of the contract that shapes the answer: the request's and its sampling's."""
    top = [f.name for f in Request.DESCRIPTOR.fields if f.name not in NOT_SHAPING | NOT_COMPARED | {"sampling"}]
    sampling = [f"sampling.{f.name}" for f in common_pb2.SamplingParams.DESCRIPTOR.fields]
    return top + sampling


def apply_change(request: Request, field: str, rng: random.Random) -> Request | None:
    """A copy of `request` with `field` changed, or None when the change does not apply to it."""
    other = Request()
    other.CopyFrom(request)
    if field in CHANGES:
        applies, change = CHANGES[field]
        if not applies(request):
            return None
        change(other, rng)
        return other
    message: object = other.sampling if field.startswith("sampling.") else other
    descriptor = message.DESCRIPTOR.fields_by_name[field.removeprefix("sampling.")]  # type: ignore[attr-defined]
    generic_change(message, descriptor, rng)
    return other


def test_every_shaping_field_of_the_contract_is_exercised() -> None:
    fields = shaping_fields()
    # The ones this file knows by name, and the ones it changes generically (a new field).
    assert {"prompt", "system_prompt", "sampling.temperature", "top_k"} <= set(fields)
    unknown_to_the_gateway = set(fields) - set(CHANGES)
    rng = random.Random(SEED)
    for field in sorted(unknown_to_the_gateway):
        base = random_request(rng)
        changed = apply_change(base, field, rng)
        assert changed is not None
        try:
            validate(changed, CONFIG)
        except InvalidArgument as exc:  # pragma: no cover - only for a newly added field
            pytest.fail(f"{field}: its generic change is refused ({exc.violations}); add an entry to CHANGES")


def test_requests_differing_in_one_shaping_field_never_share_an_entry() -> None:
    rng = random.Random(SEED)
    fields = shaping_fields()
    tried: Counter[str] = Counter()
    while sum(tried.values()) < PAIRS:
        base = random_request(rng)
        field = rng.choice(fields)
        other = apply_change(base, field, rng)
        if other is None:
            continue
        tried[field] += 1
        (key_a, scope_a), (key_b, scope_b) = key_of(base), key_of(other)
        where = f"seed {SEED}, field {field}:\n{base}\n---\n{other}"
        assert key_a != key_b, f"one exact entry for two different requests ({where})"
        if field != "prompt":  # the semantic tier compares questions only within one identical scope
            assert scope_a != scope_b, f"one semantic scope for two different requests ({where})"
    assert set(tried) == set(fields), f"never exercised: {set(fields) - set(tried)} (seed {SEED})"


def test_requests_differing_only_in_what_cannot_change_the_answer_share_their_entry() -> None:
    rng = random.Random(SEED + 1)
    tried: Counter[str] = Counter()
    while sum(tried.values()) < PAIRS:
        base = random_request(rng)
        name = rng.choice(list(SAME))
        applies, change = SAME[name]
        if not applies(base):
            continue
        other = Request()
        other.CopyFrom(base)
        change(other, rng)
        tried[name] += 1
        assert key_of(base) == key_of(other), f"seed {SEED + 1}, {name}:\n{base}\n---\n{other}"
    assert set(tried) == set(SAME), f"never exercised: {set(SAME) - set(tried)}"


def test_the_system_prompt_is_part_of_the_entry() -> None:
    # The case a user hit through the OpenAI front door.
    french = Request(prompt="What is 2 + 2?", system_prompt="Answer in French.")
    number = Request(prompt="What is 2 + 2?", system_prompt="Answer with a number only.")
    assert key_of(french)[0] != key_of(number)[0]
    assert key_of(french)[1] != key_of(number)[1]
