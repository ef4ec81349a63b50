"""LoRA adapters on Gemma 3 in both runtimes, held to PEFT on HF's model of the same GGUF: q and k
are adapted before QK-norm, o and down before the post-sublayer norms, as PEFT adapts HF's modules.
A step whose rows belong to different adapters (and to none) gives each row its own adapter's
logits; the native runtime and the torch runtime's C kernels compute the same bits under adapters.

The tiny model has Gemma 3 270M's attention (4 query heads on one KV head, 256 wide) and windows of
8 tokens, so the decode steps read past the sliding-window layers' windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ricllm import LLM
from tests.helpers import require_module, write_tiny_gemma3_gguf
from tests.test_lora_runtime import (LOGIT_TOL, MIXED, ORACLE_ATOL, adapters_for, assert_each_row_as_alone,
                                     positions_of, run_steps)

HEAD_DIM = 256


@pytest.fixture(scope="module")
def tiny_gemma3_q8(tmp_path_factory) -> Path:
    """Q8_0 layers, 256-wide heads on one KV head, windows of 8, a vocabulary of whole head tiles: both
    runtimes serve it."""
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("tiny_gemma3_lora") / "tiny.gguf", seed=11, quant="Q8_0",
                                  pad_vocab_to=16, head_dim=HEAD_DIM, kv_heads=1, window=8)


def engine(path: Path, runtime: str, **kwargs) -> LLM:
    kwargs.setdefault("weight_cache", False)
    kwargs.setdefault("kv_cache_budget", "8MiB")
    kwargs.setdefault("weights", "int8")
    return LLM(str(path), runtime=runtime, **kwargs)


def peft_logits(gguf: Path, adapter_folder: Path | None, token_ids: list[int], positions: list[int]) -> torch.Tensor:
    """PEFT's logits on HF's Gemma 3 of the GGUF (fp32), under the adapter in ``adapter_folder`` (None: none)."""
    from tests.hf_oracle import gemma3_oracle

    model = gemma3_oracle(gguf, HEAD_DIM)
    if adapter_folder is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter_folder))
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, positions].float()


@pytest.fixture(scope="module")
def gemma_pair(tiny_gemma3_q8, tmp_path_factory):
    """The native runtime and the torch runtime (bf16, the C kernels) on the same int8 tiny Gemma 3,
    each with adapters A (slot 0) and B (slot 2) loaded."""
    folder = tmp_path_factory.mktemp("gemma_adapters")
    engines = {runtime: engine(tiny_gemma3_q8, runtime) for runtime in ("native", "torch")}
    assert engines["native"].engine.runtime.name == "native"
    assert type(engines["torch"].engine.runtime.lora).__name__ == "LoraSlots"
    adapters = {runtime: adapters_for(llm, folder) for runtime, llm in engines.items()}
    return engines, adapters


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"], ids=["c-kernels", "torch-ops"])
def test_fp32_logits_under_adapters_are_pefts(tiny_gemma3_q8, tmp_path, attention_backend):
    """The torch runtime in fp32, with the C kernels (the adapters in the C layout) and with the torch
    reference ops (``lora_delta``): prefill and decode logits of two requests under two adapters and
    one under none, in one batch, past the sliding windows, equal PEFT's."""
    require_module("peft")  # the dev extra's; CI fails without it
    llm = engine(tiny_gemma3_q8, "torch", weights="auto", dtype="float32", attention_backend=attention_backend)
    kind = type(llm.engine.runtime.lora).__name__
    assert kind == ("LoraSlots" if attention_backend == "cpu" else "TorchLoraSlots")
    adapters_for(llm, tmp_path)
    requests = [MIXED[0], MIXED[1], MIXED[2]]
    for (prompt, slot), (tokens, logits) in zip(requests, run_steps(llm, requests)):
        assert len(tokens) > 8  # past the sliding-window layers' window
        folder = {0: tmp_path / "A", 2: tmp_path / "B", None: None}[slot]
        reference = peft_logits(tiny_gemma3_q8, folder, tokens, positions_of(prompt, tokens))
        torch.testing.assert_close(logits, reference, atol=ORACLE_ATOL, rtol=0)
        assert tokens[len(prompt):] == reference.argmax(-1).tolist()


@pytest.mark.parametrize("runtime", ["native", "torch"])
def test_bf16_logits_under_an_adapter_follow_pefts(gemma_pair, tiny_gemma3_q8, runtime):
    """bf16 activations and int8 weights err from HF's fp32 model by rounding; under the adapter they
    stay within the bf16 tolerance of PEFT's logits, which the adapter moves by several units."""
    require_module("peft")
    engines, adapters = gemma_pair
    llm, folder = engines[runtime], Path(adapters[runtime][0].path)
    prompt = MIXED[0][0]
    (tokens, logits), = run_steps(llm, [MIXED[0]])
    reference = peft_logits(tiny_gemma3_q8, folder, tokens, positions_of(prompt, tokens))
    error = (logits - reference).abs().max().item()
    moved = (reference - peft_logits(tiny_gemma3_q8, None, tokens, positions_of(prompt, tokens))).abs().max().item()
    assert error <= LOGIT_TOL, f"{error:.3f} from PEFT's logits under the adapter"
    assert moved > 10 * LOGIT_TOL, f"the adapter moves PEFT's logits by only {moved:.3f}"


@pytest.mark.parametrize("runtime", ["native", "torch"])
def test_a_mixed_batch_gives_each_request_its_own_adapters_logits(gemma_pair, runtime):
    """Prefill and decode steps whose rows belong to adapter A, adapter B and none: each request's
    logits and greedy tokens are those of its run alone."""
    engines, _ = gemma_pair
    assert_each_row_as_alone(engines[runtime])


def test_adapters_change_their_rows_and_leave_the_others_as_they_are(gemma_pair):
    engines, _ = gemma_pair
    llm = engines["native"]
    base = run_steps(llm, [(prompt, None) for prompt, _ in MIXED])
    for (prompt, slot), (_, ours), (_, plain) in zip(MIXED, run_steps(llm, MIXED), base):
        moved = (ours[0] - plain[0]).abs().max().item()  # the prefill's logits: the same context
        assert moved > 1.0 if slot is not None else moved == 0.0, (slot, moved)


def test_native_and_torch_compute_the_same_bits_under_adapters(gemma_pair):
    """Where both attend in the same C kernel (decodes, small prefills) the two runtimes agree bit for
    bit with adapters, as they do without."""
    engines, _ = gemma_pair
    native, torch_runtime = (run_steps(engines[runtime], MIXED) for runtime in ("native", "torch"))
    for (tokens, logits), (their_tokens, their_logits) in zip(native, torch_runtime):
        assert tokens == their_tokens
        assert torch.equal(logits, their_logits)


def test_a_mixed_batch_on_the_torch_reference_ops(tiny_gemma3_q8, tmp_path):
    """The torch reference modules with the adapters as tensors (``lora_delta``), as on a GPU."""
    llm = engine(tiny_gemma3_q8, "torch", attention_backend="torch", dtype="bfloat16")
    assert type(llm.engine.runtime.lora).__name__ == "TorchLoraSlots"
    adapters_for(llm, tmp_path)
    assert_each_row_as_alone(llm)
