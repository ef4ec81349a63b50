"""Which steps the CPU attention kernel serves whole, as plain numbers (no torch): the ``cpu``
backend reads it, and the runtimes report it as their capabilities
(``ricllm.engine.runtime.capabilities``), the only way it reaches admission, the scheduler and the
latency model."""

from __future__ import annotations

# A step whose prefill part is this small (its rows, and Σ query × context over its sequences)
# attends wholly in the CPU kernel: SDPA's setup outweighs its speed there, and the step can then
# run as one C call (``ricllm.kernels.cpu_decoder``), however many decodes ride along. Above it the
# torch runtime runs the step op by op: the prefill sequences attend in SDPA, or in the C prefill
# kernel where that runs on AMX tiles (SDPA took 1.6-2.8x its time there, 512-2048 tokens:
# ``CpuKernelAttention.large_prefill_in_c``). The native runtime runs every step as one C call.
C_KERNEL_PREFILL_ROWS, C_KERNEL_PREFILL_WORK = 64, 64 * 512


def c_kernel_attends(meta) -> bool:
    """Whether the ``cpu`` backend attends in its C kernel for all of this step and the torch runtime
    may run it as one C call (else, op by op, it splits: SDPA for the prefill sequences, the C
    kernel for the decodes, unless its prefill kernel beats SDPA on this CPU)."""
    return meta.is_decode_only or (meta.prefill_rows <= C_KERNEL_PREFILL_ROWS
                                   and meta.prefill_products <= C_KERNEL_PREFILL_WORK)
