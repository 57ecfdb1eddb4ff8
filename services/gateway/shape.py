"""What shapes an answer: the one definition the answer cache's exact key, its semantic tier's
filter and its scope are built from.

A request's answer depends on the question, on everything else the model is given (the system
prompt, every turn of a conversation, the response format and its schema), on how it decodes
(sampling), on which model answers (its key: name, id, weights digest, dtype), on the tenant
(entries never cross tenants), and on the retrieval actually used (collection, version, chunks
asked for, minimum score). Two requests share a cache entry only when all of these are equal.

The definition is by exclusion, so that a field added to `GenerateRequest` shapes the answer
(and joins the key) without any edit here: `answer_shape` keeps every field of the request
except the ones listed in `OUTSIDE_SHAPE`, each with where it is accounted for instead. Adding a
field that does *not* shape the answer is the one edit: list it there. A field whose value must
be resolved first (a default filled in) is resolved in `answer_shape`. The cache compares the
shape byte for byte (its deterministic serialization), so nothing in it is silently ignored.

The semantic tier compares only the user's question, and only among entries whose every other
part of the scope (this shape included) is identical; `semantic_allowed` says when a request
may be answered by a similar question at all: only a single question (the gateway writes a
conversation that is only a question in the one-turn shorthand first, `core.one_turn_form`), never
a turn of a conversation, where a similar last question after other earlier turns is another
request.
"""

from __future__ import annotations

from llmesh.v1 import cache_pb2, common_pb2, gateway_pb2

# Fields of GenerateRequest that are not part of the shape, and where each is accounted for.
OUTSIDE_SHAPE: dict[str, str] = {
    "prompt": "the question: the exact key's own part, and what the semantic tier compares",
    "sampling": "CacheScope.sampling, after the gateway's defaults; canonicalized by the cache",
    "use_cache": "whether the cache is used at all",
    "lane": "admission priority only",
    "tenant": "CacheScope.tenant ('' resolved to 'default')",
    "model": "CacheScope.model: the model key the name resolved to",
    "collection": "CacheScope.collection: the collection the answer was grounded in ('' for none)",
    "use_retrieval": "CacheScope.collection ('' when no retrieval was used)",
    "top_k": "CacheScope.retrieval_top_k, when retrieval was used",
    "n": "n > 1 never uses the cache (core.validate); 0 and 1 both ask for one answer",
}

# Fields whose presence makes a request more than one question (earlier turns of a
# conversation): such a request is never answered by the semantic tier, only by an exact entry.
MULTI_TURN_FIELDS: tuple[str, ...] = ("messages",)


def answer_shape(request: gateway_pb2.GenerateRequest, system_prompt: str) -> bytes:
    """The part of the request that shapes the answer beyond the scope's own fields, as the
    deterministic serialization of the request less `OUTSIDE_SHAPE`; `system_prompt`: the one
    the model is given ("" resolved to the default), so equal prompts share an entry."""
    shape = gateway_pb2.GenerateRequest()
    shape.CopyFrom(request)
    for name in OUTSIDE_SHAPE:
        shape.ClearField(name)
    if request.raw:
        # A raw completion continues its exact text: the surrounding whitespace and the final
        # mark the exact key's normalization drops change the continuation.
        shape.prompt = request.prompt
    shape.system_prompt = system_prompt
    return shape.SerializeToString(deterministic=True)


def semantic_allowed(request: gateway_pb2.GenerateRequest) -> bool:
    """Whether a similar earlier question may answer this request (the semantic tier): only a
    single question, never a turn of a conversation (see MULTI_TURN_FIELDS)."""
    # A raw completion continues its exact text: a similar text is another continuation.
    return not request.raw and not any(len(getattr(request, name)) for name in MULTI_TURN_FIELDS)


def cache_scope(
    *,
    model: str,
    tenant: str,
    sampling: common_pb2.SamplingParams,
    shape: bytes,
    collection: str = "",
    version: int = 0,
    top_k: int = 0,
    min_score: float = 0.0,
) -> cache_pb2.CacheScope:
    """The scope an answer is stored and looked up under. `collection`, `version`, `top_k` and
    `min_score` describe the retrieval actually used: "" / 0 when the answer had no context."""
    scope = cache_pb2.CacheScope(model=model, tenant=tenant, sampling=sampling, shape=shape)
    if collection:
        scope.collection = collection
        scope.collection_version = version
        scope.retrieval_top_k = top_k
        scope.retrieval_min_score = min_score
    return scope
