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

A hybrid model's cache has several groups (``ricllm.cache.kv_groups``), one block table each per
sequence, every table as long as group 0's (``block_table``); groups 1.. are ``Sequence.group_tables``.
Each group allocates a block at every new position, so a step's writes land in every group, and
a sliding-window group lets go of each block no later query of its window reads, as a windowed
sequence's group 0 does. Their full blocks are cached under the group's own key of group 0's
chained hash (``group_key``). A cached prefix is a hit only where every group holds what the
prefix's next query reads: group 0 every block, a sliding-window group the blocks of its window
before the first recomputed token. A pin holds those same blocks (for a prefix shorter than the
window: all of them), so a pinned template is a hit in every group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from ricllm.cache.block_pool import Block, BlockPool, hash_block
from ricllm.kv_window import EVICTED, KVWindow
from ricllm.lora_request import AdapterSlot
from ricllm.sequence import BlockGrant, Sequence


def chain_root(adapter: AdapterSlot | None) -> int | None:
    """The parent of a sequence's first block hash: None for the base model, else its adapter's."""
    return None if adapter is None else hash(("lora", adapter.content_hash))


def group_key(group: int, block_hash: int) -> int:
    """Where cache group ``group`` (1..) files its block at the position group 0 hashes ``block_hash``."""
    return hash(("group", group, block_hash))


def needed_positions(window: KVWindow | None, num_computed: int, block_size: int) -> range | list[int]:
    """Block positions a sequence with ``num_computed`` tokens computed still reads under ``window``:
    all of them, or those not evictable."""
    num_blocks = -(-num_computed // block_size)
    if window is None:
        return range(num_blocks)
    gone = window.evictable(num_computed, block_size)
    return [i for i in range(num_blocks) if i not in gone]


class PrefixHit(list):
    """A prompt's leading cached blocks in group 0 (the list itself: one group's hit is a plain list
    of blocks); ``group_blocks[g - 1][i]`` is group ``g``'s cached block at position ``i``, None where
    it has none: the hit holds one at every position the group's window reads from the first
    recomputed token on (``needed_positions``), and a sequence takes only those."""

    def __init__(self, blocks: list[Block], group_blocks: list[list[Block | None]]):
        super().__init__(blocks)
        self.group_blocks = group_blocks


@dataclass
class PinHandle:
    """A prefix kept resident: its full blocks hold a reference until ``unpin``."""

    handle_id: int
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)  # every group's


