"""Weights into a ``Gemma3Model``: a checkpoint's ricllm-named tensors copied in, q/k/v and
gate/up fused as they arrive, each layer handed to ``on_layer_loaded`` once complete (to pack it
then, with ``llama_weights.pack_layer``: the projections are named as the Llama model's)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ricllm.engine.runtime.gemma3 import Gemma3Model
from ricllm.engine.runtime.llama_weights import check_complete, place_weight
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
            place_weight(owner, tensor, name, device)
            loaded.add(name)
            continue
        _, index, part = name.split(".")
        if part in FUSED:
            group, members = FUSED[part]
            pending[f"{index}.{part}"] = tensor
            if not all(f"{index}.{m}" in pending for m in members):
                continue
            tensor, part = torch.cat([pending.pop(f"{index}.{m}") for m in members], dim=0), group
        place_weight(_owners(model.layers[int(index)])[part], tensor, name, device)
        loaded.add(f"layers.{index}.{part}")
        parts_left[int(index)] -= 1
        if parts_left[int(index)] == 0 and on_layer_loaded is not None:
            on_layer_loaded(int(index))
    check_complete(model, loaded, LAYER_PARTS)
