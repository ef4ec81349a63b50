"""Sink + window retention: a sequence keeps the K/V of its first ``sinks`` tokens and its last
``window``; the blocks in between go back to the pool as it advances.

Attention is defined per query, not by what happens to be resident: the query at position ``p``
sees key ``j`` iff ``j <= p`` and (``j < sinks`` or ``j > p - window``). So the answer does not
depend on how a prompt was chunked or what else ran in the batch, and a block may go as soon as no
later query can see it: every later query sits at ``p >= num_computed``, so a block entirely
inside ``[sinks, num_computed - window + 1)`` is never read again.

Positions stay the tokens' own (RoPE as computed, no re-rotation as in StreamingLLM): a block's
K/V is then the same whether or not its neighbours were evicted, so prefix-cache hashes stay
valid and recomputation after a preemption reproduces it exactly. The price is that a windowed
sequence still ends at ``max_model_len``; re-rotation buys unbounded length, which a RIC answer of
a few dozen tokens does not need.

Memory: during a step that computes ``c`` tokens, the keys ``[p0 - window + 1, p0 + c)`` of its
first query ``p0`` must be resident, ``n = window + c - 1`` keys spanning at most
``(n - 2) // block_size + 2`` blocks, besides ``ceil(sinks / block_size)`` sink blocks.
That is the most a windowed sequence ever holds (``max_blocks``): S + W + one chunk + two partial
blocks, which admission reserves.
"""

from __future__ import annotations

from dataclasses import dataclass

EVICTED = -1  # a block_table entry whose block went back to the pool (attention never reads it)


@dataclass(frozen=True)
class KVWindow:
    sinks: int
    window: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.sinks < 0:
            raise ValueError(f"a KV window keeps at least 1 recent token and no negative sinks, got "
                             f"window {self.window}, sinks {self.sinks}")

    def evictable(self, num_computed: int, block_size: int) -> range:
        """Block indices that no later query reads: entirely past the sinks and before the window."""
        first = -(-self.sinks // block_size)
        end = max(num_computed - self.window + 1, 0) // block_size
        return range(first, max(first, end))

    def max_blocks(self, chunk: int, block_size: int) -> int:
        """The most blocks the sequence holds at once when steps compute up to ``chunk`` tokens."""
        keys = self.window + chunk - 1
        return -(-self.sinks // block_size) + (keys - 2) // block_size + 2

    def visible(self, key: int, query: int) -> bool:
        return key <= query and (key < self.sinks or key > query - self.window)


def most_blocks(total_tokens: int, window: KVWindow | None, block_size: int, chunk: int) -> int:
    """Blocks a sequence of ``total_tokens`` holds at most: all of them, or what its window keeps."""
    every = -(-total_tokens // block_size)
    return every if window is None else min(every, window.max_blocks(chunk, block_size))


def pinned_blocks_held(pinned_hits: int, window: KVWindow | None, block_size: int) -> int:
    """Of a request's leading pinned blocks, those it holds at its most: all of them, or for a
    windowed request those in its sinks (its window moves past the others, which stay pinned)."""
    return pinned_hits if window is None else min(pinned_hits, -(-window.sinks // block_size))


def group_window(layer_window: int, own: KVWindow | None) -> KVWindow | None:
    """What a cache group whose layers see ``layer_window`` tokens (0: the whole sequence) keeps of
    a sequence whose own window is ``own``: a full-attention group keeps what ``own`` keeps (its
    sinks + window; None: every token); a sliding-window group keeps the layer's window, or
    ``own``'s where that is narrower, and no sinks (the layer reads none)."""
    if layer_window == 0:
        return own
    narrower = own is not None and own.window < layer_window
    return KVWindow(0, own.window if narrower else layer_window)


def window_of(sinks: int | None, window: int | None) -> KVWindow | None:
    """A request's window (None or 0: exact, every token kept)."""
    return KVWindow(sinks or 0, window) if window else None


def reach(window: KVWindow | None) -> int:
    """The most positions a query reads under ``window``: its sinks and window (0: every position)."""
    return 0 if window is None else window.sinks + window.window


def mean_positions_read(attended: int, group_reaches: tuple[int, ...], span: int = 0) -> int | float:
    """K/V positions a sequence's layers read in a step, averaged over its cache groups (each group
    has as many layers: ``ricllm.cache.kv_groups``), when its last query attends to ``attended``
    positions and its first sits ``span`` positions before it: a group of reach ``r``
    (``group_reaches``, groups 1..; 0: every position) reads at most ``r + span`` (the first query's
    reach to the last one's), group 0 is counted whole (a request's own window is not credited: an
    upper bound). Times the bytes of one position across every layer, it is the step's K/V bytes;
    with one group (the Llama family) it is ``attended``."""
    if not group_reaches:
        return attended
    reads = sum(min(attended, r + span) if r else attended for r in group_reaches)
    return (attended + reads) / (1 + len(group_reaches))
