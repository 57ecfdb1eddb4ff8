"""Prompt normalization and cache keys: what makes two requests "the same" for the cache.

The key covers the model, the normalized prompt, every decoding parameter that changes the
answer, the tenant, and the retrieval collection with its version. Greedy and sampled decoding
never share a key: greedy ignores top_p and the seed, so those are left out of greedy keys.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from dataclasses import dataclass, field
from typing import Any

KEY_VERSION = 1


def normalize_prompt(prompt: str) -> str:
    """NFKC, casefold, whitespace collapsed, trailing punctuation removed."""
    text = unicodedata.normalize("NFKC", prompt)
    text = unicodedata.normalize("NFKC", text.casefold())
    text = " ".join(text.split())
    end = len(text)
    while end > 0 and (unicodedata.category(text[end - 1]).startswith("P") or text[end - 1].isspace()):
        end -= 1
    return text[:end]


def _f32(value: float) -> float:
    # Values arrive as protobuf float32: round so 0.7 and 0.699999988 give one key.
    return round(float(value), 5)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def canonical(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_new_tokens": int(self.max_new_tokens),
            "stop": sorted(set(self.stop)),
            "ignore_eos": bool(self.ignore_eos),
        }
        if self.greedy:
            out["mode"] = "greedy"
        else:
            top_p = _f32(self.top_p)
            out.update(
                mode="sample",
                temperature=_f32(self.temperature),
                top_p=top_p if 0.0 < top_p < 1.0 else 1.0,
                seed=self.seed,
            )
        return out

    def digest(self) -> str:
        return _sha(self.canonical())


@dataclass(frozen=True)
class Scope:
    model: str
    tenant: str = ""
    collection: str = ""
    collection_version: int = 0
    sampling: Sampling = field(default_factory=Sampling)

    def canonical(self) -> dict[str, Any]:
        return {
            "v": KEY_VERSION,
            "model": self.model,
            "tenant": self.tenant,
            "collection": self.collection,
            "collection_version": int(self.collection_version),
            "sampling": self.sampling.canonical(),
        }

    def digest(self) -> str:
        """Identifies the scope (everything but the prompt)."""
        return _sha(self.canonical())


def entry_key(normalized_prompt: str, scope: Scope) -> str:
    """sha256 hex of the normalized prompt and the whole scope: the exact-tier key."""
    return _sha({**scope.canonical(), "prompt": normalized_prompt})


def _sha(obj: Any) -> str:
    raw = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def name_digest(name: str) -> str:
    """Short stable id of a tenant or collection name for Redis set keys."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()[:32]
