"""Converted weights on disk, so that a model's second start skips parsing, dequantizing and packing.

The first start of a model builds it from the file (GGUF metadata and tokenizer, dequantized
tensors, packed int4/int8 projections) and then saves the result as one entry under
``$RICLLM_CACHE_DIR/weights/``. Later starts with the same key memory-map that entry: the
model's tensors are the file's pages, read as the first steps touch them.

An entry is valid only for its key: the source file's sha256, the dtype, the device type,
the requested weight format, ``max_packed_rows``, the ricllm and torch versions (packed int4
layouts are torch-internal) and a digest of the conversion code. Anything else is rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ricllm.logging import get_logger
from ricllm.model.packed_linear import PackedEmbedding, PackedLinear, head_max_packed_rows, vnni_layout_available
from ricllm.model.spec import ModelSpec
from ricllm.model.tokenizer import Tokenizer
from ricllm.paths import cache_dir, evict_least_recent, file_digest, touch_used
from ricllm.version import __version__

log = get_logger("ricllm.weight_cache")
ENTRY_VERSION = 1
MAX_ENTRIES = 4  # most recently used entries kept; older ones are deleted when a new one is written
PROJECTIONS = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass
class CachedModel:
    spec: ModelSpec
    tokenizer: Tokenizer
    state: dict[str, torch.Tensor]
    weight_formats: tuple[str, str]
    packed_formats: dict[str, str]  # each packed projection's format, by its state prefix (``layers.0.attn.o_proj``)


def _conversion_code_digest() -> str:
    """The source of the code that turns a file into tensors: an edit to it (a fix in packing
    or dequantization) must not be hidden by entries written before, even at the same version."""
    from ricllm.kernels import cpu_quant  # the VNNI layout's packing code
    from ricllm.model import formats, loader, packed_linear

    runtime_dir = Path(__file__).parent  # the torch model whose state an entry holds, and its loading
    digest = hashlib.sha256()
    for path in (loader.__file__, runtime_dir / "llama.py", runtime_dir / "llama_weights.py", runtime_dir / "gemma3.py",
                 runtime_dir / "gemma3_weights.py", packed_linear.__file__, formats.__file__, __file__,
                 cpu_quant.__file__):
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def entry_path(source: Path, dtype: torch.dtype, device: torch.device, weights: str,
               max_packed_rows: int | None) -> Path:
    key = {"sha256": file_digest(source), "dtype": str(dtype), "device": device.type, "weights": weights,
           "max_packed_rows": max_packed_rows,
           "vnni": [vnni_layout_available(f) for f in ("int4", "int8")] if weights != "bf16" else None, "ricllm": __version__, "torch": torch.__version__,
           "code": _conversion_code_digest(), "entry": ENTRY_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "weights" / f"{digest}.pt"


def load(path: Path) -> CachedModel | None:
    """The entry at ``path``, memory-mapped; ``None`` when absent or unreadable (then rebuilt)."""
    if not path.is_file():
        return None
    try:
        touch_used(path)  # recently used: kept by the eviction in ``save``
        entry = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        return CachedModel(ModelSpec.from_dict(entry["spec"]), Tokenizer.from_state(entry["tokenizer"]),
                           entry["state"], tuple(entry["weight_formats"]), entry["packed_formats"])
    except Exception as exc:  # a torn or stale file is a cache miss, never a failed start
        log.warning("weight_cache_unreadable", path=str(path), error=str(exc))
        return None


def save(path: Path, spec: ModelSpec, tokenizer: Tokenizer, model: nn.Module, weight_formats: tuple[str, str]) -> None:
    """Write atomically (temporary file, then rename): a concurrent start never reads half an entry."""
    entry = {"spec": dataclasses.asdict(spec), "tokenizer": tokenizer.to_state(),
             "weight_formats": list(weight_formats), "packed_formats": _packed_formats(model),
             "state": _state_with_rope(model)}
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".partial", delete=False) as handle:
            torch.save(entry, handle)
        os.replace(handle.name, path)
        touch_used(path)
    except OSError as exc:  # a full or read-only disk costs the next start time, nothing else
        log.warning("weight_cache_not_written", path=str(path), error=str(exc))
        Path(handle.name).unlink(missing_ok=True)
        return
    log.info("weight_cache_written", path=str(path), bytes=path.stat().st_size)
    _evict(path.parent)


def _evict(folder: Path) -> None:
    """Keep the ``MAX_ENTRIES`` most recently used entries: each is a model's size on disk."""
    for stale in evict_least_recent(folder, "*.pt", MAX_ENTRIES):
        log.info("weight_cache_evicted", path=str(stale))


def _state_with_rope(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict plus the RoPE tables, which may come from a file's ``rope_freqs`` (a model
    that computes its rotations from the spec alone, as Gemma's, has none)."""
    state = dict(model.state_dict())
    if hasattr(model.rope, "cos"):
        state["rope.cos"], state["rope.sin"] = model.rope.cos, model.rope.sin
    return state


def _packed_formats(model: nn.Module) -> dict[str, str]:
    """Each packed projection's format: a layer's projections may differ (``formats.projection_formats``)."""
    return {f"layers.{index}.{name}": m.fmt for index, layer in enumerate(model.layers) for name in PROJECTIONS
            if isinstance(m := layer.get_submodule(name), PackedLinear)}


def adopt(model: nn.Module, cached: CachedModel, max_packed_rows: int | None) -> nn.Module:
    """Give a model built on the meta device the entry's tensors (packed modules included)."""
    state = dict(cached.state)
    head_fmt = cached.weight_formats[1]
    for index, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            prefix = f"layers.{index}.{name}"
            if f"{prefix}.packed_weight" in state:
                _swap(layer, name, _packed_from(state, prefix, cached.packed_formats[prefix], max_packed_rows))
    if "packed_head.packed_weight" in state:
        model.packed_head = _packed_from(state, "packed_head", head_fmt, head_max_packed_rows(max_packed_rows))
        model.lm_head = None
        if "embed.weight" not in state:  # a tied embedding served from the packed head
            model.embed = PackedEmbedding(model.packed_head, state["norm.weight"].dtype)
    if "rope.cos" in state:
        model.rope.cos, model.rope.sin = state.pop("rope.cos"), state.pop("rope.sin")
    model.load_state_dict(state, assign=True, strict=True)
    return model


def _packed_from(state: dict, prefix: str, fmt: str, max_rows: int | None) -> PackedLinear:
    return PackedLinear(state[f"{prefix}.packed_weight"], state[f"{prefix}.packed_scales"],
                        state.get(f"{prefix}.weight"), fmt, 0 if max_rows is None else max_rows,
                        state.get(f"{prefix}.packed_offsets"))


def _swap(layer: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, attr = dotted.split(".")
    setattr(getattr(layer, parent), attr, module)
