"""What one engine step tells the attention layers about the flat token batch.

The batch is flat: ``T`` tokens from ``B`` sequences, sequence ``i`` owning tokens
``query_start_loc[i]:query_start_loc[i+1]``. Its K/V already in the cache, plus the
tokens of this step, add up to ``context_lens[i]``; so query ``j`` of sequence ``i`` sits at
position ``context_lens[i] - q_len_i + j`` and sees keys ``0..`` that position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once by the model runner).

    slot_mapping: ``[T]`` int64, flat cache slot ``block * block_size + offset`` where token
        ``t``'s K/V is written; ``-1`` marks a padding token whose K/V is dropped.
    query_start_loc: ``[B + 1]`` int32, cumulative query lengths.
    context_lens: ``[B]`` int32, tokens each sequence can attend to after this step's write.
    block_tables: ``[B, max_blocks]`` int32, physical block ids; unused entries are 0
        (never read, since positions past ``context_lens`` are masked).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_context_len: int
    has_padding: bool = False  # some slot_mapping entries are -1 (CUDA-graph style padded batches)
    query_context_products: int = 0  # Σ query length × context length: the step's attention work
    # Derived tensors memoized by backends for reuse across layers (gather indices, masks).
    scratch: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
