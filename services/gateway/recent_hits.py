"""Which requests the answer cache served lately, so admission can tell a request that will
almost surely be answered from the cache from one that will generate.

While the mesh is over capacity a cacheable request that would not fit is looked up only
briefly before it is shed (a refusal must stay fast). A request the cache answered a moment ago
is different: it costs the model nothing, so it is looked up as usual and served, and overload
does not shed answers that already exist. The memory is local to this gateway, bounded in size
and age, and only a hint: a remembered request that misses is shed like any other.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

from llmesh.v1 import cache_pb2

MAX_ENTRIES = 65536
# Past this the cache may have expired or evicted the answer: the request is unknown again.
MAX_AGE_S = 300.0


def request_key(prompt: str, scope: cache_pb2.CacheScope) -> bytes:
    """A digest of what the cache answers for: the prompt in its scope (model, tenant,
    collection version, sampling)."""
    digest = hashlib.blake2b(scope.SerializeToString(deterministic=True), digest_size=16)
    digest.update(b"\0")
    digest.update(prompt.encode("utf-8", "surrogatepass"))
    return digest.digest()


class RecentHits:
    """Keys of requests the cache answered within `max_age` seconds, the newest `max_entries`."""

    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        max_age: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_age = max_age
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def hit(self, key: bytes) -> None:
        self._seen[key] = self._clock()
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def missed(self, key: bytes) -> None:
        self._seen.pop(key, None)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes) or key not in self._seen:
            return False
        if self._clock() - self._seen[key] > self.max_age:
            del self._seen[key]
            return False
        return True
