"""The native model and its runner: one step is the embedding lookup, the decoder stack as one
C call for all layers (``kernels/cpu_decoder.c``), prefill chunks included, then the packed head
(on the allowed tokens' tiles only for constrained rows, where that is cheaper: ``narrow_head``).
The step's LoRA segments go to the same call: each projection gets its rows' adapter updates there
(``lora_slots``).
Numpy arrays and ricllm's C kernels only: this module never imports torch. The arrays it hands
to C start on a cache line (``ricllm.kernels.aligned``), as torch's tensors do."""

from __future__ import annotations

import numpy as np

from ricllm.cache.kv_cache import NativeKVCache
from ricllm.engine.runtime.flat_batch import FlatBatch, flatten
from ricllm.engine.runtime.lora_slots import LoraSlots
from ricllm.engine.runtime.narrow_head import TILE, StepLogits, plan_head, step_logits
from ricllm.engine.scheduler import ScheduledBatch
from ricllm.kernels.aligned import aligned_empty
from ricllm.kernels.decoder_stack_call import CACHE_TYPE_CODES, DecoderStackCall, LoraStepArgument, layer_addresses
from ricllm.kernels.team import PinnedTeam
from ricllm.model import native_weights
from ricllm.model.native_weights import NativeWeights, Packed


def int32_array(values) -> np.ndarray:
    """``values`` as a contiguous int32 array: what the kernels take for tables and lengths."""
    return np.ascontiguousarray(values, dtype=np.int32)


