"""The pool of KV blocks: reference counts, an LRU free queue, and the prefix-cache index.

Invariants
- Every block is either referenced (``ref_count > 0``: held by running sequences or pins) or in
  the free queue, never both; ``num_used + num_free == num_blocks`` at all times.
- A block is *cached* when it carries a hash: it is full, and its K/V holds exactly
  ``token_ids`` after the prefix that the hash chains over. A cached block stays findable after
  its last reference goes (it sits in the free queue and can be revived by a hit) until the pool
  hands it out again; only then is its hash dropped (lazy eviction).
- The free queue runs least- to most-recently released; ``allocate`` takes from the front, so
  the eviction order is LRU. Callers release a sequence's blocks tail first, so that the tails of
  prefix chains are evicted before their heads.
- One hash maps to one block: a block recomputed while an equal one is cached stays unhashed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Key of a full block: its tokens chained to everything before them."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Unreferenced blocks that a prefix hit could still revive."""
        return sum(1 for b in self._free.values() if b.block_hash is not None)

    def allocate(self) -> Block:
        """Take the least recently released free block, evicting its cached content."""
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """The cached block for this hash, if its stored tokens match (guards hash collisions)."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def acquire(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block.block_id} released more often than acquired"
        if block.ref_count == 0:
            self._free[block.block_id] = block

    def register(self, block: Block, block_hash: int, token_ids: Sequence[int]) -> None:
        """Make a newly full block findable, unless an equal block is cached already."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._cached[block_hash] = block
