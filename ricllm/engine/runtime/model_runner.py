"""Turns a scheduled batch into tensors, runs the model once, and returns last-position logits
(for constrained rows, their allowed tokens' logits: ``narrow_head``)."""

from __future__ import annotations

import numpy as np
import torch

from ricllm.attention.metadata import AttentionMetadata
from ricllm.cache.kv_cache import KVCache
from ricllm.engine.runtime.flat_batch import flatten
from ricllm.engine.runtime.llama import LlamaModel
from ricllm.engine.runtime.lora_delta import LoraBatch, TorchLoraSlots, lora_batch
from ricllm.engine.runtime.lora_slots import LoraSlots
from ricllm.engine.runtime.narrow_head import TILE, StepLogits, plan_head, step_logits
from ricllm.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device, lora: LoraSlots | TorchLoraSlots):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.lora = lora
        self.block_size = kv_cache.geometry.block_size
        self.narrow_head = True  # constrained rows on the k-wide head where it is exact (off: the whole head)

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
    def run(self, batch: ScheduledBatch, allowed: list[np.ndarray | None] | None = None
            ) -> tuple[torch.Tensor | StepLogits, list[int]]:
        """Logits ``[N, vocab]`` (fp32) for the rows that sample, and those rows' batch indices;
        with ``allowed`` (per sampled row, its constraint's allowed ids or None) a ``StepLogits``."""
        input_ids, positions, meta, lora, logits_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta, lora)
        hidden = hidden.index_select(0, self._tensor(logits_rows, torch.int64))
        if allowed is None:
            return self.model.compute_logits(hidden), logits_rows
        return self._head(hidden, allowed), logits_rows

    def _head(self, hidden: torch.Tensor, allowed: list[np.ndarray | None]) -> StepLogits:
        narrows = self.narrow_head and self.model.head_narrows(len(allowed))
        plan = plan_head(allowed, self.model.spec.vocab_size // TILE, narrows)
        full = self.model.compute_logits(hidden[self._tensor(plan.full_rows, torch.int64)]) if plan.full_rows else None
        narrow = None
        if plan.narrow_rows:
            rows = hidden[self._tensor(plan.narrow_rows, torch.int64)]
            narrow = self.model.compute_logits_on_tiles(rows, torch.from_numpy(plan.tiles))
        return step_logits(plan, allowed, full, narrow, self._take)

    def _take(self, logits: torch.Tensor, row: int, columns: np.ndarray) -> torch.Tensor:
        return logits[row, torch.from_numpy(columns).to(logits.device)]
