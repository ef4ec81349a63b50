"""Turns a scheduled batch into tensors, runs the model once, and returns last-position logits."""

from __future__ import annotations

import torch

from ricllm.attention.metadata import AttentionMetadata
from ricllm.cache.kv_cache import KVCache
from ricllm.engine.scheduler import ScheduledBatch
from ricllm.engine.sequence import Sequence
from ricllm.model.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.geometry.block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat ``input_ids``, ``positions``, the attention metadata, and which rows get logits.

        A sequence gets logits only when this step computes its last known token (decode, or
        the final chunk of a prefill); earlier prefill chunks only fill the cache.
        """
        input_ids, positions, slots, starts, context_lens, logits_rows = [], [], [], [0], [], []
        for seq, num_new in batch.items:
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self._slots(seq, start, end)
            starts.append(starts[-1] + num_new)
            context_lens.append(end)
            if end == seq.num_tokens:
                logits_rows.append(starts[-1] - 1)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            query_start_loc=self._tensor(starts, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            block_tables=self._block_tables([seq for seq, _ in batch.items]),
            max_query_len=max(n for _, n in batch.items),
            max_context_len=max(context_lens),
            prefill_rows=sum(n for _, n in batch.items if n > 1),
            prefill_products=sum(n * length for (_, n), length in zip(batch.items, context_lens) if n > 1),
        )
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta, logits_rows

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return self._tensor(rows, torch.int32)

    def _tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Logits ``[N, vocab]`` (fp32) for the rows that sample, and those rows' batch indices."""
        input_ids, positions, meta, logits_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        rows = torch.tensor(logits_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows)), logits_rows
