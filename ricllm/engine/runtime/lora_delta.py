"""LoRA updates for a batch of rows grouped by adapter, in torch: ``lora_delta``, the reference for
the GPU path, the same product as the CPU kernel (``ricllm/kernels/cpu_lora.py``, ``kernels/cpu_lora.c``);
``TorchLoraSlots``, the adapters a torch runtime holds on its device; ``LoraBatch``, a step's
adapters as the torch model (``llama``) adds them to its projections' outputs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ricllm.engine.runtime.lora_slots import LoraSlots, check_adapter, check_slot, fused_columns
from ricllm.kernels.cpu_lora import LoraSegment, apply_lora
from ricllm.kernels.decoder_stack_call import LoraStepArgument
from ricllm.model.lora import LoraAdapter
from ricllm.model.spec import ModelSpec


def lora_delta(x: torch.Tensor, segments: Sequence[tuple[int, int, int]],
               adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]], out_features: int) -> torch.Tensor:
    """What one projection's adapters add to its output ``[rows, out_features]``, fp32.

    ``x [rows, in]`` is the projection's input. Segment ``(start, end, i)`` gives rows
    ``[start, end)`` adapter ``i``'s update ``scale · (x · Aᵀ) · Bᵀ``, where ``adapters[i]`` is
    ``(A [rank, in], B [out, rank], scale)`` on ``x``'s device; rows no segment covers get zeros.
    Products are taken in fp32 whatever ``x``'s type, as the CPU kernel takes them."""
    delta = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    for start, end, index in segments:
        a, b, scale = adapters[index]
        low_rank = x[start:end].float() @ a.float().T
        delta[start:end] = (low_rank * scale) @ b.float().T
    return delta


class TorchLoraSlots:
    """``capacity`` slots (``config.max_loras``) of resident adapters as tensors on ``device`` in the
    activations' type ``dtype``, for ``lora_delta``: the torch runtime's where the C kernels do not
    run (a GPU, the torch reference ops). The same interface as ``LoraSlots``."""

    def __init__(self, spec: ModelSpec, capacity: int, device: torch.device, dtype: torch.dtype):
        self.spec, self.capacity, self.device, self.dtype = spec, capacity, device, dtype
        self._slots: list[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] | None] = [None] * capacity

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` to the device in ``slot``, replacing what it held; ValueError for a slot
        out of range or an adapter of another shape (the slot is then left as it was)."""
        check_slot(slot, self.capacity)
        check_adapter(adapter, self.spec)

        def on_device(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(device=self.device, dtype=self.dtype).contiguous()

        self._slots[slot] = {(layer, name): (on_device(update.a), on_device(update.b), update.scale)
                             for layer, name, update in adapter.projections()}

    def unload(self, slot: int) -> None:
        check_slot(slot, self.capacity)
        self._slots[slot] = None

    @property
    def nbytes(self) -> int:
        """Bytes of every resident adapter as laid out."""
        return sum(a.nbytes + b.nbytes for held in self._slots if held for a, b, _ in held.values())

    def slot_nbytes(self, slot: int) -> int:
        """Bytes of the adapter in ``slot`` as laid out: what one read of all its updates streams."""
        check_slot(slot, self.capacity)
        return sum(a.nbytes + b.nbytes for a, b, _ in (self._slots[slot] or {}).values())

    def updates(self, layer: int, name: str, segments: Sequence[tuple[int, int, int]]
                ) -> tuple[list[tuple[int, int, int]], list[tuple[torch.Tensor, torch.Tensor, float]]]:
        """``lora_delta``'s segments and adapters for ``name`` in ``layer``: the segments whose slot updates it."""
        kept, adapters, index_of = [], [], {}
        for start, end, slot in segments:
            held = self._slots[slot]
            update = None if held is None else held.get((layer, name))
            if update is None:
                continue
            if slot not in index_of:
                index_of[slot] = len(adapters)
                adapters.append(update)
            kept.append((start, end, index_of[slot]))
        return kept, adapters


class LoraBatch:
    """A step's adapters as the torch model adds them: the step's segments over the runtime's slots.
    With ``LoraSlots`` (the CPU with the C kernels) the C kernel adds each update to the tensors' data
    and ``stack_argument`` is the decoder stack's; with ``TorchLoraSlots``, ``lora_delta``'s fp32
    update is added and the sum rounded once to the activations' type, as the kernel rounds it."""

    def __init__(self, slots: LoraSlots | TorchLoraSlots, segments: Sequence[tuple[int, int, int]]):
        self.slots, self.segments = slots, list(segments)
        self.columns = fused_columns(slots.spec)
        in_c = isinstance(slots, LoraSlots)
        self.stack_argument: LoraStepArgument | None = slots.stack_step(self.segments) if in_c else None
        self._add_one = self._add_in_c if in_c else self._add_in_torch

    def layer(self, index: int) -> LoraLayerBatch:
        return LoraLayerBatch(self, index)

    def add(self, layer: int, names: Sequence[str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (a projection's output, the fused one of ``names``) with each named projection's
        updates added in place on its columns, from its input ``x``."""
        for name in names:
            first, width = self.columns[name]
            self._add_one(layer, name, x, y[:, first:first + width])
        return y

    def _add_in_c(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        found = self.slots.updates(layer, name, self.segments)
        if found:
            apply_lora(_as_numpy(x.contiguous()), _as_numpy(y),
                       [LoraSegment(start, end, weights) for start, end, weights in found],
                       threads=torch.get_num_threads())

    def _add_in_torch(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        segments, adapters = self.slots.updates(layer, name, self.segments)
        if not segments:
            return
        delta = lora_delta(x, segments, adapters, y.shape[1])
        for start, end, _ in segments:
            y[start:end] = (y[start:end].float() + delta[start:end]).to(y.dtype)


class LoraLayerBatch:
    """One layer's share of a ``LoraBatch``: what the layer's modules are handed."""

    def __init__(self, batch: LoraBatch, layer: int):
        self.batch, self.index = batch, layer

    def add(self, names: Sequence[str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.batch.add(self.index, names, x, y)


def lora_batch(slots: LoraSlots | TorchLoraSlots, segments: Sequence[tuple[int, int, int]]) -> LoraBatch | None:
    """The step's ``LoraBatch``; None when no row has an adapter (the model then runs as without LoRA)."""
    return LoraBatch(slots, segments) if segments else None


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's data as numpy, no copy: bf16 as its uint16 bit patterns, as the kernels take it."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()