class KVCacheManager:
    """``group_windows``: the layer windows of cache groups 1.. (``kv_groups.sliding_windows``; 0: a
    group of full-attention layers); empty for a one-group cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: tuple[int, ...] = ()):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.group_windows = group_windows
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

    def find_cached_prefix(self, token_ids: list[int], adapter: AdapterSlot | None = None,
                           group_windows: tuple[KVWindow | None, ...] | None = None) -> list[Block]:
        """Leading full blocks of ``token_ids`` already cached under ``adapter`` (None: the base
        model), leaving the last token uncached. With several cache groups, a ``PrefixHit`` cut to
        where every group holds what a sequence keeping ``group_windows`` reads (the sequence's
        ``Sequence.group_windows``; None: the layers' own windows)."""
        if not self.enable_prefix_caching:
            return [] if not self.group_windows else PrefixHit([], [[] for _ in self.group_windows])
        hits = self._cached_blocks_from(token_ids, 0, chain_root(adapter))
        if not self.group_windows:
            return hits
        return self._hit_in_every_group(token_ids, hits, self.layer_windows if group_windows is None else group_windows)

    def _cached_blocks_from(self, token_ids: list[int], start: int, parent: int | None) -> list[Block]:
        """Cached full blocks of ``token_ids`` from block ``start`` on (``parent``: the chained hash
        before it), up to the first miss, leaving the last token uncached."""
        hits = []
        for i in range(start, (len(token_ids) - 1) // self.block_size):
            chunk = token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = hash_block(parent, chunk)
            block = self.pool.lookup(parent, chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    @property
    def layer_windows(self) -> tuple[KVWindow | None, ...]:
        """What groups 1.. keep of a sequence without a window of its own."""
        return tuple(KVWindow(0, w) if w else None for w in self.group_windows)

    def _hit_in_every_group(self, token_ids: list[int], hits: list[Block],
                            windows: tuple[KVWindow | None, ...]) -> PrefixHit:
        """The longest leading part of group 0's ``hits`` that every other group can serve too: each
        group's cached blocks looked up once, then each length checked by counting the misses among
        the positions its window reads."""
        chunks = [token_ids[i * self.block_size:(i + 1) * self.block_size] for i in range(len(hits))]
        found = [[self.pool.lookup(group_key(g, block.block_hash), chunk) for block, chunk in zip(hits, chunks)]
                 for g in range(1, len(windows) + 1)]
        misses = [list(accumulate((block is None for block in blocks), initial=0)) for blocks in found]
        for length in range(len(hits), 0, -1):
            if all(self._reads_only_cached(w, m, length) for w, m in zip(windows, misses)):
                return PrefixHit(hits[:length], [blocks[:length] for blocks in found])
        return PrefixHit([], [[] for _ in windows])

    def _reads_only_cached(self, window: KVWindow | None, misses: list[int], length: int) -> bool:
        """Whether a hit of ``length`` blocks finds every block ``window`` reads (``misses[i]``: how
        many of the first ``i`` positions the group has no cached block for)."""
        gone = window.evictable(length * self.block_size, self.block_size) if window else range(0)
        if not gone:
            return misses[length] == 0
        return misses[gone.start] == 0 and misses[length] == misses[gone.stop]

    def held_blocks_by_group(self, seqs: list[Sequence]) -> tuple[int, ...]:
        """Distinct blocks ``seqs`` hold in each cache group, group 0 first (pins apart)."""
        tables_by_group = zip(*((seq.block_table, *seq.group_tables) for seq in seqs))
        held = tuple(len({b for table in tables for b in table} - {EVICTED}) for tables in tables_by_group)
        return held or (0,) * (1 + len(self.group_windows))

    @property
    def num_pinned_blocks(self) -> int:
        return len({bid for pin in self.pins.values() for bid in pin.block_ids})

    # ------------------------------------------------------------ allocation

    def new_blocks(self, seq: Sequence, num_new_tokens: int, hits: list[Block] = ()) -> int:
        """Blocks the pool must hand out for ``num_new_tokens`` more after ``hits``: one per new
        position in every group."""
        held = len(seq.block_table) + len(hits)
        positions = self.blocks_for_tokens(seq.num_computed_tokens + len(hits) * self.block_size
                                           + num_new_tokens) - held
        return positions * (1 + len(seq.group_tables))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[Block] = ()) -> bool:
        """Enough free blocks for ``num_new_tokens`` more, after reviving the hit blocks."""
        revived = sum(1 for b in self._hit_blocks(seq, hits) if b.ref_count == 0)
        return self.new_blocks(seq, num_new_tokens, hits) + revived <= self.pool.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[Block] = ()) -> BlockGrant | None:
        """Take the hit blocks and enough new ones for ``num_new_tokens``; None, nothing taken, if short."""
        if not self.can_allocate(seq, num_new_tokens, hits):
            return None
        computed = len(hits) * self.block_size if hits else seq.num_computed_tokens
        new = self.blocks_for_tokens(computed + num_new_tokens) - len(seq.block_table) - len(hits)
        held = self._take_hits(seq, hits)
        grant = BlockGrant([*held[0], *(self.pool.allocate().block_id for _ in range(new))],
                           [b.block_hash for b in hits], computed if hits else None,
                           self._count_query(seq, len(hits)) if seq.num_cached_tokens < 0 else None,
                           [[*ids, *(self.pool.allocate().block_id for _ in range(new))] for ids in held[1:]])
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used)
        return grant

    def hold_prefix(self, seq: Sequence, hits: list[Block]) -> BlockGrant:
        """Take a waiting sequence's prefix hits before it is scheduled: admission credited them to
        its bound, and a cached block nobody holds may be evicted by any allocation until then.
        The sequence then starts ``len(hits)`` blocks in, as if scheduled with them."""
        held = self._take_hits(seq, hits)
        return BlockGrant(held[0], [b.block_hash for b in hits], len(hits) * self.block_size,
                          self._count_query(seq, len(hits)), held[1:])

    def extend_held_prefix(self, seq: Sequence) -> BlockGrant | None:
        """Blocks cached since a waiting sequence took its prefix (``hold_prefix``; none, if it had no
        hit then) that continue it: another request computed them, so this one need not. Taken as
        ``hold_prefix`` takes them; None when none continue it, or with several cache groups or a
        window of its own (there the held prefix stays as it was)."""
        held = len(seq.block_table)
        if (self.group_windows or not self.enable_prefix_caching or seq.kv_window is not None
                or seq.num_computed_tokens != held * self.block_size or len(seq.block_hashes) != held):
            return None
        more = self._cached_blocks_from(seq.token_ids, held, seq.block_hashes[-1] if held else chain_root(seq.adapter))
        if not more or not held:
            return self.hold_prefix(seq, more) if more else None
        self.prefix_hits_tokens += len(more) * self.block_size
        cached = (held + len(more)) * self.block_size
        return BlockGrant(self._take(more), [b.block_hash for b in more], cached, cached)

    def _hit_blocks(self, seq: Sequence, hits: list[Block]) -> list[Block]:
        """Every block a hit gives ``seq``: group 0's, and each other group's that its window reads."""
        blocks = list(hits)
        for g, window in enumerate(seq.group_windows):
            needed = needed_positions(window, len(hits) * self.block_size, self.block_size)
            blocks += [hits.group_blocks[g][i] for i in needed]
        return blocks

    def _take_hits(self, seq: Sequence, hits: list[Block]) -> list[list[int]]:
        """Acquire the hit's blocks for ``seq``: each group's block ids, EVICTED where it does not read."""
        held = [self._take(hits)]
        for g, window in enumerate(seq.group_windows):
            needed = set(needed_positions(window, len(hits) * self.block_size, self.block_size))
            held.append([self._take([block])[0] if i in needed else EVICTED
                         for i, block in enumerate(hits.group_blocks[g][:len(hits)])] if hits else [])
        return held

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
            for g, table in enumerate(seq.group_tables, start=1):
                if table[i] != EVICTED:
                    self.pool.register(self.pool.blocks[table[i]], group_key(g, parent), chunk)
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

    def evict_outside_group_windows(self, seq: Sequence) -> list[list[int]]:
        """Release, in each cache group 1.., the blocks its window shows no later query
        (after ``cache_full_blocks``); per group, the block-table positions that went."""
        gone_by_group = []
        for window, table, evicted in zip(seq.group_windows, seq.group_tables, seq.group_evicted):
            gone = []
            if window is not None:
                evictable = window.evictable(seq.num_computed_tokens, self.block_size)
                # the evicted entries are the front of this range (no sinks in a sliding group)
                gone = [i for i in range(evictable.start + evicted, evictable.stop) if table[i] != EVICTED]
            for i in gone:
                self.pool.release(self.pool.blocks[table[i]])
            gone_by_group.append(gone)
        return gone_by_group

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first (tails are evicted before heads); the sequence
        then holds none (``Sequence.drop_blocks``)."""
        for table in (seq.block_table, *seq.group_tables):
            for block_id in reversed(table):
                if block_id != EVICTED:
                    self.pool.release(self.pool.blocks[block_id])

    # ------------------------------------------------------------ pins

    def pin(self, seq: Sequence, handle: PinHandle) -> None:
        """Keep the sequence's full prompt blocks resident under ``handle`` (call before ``free``)."""
        if seq.num_evicted_blocks:
            raise ValueError(f"request {seq.request_id} evicted part of its prompt (kv_window): a pinned "
                             "template keeps its whole prompt, so it must run without a window")
        num_full = min(seq.num_prompt_tokens, seq.num_computed_tokens) // self.block_size
        held = list(seq.block_table[:num_full])
        for table, window in zip(seq.group_tables, self.layer_windows):
            held += [table[i] for i in needed_positions(window, num_full * self.block_size, self.block_size)]
        if EVICTED in held:
            raise ValueError(f"request {seq.request_id} let part of its prompt go: a pinned template keeps "
                             "what a hit on it reads, so it must run keeping every block")
        for block_id in held:
            self.pool.acquire(self.pool.blocks[block_id])
            handle.block_ids.append(block_id)
        self.pins[handle.handle_id] = handle

    def blocks_to_pin(self, num_tokens: int) -> int:
        """Blocks a pin of ``num_tokens`` holds: its full blocks in group 0, and in every other group
        those a hit on it reads (all of them for a prefix shorter than the group's window)."""
        num_full = num_tokens // self.block_size
        return num_full + sum(len(needed_positions(w, num_full * self.block_size, self.block_size))
                              for w in self.layer_windows)

    def unpin(self, handle: PinHandle) -> None:
        for block_id in reversed(handle.block_ids):
            self.pool.release(self.pool.blocks[block_id])
        handle.block_ids = []
        del self.pins[handle.handle_id]
