"""Weights into a ``Gemma3Model``: a checkpoint's ricllm-named tensors copied in, q/k/v and
gate/up fused as they arrive, each layer handed to ``on_layer_loaded`` once complete (to pack it
then, with ``llama_weights.pack_layer``: the projections are named as the Llama model's)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ricllm.engine.runtime.gemma3 import Gemma3Model
from ricllm.errors import ModelLoadError

# a file's separate projections, and the fused one each lands in (its parts in order)
FUSED = {"q": ("qkv", ("q", "k", "v")), "k": ("qkv", ("q", "k", "v")), "v": ("qkv", ("q", "k", "v")),
         "gate": ("gate_up", ("gate", "up")), "up": ("gate_up", ("gate", "up"))}
LAYER_PARTS = ("qkv", "gate_up", "o", "down", "attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm",
               "post_ffn_norm")


def _owners(layer: nn.Module) -> dict[str, nn.Module]:
    """The module whose ``weight`` each ricllm layer tensor (or fused group) is."""
    return {"qkv": layer.attn.qkv_proj, "o": layer.attn.o_proj, "q_norm": layer.attn.q_norm,
            "k_norm": layer.attn.k_norm, "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj,
            "attn_norm": layer.attn_norm, "post_attn_norm": layer.post_attn_norm, "ffn_norm": layer.ffn_norm,
            "post_ffn_norm": layer.post_ffn_norm}


def load_weights(model: Gemma3Model, tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device,
                 on_layer_loaded: Callable[[int], None] | None = None) -> None:
    """Copy ricllm-named tensors in; a weight still on the meta device gets its memory on
    ``device``. ``on_layer_loaded(i)`` runs as soon as layer ``i`` has all its weights."""
    pending: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    parts_left = [len(LAYER_PARTS)] * len(model.layers)
    for name, tensor in tensors:
        if not name.startswith("layers."):
            if name == "lm_head" and model.lm_head is None:
                continue  # a checkpoint may ship an explicit copy of a tied head
            owner = {"embed": model.embed, "norm": model.norm, "lm_head": model.lm_head}.get(name)
            if owner is None:
                raise ModelLoadError(f"tensor {name} has no place in a Gemma 3 model")
            _place(owner, tensor, name, device)
            loaded.add(name)
            continue
        _, index, part = name.split(".")
        if part in FUSED:
            group, members = FUSED[part]
            pending[f"{index}.{part}"] = tensor
            if not all(f"{index}.{m}" in pending for m in members):
                continue
            tensor, part = torch.cat([pending.pop(f"{index}.{m}") for m in members], dim=0), group
        _place(_owners(model.layers[int(index)])[part], tensor, name, device)
        loaded.add(f"layers.{index}.{part}")
        parts_left[int(index)] -= 1
        if parts_left[int(index)] == 0 and on_layer_loaded is not None:
            on_layer_loaded(int(index))
    _check_complete(model, loaded)


def _place(owner: nn.Module, tensor: torch.Tensor, name: str, device: torch.device) -> None:
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


def _check_complete(model: Gemma3Model, loaded: set[str]) -> None:
    expected = {"embed", "norm"} | ({"lm_head"} if model.lm_head is not None else set())
    for i in range(model.spec.num_layers):
        expected |= {f"layers.{i}.{p}" for p in LAYER_PARTS}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"model file lacks weight(s): {', '.join(missing[:5])}")
