"""PEFT LoRA adapters read by ``ricllm.model.lora``: the updates and their scales as PEFT resolves
them, what is refused and why, the content hash, and (where ``peft`` is installed) the same
per-projection updates as PEFT applies to the HF model loaded from the same tiny GGUF."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from ricllm.engine.runtime.lora_delta import lora_delta
from ricllm.errors import ModelLoadError, RicllmError
from ricllm.model.loader import open_checkpoint
from ricllm.model.lora import PROJECTION_MODULES, PROJECTIONS, load_lora_adapter, projection_shape
from tests.helpers import require_module
from tests.lora_adapters import random_lora_tensors, lora_config, tensor_name, write_lora_adapter


@pytest.fixture(scope="module")
def spec(tiny_gguf):
    return open_checkpoint(tiny_gguf).spec


def test_an_adapter_gives_each_layer_and_projection_its_a_b_and_alpha_over_r(spec, tmp_path):
    folder = write_lora_adapter(tmp_path / "plain", spec, rank=4, alpha=8, seed=3)
    written = random_lora_tensors(spec, lora_config(rank=4, alpha=8), seed=3)
    adapter = load_lora_adapter(folder, spec)
    assert [(layer, name) for layer, name, _ in adapter.projections()] == [
        (layer, name) for layer in range(spec.num_layers) for name in PROJECTIONS]
    for layer, name, update in adapter.projections():
        in_features, out_features = projection_shape(spec, name)
        assert update.a.shape == (4, in_features) and update.b.shape == (out_features, 4)
        assert update.a.dtype == update.b.dtype == np.float32
        np.testing.assert_array_equal(update.a, written[tensor_name(layer, name, "A")])
        np.testing.assert_array_equal(update.b, written[tensor_name(layer, name, "B")])
        assert update.scale == 2.0
    expected = sum(4 * sum(projection_shape(spec, name)) for name in PROJECTIONS) * spec.num_layers
    assert adapter.num_parameters == expected and adapter.nbytes == 4 * expected and adapter.max_rank == 4


def test_rslora_scales_by_alpha_over_the_root_of_r(spec, tmp_path):
    folder = write_lora_adapter(tmp_path / "rs", spec, rank=16, alpha=8, config={"use_rslora": True})
    assert {update.scale for _, _, update in load_lora_adapter(folder, spec).projections()} == {8 / math.sqrt(16)}


def test_rank_and_alpha_patterns_set_a_modules_own_rank_and_scale(spec, tmp_path):
    """PEFT's rule: a pattern key matches the end of the module's name (``q_proj`` every q; a full
    name one module), the first key that matches wins, the rest keep ``r`` and ``lora_alpha``."""
    folder = write_lora_adapter(tmp_path / "patterns", spec, rank=4, alpha=8, config={
        "rank_pattern": {"q_proj": 8}, "alpha_pattern": {"model.layers.1.mlp.down_proj": 2, "down_proj": 12}})
    adapter = load_lora_adapter(folder, spec)
    assert adapter.projection(0, "q").rank == 8 and adapter.projection(0, "q").scale == 1.0
    assert adapter.projection(1, "q").rank == 8 and adapter.projection(0, "k").rank == 4
    assert adapter.projection(0, "down").scale == 3.0 and adapter.projection(1, "down").scale == 0.5
    assert adapter.projection(1, "up").scale == 2.0 and adapter.max_rank == 8


def test_only_the_targeted_layers_and_projections_are_updated(spec, tmp_path):
    folder = write_lora_adapter(tmp_path / "qv", spec, projections=("q", "v"), tensors=None)
    adapter = load_lora_adapter(folder, spec)
    assert [(layer, name) for layer, name, _ in adapter.projections()] == [(0, "q"), (0, "v"), (1, "q"), (1, "v")]
    assert adapter.projection(0, "k") is None
    only_layer_1 = tmp_path / "layer1"
    config = lora_config(projections=("q", "v"), layers_to_transform=[1])
    tensors = {name: values for name, values in random_lora_tensors(spec, config, projections=("q", "v")).items()
               if ".layers.1." in name}
    write_lora_adapter(only_layer_1, spec, projections=(), config=config, tensors=tensors)
    assert [(layer, name) for layer, name, _ in load_lora_adapter(only_layer_1, spec).projections()] == [
        (1, "q"), (1, "v")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_files_read_as_the_fp32_values_they_hold(spec, tmp_path, dtype):
    folder = write_lora_adapter(tmp_path / "half", spec, dtype=dtype, seed=4)
    written = random_lora_tensors(spec, lora_config(), seed=4)
    for layer, name, update in load_lora_adapter(folder, spec).projections():
        stored = torch.from_numpy(written[tensor_name(layer, name, "A")]).to(dtype).float().numpy()
        np.testing.assert_array_equal(update.a, stored)


def test_the_content_hash_follows_what_the_updates_compute(spec, tmp_path):
    base = load_lora_adapter(write_lora_adapter(tmp_path / "a", spec, seed=1), spec)
    again = load_lora_adapter(write_lora_adapter(tmp_path / "b", spec, seed=1,
                                                 config={"base_model_name_or_path": "elsewhere"}), spec)
    alpha = load_lora_adapter(write_lora_adapter(tmp_path / "c", spec, seed=1, alpha=16), spec)
    tensors = random_lora_tensors(spec, lora_config(), seed=1)
    tensors[tensor_name(1, "down", "B")][3, 2] += 1e-3
    one_number = load_lora_adapter(write_lora_adapter(tmp_path / "d", spec, seed=1, tensors=tensors), spec)
    assert len(base.content_hash) == 64 and base.content_hash == again.content_hash
    assert len({base.content_hash, alpha.content_hash, one_number.content_hash}) == 3


# (config fields set, tensors added or replaced, what the message must name)
REFUSED = {
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, {}, "modules_to_save"),
    "dora": ({"use_dora": True}, {}, "use_dora .DoRA"),
    "bias": ({"bias": "lora_only"}, {}, "bias is 'lora_only'"),
    "lora_bias": ({"lora_bias": True}, {}, "lora_bias"),
    "other peft type": ({"peft_type": "IA3"}, {}, "peft_type is 'IA3'"),
    "embedding target": ({"target_modules": ["q_proj", "embed_tokens"]}, {}, "embed_tokens.*embedding"),
    "head target": ({"target_modules": ["q_proj", "lm_head"]}, {}, "lm_head.*head"),
    "regex head target": ({"target_modules": r".*(q_proj|lm_head)"}, {}, "lm_head"),
    "base-changing init": ({"init_lora_weights": "pissa_niter_4"}, {}, "pissa_niter_4.*changes the base"),
    "variant": ({"use_qalora": True}, {}, "use_qalora"),
    "unknown field": ({"fancy_new_variant": {"on": 1}}, {}, "fancy_new_variant.*does not know"),
    "embedding tensor": ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 8), np.float32)},
                         "lora_embedding_A is LoRA on the embedding"),
    "dora tensor": ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                         np.ones(64, np.float32)}, "DoRA's magnitude"),
    "bias tensor": ({}, {"base_model.model.model.layers.0.self_attn.q_proj.bias": np.ones(64, np.float32)},
                    "is a bias"),
    "wrong shape": ({}, {tensor_name(0, "k", "B"): np.zeros((64, 4), np.float32)},
                    r"layer 0 self_attn.k_proj: lora_A is \[4, 64\] and lora_B \[64, 4\]"
                    r".*needs \[4, 64\] and \[32, 4\]"),
    "rank unlike the config": ({}, {tensor_name(0, "q", "A"): np.zeros((2, 64), np.float32),
                                    tensor_name(0, "q", "B"): np.zeros((64, 2), np.float32)},
                               r"q_proj: lora_A is \[2, 64\] and lora_B \[64, 2\]; .* rank 4 needs \[4, 64\]"),
    "layer beyond the model": ({}, {"base_model.model.model.layers.7.mlp.up_proj.lora_A.weight":
                                    np.zeros((4, 64), np.float32)}, "layer 7; the model has 2 layers"),
    "untargeted tensor": ({"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]}, {},
                          "tensors for layer 0 mlp.down_proj, layer 1 mlp.down_proj, which .* does not target"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_what_is_not_plain_lora_on_the_projections_is_refused_by_name(spec, tmp_path, case):
    config, tensors, message = REFUSED[case]
    folder = write_lora_adapter(tmp_path / "refused", spec, config=config, tensors=tensors)
    with pytest.raises(ModelLoadError, match=message) as refused:
        load_lora_adapter(folder, spec)
    assert str(refused.value).startswith(f"LoRA adapter {folder}: ")


def test_an_adapter_for_another_model_is_refused_with_both_shapes(spec, tmp_path):
    wider = type(spec)(**{**spec.__dict__, "hidden_size": 128, "name": "wider"})
    folder = write_lora_adapter(tmp_path / "wider", wider)
    with pytest.raises(ModelLoadError, match=r"lora_A is \[4, 128\] .* needs \[4, 64\]"):
        load_lora_adapter(folder, spec)


def test_missing_files_are_named(spec, tmp_path):
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_lora_adapter(tmp_path / "absent", spec)
    folder = write_lora_adapter(tmp_path / "a", spec)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(ModelLoadError, match="adapter_model.safetensors is missing .adapter_model.bin is there"):
        load_lora_adapter(folder, spec)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(ModelLoadError, match="adapter_config.json is missing"):
        load_lora_adapter(folder, spec)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(RicllmError, match="adapter_config.json is not readable JSON"):
        load_lora_adapter(folder, spec)
    (folder / "adapter_config.json").write_text(json.dumps(lora_config()))
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{truncated")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_lora_adapter(folder, spec)


def test_lora_a_without_lora_b_is_refused(spec, tmp_path):
    folder = write_lora_adapter(tmp_path / "half", spec)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    del tensors[tensor_name(1, "o", "B")]
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="layer 1 self_attn.o_proj has lora_A without lora_B"):
        load_lora_adapter(folder, spec)


def test_the_adapters_rows_are_the_loaders_rows(tiny_gguf, tiny_oracle):
    """PEFT trains against HF's projections; ricllm's loader undoes llama.cpp's q/k row permutation,
    so its projections are HF's row for row and an update's rows land on the rows they were trained for."""
    ours = dict(open_checkpoint(tiny_gguf).tensors())
    for layer, hf_layer in enumerate(tiny_oracle.model.layers):
        for name, module in PROJECTION_MODULES.items():
            theirs = hf_layer.get_submodule(module).weight
            torch.testing.assert_close(ours[f"layers.{layer}.{name}"].float(), theirs, rtol=0, atol=0)


def _peft_deltas_match_ours(peft_model, adapter, spec) -> int:
    """Every LoRA module PEFT put into the model adds to its base projection what ricllm's arrays add."""
    generator = torch.Generator().manual_seed(0)
    layers, checked = peft_model.base_model.model.model.layers, 0
    for layer, hf_layer in enumerate(layers):
        for name, module_name in PROJECTION_MODULES.items():
            module = hf_layer.get_submodule(module_name)
            update = adapter.projection(layer, name)
            if not hasattr(module, "lora_A"):
                assert update is None, (layer, name)
                continue
            x = torch.randn(5, projection_shape(spec, name)[0], generator=generator)
            with torch.no_grad():
                theirs = module(x) - module.base_layer(x)
            ours = lora_delta(x, [(0, 5, 0)], [(torch.from_numpy(update.a), torch.from_numpy(update.b),
                                                update.scale)], theirs.shape[1])
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
            checked += 1
    return checked


