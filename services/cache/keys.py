"""Cache keys: what makes two requests "the same" for the cache.

The exact key is the question, normalized only in ways that provably keep its meaning, with the
whole scope (`CacheScope`: model key, tenant, the retrieval used, sampling and the rest of the
request that shapes the answer), keyed on the scope's deterministic serialization: every field,
present and future, unknown ones included, counts. Only equivalences the cache knows to hold are
folded first (`canonical_scope`): greedy decoding ignores top_p and the seed, top_p 0 and 1 are
both "off", stop sequences are a set, and an answer without context has no retrieval settings.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass

from llmesh.v1 import cache_pb2

KEY_VERSION = 2
_KEY_PREFIX = f"llmesh-cache-v{KEY_VERSION}\0".encode()


def normalize_prompt(prompt: str) -> str:
    """The question as the exact tier compares it: canonically equivalent code points composed
    (NFC), surrounding whitespace removed and one final `?` or `.` dropped. Nothing else:
    case, inner whitespace (indentation), brackets, braces, quotes and every other mark count."""
    text = unicodedata.normalize("NFC", prompt).strip()
    if text.endswith(("?", ".")):
        text = text[:-1].rstrip()
    return text


def embedding_text(prompt: str) -> str:
    """What the semantic tier embeds: compatibility-folded, casefolded, whitespace collapsed,
    trailing punctuation removed (the embedding model is uncased; the near-hit guard compares
    the questions as asked, so nothing this folds away can merge two different questions)."""
    text = unicodedata.normalize("NFKC", prompt)
    text = unicodedata.normalize("NFKC", text.casefold())
    text = " ".join(text.split())
    end = len(text)
    while end > 0 and (unicodedata.category(text[end - 1]).startswith("P") or text[end - 1].isspace()):
        end -= 1
    return text[:end]


def canonical_scope(scope: cache_pb2.CacheScope) -> cache_pb2.CacheScope:
    """A copy of the scope with the known equivalences folded (see the module doc)."""
    out = cache_pb2.CacheScope()
    out.CopyFrom(scope)
    s = out.sampling
    if not s.temperature > 0.0:  # greedy (NaN never passes the gateway; here it is greedy too)
        s.temperature = 0.0
        s.top_p = 0.0
        s.ClearField("seed")
    elif s.top_p >= 1.0:
        s.top_p = 0.0  # 0 means 1.0
    if len(s.stop) > 1:
        stop = sorted(set(s.stop))
        del s.stop[:]
        s.stop.extend(stop)
    if not out.collection:
        out.collection_version = 0
        out.retrieval_top_k = 0
        out.retrieval_min_score = 0.0
    return out


@dataclass(frozen=True)
class Scope:
    """A canonical scope and its serialization (computed once per lookup)."""

    msg: cache_pb2.CacheScope
    raw: bytes

    @classmethod
    def of(cls, scope: cache_pb2.CacheScope) -> Scope:
        canonical = canonical_scope(scope)
        return cls(canonical, canonical.SerializeToString(deterministic=True))

    @classmethod
    def make(cls, model: str, tenant: str = "", collection: str = "", collection_version: int = 0) -> Scope:
        """A scope from its main fields (tests and benchmarks)."""
        return cls.of(
            cache_pb2.CacheScope(
                model=model, tenant=tenant, collection=collection, collection_version=collection_version
            )
        )

    @property
    def model(self) -> str:
        return self.msg.model

    @property
    def tenant(self) -> str:
        return self.msg.tenant

    @property
    def collection(self) -> str:
        return self.msg.collection

    @property
    def collection_version(self) -> int:
        return int(self.msg.collection_version)

    def digest(self) -> str:
        """Identifies the scope (everything but the question): what the semantic tier filters on."""
        return hashlib.sha256(_KEY_PREFIX + self.raw).hexdigest()


def entry_key(normalized_prompt: str, scope: Scope) -> str:
    """sha256 hex of the normalized question and the whole scope: the exact-tier key."""
    digest = hashlib.sha256(_KEY_PREFIX)
    digest.update(len(scope.raw).to_bytes(8, "big"))
    digest.update(scope.raw)
    digest.update(normalized_prompt.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def name_digest(*names: str) -> str:
    """Short stable id of a tenant, or of a tenant's collection or model, for Redis set keys."""
    return hashlib.sha256("\0".join(names).encode("utf-8", "surrogatepass")).hexdigest()[:32]
