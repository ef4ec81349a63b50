"""The native runtime's weights: one file of packed arrays that numpy maps without torch.

The torch runtime converts a model file once (dequantize, pack in ricllm's VNNI layout; see
``ricllm.kernels.cpu_quant``) and :func:`write` saves what the C decoder stack reads: per layer
the two norm weights and the four packed projections, the final norm, the packed head, the
embedding (or nothing, when lookups dequantize rows of the tied head exactly) and the RoPE
tables already in bf16. :func:`read` maps the file: the arrays are its pages, shared with the
page cache and read as steps touch them.

File layout: ``MAGIC``, a little-endian u64 header length, a JSON header (UTF-8: the model's
spec, tokenizer and formats, and each array's dtype, shape and offset), then the arrays, each at a
64-byte aligned offset. bf16 arrays are stored and mapped as uint16 bit patterns (numpy has no
bf16; the kernels take the bits).

The tokenizer (version 2 on): a BPE tokenizer's vocabulary is a list in the header and its merges an
int32 array of token ids (``Tokenizer.to_compact_state``), the rest of it JSON; rebuilt that way it
takes about half the time of parsing the whole tokenizer's JSON, the largest part of a start's work
on the file. Any other tokenizer is stored whole (``Tokenizer.to_state``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ricllm.model.formats import PROJECTIONS
from ricllm.model.spec import ModelSpec
from ricllm.model.tokenizer import Tokenizer

MAGIC = b"RICLLMNW"
FORMAT_VERSION = 2  # 2: the tokenizer's vocabulary and merges outside its JSON
ALIGN = 64
# Gemma 3's norms beside the two of every layer, in its decoder stack's order (kernels/cpu_decoder.c)
GEMMA3_NORMS = ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")
TOKENIZER_MERGES = "tokenizer.merges"  # int32 [merges, 2]: (left, right) token ids, in rank order


@dataclass
class Packed:
    """A projection in the VNNI layout: what ``ricllm_quant_gemm`` takes."""

    weight: np.ndarray  # uint8
    scales: np.ndarray  # float16 [tiles, groups, 2, 16]
    offsets: np.ndarray  # int32 (empty for 4-bit)
    bits: int

    @property
    def out_features(self) -> int:
        return self.scales.shape[0] * self.scales.shape[-1]

    @property
    def decode_bytes(self) -> int:
        """What a product of one or two rows reads: the 8-bit correction (``offsets``) is then
        recomputed from the weights in hand (``int8_tile``), and 4-bit weights have none."""
        return self.weight.nbytes + self.scales.nbytes


@dataclass
class NativeLayer:
    attn_norm: np.ndarray  # uint16 (bf16) [hidden]
    ffn_norm: np.ndarray
    projections: dict[str, Packed]  # PROJECTIONS
    norms: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # Gemma 3's GEMMA3_NORMS; else empty


@dataclass
class NativeWeights:
    spec: ModelSpec
    tokenizer: Tokenizer
    weight_formats: tuple[str, str]
    layers: list[NativeLayer]
    norm: np.ndarray  # uint16 (bf16) [hidden]
    head: Packed
    embedding: np.ndarray | None  # uint16 (bf16) [vocab, hidden]; None: rows dequantized from the head
    rope_cos: np.ndarray  # uint16 (bf16) [max_positions, head_dim]; Gemma 3: its global layers' base
    rope_sin: np.ndarray
    rope_local_cos: np.ndarray | None = None  # Gemma 3: its sliding-window layers' base; else None
    rope_local_sin: np.ndarray | None = None

    def weight_bytes(self) -> int:
        """Bytes a one-stream decode step reads: every projection and norm and the head (an
        embedding is only looked up, row by row)."""
        layers = sum(p.decode_bytes for layer in self.layers for p in layer.projections.values())
        norms = sum(layer.attn_norm.nbytes + layer.ffn_norm.nbytes + sum(n.nbytes for n in layer.norms.values())
                    for layer in self.layers)
        return layers + norms + self.norm.nbytes + self.head.decode_bytes


# ------------------------------------------------------------------ reading


def read(path: Path) -> NativeWeights:
    """Map ``path``; ``ValueError`` when it is not a complete file of this format and version."""
    arrays, meta = _map(path)
    spec, bits = ModelSpec.from_dict(meta["spec"]), meta["bits"]

    def packed(prefix: str, width: int) -> Packed:
        return Packed(arrays[f"{prefix}.weight"], arrays[f"{prefix}.scales"], arrays[f"{prefix}.offsets"], width)

    layers = [NativeLayer(arrays[f"layers.{i}.attn_norm"], arrays[f"layers.{i}.ffn_norm"],
                          {p: packed(f"layers.{i}.{p}", bits[i][k]) for k, p in enumerate(PROJECTIONS)},
                          {n: arrays[f"layers.{i}.{n}"] for n in GEMMA3_NORMS if f"layers.{i}.{n}" in arrays})
              for i in range(spec.num_layers)]
    tokenizer = _tokenizer(meta["tokenizer"], meta.get("tokenizer_tokens"), arrays.get(TOKENIZER_MERGES))
    return NativeWeights(spec, tokenizer, tuple(meta["weight_formats"]),
                         layers, arrays["norm"], packed("head", meta["head_bits"]), arrays.get("embedding"),
                         arrays["rope.cos"], arrays["rope.sin"], arrays.get("rope.local_cos"),
                         arrays.get("rope.local_sin"))


def _tokenizer(state: dict, tokens: list[str] | None, merges: np.ndarray | None) -> Tokenizer:
    if merges is None:
        return Tokenizer.from_state(state)
    return Tokenizer.from_compact_state(state, tokens, merges[:, 0].tolist(), merges[:, 1].tolist())


def _map(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    if buffer.shape[0] < len(MAGIC) + 8 or bytes(buffer[:len(MAGIC)]) != MAGIC:
        raise ValueError(f"{path} is not a ricllm native weights file")
    (header_len,) = struct.unpack("<Q", bytes(buffer[len(MAGIC):len(MAGIC) + 8]))
    start = len(MAGIC) + 8
    header = json.loads(bytes(buffer[start:start + header_len]))
    if header.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format version {header.get('version')}, this ricllm reads {FORMAT_VERSION}")
    arrays = {}
    for name, entry in header["arrays"].items():
        dtype, shape, offset = np.dtype(entry["dtype"]), tuple(entry["shape"]), entry["offset"]
        end = offset + dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if end > buffer.shape[0]:
            raise ValueError(f"{path} is truncated: array {name} ends at byte {end} of {buffer.shape[0]}")
        arrays[name] = buffer[offset:end].view(dtype).reshape(shape)
    return arrays, header["metadata"]


# ------------------------------------------------------------------ writing (from a torch model)


def write(path: Path, spec: ModelSpec, tokenizer: Tokenizer, model, weight_formats: tuple[str, str]) -> None:
    """Save a packed ``LlamaModel`` or ``Gemma3Model`` (every projection and the head in the VNNI layout: see
    :func:`unsupported_reason`) atomically: a temporary file, then a rename."""
    arrays, bits = _model_arrays(model)
    metadata = {"spec": dataclasses.asdict(spec), "weight_formats": list(weight_formats), "bits": bits,
                "head_bits": 4 if model.packed_head.fmt == "int4" else 8, **_tokenizer_parts(tokenizer, arrays)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".partial", delete=False) as handle:
        try:
            _write_file(handle, arrays, metadata)
        except BaseException:
            Path(handle.name).unlink(missing_ok=True)
            raise
    os.replace(handle.name, path)


def _tokenizer_parts(tokenizer: Tokenizer, arrays: dict[str, np.ndarray]) -> dict:
    """The header's tokenizer entries; the merges of a compact one go into ``arrays``."""
    compact = tokenizer.to_compact_state()
    if compact is None:
        return {"tokenizer": tokenizer.to_state()}
    arrays[TOKENIZER_MERGES] = np.array(compact.merges, dtype=np.int32).reshape(-1, 2)
    return {"tokenizer": compact.state, "tokenizer_tokens": compact.tokens}


