"""Gemma 3 in the native runtime: ``gemma3.py``'s math as one C call per step (``ricllm_gemma3_decoder_stack``
in ``kernels/cpu_decoder.c``) around a numpy embedding lookup and the packed head. Numpy and ricllm's C
kernels only: this module never imports torch.

    x = round(embed(ids) · round(√hidden))             (as HF and the torch model round it in bf16)
    each layer: Gemma's norms, QK-norm, its base's RoPE table, GeGLU, its view of the cache, and the
                step's LoRA updates of its projections (q and k before QK-norm)
    logits = head(n(x))                                 (c · tanh(logits / c) where the model caps them)

A layer's view is how it attends (``AttentionView``): its cache group's slots and block tables
(``ricllm.cache.kv_groups``), and its sliding window, or the sequence's own ``kv_window`` where that
is narrower, with no sinks; full-attention layers keep a sequence's own sinks and window
(``gemma3.sliding_window_metadata`` is the same rule in torch).
"""

from __future__ import annotations

import numpy as np

from ricllm.cache.kv_groups import kv_cache_groups, layer_groups
from ricllm.engine.runtime.flat_batch import FlatBatch
from ricllm.engine.runtime.native_model import NativeModel, int32_array
from ricllm.kernels.aligned import aligned_empty
from ricllm.kernels.decoder_stack_call import LoraStepArgument
from ricllm.kernels.cpu_lora import from_bf16, to_bf16
from ricllm.kernels.gemma3_stack_call import AttentionView, Gemma3StackCall
from ricllm.model import native_weights
from ricllm.model.native_weights import NativeWeights


def layer_views(spec) -> tuple[list[tuple[int, int]], list[int]]:
    """The distinct ``(cache group, window)`` pairs the layers attend through, and each layer's
    index among them. A one-group cache (every layer of one kind, or a store without groups)
    attends through group 0 with each layer's own window."""
    groups = kv_cache_groups(spec)
    group_of = layer_groups(groups, spec.num_layers) if len(groups) > 1 else [0] * spec.num_layers
    keys = [(group_of[i], spec.layer_window(i)) for i in range(spec.num_layers)]
    views = list(dict.fromkeys(keys))
    return views, [views.index(key) for key in keys]


class NativeGemma3Model(NativeModel):
    """``NativeModel``'s interface; one step = scaled embedding, the Gemma 3 stack, the packed head."""

    def __init__(self, weights: NativeWeights, threads: int):
        from ricllm.kernels.cpu_library import library

        self.weights, self.spec, self.threads = weights, weights.spec, threads
        self._lib = library()
        spec = self.spec
        self.views, layer_view = layer_views(spec)
        self._stack = Gemma3StackCall(
            hidden=spec.hidden_size, heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            inter=spec.intermediate_size, is_bf16=1, eps=spec.rms_norm_eps, scale=spec.attention_scale,
            bits=[layer.projections[p].bits for layer in weights.layers for p in native_weights.PROJECTIONS],
            layer_rope=[1 if spec.layer_window(i) else 0 for i in range(spec.num_layers)],
            layer_view=layer_view, rope_tables=2)
        self._stack.bind_norms([layer.norms[n].ctypes.data for layer in weights.layers
                                for n in native_weights.GEMMA3_NORMS])
        # √hidden in bf16, as the torch model multiplies the bf16 embedding by it
        self._embed_scale = from_bf16(to_bf16(np.array([spec.hidden_size ** 0.5])))[0]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """bf16 rows ``[T, hidden]``: the embedding times √hidden, rounded."""
        rows = super().embed(ids)
        out = aligned_empty(rows.shape, np.uint16)
        out[...] = to_bf16(from_bf16(rows) * self._embed_scale)
        return out

    def forward(self, input_ids: list[int], positions: list[int], flat: FlatBatch,
                lora: LoraStepArgument | None = None) -> np.ndarray:
        x = self.embed(np.asarray(input_ids, dtype=np.int64))
        where = np.asarray(positions, dtype=np.int64)
        cos, sin = (aligned_empty((2, where.size, self.spec.head_dim), np.uint16) for _ in range(2))
        w = self.weights
        for table, (global_rows, local_rows) in ((cos, (w.rope_cos, w.rope_local_cos)),
                                                 (sin, (w.rope_sin, w.rope_local_sin))):
            np.take(global_rows, where, axis=0, out=table[0])
            np.take(local_rows, where, axis=0, out=table[1])
        starts, lens = int32_array(flat.query_start_loc), int32_array(flat.context_lens)
        arrays = [self._view_arrays(flat, group, window) for group, window in self.views]
        views = [AttentionView(slots.ctypes.data, tables.ctypes.data,
                               None if sinks is None else sinks.ctypes.data,
                               None if windows is None else windows.ctypes.data)
                 for slots, tables, sinks, windows in arrays]
        out = aligned_empty(x.shape, x.dtype)
        self._stack.run(x.ctypes.data, out.ctypes.data, w.norm.ctypes.data, cos.ctypes.data, sin.ctypes.data,
                        starts.ctypes.data, lens.ctypes.data, views, rows=x.shape[0], batch=lens.shape[0],
                        table_width=arrays[0][1].shape[1], threads=self.threads, lora=lora)
        return out  # ``arrays`` lived until here: the call read them

    @staticmethod
    def _view_arrays(flat: FlatBatch, group: int, window: int):
        """(slots, tables, sinks, windows) of one view; sinks and windows None when no sequence keeps one."""
        slots = flat.slot_mapping if group == 0 else flat.group_slot_mappings[group - 1]
        tables = flat.block_tables if group == 0 else flat.group_block_tables[group - 1]
        own = flat.kv_windows
        if window == 0:
            sinks, windows = (None, None) if own is None else (int32_array(flat.kv_sinks), int32_array(own))
        else:
            windows = int32_array([w if 0 < w < window else window for w in own] if own is not None
                             else [window] * len(flat.context_lens))
            sinks = np.zeros_like(windows)
        return np.asarray(slots, dtype=np.int64), int32_array(tables), sinks, windows

    def _head(self, hidden: np.ndarray, tiles: np.ndarray | None) -> np.ndarray:
        logits = super()._head(hidden, tiles)
        cap = self.spec.final_logit_softcapping
        if cap is not None:
            np.multiply(np.tanh(logits / np.float32(cap)), np.float32(cap), out=logits)
        return logits
