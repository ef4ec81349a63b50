"""Which blocks each sequence holds: on-demand allocation, prefix-cache hits, pins.

A sequence holds one reference on every block in its ``block_table``; a block shared through
the prefix cache has one reference per holder. Only full blocks are ever shared.

The manager reads a sequence but never writes it: each call takes or releases references in the
pool and hands back what changed (a ``BlockGrant``, the hashes of blocks that became full, the
table positions a window let go), which the sequence records (``Sequence.take_blocks``,
``evict_blocks``, ``drop_blocks``) before the next call about it. So the invariant holds between
calls: the pool's references are exactly the blocks in the sequences' tables and in the pins.

A block's hash chains over every token before it, from a root: none for the base model, the
adapter's content hash for a sequence served under a LoRA adapter (``chain_root``). The adapter
changes every layer's K and V, so a prefix computed under one adapter is never found for another,
nor for the base model; an adapter replaced by another of new content starts a new chain.

The prefix hit of a prompt is capped at ``num_tokens - 1`` tokens (rounded down to whole
blocks): the last token is always recomputed, because its logits are what the first output
token is sampled from, and logits are not cached.

A windowed sequence (``ricllm.kv_window``) drops its reference on each block that no later
query of it can see; its table keeps the entry as ``EVICTED``, so positions still index blocks.
Dropping a reference frees nothing that another holder (a pin, another sequence) still holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ricllm.cache.block_pool import Block, BlockPool, hash_block
from ricllm.kv_window import EVICTED
from ricllm.lora_request import AdapterSlot
from ricllm.sequence import BlockGrant, Sequence


def chain_root(adapter: AdapterSlot | None) -> int | None:
    """The parent of a sequence's first block hash: None for the base model, else its adapter's."""
    return None if adapter is None else hash(("lora", adapter.content_hash))


@dataclass
class PinHandle:
    """A prefix kept resident: its full blocks hold a reference until ``unpin``."""

    handle_id: int
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pins: dict[int, PinHandle] = {}
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.peak_used_blocks = 0

    # ------------------------------------------------------------ lookups

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hash_chain(self, token_ids: list[int], num_blocks: int, adapter: AdapterSlot | None = None) -> list[int]:
        hashes, parent = [], chain_root(adapter)
        for i in range(num_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, token_ids: list[int], adapter: AdapterSlot | None = None) -> list[Block]:
        """Leading full blocks of ``token_ids`` already cached under ``adapter`` (None: the base
        model), leaving the last token uncached."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits, parent = [], chain_root(adapter)
        for i in range(max_blocks):
            chunk = token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = hash_block(parent, chunk)
            block = self.pool.lookup(parent, chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    @property
    def num_pinned_blocks(self) -> int:
        return len({bid for pin in self.pins.values() for bid in pin.block_ids})

    # ------------------------------------------------------------ allocation

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[Block] = ()) -> bool:
        """Enough free blocks for ``num_new_tokens`` more, after reviving the hit blocks."""
        held = len(seq.block_table) + len(hits)
        needed = self.blocks_for_tokens(seq.num_computed_tokens + len(hits) * self.block_size
                                        + num_new_tokens) - held
        revived = sum(1 for b in hits if b.ref_count == 0)
        return needed + revived <= self.pool.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[Block] = ()) -> BlockGrant | None:
        """Take the hit blocks and enough new ones for ``num_new_tokens``; None, nothing taken, if short."""
        if not self.can_allocate(seq, num_new_tokens, hits):
            return None
        computed = len(hits) * self.block_size if hits else seq.num_computed_tokens
        new = self.blocks_for_tokens(computed + num_new_tokens) - len(seq.block_table) - len(hits)
        grant = BlockGrant([*self._take(hits), *(self.pool.allocate().block_id for _ in range(new))],
                           [b.block_hash for b in hits], computed if hits else None,
                           self._count_query(seq, len(hits)) if seq.num_cached_tokens < 0 else None)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used)
        return grant

    def hold_prefix(self, seq: Sequence, hits: list[Block]) -> BlockGrant:
        """Take a waiting sequence's prefix hits before it is scheduled: admission credited them to
        its bound, and a cached block nobody holds may be evicted by any allocation until then.
        The sequence then starts ``len(hits)`` blocks in, as if scheduled with them."""
        return BlockGrant(self._take(hits), [b.block_hash for b in hits], len(hits) * self.block_size,
                          self._count_query(seq, len(hits)))

    def _take(self, hits: list[Block]) -> list[int]:
        for block in hits:
            self.pool.acquire(block)
        return [block.block_id for block in hits]

    def _count_query(self, seq: Sequence, num_hit_blocks: int) -> int:
        """Count a prompt's prefix-cache query; the tokens it hit."""
        hit_tokens = num_hit_blocks * self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries_tokens += seq.num_prompt_tokens
            self.prefix_hits_tokens += hit_tokens
        return hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> list[int]:
        """Register blocks that became full with computed K/V, so later prompts can hit them; their
        chained hashes, for the end of the sequence's ``block_hashes``."""
        if not self.enable_prefix_caching:
            return []
        num_full = seq.num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else chain_root(seq.adapter)
        hashes = []
        for i in range(len(seq.block_hashes), num_full):
            chunk = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = hash_block(parent, chunk)
            if seq.block_table[i] != EVICTED:
                self.pool.register(self.pool.blocks[seq.block_table[i]], parent, chunk)
            hashes.append(parent)
        return hashes

    def evict_outside_window(self, seq: Sequence) -> list[int]:
        """Release the blocks its window no longer shows any later query (after ``cache_full_blocks``,
        so they stay findable by their hashes); the block-table positions that went."""
        if seq.kv_window is None:
            return []
        evictable = seq.kv_window.evictable(seq.num_computed_tokens, self.block_size)
        # the evicted entries are always the front of this range (it only grows): start past them
        gone = [i for i in range(evictable.start + seq.num_evicted_blocks, evictable.stop)
                if seq.block_table[i] != EVICTED]
        for i in gone:
            self.pool.release(self.pool.blocks[seq.block_table[i]])
        return gone

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first (tails are evicted before heads); the sequence
        then holds none (``Sequence.drop_blocks``)."""
        for block_id in reversed(seq.block_table):
            if block_id != EVICTED:
                self.pool.release(self.pool.blocks[block_id])

    # ------------------------------------------------------------ pins

    def pin(self, seq: Sequence, handle: PinHandle) -> None:
        """Keep the sequence's full prompt blocks resident under ``handle`` (call before ``free``)."""
        if seq.num_evicted_blocks:
            raise ValueError(f"request {seq.request_id} evicted part of its prompt (kv_window): a pinned "
                             "template keeps its whole prompt, so it must run without a window")
        num_full = min(seq.num_prompt_tokens, seq.num_computed_tokens) // self.block_size
        for block_id in seq.block_table[:num_full]:
            self.pool.acquire(self.pool.blocks[block_id])
            handle.block_ids.append(block_id)
        self.pins[handle.handle_id] = handle

    def unpin(self, handle: PinHandle) -> None:
        for block_id in reversed(handle.block_ids):
            self.pool.release(self.pool.blocks[block_id])
        handle.block_ids = []
        del self.pins[handle.handle_id]
