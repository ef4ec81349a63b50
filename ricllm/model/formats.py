"""Weight formats: which packed form (``int4``, ``int8``) or ``dense`` a file's weights take.
Plain names and rules, no torch: both runtimes decide with it.

``weights="auto"`` decides per projection: a projection packs 4-bit where the file stores every
tensor in it (q, k and v fuse into ``qkv``, gate and up into ``gate_up``) in a 4-bit type, and
8-bit otherwise, so a mixed file (llama.cpp's Q4_K_M: Q4_K beside Q5_0, Q6_K and Q8_0) keeps its
4-bit tensors 4-bit. Each layer then carries a format per projection (``projection_formats``);
the layers' format names the mix (``int4+int8``) where there is one.
"""

from __future__ import annotations

from ricllm.errors import ConfigError

WEIGHT_FORMATS = ("auto", "bf16", "int8", "int4")
FOUR_BIT_TYPES = {"Q4_0", "Q4_1", "Q4_K"}
EIGHT_BIT_TYPES = {"Q8_0", "Q5_0", "Q5_K", "Q6_K"}
MIXED = "int4+int8"  # the layers' format where auto packs some projections 4-bit and others 8-bit
# each packed projection of a layer, in the decoder stack's order, and the GGUF tensors fused into it
PROJECTION_TENSORS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
                      "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
PROJECTIONS = tuple(PROJECTION_TENSORS)


def resolve_formats(requested: str, tensor_types: dict[str, str], packable: bool,
                    where: str = "") -> tuple[str, str]:
    """(layer format, LM-head format): the head's among ``dense``, ``int8``, ``int4``; the layers'
    one of those or ``MIXED``, each projection's then given by ``projection_formats``.

    ``auto`` keeps weights as compact as the file stores them: 4-bit projections stay 4-bit, 8-bit
    ones 8-bit, float ones dense; the head is int8 when the file quantized it. Packed weights
    need the CPU and bf16 activations (``packable``); elsewhere ``auto`` is dense. ``where`` names
    the dtype and device in the error.
    """
    if requested not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weights format {requested!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if requested == "bf16" or (requested == "auto" and not packable):
        return "dense", "dense"
    if not packable:
        raise ConfigError(f"weights={requested!r} needs dtype bfloat16 on the CPU (got {where})")
    if requested != "auto":
        return requested, "int8"
    head_type = tensor_types.get("output.weight", tensor_types.get("token_embd.weight", "F32"))
    head = "int8" if head_type in FOUR_BIT_TYPES | EIGHT_BIT_TYPES else "dense"
    if not _layers_quantized(tensor_types):
        return "dense", head
    found = {_file_format(tensor_types, layer, parts) for layer in range(_layer_count(tensor_types))
             for parts in PROJECTION_TENSORS.values()} - {None}
    return (MIXED if len(found) > 1 else found.pop() if found else "int8"), head


def projection_formats(layer_format: str, tensor_types: dict[str, str], layer: int) -> tuple[str, ...]:
    """Layer ``layer``'s format per projection (``PROJECTIONS`` order) under the resolved layer
    format: the same for all four, or each by its tensors' types where the layers are ``MIXED``."""
    if layer_format != MIXED:
        return (layer_format,) * len(PROJECTIONS)
    return tuple(_file_format(tensor_types, layer, parts) or "int8" for parts in PROJECTION_TENSORS.values())


def _file_format(tensor_types: dict[str, str], layer: int, parts: tuple[str, ...]) -> str | None:
    """int4 for a projection whose tensors the file stores all 4-bit, else int8; None where the
    file lists none of them."""
    kinds = {tensor_types[name] for part in parts if (name := f"blk.{layer}.{part}.weight") in tensor_types}
    return None if not kinds else "int4" if kinds <= FOUR_BIT_TYPES else "int8"


def _layers_quantized(tensor_types: dict[str, str]) -> bool:
    return any(name.startswith("blk.") and kind in FOUR_BIT_TYPES | EIGHT_BIT_TYPES
               for name, kind in tensor_types.items())


def _layer_count(tensor_types: dict[str, str]) -> int:
    return 1 + max(int(name.split(".")[1]) for name in tensor_types if name.startswith("blk."))
