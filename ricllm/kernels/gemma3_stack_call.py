"""Gemma 3's decoder stack call (``ricllm_gemma3_decoder_stack`` in ``kernels/cpu_decoder.c``) from
plain numbers and addresses: no torch.

It takes the Llama stack's dims and per-layer pointers (``DecoderStackCall``), and beside them each
layer's four extra norms, its RoPE table (the step's ``cos``/``sin`` hold one table per base, one
after another) and its view of the cache: a view is one cache group's slots and block tables with
one sliding window (``AttentionView``), what a layer of that group attends through. A step's LoRA
adapters are the Llama stack's argument (``LoraTable.step``), applied at the same projections.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ricllm.kernels.cpu_library import library
from ricllm.kernels.decoder_stack_call import DecoderStackCall, LoraStepArgument

NORMS_PER_LAYER = 4  # q_norm, k_norm, post_attn_norm, post_ffn_norm (GEMMA3_NORMS in cpu_decoder.c)


class Gemma3Step(ctypes.Structure):
    """``Gemma3Step`` in cpu_decoder.c."""
    _fields_ = [("norms", ctypes.c_void_p), ("layer_rope", ctypes.c_void_p), ("layer_view", ctypes.c_void_p),
                ("view_slots", ctypes.c_void_p), ("view_tables", ctypes.c_void_p), ("view_sinks", ctypes.c_void_p),
                ("view_windows", ctypes.c_void_p), ("lora", ctypes.c_void_p), ("views", ctypes.c_int32),
                ("rope_tables", ctypes.c_int32)]


@dataclass(frozen=True)
class AttentionView:
    """One view's arrays for a step, as addresses: int64 ``slots`` [rows], int32 ``tables``
    [batch, table_width], int32 ``sinks`` and ``windows`` [batch] (both None: no window)."""

    slots: int
    tables: int
    sinks: int | None
    windows: int | None


class Gemma3StackCall(DecoderStackCall):
    """``layer_rope[i]``: layer ``i``'s table among ``rope_tables``; ``layer_view[i]``: its view."""

    def __init__(self, *, layer_rope: list[int], layer_view: list[int], rope_tables: int, **dims):
        super().__init__(**dims)
        if [self._lib.ricllm_gemma3_stack_layout(which) for which in range(2)] != [
                ctypes.sizeof(Gemma3Step), NORMS_PER_LAYER]:
            raise RuntimeError("the Gemma 3 stack's C and Python layouts disagree")
        self.views = max(layer_view) + 1
        self._layer_rope = (ctypes.c_int32 * len(layer_rope))(*layer_rope)
        self._layer_view = (ctypes.c_int32 * len(layer_view))(*layer_view)
        self._rope_tables = rope_tables
        self._norms = None

    def bind_norms(self, addresses: list[int]) -> None:
        """Every layer's q_norm, k_norm, post_attn_norm and post_ffn_norm weights, layer after layer."""
        self._norms = (ctypes.c_void_p * len(addresses))(*addresses)

    def run(self, x: int, out: int, final_norm: int, cos: int, sin: int, starts: int, lens: int,
            views: list[AttentionView], *, rows: int, batch: int, table_width: int, threads: int,
            lora: LoraStepArgument | None = None) -> None:
        """Run the stack on the step: int32 ``starts``/``lens``, ``views`` in view order; ``lora``: the
        step's adapters (``LoraTable.step``), None when no row has one."""
        if len(views) != self.views:
            raise ValueError(f"the stack attends through {self.views} views, the step has {len(views)}")
        self._set(rows=rows, batch=batch, table_width=table_width, num_threads=threads)
        pointers = ctypes.c_void_p * len(views)
        view_arrays = (pointers(*(v.slots for v in views)), pointers(*(v.tables for v in views)),
                       pointers(*(v.sinks for v in views)), pointers(*(v.windows for v in views)))
        step = Gemma3Step(ctypes.addressof(self._norms), ctypes.addressof(self._layer_rope),
                          ctypes.addressof(self._layer_view), *map(ctypes.addressof, view_arrays),
                          None if lora is None else lora.address, len(views), self._rope_tables)
        code = library().ricllm_gemma3_decoder_stack(x, out, self._pointers, self._bits, final_norm, cos, sin, starts,
                                                     lens, ctypes.addressof(step), self._dims, self.eps, self.scale)
        if code != 0:
            raise RuntimeError(f"the CPU Gemma 3 decoder stack failed (code {code})")