class NativeModel:
    """One step = embedding lookup, the decoder stack (one C call), then the packed head."""

    def __init__(self, weights: NativeWeights, threads: int):
        from ricllm.kernels.cpu_library import library

        self.weights, self.spec, self.threads = weights, weights.spec, threads
        self._lib = library()  # the embedding lookup and the head; the stack through its call block
        spec = self.spec
        self._stack = DecoderStackCall(
            hidden=spec.hidden_size, heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            inter=spec.intermediate_size, is_bf16=1, eps=spec.rms_norm_eps, scale=spec.attention_scale,
            bits=[layer.projections[p].bits for layer in weights.layers for p in native_weights.PROJECTIONS])

    def bind_cache(self, kv_cache: NativeKVCache) -> None:
        """Take every layer's weight and K/V pointers once: the arrays live as long as the engine."""
        addresses = []
        for layer, (k, v) in zip(self.weights.layers, kv_cache.layers, strict=True):
            qkv, o, gate_up, down = (packed_addresses(layer.projections[p]) for p in native_weights.PROJECTIONS)
            addresses += layer_addresses(layer.attn_norm.ctypes.data, qkv, o, layer.ffn_norm.ctypes.data, gate_up,
                                         down, k.ctypes.data, v.ctypes.data)
        self._stack.bind(addresses, block_size=kv_cache.geometry.block_size,
                         cache_type=CACHE_TYPE_CODES[kv_cache.geometry.kv_format.name])
        self._kv_cache = kv_cache  # the pointers are into it: keep it alive

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """bf16 rows ``[T, hidden]`` of the embedding."""
        if self.weights.embedding is not None:
            return _take_rows(self.weights.embedding, ids)
        head, hidden = self.weights.head, self.spec.hidden_size
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = aligned_empty((ids.shape[0], hidden), np.uint16)
        code = self._lib.ricllm_quant_rows(head.weight.ctypes.data, head.scales.ctypes.data, head.bits,
                                           ids.ctypes.data, ids.shape[0], hidden, head.out_features,
                                           out.ctypes.data, 1)
        if code != 0:
            raise IndexError(f"token id out of range [0, {head.out_features})")
        return out

    def forward(self, input_ids: list[int], positions: list[int], flat: FlatBatch,
                lora: LoraStepArgument | None = None) -> np.ndarray:
        """Hidden states ``[T, hidden]`` (bf16 bits) after the final norm; writes the step's K/V.
        ``lora``: the step's adapters (``LoraSlots.stack_step``), None when no row has one."""
        x = self.embed(np.asarray(input_ids, dtype=np.int64))
        where = np.asarray(positions, dtype=np.int64)
        cos, sin = self.weights.rope_cos[where], self.weights.rope_sin[where]
        slots = np.asarray(flat.slot_mapping, dtype=np.int64)
        tables, starts, lens = (int32_array(values) for values in (flat.block_tables, flat.query_start_loc,
                                                                   flat.context_lens))
        sinks, windows = (None, None) if flat.kv_windows is None else (int32_array(flat.kv_sinks),
                                                                       int32_array(flat.kv_windows))
        out = aligned_empty(x.shape, x.dtype)
        self._stack(x.ctypes.data, out.ctypes.data, self.weights.norm.ctypes.data, cos.ctypes.data, sin.ctypes.data,
                    slots.ctypes.data, tables.ctypes.data, starts.ctypes.data, lens.ctypes.data,
                    rows=x.shape[0], batch=lens.shape[0], table_width=tables.shape[1], threads=self.threads,
                    sinks=None if sinks is None else sinks.ctypes.data,
                    windows=None if windows is None else windows.ctypes.data, lora=lora)
        return out

    def compute_logits(self, hidden: np.ndarray) -> np.ndarray:
        """fp32 ``[N, vocab]``: the packed head's bf16 products, widened (as the torch runtime)."""
        return self._head(hidden, None)

    def head_narrows(self, rows: int) -> bool:
        """Whether ``compute_logits_on_tiles`` gives each logit as ``compute_logits`` does for up
        to ``rows`` rows: always at 8 bits; at 4 bits where one path serves every row count up
        to ``rows`` (not past AMX's threshold)."""
        from ricllm.kernels.cpu_library import int4_path

        return self.weights.head.bits == 8 or int4_path(rows) == int4_path(1)

    def compute_logits_on_tiles(self, hidden: np.ndarray, tiles: np.ndarray) -> np.ndarray:
        """fp32 ``[N, 16·len(tiles)]``: the logits of the head's 16-row tiles ``tiles`` only, each
        bit for bit the whole head's (``narrow_head``)."""
        return self._head(hidden, np.ascontiguousarray(tiles, dtype=np.int32))

    def _head(self, hidden: np.ndarray, tiles: np.ndarray | None) -> np.ndarray:
        head = self.weights.head
        rows, cols = hidden.shape
        width = head.out_features if tiles is None else 16 * tiles.size
        out = aligned_empty((rows, width), np.uint16)
        scratch = aligned_empty(2 * rows * cols + 8 * rows * (cols // 32), np.uint8)
        arguments = (hidden.ctypes.data, head.weight.ctypes.data, head.scales.ctypes.data, head.offsets.ctypes.data,
                     head.bits, out.ctypes.data, rows, cols, head.out_features)
        if tiles is None:
            code = self._lib.ricllm_quant_gemm(*arguments, 1, scratch.ctypes.data, self.threads)
        else:
            code = self._lib.ricllm_quant_gemm_tiles(*arguments, tiles.ctypes.data, tiles.size, 1,
                                                     scratch.ctypes.data, self.threads)
        if code != 0:
            raise RuntimeError(f"the packed head failed (code {code})")
        logits = aligned_empty(out.shape, np.float32)
        self._lib.ricllm_bf16_to_f32(out.ctypes.data, logits.ctypes.data, out.size, self.threads)
        return logits


def _take_rows(array: np.ndarray, rows) -> np.ndarray:
    """``array[rows]``, copied into an array that starts on a cache line."""
    return np.take(array, rows, axis=0, out=aligned_empty((len(rows), *array.shape[1:]), array.dtype))


def packed_addresses(p: Packed) -> tuple[int, int, int]:
    """A packed projection's (weight, scales, offsets) addresses, as the decoder stacks take them."""
    return p.weight.ctypes.data, p.scales.ctypes.data, p.offsets.ctypes.data


class NativeModelRunner:
    def __init__(self, model: NativeModel, kv_cache: NativeKVCache, lora: LoraSlots, pin_threads: bool = True):
        self.model, self.kv_cache, self.lora = model, kv_cache, lora
        self.block_size = kv_cache.geometry.block_size
        self.narrow_head = True  # constrained rows on the k-wide head where it is exact (off: the whole head)
        self.team = PinnedTeam(model.threads if pin_threads else 1)  # a team of one pins nothing
        model.bind_cache(kv_cache)

    def run(self, batch: ScheduledBatch, allowed: list[np.ndarray | None] | None = None
            ) -> tuple[np.ndarray | StepLogits, list[int]]:
        """Logits ``[N, vocab]`` (fp32) for the rows that sample, and those rows' batch indices;
        with ``allowed`` (per sampled row, its constraint's allowed ids or None) a ``StepLogits``."""
        with self.team.computing():
            return self._run(batch, allowed)

    def _run(self, batch: ScheduledBatch, allowed: list[np.ndarray | None] | None
             ) -> tuple[np.ndarray | StepLogits, list[int]]:
        flat = flatten(batch, self.block_size)
        hidden = self.model.forward(flat.input_ids, flat.positions, flat, self.lora.stack_step(flat.lora_segments))
        hidden = _take_rows(hidden, flat.logits_rows)
        if allowed is None:
            return self.model.compute_logits(hidden), flat.logits_rows
        return self._head(hidden, allowed), flat.logits_rows

    def _head(self, hidden: np.ndarray, allowed: list[np.ndarray | None]) -> StepLogits:
        model = self.model
        plan = plan_head(allowed, model.weights.head.out_features // TILE,
                         self.narrow_head and model.head_narrows(len(allowed)))
        full = model.compute_logits(_take_rows(hidden, plan.full_rows)) if plan.full_rows else None
        narrow = model.compute_logits_on_tiles(_take_rows(hidden, plan.narrow_rows), plan.tiles) \
            if plan.narrow_rows else None
        return step_logits(plan, allowed, full, narrow, lambda matrix, row, columns: matrix[row, columns])
