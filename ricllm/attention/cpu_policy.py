"""Which steps the CPU attention kernel serves whole, as plain numbers (no torch): the torch
runtime's ``cpu`` backend and the latency model's step features both read it."""

from __future__ import annotations

# A step whose prefill part is this small (its rows, and Σ query × context over its sequences)
# attends wholly in the CPU kernel: SDPA's setup outweighs its speed there, and the step can then
# run as one C call (``ricllm.kernels.cpu_decoder``), however many decodes ride along. Above it
# SDPA's tiled kernel is about twice as fast on the prefill sequences.
C_KERNEL_PREFILL_ROWS, C_KERNEL_PREFILL_WORK = 64, 64 * 512


def c_kernel_attends(meta) -> bool:
    """Whether the ``cpu`` backend attends in its C kernel for all of this step (else it splits:
    SDPA for the prefill sequences, the C kernel for the decodes)."""
    return meta.is_decode_only or (meta.prefill_rows <= C_KERNEL_PREFILL_ROWS
                                   and meta.prefill_products <= C_KERNEL_PREFILL_WORK)
