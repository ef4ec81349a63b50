"""Turns a scheduled batch into tensors, runs the model once, and returns last-position logits."""

from __future__ import annotations

import torch

from ricllm.attention.metadata import AttentionMetadata
from ricllm.cache.kv_cache import KVCache
from ricllm.engine.runtime.flat_batch import flatten
from ricllm.engine.runtime.llama import LlamaModel
from ricllm.engine.runtime.lora_delta import LoraBatch, TorchLoraSlots, lora_batch
from ricllm.engine.runtime.lora_slots import LoraSlots
from ricllm.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device, lora: LoraSlots | TorchLoraSlots):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.lora = lora
        self.block_size = kv_cache.geometry.block_size

    def prepare(self, batch: ScheduledBatch
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, LoraBatch | None, list[int]]:
        """Flat ``input_ids``, ``positions``, the attention metadata, the step's adapters (None when
        no row has one), and which rows get logits."""
        flat = flatten(batch, self.block_size)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(flat.slot_mapping, torch.int64),
            query_start_loc=self._tensor(flat.query_start_loc, torch.int32),
            context_lens=self._tensor(flat.context_lens, torch.int32),
            block_tables=self._tensor(flat.block_tables, torch.int32),
            max_query_len=flat.max_query_len,
            max_context_len=max(flat.context_lens),
            prefill_rows=flat.prefill_rows,
            prefill_products=flat.prefill_products,
            kv_sinks=None if flat.kv_sinks is None else self._tensor(flat.kv_sinks, torch.int32),
            kv_windows=None if flat.kv_windows is None else self._tensor(flat.kv_windows, torch.int32),
            group_slot_mappings=tuple(self._tensor(slots, torch.int64) for slots in flat.group_slot_mappings),
            group_block_tables=tuple(self._tensor(tables, torch.int32) for tables in flat.group_block_tables),
        )
        return (self._tensor(flat.input_ids, torch.int64), self._tensor(flat.positions, torch.int64), meta,
                lora_batch(self.lora, flat.lora_segments), flat.logits_rows)

    def _tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Logits ``[N, vocab]`` (fp32) for the rows that sample, and those rows' batch indices."""
        input_ids, positions, meta, lora, logits_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta, lora)
        rows = torch.tensor(logits_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows)), logits_rows
