"""HF transformers on a model's GGUF, fp32: the numerical oracle, loaded from a copy without the vocabulary.

HF's GGUF loader reads the file's header with gguf-py's ``GGUFReader`` twice (config, then weights), and
that reader builds a numpy view per element of every metadata array: for Gemma 3's 262,144-token
vocabulary (tokens, scores, types) about 20 s a pass on two cores, most of the oracle's load. The
model needs none of it. So the oracle loads ``oracle_copy``: the same tensors byte for byte (HF
dequantizes them itself) and the same metadata, less the tokenizer's arrays, with the vocabulary's size
stated where the file left HF to count it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from tests.helpers import require_module

VOCABULARY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.merges")


def oracle_copy(path: Path, folder: Path) -> Path:
    """``path`` rewritten into ``folder`` without its vocabulary arrays (see the module's docstring)."""
    import gguf

    from ricllm.model.gguf_file import GGUFFile

    source = GGUFFile(path)
    architecture = source.fields["general.architecture"]
    copy = folder / path.name
    writer = gguf.GGUFWriter(copy, architecture)
    for key, value in source.fields.items():
        if key not in VOCABULARY_ARRAYS and key != "general.architecture":
            writer.add_key_value(key, value, _value_type(value))
    if f"{architecture}.vocab_size" not in source.fields:
        writer.add_uint32(f"{architecture}.vocab_size", len(source.fields["tokenizer.ggml.tokens"]))
    for tensor in source.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return copy


def _value_type(value):
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.INT32 if value < 0 else GGUFValueType.UINT32 if value < 2**32 else GGUFValueType.UINT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    return GGUFValueType.ARRAY if isinstance(value, list) else GGUFValueType.STRING


def load_hf_oracle(path: Path, **config) -> torch.nn.Module:
    """HF transformers' model of the GGUF at ``path``, fp32, in eval mode (``config``: overrides of HF's
    config, as ``from_pretrained`` takes them)."""
    require_module("transformers")
    require_module("accelerate")
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="hf_oracle_") as folder:
        copy = oracle_copy(Path(path), Path(folder))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=copy.name, dtype=torch.float32, **config)
    return model.eval()


def gemma3_oracle(path: Path, query_pre_attn_scalar: int = 256) -> torch.nn.Module:
    """``load_hf_oracle`` for a Gemma 3 GGUF. HF's GGUF loader leaves ``query_pre_attn_scalar`` at its
    default, 256: the head dim of every Gemma 3 but the 27B. ricllm scales by the head dim, as llama.cpp
    does, so a tiny model's oracle is told its heads' width."""
    return load_hf_oracle(path, query_pre_attn_scalar=query_pre_attn_scalar)
