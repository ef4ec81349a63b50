"""LoRA adapters in the PEFT format, read into plain arrays and checked against a model's shape.

A PEFT adapter is a folder: ``adapter_config.json`` (rank ``r``, ``lora_alpha``, which modules it
targets, ...) and ``adapter_model.safetensors``, whose tensors are named by the module they
update, e.g. ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (``A``: rank ×
in) and ``...q_proj.lora_B.weight`` (``B``: out × rank). The update of one projection is

    y += scale · (x · Aᵀ) · Bᵀ,    scale = alpha / r   (alpha / √r with ``use_rslora``)

with ``r`` and ``alpha`` per module from ``rank_pattern`` / ``alpha_pattern`` where they name it,
as PEFT resolves them. Only that plain form on the seven Llama projections (q, k, v, o, gate,
up, down) is served: whatever else PEFT can save changes what the model computes in a way these
arrays do not hold (DoRA's magnitudes, trained copies of whole modules, biases, embedding or
head updates, the LoRA variants, initialisations that change the base weights), so it is
refused by name rather than served wrong. Numbers come out as fp32 whatever the file stores
(F32, F16 or BF16); reading them needs numpy and the ``safetensors`` package, not torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from ricllm.errors import ModelLoadError
from ricllm.model.spec import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# ricllm's projection names (as the model loader names a layer's tensors), in the order a layer runs
# them, and the HF Llama module each is
PROJECTION_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                      "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                      "down": "mlp.down_proj"}
PROJECTIONS = tuple(PROJECTION_MODULES)
EMBEDDING_MODULES = ("embed_tokens", "lm_head")  # the modules whose targets are refused by name
HASH_FORMAT = b"ricllm-lora-1\0"  # heads the content hash: a change in what it covers changes every hash

_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_FILE_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # BF16: fp32's upper 16 bits

# PEFT fields that select a LoRA variant or add trained parameters these arrays cannot hold: refused
# when set. The value says what it is, for the message.
_REFUSED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA: per-output magnitudes)",
    "modules_to_save": "trained copies of whole modules",
    "trainable_token_indices": "trained embedding rows",
    "lora_bias": "a bias on lora_B",
    "layer_replication": "replicated layers",
    "target_parameters": "LoRA on raw parameters",
    "megatron_config": "Megatron-parallel layers",
    "use_qalora": "QA-LoRA (pooled inputs)",
    "use_bdlora": "block-diagonal LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow routing between adapters",
    "kasa_config": "KaSA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
}
# PEFT fields that do not change what a loaded adapter computes (metadata, dropout, how training
# started), or that are read below
_KNOWN_FIELDS = {
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "use_rslora", "bias",
    "fan_in_fan_out",  # PEFT resets it to false on nn.Linear layers, which every Llama projection is
    "init_lora_weights", "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "qalora_group_size", "ensure_weight_tying", "runtime_config",
}
# initialisations that subtract their start from the base weights: such an adapter belongs to that
# changed base model, not to the model file it names
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_VARIANT_INITS = ("mica",)


@dataclass(frozen=True)
class LoraProjection:
    """One projection's low-rank update, ``y += scale · (x · Aᵀ) · Bᵀ``: ``a`` is ``[rank, in]``,
    ``b`` is ``[out, rank]``, both fp32 and C-contiguous."""

    a: np.ndarray
    b: np.ndarray
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def num_parameters(self) -> int:
        return self.a.size + self.b.size


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: per model layer, the projections it updates (a projection absent from a
    layer's mapping is not updated there). ``content_hash`` (sha256, hex) covers what the updates
    compute, each projection's place, rank, scale and numbers, so two adapters that change any
    logit differ in it and the same adapter saved twice does not."""

    path: Path
    layers: tuple[Mapping[str, LoraProjection], ...]
    content_hash: str

    def projection(self, layer: int, name: str) -> LoraProjection | None:
        return self.layers[layer].get(name)

    def projections(self) -> Iterator[tuple[int, str, LoraProjection]]:
        """``(layer, projection name, update)`` in the order the model runs them."""
        for layer, updates in enumerate(self.layers):
            for name in PROJECTIONS:
                if name in updates:
                    yield layer, name, updates[name]

    @property
    def num_parameters(self) -> int:
        return sum(update.num_parameters for _, _, update in self.projections())

    @property
    def nbytes(self) -> int:
        """The bytes its arrays hold (fp32): what serving it adds to the model's weights."""
        return sum(update.a.nbytes + update.b.nbytes for _, _, update in self.projections())

    @property
    def max_rank(self) -> int:
        return max(update.rank for _, _, update in self.projections())


def projection_shape(spec: ModelSpec, name: str) -> tuple[int, int]:
    """``(in_features, out_features)`` of a layer's projection ``name`` in a model of ``spec``."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return {"q": (hidden, spec.q_size), "k": (hidden, spec.kv_size), "v": (hidden, spec.kv_size),
            "o": (spec.q_size, hidden), "gate": (hidden, inter), "up": (hidden, inter),
            "down": (inter, hidden)}[name]


def load_lora_adapter(path: str | os.PathLike, spec: ModelSpec) -> LoraAdapter:
    """Read the PEFT adapter folder ``path`` for a model of ``spec``; ModelLoadError naming the
    problem for a missing file, a refused feature or a shape the model does not have."""
    folder = Path(path).expanduser()
    config = _read_config(folder)
    _refuse_unsupported(config, folder)
    raw = _read_tensors(folder)
    layers = _projections(config, raw, spec, folder)
    return LoraAdapter(path=folder, layers=tuple(MappingProxyType(updates) for updates in layers),
                       content_hash=_content_hash(layers))


def _fail(folder: Path, problem: str) -> ModelLoadError:
    return ModelLoadError(f"LoRA adapter {folder}: {problem}")


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise _fail(folder, "no such folder (a PEFT adapter is a folder with "
                            f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise _fail(folder, f"{CONFIG_FILE} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(folder, f"{CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _fail(folder, f"{CONFIG_FILE} holds no JSON object")
    return config


def _refuse_unsupported(config: dict, folder: Path) -> None:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _fail(folder, f"peft_type is {peft_type!r}; ricllm serves LoRA adapters (peft_type 'LORA') only")
    for field, what in _REFUSED_FIELDS.items():
        if config.get(field):
            raise _fail(folder, f"{CONFIG_FILE} sets {field} ({what}), which ricllm does not serve; "
                                "ricllm serves plain LoRA on q/k/v/o/gate/up/down")
    if config.get("bias", "none") != "none":
        raise _fail(folder, f"bias is {config['bias']!r}: ricllm serves adapters with bias 'none' only "
                            "(trained biases change the base projections)")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise _fail(folder, f"init_lora_weights is {init!r}, which changes the base model's weights: the "
                            "adapter belongs to that changed model (save it converted to plain LoRA, PEFT's "
                            "path_initial_model_for_weight_conversion)")
    if isinstance(init, str) and init.lower() in _VARIANT_INITS:
        raise _fail(folder, f"init_lora_weights is {init!r}, a LoRA variant ricllm does not serve")
    unknown = sorted(field for field, value in config.items() if field not in _KNOWN_FIELDS
                     and field not in _REFUSED_FIELDS and value not in (None, False, [], {}, ""))
    if unknown:
        raise _fail(folder, f"{CONFIG_FILE} sets {', '.join(unknown)}, which ricllm does not know; "
                            "it serves plain LoRA only")
    for module in EMBEDDING_MODULES:
        if _targets(config, f"model.{module}" if module == "embed_tokens" else module):
            raise _fail(folder, f"target_modules names {module}: LoRA on the "
                                f"{'embedding' if module == 'embed_tokens' else 'head (lm_head)'} is not served, "
                                "only on q/k/v/o/gate/up/down")


def _read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the weights file as fp32, by name."""
    import safetensors

    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickled = folder / "adapter_model.bin"
        hint = (f" ({pickled.name} is there: ricllm reads safetensors only; save with "
                "safe_serialization=True)") if pickled.is_file() else ""
        raise _fail(folder, f"{WEIGHTS_FILE} is missing{hint}")
    try:
        entries = safetensors.deserialize(weights.read_bytes())
    except (OSError, safetensors.SafetensorError) as exc:
        raise _fail(folder, f"{WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None
    tensors = {}
    for name, entry in entries:
        if entry["dtype"] not in _FILE_DTYPES:
            raise _fail(folder, f"tensor {name} is {entry['dtype']}; adapters are read in "
                                f"{', '.join(_FILE_DTYPES)}")
        values = np.frombuffer(entry["data"], dtype=_FILE_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        if entry["dtype"] == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = np.ascontiguousarray(values, dtype=np.float32)
    return tensors


def _projections(config: dict, tensors: dict[str, np.ndarray], spec: ModelSpec,
                 folder: Path) -> list[dict[str, LoraProjection]]:
    """Per layer, its projections' updates, each checked against the config and the model."""
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    module_names = {module: name for name, module in PROJECTION_MODULES.items()}
    for key, values in tensors.items():
        match = _TENSOR.fullmatch(key)
        module = match and f"{match[2]}.{match[3]}"
        if not match or module not in module_names:
            raise _fail(folder, _unexpected_tensor(key))
        layer = int(match[1])
        if layer >= spec.num_layers:
            raise _fail(folder, f"tensor {key} is for layer {layer}; the model has {spec.num_layers} layers")
        halves.setdefault((layer, module_names[module]), {})[match[4]] = values
    if not halves:
        raise _fail(folder, f"{WEIGHTS_FILE} holds no LoRA tensors")
    targeted = {(layer, name) for layer in range(spec.num_layers) for name in PROJECTIONS
                if _targets(config, _module_key(layer, name), layer)}
    if targeted != set(halves):
        extra, missing = sorted(set(halves) - targeted), sorted(targeted - set(halves))
        problem = (f"holds tensors for {_where(extra)}, which {CONFIG_FILE} does not target" if extra else
                   f"lacks the tensors of {_where(missing)}, which {CONFIG_FILE} targets")
        raise _fail(folder, f"{WEIGHTS_FILE} {problem}")
    layers: list[dict[str, LoraProjection]] = [{} for _ in range(spec.num_layers)]
    for (layer, name), pair in sorted(halves.items(), key=lambda item: (item[0][0], PROJECTIONS.index(item[0][1]))):
        layers[layer][name] = _projection(config, spec, layer, name, pair, folder)
    return layers


def _projection(config: dict, spec: ModelSpec, layer: int, name: str, pair: dict[str, np.ndarray],
                folder: Path) -> LoraProjection:
    where = f"layer {layer} {PROJECTION_MODULES[name]}"
    if set(pair) != {"A", "B"}:
        raise _fail(folder, f"{where} has lora_{next(iter(pair))} without lora_{'B' if 'A' in pair else 'A'}")
    a, b = pair["A"], pair["B"]
    in_features, out_features = projection_shape(spec, name)
    rank = _pattern_value(config.get("rank_pattern") or {}, _module_key(layer, name), config.get("r", 8))
    alpha = _pattern_value(config.get("alpha_pattern") or {}, _module_key(layer, name), config.get("lora_alpha", 8))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise _fail(folder, f"{where}: rank {rank!r} and alpha {alpha!r} must be a positive integer and a number")
    if a.ndim != 2 or b.ndim != 2 or a.shape != (rank, in_features) or b.shape != (out_features, rank):
        raise _fail(folder, f"{where}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}; this model "
                            f"({spec.name or 'its spec'}) with rank {rank} needs [{rank}, {in_features}] and "
                            f"[{out_features}, {rank}]")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraProjection(a=a, b=b, scale=float(scale))


def _module_key(layer: int, name: str) -> str:
    """The module's name in the HF model, as PEFT matches target_modules and patterns against it."""
    return f"model.layers.{layer}.{PROJECTION_MODULES[name]}"


def _matches(spec: str | list | None, key: str) -> bool:
    """PEFT's rule: a string is a regular expression over the whole name (``all-linear``: every
    linear layer but the head); a list names modules by their last dotted parts."""
    if not spec:
        return False
    if spec == "all-linear":
        return key.endswith(tuple(f".{module}" for module in PROJECTION_MODULES.values()))
    if isinstance(spec, str):
        return re.fullmatch(spec, key) is not None
    return key in spec or any(key.endswith(f".{target}") for target in spec)


def _targets(config: dict, key: str, layer: int | None = None) -> bool:
    if not _matches(config.get("target_modules"), key) or _matches(config.get("exclude_modules"), key):
        return False
    only = config.get("layers_to_transform")
    if only is None or layer is None:
        return True
    return layer in ([only] if isinstance(only, int) else only)


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's ``get_pattern_key``: the first pattern that matches the end of the module name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _where(places: list[tuple[int, str]]) -> str:
    named = [f"layer {layer} {PROJECTION_MODULES[name]}" for layer, name in places[:3]]
    return ", ".join(named) + (f" and {len(places) - 3} more" if len(places) > 3 else "")


def _unexpected_tensor(key: str) -> str:
    if "lora_embedding" in key or "embed_tokens" in key:
        return f"tensor {key} is LoRA on the embedding, which is not served (only q/k/v/o/gate/up/down)"
    if "lm_head" in key:
        return f"tensor {key} is for the head (lm_head), which is not served (only q/k/v/o/gate/up/down)"
    if "lora_magnitude_vector" in key:
        return f"tensor {key} is DoRA's magnitude, which is not served (plain LoRA only)"
    if key.endswith(".bias"):
        return f"tensor {key} is a bias, which is not served (bias 'none' only)"
    return (f"tensor {key} is not a LoRA update of a Llama projection "
            "(base_model.model.model.layers.N.{self_attn,mlp}.*_proj.lora_{A,B}.weight)")


def _content_hash(layers: list[dict[str, LoraProjection]]) -> str:
    digest = hashlib.sha256(HASH_FORMAT)
    for layer, updates in enumerate(layers):
        for name, update in updates.items():
            digest.update(f"{layer}.{name} rank={update.rank} scale={update.scale!r}\0".encode())
            digest.update(update.a.tobytes())
            digest.update(update.b.tobytes())
    return digest.hexdigest()
