"""What a runtime reports about how it runs steps, for the policies above it to follow.

Admission, the scheduler and the latency model see the hardware only through this: a
``RuntimeCapabilities`` the runtime fills from the kernels it actually runs, handed to them at
construction. None of them imports a kernel's own policy (``ricllm.attention.cpu_policy``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ricllm.attention.cpu_policy import C_KERNEL_PREFILL_ROWS, C_KERNEL_PREFILL_WORK


@dataclass(frozen=True)
class KernelLimits:
    """How much prefill a step may carry and still run in its cheap regime: within both limits
    the step's attention runs in the decode-shaped kernel and, where the runtime has one, the whole
    step is one kernel call; past either, the step runs another way (op by op, or the prefill
    kernel), which costs a fixed amount and dearer prefill tokens of its own."""

    prefill_rows: int  # prefill tokens in the step
    prefill_work: int  # Σ over prefill chunks of chunk length × positions attended

    def cover(self, prefill_rows: int, prefill_work: int) -> bool:
        return prefill_rows <= self.prefill_rows and prefill_work <= self.prefill_work


@dataclass(frozen=True)
class RuntimeCapabilities:
    """``kernel_limits``: None where every step runs alike whatever its prefill (a GPU's kernels,
    the torch reference), so no policy holds a step to a limit."""

    kernel_limits: KernelLimits | None = None


# The C kernels' (``cpu_policy``): the native runtime's, and the torch runtime's with the ``cpu``
# attention backend.
C_KERNEL_LIMITS = KernelLimits(C_KERNEL_PREFILL_ROWS, C_KERNEL_PREFILL_WORK)
C_KERNEL_CAPABILITIES = RuntimeCapabilities(C_KERNEL_LIMITS)
NO_LIMITS = RuntimeCapabilities()