def unsupported_reason(model) -> str | None:
    """Why a converted ``LlamaModel`` or ``Gemma3Model`` cannot be served natively, or None when it can."""
    from ricllm.model.packed_linear import PackedEmbedding, PackedLinear

    def own(m) -> bool:
        return isinstance(m, PackedLinear) and m.layout == "vnni" and m.weight is None

    for layer in model.layers:
        for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if not own(m):
                return "a layer's projection is not packed in ricllm's layout (dense weights, or a shape that does not tile)"
    if not own(model.packed_head):
        return "the LM head is not packed in ricllm's layout"
    if not isinstance(model.embed, PackedEmbedding) and model.embed.weight.dtype.itemsize != 2:
        return "the embedding is not bf16"
    return None


def _bits(m) -> int:
    return 4 if m.fmt == "int4" else 8


def _model_arrays(model) -> tuple[dict[str, np.ndarray], list[list[int]]]:
    import torch

    from ricllm.model.packed_linear import PackedEmbedding

    def host(t: torch.Tensor) -> np.ndarray:
        t = t.detach().contiguous()
        return (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy())

    arrays, bits = {}, []
    for i, layer in enumerate(model.layers):
        modules = dict(zip(PROJECTIONS, (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                                         layer.mlp.down_proj)))
        arrays[f"layers.{i}.attn_norm"], arrays[f"layers.{i}.ffn_norm"] = host(layer.attn_norm.weight), host(
            layer.ffn_norm.weight)
        if model.spec.architecture == "gemma3":
            norms = (layer.attn.q_norm, layer.attn.k_norm, layer.post_attn_norm, layer.post_ffn_norm)
            for name, norm in zip(GEMMA3_NORMS, norms, strict=True):
                arrays[f"layers.{i}.{name}"] = host(norm.weight)
        for name, m in modules.items():
            for part in ("weight", "scales", "offsets"):
                arrays[f"layers.{i}.{name}.{part}"] = host(getattr(m, f"packed_{part}"))
        bits.append([_bits(m) for m in modules.values()])
    arrays["norm"] = host(model.norm.weight)
    for part in ("weight", "scales", "offsets"):
        arrays[f"head.{part}"] = host(getattr(model.packed_head, f"packed_{part}"))
    if not isinstance(model.embed, PackedEmbedding):
        arrays["embedding"] = host(model.embed.weight)
    # the tables as a step uses them: fp32 angles rounded to bf16 by torch, so both runtimes agree bit for bit
    if model.spec.architecture == "gemma3":
        # every position's (cos, sin) per base, as ``LayerRoPE`` computes a step's: 0 global, 1 local
        positions = torch.arange(model.spec.max_position_embeddings)
        (cos, sin), (local_cos, local_sin) = model.rope(positions, torch.bfloat16)
        arrays["rope.cos"], arrays["rope.sin"] = host(cos[:, 0]), host(sin[:, 0])
        arrays["rope.local_cos"], arrays["rope.local_sin"] = host(local_cos[:, 0]), host(local_sin[:, 0])
        return arrays, bits
    arrays["rope.cos"], arrays["rope.sin"] = host(model.rope.cos.to(torch.bfloat16)), host(
        model.rope.sin.to(torch.bfloat16))
    return arrays, bits


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _write_file(handle, arrays: dict[str, np.ndarray], metadata: dict) -> None:
    entries, offset = {}, 0
    for name, array in arrays.items():
        entries[name] = {"dtype": array.dtype.str, "shape": list(array.shape), "offset": offset}
        offset = _aligned(offset + array.nbytes)
    # the header's length depends on the offsets, which depend on it: fix its size first
    draft = json.dumps({"version": FORMAT_VERSION, "metadata": metadata, "arrays": entries},
                       ensure_ascii=False).encode()
    data_start = _aligned(len(MAGIC) + 8 + len(draft) + 32 * len(entries) + 64)
    for entry in entries.values():
        entry["offset"] += data_start
    header = json.dumps({"version": FORMAT_VERSION, "metadata": metadata, "arrays": entries},
                        ensure_ascii=False).encode()
    if len(header) > data_start - len(MAGIC) - 8:
        raise RuntimeError("native weights header outgrew its reserved size: this is a bug in ricllm")
    header = header.ljust(data_start - len(MAGIC) - 8, b" ")
    handle.write(MAGIC + struct.pack("<Q", len(header)) + header)
    position = data_start
    for name, array in arrays.items():
        handle.write(b"\0" * (entries[name]["offset"] - position))
        handle.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        position = entries[name]["offset"] + array.nbytes
