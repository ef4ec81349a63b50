"""The LoRA adapters a runtime holds, in numbered slots, laid out for ricllm's C kernels: no torch.

The engine loads an adapter into a slot (``load``) and a sequence served under it carries that
slot (``Sequence.adapter.slot``); each step's rows are grouped into segments by slot
(``FlatBatch.lora_segments``) and every projection's output gets its segment's update
(``kernels/cpu_lora.c``). ``LoraSlots`` keeps each adapter's A and Bᵀ as the kernel reads them
(``kernel_weights``), in the activations' type: bf16 for bf16 activations, the native runtime's
(half the bytes each step reads; the kernel sums in fp32 and rounds the output once, as the
projection's own output is rounded), fp32 for fp32 ones. ``table`` is the decoder stack's view of
every slot; ``updates`` gives a projection's per-slot weights to the per-op path.
"""

from __future__ import annotations

from collections.abc import Sequence

from ricllm.kernels.cpu_lora import LoraKernelWeights, kernel_weights, side_by_side
from ricllm.kernels.decoder_stack_call import LoraStepArgument, LoraTable
from ricllm.model.lora import PROJECTIONS, LoraAdapter, projection_shape
from ricllm.model.spec import ModelSpec


def fused_columns(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Where each projection's output lies in the model's fused outputs, ``(first column, width)``:
    q, k and v side by side in a qkv row, gate then up in a gate_up row; o and down alone."""
    q, kv, inter, hidden = spec.q_size, spec.kv_size, spec.intermediate_size, spec.hidden_size
    return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "o": (0, hidden), "gate": (0, inter),
            "up": (inter, inter), "down": (0, hidden)}


# a layer's projections by the product that updates them (those of one product read one input), in
# the order the decoder stack runs the products
PRODUCTS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))


def in_read_order(spec: ModelSpec, weights: dict[tuple[int, str], LoraKernelWeights]
                  ) -> dict[tuple[int, str], LoraKernelWeights]:
    """``weights`` copied into one buffer in the order a decode step reads them: per layer and
    product, the A of each of its projections, then their Bᵀ (the product's first half reads the
    As, its second the Bᵀs). The step's reads of the adapter are then one walk up through memory."""
    groups = [[(layer, name) for name in names if (layer, name) in weights]
              for layer in range(spec.num_layers) for names in PRODUCTS]
    copies = side_by_side([array for group in groups
                           for array in [*(weights[key].a for key in group), *(weights[key].b_t for key in group)]])
    laid_out, at = {}, 0
    for group in groups:
        for i, key in enumerate(group):
            laid_out[key] = LoraKernelWeights(a=copies[at + i], b_t=copies[at + len(group) + i],
                                              scale=weights[key].scale)
        at += 2 * len(group)
    return laid_out


def check_slot(slot: int, capacity: int) -> None:
    if not 0 <= slot < capacity:
        raise ValueError(f"LoRA slot {slot} is out of range: this runtime holds {capacity} adapter"
                         f"{'' if capacity == 1 else 's'} (max_loras), slots 0 to {capacity - 1}"
                         if capacity else f"LoRA slot {slot}: this runtime holds no adapters (max_loras is 0)")


def check_adapter(adapter: LoraAdapter, spec: ModelSpec) -> None:
    """ValueError naming the adapter and the first layer or projection whose shape is not the model's."""
    if len(adapter.layers) != spec.num_layers:
        raise ValueError(f"LoRA adapter {adapter.path} has {len(adapter.layers)} layers; "
                         f"the model ({spec.name or 'its spec'}) has {spec.num_layers}")
    for layer, name, update in adapter.projections():
        in_features, out_features = projection_shape(spec, name)
        if update.a.shape[1] != in_features or update.b.shape != (out_features, update.rank):
            raise ValueError(f"LoRA adapter {adapter.path}: layer {layer} {name} is A {list(update.a.shape)}, "
                             f"B {list(update.b.shape)}; the model ({spec.name or 'its spec'}) needs "
                             f"[rank, {in_features}] and [{out_features}, rank]")


class LoraSlots:
    """``capacity`` slots (``config.max_loras``) of resident adapters in the C kernels' layout."""

    def __init__(self, spec: ModelSpec, capacity: int, *, bf16: bool):
        self.spec, self.capacity, self.bf16 = spec, capacity, bf16
        self.table = LoraTable(capacity, spec.num_layers, bf16=bf16)
        self._slots: list[dict[tuple[int, str], LoraKernelWeights] | None] = [None] * capacity

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Lay ``adapter`` out in ``slot``, replacing what it held; ValueError for a slot out of
        range or an adapter of another shape (the slot is then left as it was)."""
        check_slot(slot, self.capacity)
        check_adapter(adapter, self.spec)
        weights = in_read_order(self.spec, {
            (layer, name): kernel_weights(update.a, update.b, update.scale, bf16=self.bf16)
            for layer, name, update in adapter.projections()})
        for layer in range(self.spec.num_layers):
            for name in PROJECTIONS:
                self.table.set(slot, layer, name, weights.get((layer, name)))
        self._slots[slot] = weights  # after the table points at them: the old arrays go only now

    def unload(self, slot: int) -> None:
        check_slot(slot, self.capacity)
        for layer in range(self.spec.num_layers):
            for name in PROJECTIONS:
                self.table.set(slot, layer, name, None)
        self._slots[slot] = None

    @property
    def nbytes(self) -> int:
        """Bytes of every resident adapter as laid out."""
        return sum(w.nbytes for held in self._slots if held for w in held.values())

    def slot_nbytes(self, slot: int) -> int:
        """Bytes of the adapter in ``slot`` as laid out: what one read of all its updates streams."""
        check_slot(slot, self.capacity)
        return sum(w.nbytes for w in (self._slots[slot] or {}).values())

    def updates(self, layer: int, name: str, segments: Sequence[tuple[int, int, int]]
                ) -> list[tuple[int, int, LoraKernelWeights]]:
        """``(start, end, weights)`` for the segments whose slot updates ``name`` in ``layer``."""
        found = []
        for start, end, slot in segments:
            held = self._slots[slot]
            weights = None if held is None else held.get((layer, name))
            if weights is not None:
                found.append((start, end, weights))
        return found

    def stack_step(self, segments: Sequence[tuple[int, int, int]]) -> LoraStepArgument | None:
        """The decoder stack's LoRA argument for a step's segments; None when there are none."""
        if not segments:
            return None
        for _, _, slot in segments:
            check_slot(slot, self.capacity)
        return self.table.step(segments)
