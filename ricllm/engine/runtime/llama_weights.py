"""Weights into a ``LlamaModel``: a checkpoint's ricllm-named tensors copied in (q/k/v and
gate/up fused as they arrive), and projections swapped for packed weight-only ones.

A converting start builds the model on the meta device (``LlamaModel.build(allocate=False)``):
each weight gets its memory as it arrives and each layer is packed as soon as it is complete, so
the whole dense model never exists at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ricllm.engine.runtime.llama import LlamaModel, RotaryEmbedding, rope_inverse_frequencies
from ricllm.errors import ModelLoadError
from ricllm.model.packed_linear import PackedEmbedding, PackedLinear, can_pack, head_max_packed_rows

LAYER_PARTS = ("qkv", "gate_up", "attn_norm", "ffn_norm", "o", "down")
# a file's separate projections, and the fused one each lands in (its parts in order)
FUSED = {"q": ("qkv", ("q", "k", "v")), "k": ("qkv", ("q", "k", "v")), "v": ("qkv", ("q", "k", "v")),
         "gate": ("gate_up", ("gate", "up")), "up": ("gate_up", ("gate", "up"))}


def load_weights(model: LlamaModel, tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device,
                 on_layer_loaded: Callable[[int], None] | None = None) -> None:
    """Copy ricllm-named tensors in, fusing q/k/v and gate/up as they arrive; a weight still on the
    meta device gets its memory on ``device``. ``on_layer_loaded(i)`` runs as soon as layer ``i``
    has all its weights (to pack it then)."""
    pending: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    parts_left = [len(LAYER_PARTS)] * len(model.layers)
    for name, tensor in tensors:
        if name == "rope_freqs":
            inv_freq = rope_inverse_frequencies(model.spec, tensor)
            model.rope = RotaryEmbedding(inv_freq, model.spec.max_position_embeddings).to(model.rope.cos.device)
            continue
        for target in _assign(model, name, tensor, pending, device):
            loaded.add(target)
            if target.startswith("layers."):
                index = int(target.split(".")[1])
                parts_left[index] -= 1
                if parts_left[index] == 0 and on_layer_loaded is not None:
                    on_layer_loaded(index)
    check_complete(model, loaded)


def _assign(model: LlamaModel, name: str, tensor: torch.Tensor, pending: dict[str, torch.Tensor],
            device: torch.device) -> list[str]:
    if not name.startswith("layers."):
        return _assign_global(model, name, tensor, device)
    _, index, part = name.split(".")
    layer = model.layers[int(index)]
    if part in FUSED:
        group, members = FUSED[part]
        pending[f"{index}.{part}"] = tensor
        if not all(f"{index}.{m}" in pending for m in members):
            return []
        tensor = torch.cat([pending.pop(f"{index}.{m}") for m in members], dim=0)
        place_weight(layer.attn.qkv_proj if group == "qkv" else layer.mlp.gate_up_proj, tensor, name, device)
        return [f"layers.{index}.{group}"]
    owners = {"attn_norm": layer.attn_norm, "ffn_norm": layer.ffn_norm, "o": layer.attn.o_proj,
              "down": layer.mlp.down_proj}
    place_weight(owners[part], tensor, name, device)
    return [f"layers.{index}.{part}"]


def _assign_global(model: LlamaModel, name: str, tensor: torch.Tensor, device: torch.device) -> list[str]:
    if name == "lm_head" and model.lm_head is None:
        return []  # a checkpoint may ship an explicit copy of a tied head
    place_weight({"embed": model.embed, "norm": model.norm, "lm_head": model.lm_head}[name], tensor, name, device)
    return [name]


def place_weight(owner: nn.Module, tensor: torch.Tensor, name: str, device: torch.device) -> None:
    """``owner.weight = tensor`` in the weight's dtype: copied into allocated memory, or given
    new memory when the model was built without (``build(allocate=False)``)."""
    target = owner.weight
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)} from the metadata")
    with torch.no_grad():
        if target.is_meta:  # copy=True: a float32 file tensor may be a read-only view of the file
            owner.weight = nn.Parameter(tensor.to(device, target.dtype, copy=True), requires_grad=False)
        else:
            target.copy_(tensor)


def check_complete(model: nn.Module, loaded: set[str], layer_parts: Iterable[str] = LAYER_PARTS) -> None:
    """Every weight the model needs was loaded: its embedding, final norm, head (untied) and each
    layer's ``layer_parts``."""
    expected = {"embed", "norm"} | ({"lm_head"} if model.lm_head is not None else set())
    for i in range(model.spec.num_layers):
        expected |= {f"layers.{i}.{p}" for p in layer_parts}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"model file lacks weight(s): {', '.join(missing[:5])}")


def pack_layer(model: LlamaModel, index: int, formats: tuple[str, ...], max_packed_rows: int | None) -> None:
    """Swap one layer's four projections for weight-only quantized ones, each in its format
    (``formats``, in ``formats.PROJECTIONS`` order: qkv, o, gate_up, down; ``"dense"`` leaves
    one); their dense weights go unless kept for large batches."""
    layer = model.layers[index]
    qkv, o, gate_up, down = formats
    layer.attn.qkv_proj = _packed(layer.attn.qkv_proj, qkv, max_packed_rows)
    layer.attn.o_proj = _packed(layer.attn.o_proj, o, max_packed_rows)
    layer.mlp.gate_up_proj = _packed(layer.mlp.gate_up_proj, gate_up, max_packed_rows)
    layer.mlp.down_proj = _packed(layer.mlp.down_proj, down, max_packed_rows)


def pack_head(model: LlamaModel, fmt: str, max_packed_rows: int | None) -> None:
    """The LM head packed in ``fmt`` as ``model.packed_head`` (``"dense"`` leaves it)."""
    if fmt == "dense":
        return
    head = model.embed if model.lm_head is None else model.lm_head
    head_rows = head_max_packed_rows(max_packed_rows)
    # a tied head's bf16 copy is the embedding itself: no second copy in memory
    shared = model.embed.weight if head is model.embed and model.embed.weight.dtype == torch.bfloat16 else None
    model.packed_head = _packed(head, fmt, head_rows, shared)
    if model.lm_head is not None:
        model.lm_head = None  # the packed head keeps its own dense copy
    elif head_rows is None:
        _serve_embedding_from_head(model)


def _serve_embedding_from_head(model: LlamaModel) -> bool:
    """Drop a tied embedding's dense copy when the packed head (kept packed at every size)
    gives exactly its rows: lookups dequantize them (``PackedEmbedding``)."""
    head, dense = model.packed_head, getattr(model.embed, "weight", None)
    if not isinstance(head, PackedLinear) or head.weight is not None or dense is None:
        return False
    if not PackedEmbedding.serves(head, dense):
        return False
    model.embed = PackedEmbedding(head, dense.dtype)
    return True


def _packed(linear: nn.Module, fmt: str, max_rows: int | None, shared: torch.Tensor | None = None) -> nn.Module:
    """``linear`` as a ``PackedLinear`` in ``fmt``, or itself where ``fmt`` is dense or the shape
    does not pack. The packers read the weight a slice at a time in fp32."""
    if fmt == "dense" or not can_pack(linear.weight, fmt):
        return linear
    return PackedLinear.pack(linear.weight, fmt, max_rows, shared)
