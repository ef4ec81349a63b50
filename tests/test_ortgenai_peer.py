"""bench_cpu's ORT GenAI peer (benchmarks/ortgenai_peer.py): the HF folder its builder reads is the
GGUF's own model, an interpreter without ORT GenAI is named rather than run, and the roofline's bytes
come from the built graph. ORT GenAI itself is not needed here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: no folder of ours shadows an installed package

from benchmarks import ortgenai_peer
from tests.helpers import require_module


def test_the_hf_folder_is_the_gguf_model_unpacked_with_its_tokenizer(tiny_native_gguf, tmp_path):
    require_module("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "hf"
    ortgenai_peer.write_hf_folder(tiny_native_gguf, folder)  # Q4_1 layers, unpacked to fp32
    saved = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    direct = AutoModelForCausalLM.from_pretrained(str(tiny_native_gguf.parent), gguf_file=tiny_native_gguf.name,
                                                  dtype=torch.float32).eval()
    assert getattr(saved.config, "quantization_config", None) is None  # a plain model the builder can read
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.inference_mode():
        assert torch.equal(saved(ids).logits, direct(ids).logits)
    text = "the near-RT RIC"
    assert AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"] == AutoTokenizer.from_pretrained(
        str(tiny_native_gguf.parent), gguf_file=tiny_native_gguf.name)(text)["input_ids"]


def test_an_interpreter_that_cannot_import_ort_genai_is_named_not_run(tmp_path):
    python, env, problem = ortgenai_peer.packages(str(tmp_path / "no-python"), tmp_path, ortgenai_peer.VERSIONS)
    assert python == str(tmp_path / "no-python") and env == {} and "no-python" in problem
    python, env, problem = ortgenai_peer.packages(sys.executable, tmp_path, {})
    if problem:  # this venv has no ORT GenAI: the import error names the module
        assert "onnxruntime_genai" in problem


def test_every_initializer_is_read_per_token_but_the_rope_tables(tmp_path):
    require_module("onnx")
    import onnx
    from onnx import helper, numpy_helper

    initializers = [numpy_helper.from_array(np.zeros((960, 18, 16), np.uint8), "qkv.weight_Q4"),
                    numpy_helper.from_array(np.zeros((960, 18), np.float32), "qkv.weight_scales"),
                    numpy_helper.from_array(np.zeros(576, np.float32), "norm.weight"),
                    numpy_helper.from_array(np.zeros((8192, 32), np.float32), "cos_cache"),
                    numpy_helper.from_array(np.zeros((8192, 32), np.float32), "sin_cache")]
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [], initializer=initializers)),
              str(tmp_path / "model.onnx"))
    assert ortgenai_peer.weight_bytes(tmp_path) == 960 * 18 * 16 + 960 * 18 * 4 + 576 * 4
    config = {"model": {"decoder": {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_size": 64}}}
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    assert ortgenai_peer.kv_bytes_per_token(tmp_path) == 2 * 30 * 3 * 64 * 4  # fp32 K and V


def test_a_built_model_is_reused_without_running_anything(tmp_path):
    digest = "ab" * 32
    model_dir = ortgenai_peer.model_folder(tmp_path, digest, ortgenai_peer.VERSIONS)
    assert model_dir.parent == tmp_path / "ortgenai"
    model_dir.mkdir(parents=True)
    (model_dir / "build.json").write_text("{}")
    found, problem = ortgenai_peer.build(Path("/no/such.gguf"), digest, "/no/python", {}, tmp_path,
                                         ortgenai_peer.VERSIONS, "5.25.0")
    assert (found, problem) == (model_dir, None)


@pytest.mark.parametrize("step", ["hf-folder", "builder"])
def test_a_failed_step_leaves_no_folder_behind_and_says_which(tmp_path, step):
    gguf = tmp_path / "missing.gguf"  # the HF folder cannot be written from a file that is not there
    if step == "builder":
        hf = tmp_path / "ortgenai" / f"hf-{'cd' * 8}-transformers-5.25.0"
        hf.mkdir(parents=True)
        (hf / "config.json").write_text("{}")
    python = str(tmp_path / "no-python") if step == "builder" else sys.executable
    found, problem = ortgenai_peer.build(gguf, "cd" * 32, python, {}, tmp_path, ortgenai_peer.VERSIONS, "5.25.0")
    assert found is None
    assert ("writing the HF folder" if step == "hf-folder" else "model builder") in problem
    left = sorted(p.name for p in (tmp_path / "ortgenai").iterdir())
    assert left == ([] if step == "hf-folder" else [hf.name])  # no half-built folder is taken for a built one