def test_peft_applies_the_updates_ricllm_reads(spec, tiny_gguf, tmp_path):
    """The tiny writer's adapter, loaded by PEFT onto HF's model of the same GGUF: each projection's
    update equals ricllm's, patterns and rsLoRA included."""
    require_module("peft")  # the dev extra's; CI fails without it
    import peft
    from tests.hf_oracle import load_hf_oracle

    folder = write_lora_adapter(tmp_path / "ours", spec, rank=4, alpha=8, seed=2, config={
        "rank_pattern": {"q_proj": 8}, "alpha_pattern": {"model.layers.1.mlp.down_proj": 3}})
    model = peft.PeftModel.from_pretrained(load_hf_oracle(tiny_gguf), str(folder))
    assert _peft_deltas_match_ours(model, load_lora_adapter(folder, spec), spec) == 7 * spec.num_layers


def test_what_peft_saves_ricllm_reads(spec, tiny_gguf, tmp_path):
    """An adapter PEFT itself makes and saves (random B, per-module ranks and alphas, rsLoRA, some
    projections of one layer) loads here with PEFT's updates."""
    require_module("peft")  # the dev extra's; CI fails without it
    import peft
    from tests.hf_oracle import load_hf_oracle

    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                             layers_to_transform=[1], rank_pattern={"v_proj": 2}, alpha_pattern={"o_proj": 5},
                             use_rslora=True, init_lora_weights=False)
    torch.manual_seed(0)
    model = peft.get_peft_model(load_hf_oracle(tiny_gguf), config)
    model.save_pretrained(str(tmp_path / "saved"))
    adapter = load_lora_adapter(tmp_path / "saved", spec)
    assert adapter.projection(1, "v").rank == 2 and adapter.projection(1, "o").scale == 5 / 2
    assert _peft_deltas_match_ours(model, adapter, spec) == 4


@pytest.mark.parametrize("fields, message", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"bias": "lora_only"}, "bias is 'lora_only'"),
], ids=["dora", "modules_to_save", "embedding", "bias"])
def test_what_peft_saves_beyond_plain_lora_is_refused(spec, tiny_gguf, tmp_path, fields, message):
    require_module("peft")  # the dev extra's; CI fails without it
    import peft
    from tests.hf_oracle import load_hf_oracle

    config = peft.LoraConfig(r=4, lora_alpha=8, **{"target_modules": ["q_proj", "v_proj"], **fields})
    peft.get_peft_model(load_hf_oracle(tiny_gguf), config).save_pretrained(str(tmp_path / "saved"))
    with pytest.raises(ModelLoadError, match=message):
        load_lora_adapter(tmp_path / "saved", spec)
