"""Tiny random LoRA adapters in the PEFT format, for the tiny random GGUF models (``tests/helpers.py``).

``write_lora_adapter`` writes what ``PeftModel.save_pretrained`` writes for a Llama model: an
``adapter_config.json`` and an ``adapter_model.safetensors`` whose tensors are named
``base_model.model.model.layers.N.<module>.lora_{A,B}.weight``. Its B is random (PEFT's default
initialisation zeroes B, which would make every update zero and every test of one pass).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ricllm.model.lora import PROJECTION_MODULES, PROJECTIONS, projection_shape
from ricllm.model.spec import ModelSpec


def tensor_name(layer: int, projection: str, half: str) -> str:
    return f"base_model.model.model.layers.{layer}.{PROJECTION_MODULES[projection]}.lora_{half}.weight"


def lora_config(*, rank: int = 4, alpha: float = 8, projections: tuple[str, ...] = PROJECTIONS, **fields) -> dict:
    """An adapter_config.json as PEFT 0.21 writes it for a plain LoRA, ``fields`` set over it."""
    config = {
        "task_type": "CAUSAL_LM", "peft_type": "LORA", "auto_mapping": None, "peft_version": "0.21.2",
        "base_model_name_or_path": "tiny-random-llama", "revision": None, "inference_mode": True, "r": rank,
        "target_modules": sorted(PROJECTION_MODULES[name].split(".")[1] for name in projections),
        "exclude_modules": None, "lora_alpha": alpha, "lora_dropout": 0.0, "fan_in_fan_out": False,
        "bias": "none", "use_rslora": False, "modules_to_save": None, "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "megatron_config": None, "megatron_core": "megatron.core", "trainable_token_indices": None,
        "loftq_config": {}, "eva_config": None, "corda_config": None, "lora_ga_config": None, "use_dora": False,
        "velora_config": None, "alora_invocation_tokens": None, "use_qalora": False, "qalora_group_size": 16,
        "monteclora_config": None, "layer_replication": None, "lora_bias": False, "target_parameters": None,
        "use_bdlora": None, "arrow_config": None, "kasa_config": None, "ensure_weight_tying": False,
    }
    return {**config, **fields}


def random_lora_tensors(spec: ModelSpec, config: dict, *, seed: int = 0, std: float = 0.1,
                        projections: tuple[str, ...] = PROJECTIONS) -> dict[str, np.ndarray]:
    """A random lora_A and lora_B, fp32, for each projection of every layer; a module's rank is the
    config's ``r`` unless a ``rank_pattern`` key is the end of its name."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for name in projections:
            module = f"model.layers.{layer}.{PROJECTION_MODULES[name]}"
            rank = next((r for key, r in config["rank_pattern"].items() if re.search(rf"(^|\.){key}$", module)),
                        config["r"])
            in_features, out_features = projection_shape(spec, name)
            for half, shape in (("A", (rank, in_features)), ("B", (out_features, rank))):
                tensors[tensor_name(layer, name, half)] = (rng.standard_normal(shape) * std).astype(np.float32)
    return tensors


def write_lora_adapter(folder: Path, spec: ModelSpec, *, rank: int = 4, alpha: float = 8,
                       projections: tuple[str, ...] = PROJECTIONS, seed: int = 0, std: float = 0.1,
                       dtype: torch.dtype = torch.float32, config: dict | None = None,
                       tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A random adapter for a model of ``spec`` in ``folder``: ``config`` fields are set over
    ``lora_config``'s, ``tensors`` (fp32) replace or add to the random ones (``std`` their spread);
    stored as ``dtype``."""
    folder.mkdir(parents=True, exist_ok=True)
    full_config = lora_config(rank=rank, alpha=alpha, projections=projections, **(config or {}))
    arrays = {**random_lora_tensors(spec, full_config, seed=seed, std=std, projections=projections), **(tensors or {})}
    (folder / "adapter_config.json").write_text(json.dumps(full_config, indent=2))
    save_file({name: torch.from_numpy(values).to(dtype).contiguous() for name, values in arrays.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder
