"""What one engine step tells the attention layers about the flat token batch.

The batch is flat: ``T`` tokens from ``B`` sequences, sequence ``i`` owning tokens
``query_start_loc[i]:query_start_loc[i+1]``. Its K/V already in the cache, plus the
tokens of this step, add up to ``context_lens[i]``; so query ``j`` of sequence ``i`` sits at
position ``context_lens[i] - q_len_i + j`` and sees keys ``0..`` that position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


Part = tuple[torch.Tensor, "AttentionMetadata"]  # rows of the flat batch, and metadata of their sequences


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once by the model runner).

    slot_mapping: ``[T]`` int64, flat cache slot ``block * block_size + offset`` where token
        ``t``'s K/V is written; ``-1`` marks a padding token whose K/V is dropped.
    query_start_loc: ``[B + 1]`` int32, cumulative query lengths.
    context_lens: ``[B]`` int32, tokens each sequence can attend to after this step's write.
    block_tables: ``[B, max_blocks]`` int32, physical block ids; unused entries are 0
        (never read, since positions past ``context_lens`` are masked), evicted ones -1 (never
        read either: outside the sequence's window).
    kv_sinks, kv_windows: ``[B]`` int32 when some sequence of the step keeps a sink + window
        cache (``ricllm.kv_window``): query ``p`` sees key ``j <= p`` iff ``j < sinks`` or
        ``j > p - window``; window 0 is an exact sequence. None when every sequence is exact.
    group_slot_mappings, group_block_tables: a hybrid cache's groups 1.. (``ricllm.cache.kv_groups``),
        each as ``slot_mapping`` and ``block_tables`` are group 0's; empty for a one-group cache.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_context_len: int
    has_padding: bool = False  # some slot_mapping entries are -1 (CUDA-graph style padded batches)
    kv_sinks: torch.Tensor | None = None
    kv_windows: torch.Tensor | None = None
    # the prefill part of the step: sequences with more than one query row (decodes have one)
    prefill_rows: int = 0  # Σ their query lengths
    prefill_products: int = 0  # Σ their query length × context length: the attention work of prefill
    group_slot_mappings: tuple[torch.Tensor, ...] = ()
    group_block_tables: tuple[torch.Tensor, ...] = ()
    # Derived tensors memoized by backends for reuse across layers (gather indices, masks).
    scratch: dict = field(default_factory=dict, repr=False)

    def for_group(self, group: int) -> "AttentionMetadata":
        """The step as the layers of cache group ``group`` attend it: through that group's blocks."""
        if group == 0:
            return self
        return dataclasses.replace(self, slot_mapping=self.group_slot_mappings[group - 1],
                                   block_tables=self.group_block_tables[group - 1],
                                   group_slot_mappings=(), group_block_tables=(), scratch={})

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def split_decodes(self) -> tuple[Part, Part] | None:
        """``((decode rows, their metadata), (prefill rows, theirs))``, or None when the step is not
        a mix: a backend can then attend the two parts with different kernels. Rows index the flat
        batch; each part's metadata describes its sequences alone (no slot mapping: K/V is stored)."""
        starts = self.query_start_loc.tolist()
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        single = [i for i, n in enumerate(lengths) if n == 1]
        if not single or len(single) == len(lengths):
            return None
        multi = [i for i, n in enumerate(lengths) if n > 1]
        return self._part(single, starts, lengths), self._part(multi, starts, lengths)

    def _part(self, seqs: list[int], starts: list[int], lengths: list[int]) -> Part:
        device = self.query_start_loc.device
        rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i] + lengths[i])], device=device)
        index = torch.tensor(seqs, device=device)
        part_starts = [0]
        for i in seqs:
            part_starts.append(part_starts[-1] + lengths[i])
        context_lens = self.context_lens.index_select(0, index).contiguous()
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.new_empty(0),
            query_start_loc=torch.tensor(part_starts, dtype=self.query_start_loc.dtype, device=device),
            context_lens=context_lens, block_tables=self.block_tables.index_select(0, index).contiguous(),
            max_query_len=max(lengths[i] for i in seqs), max_context_len=int(context_lens.max()))
        return rows, meta
