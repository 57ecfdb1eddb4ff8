"""KV memory in fixed-size blocks: the pool, each sequence's block table, reference counts and
the prefix cache. Pure bookkeeping (no torch): which block holds which tokens; the tensors live
in kv.py and are addressed by block id.

* The pool has `num_blocks` blocks of `block_tokens` tokens. Block 0 is the null block: never
  handed out, always zero; every column a row does not own reads it (kv.py), so a masked column
  is a finite zero whatever an earlier owner left in a block.
* A sequence holds a `BlockTable`: the blocks of its tokens in order, exactly as many as its
  tokens fill (the last one partly). A decode step that starts a new block takes one more
  (`grow`); an empty pool answers False and the engine preempts a row.
* Prefix caching: a block that is full is registered under the chained hash of the token ids up
  to its end (llmesh.prefix_hash, the same definition the gateway's prefix routing uses; an
  engine, hence this cache, serves one model version in one dtype, which scopes the hashes).
  A new sequence reuses the longest chain of registered blocks whose tokens equal its own (the
  ids are compared, so a hash collision cannot serve wrong KV) and prefills only the rest. The
  block holding the prompt's last token is never reused: the prefill must compute that token's
  logits, and writing into a shared block is what reuse must never do.
* Reference counts: a reused block is held by every sequence using it. A block nobody holds
  stays cached (evictable) when registered, or goes back to the free heap when not; allocation
  takes free blocks first (the lowest ids: the pages a CPU pool touches stay few) and then evicts
  the least recently released cached block. A held block is never evicted.

The engine's worker thread is the only caller; `stats()` reads plain ints (any thread).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmesh.prefix_hash import ROOT, chain

NULL_BLOCK = 0


@dataclass
class BlockTable:
    """The blocks of one sequence, in token order, and the prefix hashes of its full ones."""

    blocks: list[int] = field(default_factory=list)
    #: hashes[i] is block i's chained hash, for the full blocks registered (or looked up) so far.
    hashes: list[int] = field(default_factory=list)
    #: Tokens at the start whose KV came from the prefix cache (not prefilled by this sequence).
    cached_tokens: int = 0


@dataclass(frozen=True)
class KVStats:
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    hit_tokens: int
    query_tokens: int
    evictions: int


class BlockManager:
    def __init__(self, num_blocks: int, block_tokens: int, prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least one block besides the null block")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...]] = [()] * num_blocks
        self._free = list(range(1, num_blocks))  # a heap
        #: hash -> the block registered under it.
        self._cached: dict[int, int] = {}
        #: Registered blocks nobody holds, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0
        self.query_tokens = 0
        self.evictions = 0

    # ----------------------------------------------------------------- capacity

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def stats(self) -> KVStats:
        return KVStats(
            free_blocks=self.free_blocks,
            total_blocks=self.usable_blocks,
            cached_blocks=self.cached_blocks,
            hit_tokens=self.hit_tokens,
            query_tokens=self.query_tokens,
            evictions=self.evictions,
        )

    def prefix_hashes(self, limit: int = 64) -> tuple[int, ...]:
        """Hashes of cached blocks, the most recently registered first (at most `limit`)."""
        out: list[int] = []
        for h in reversed(self._cached):
            if len(out) >= limit:
                break
            out.append(h)
        return tuple(out)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return self._hash[block] is not None

    # ----------------------------------------------------------------- sequences

    def match(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The longest chain of cached blocks that starts `token_ids` (leaving at least the
        last token to prefill): their ids and hashes. No side effects."""
        if not self.prefix_caching:
            return [], []
        bt = self.block_tokens
        blocks: list[int] = []
        hashes: list[int] = []
        parent = ROOT
        for i in range((len(token_ids) - 1) // bt):
            ids = tuple(token_ids[i * bt : (i + 1) * bt])
            parent = chain(parent, ids)
            block = self._cached.get(parent)
            if block is None or self._tokens[block] != ids:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def allocate(self, token_ids: Sequence[int], reserve: int = 0, reuse: bool = True) -> BlockTable | None:
        """A block table for a sequence about to prefill `token_ids`: the cached prefix reused
        (not with `reuse` False: every token is computed), fresh blocks for the rest. None (and
        nothing taken) when the pool cannot supply them while keeping `reserve` blocks for the
        running rows to grow into."""
        hit_blocks, hashes = self.match(token_ids) if reuse else ([], [])
        # Reused blocks nobody holds yet are counted as free: taking them removes them from it.
        reclaimed = sum(1 for b in hit_blocks if self._refs[b] == 0)
        needed = self.blocks_for(len(token_ids)) - len(hit_blocks)
        if needed + reclaimed + reserve > self.free_blocks:
            return None
        for block in hit_blocks:
            self._hold(block)
        table = BlockTable(list(hit_blocks), list(hashes), len(hit_blocks) * self.block_tokens)
        for _ in range(needed):
            table.blocks.append(self._take())
        self.query_tokens += len(token_ids)
        self.hit_tokens += table.cached_tokens
        return table

    def grow(self, table: BlockTable, tokens: int) -> bool:
        """Makes room in `table` for `tokens` tokens; False (nothing taken) when the pool is empty."""
        needed = self.blocks_for(tokens) - len(table.blocks)
        if needed > self.free_blocks:
            return False
        for _ in range(needed):
            table.blocks.append(self._take())
        return True

    def register(self, table: BlockTable, token_ids: Sequence[int]) -> None:
        """Registers the blocks of `table` that `token_ids` (the sequence's tokens whose KV is
        written) fills completely and that are not registered yet."""
        if not self.prefix_caching:
            return
        bt = self.block_tokens
        full = min(len(token_ids) // bt, len(table.blocks))
        parent = table.hashes[-1] if table.hashes else ROOT
        for i in range(len(table.hashes), full):
            ids = tuple(token_ids[i * bt : (i + 1) * bt])
            parent = chain(parent, ids)
            table.hashes.append(parent)
            block = table.blocks[i]
            if parent in self._cached or self._hash[block] is not None:
                continue  # the same prefix prefilled twice at once: the first copy stays cached
            self._cached[parent] = block
            self._hash[block] = parent
            self._tokens[block] = ids

    def free(self, table: BlockTable) -> None:
        """Releases a sequence's blocks (last first, so a chain's tail is evicted before its head)."""
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if self._hash[block] is not None:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)
        table.blocks = []
        table.hashes = []
        table.cached_tokens = 0

    def forget_cached(self) -> None:
        """Drops every cached block nobody holds (the warm-up's)."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash[block]
            if h is not None:
                del self._cached[h]
            self._hash[block] = None
            self._tokens[block] = ()
            heapq.heappush(self._free, block)

    # ----------------------------------------------------------------- blocks

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _take(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash[block]
            if h is not None:
                del self._cached[h]
            self._hash[block] = None
            self._tokens[block] = ()
            self.evictions += 1
        self._refs[block] = 1
        return block
