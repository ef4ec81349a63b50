"""Weight formats: which packed form (``int4``, ``int8``) or ``dense`` a file's weights take.
Plain names and rules, no torch: both runtimes decide with it."""

from __future__ import annotations

from ricllm.errors import ConfigError

WEIGHT_FORMATS = ("auto", "bf16", "int8", "int4")
FOUR_BIT_TYPES = {"Q4_0", "Q4_1", "Q4_K"}
EIGHT_BIT_TYPES = {"Q8_0", "Q5_0", "Q5_K", "Q6_K"}


def resolve_formats(requested: str, tensor_types: dict[str, str], packable: bool,
                    where: str = "") -> tuple[str, str]:
    """(layer format, LM-head format) among ``dense``, ``int8``, ``int4``.

    ``auto`` keeps weights as compact as the file stores them: 4-bit layers stay 4-bit, 8-bit
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
    layer_types = {t for name, t in tensor_types.items() if name.startswith("blk.") and t not in ("F32",)}
    head_type = tensor_types.get("output.weight", tensor_types.get("token_embd.weight", "F32"))
    layer = "int4" if layer_types and layer_types <= FOUR_BIT_TYPES else (
        "int8" if layer_types & (FOUR_BIT_TYPES | EIGHT_BIT_TYPES) else "dense")
    head = "int8" if head_type in FOUR_BIT_TYPES | EIGHT_BIT_TYPES else "dense"
    return layer, head
