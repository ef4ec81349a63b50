"""Gemma 3 in the torch runtime, held to HF transformers on the same GGUF (fp32) as the oracle: a tiny
random Gemma 3 whose sliding windows are narrower than the prompts (every step of the math, fast), and
the installed Gemma 3 270M (greedy tokens, teacher-forced agreement and perplexity)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ricllm import LLM, SamplingParams
from ricllm.errors import ConfigError
from tests.helpers import ROOT, TINY_GEMMA3, gemma3_270m_path, write_tiny_gemma3_gguf
from tests.hf_oracle import gemma3_oracle
from tests.test_oracle_parity import assert_matches_oracle, random_prompts
from tests.test_weight_formats import TEXT, teacher_forced_logits


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("tiny_gemma3") / "tiny_gemma3.gguf", seed=3)


@pytest.fixture(scope="module")
def tiny_gemma3_oracle(tiny_gemma3):
    return gemma3_oracle(tiny_gemma3, TINY_GEMMA3["head_dim"])


# ---------------------------------------------------------------- the math, on a tiny random Gemma 3


def test_the_spec_reads_gemma3_from_the_file_and_its_architecture(tiny_gemma3):
    from ricllm.model.loader import open_checkpoint

    spec = open_checkpoint(tiny_gemma3).spec
    assert spec.architecture == "gemma3" and spec.tie_word_embeddings
    assert spec.layer_windows == (8, 8, 8, 8, 8, 0, 8)  # one layer in six sees the whole sequence
    assert (spec.rope_theta, spec.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert spec.head_dim == 32 and spec.attention_scale == 32 ** -0.5
    assert spec.final_logit_softcapping is None


@pytest.mark.parametrize("block_size", [1, 16])
def test_logits_match_hf_over_prefill_and_decode_past_the_window(tiny_gemma3, tiny_gemma3_oracle, block_size):
    """Prompts of up to 50 tokens and 32 decode steps against windows of 8: the windowed layers'
    masks, the global layer, both RoPE bases, the norms and GeGLU, position by position."""
    llm = LLM(str(tiny_gemma3), dtype="float32", block_size=block_size, kv_cache_budget="8MiB")
    assert llm.engine.runtime.name == "torch"
    assert_matches_oracle(llm, tiny_gemma3_oracle, random_prompts(llm.engine.spec.vocab_size))


def test_prefill_in_chunks_gives_the_logits_of_one_pass(tiny_gemma3, tiny_gemma3_oracle):
    """Chunks of 5 tokens: a windowed layer's query sees keys of earlier chunks through the cache."""
    llm = LLM(str(tiny_gemma3), dtype="float32", kv_cache_budget="8MiB", max_num_batched_tokens=5,
              enable_prefix_caching=False)
    assert_matches_oracle(llm, tiny_gemma3_oracle, random_prompts(llm.engine.spec.vocab_size, (23, 41)))


def test_q5_0_layers_are_read_as_hf_reads_them(tmp_path):
    path = write_tiny_gemma3_gguf(tmp_path / "tiny_q5_0.gguf", seed=4, quant="Q5_0")
    from ricllm.model.loader import open_checkpoint

    assert set(open_checkpoint(path).tensor_types().values()) == {"F32", "Q5_0"}
    llm = LLM(str(path), dtype="float32", kv_cache_budget="8MiB")
    assert_matches_oracle(llm, gemma3_oracle(path, TINY_GEMMA3["head_dim"]),
                          random_prompts(llm.engine.spec.vocab_size, (12, 30)))


def test_a_requests_own_window_narrows_the_windowed_layers_where_it_is_narrower():
    from ricllm.attention.metadata import AttentionMetadata
    from ricllm.engine.runtime.gemma3 import sliding_window_metadata

    def metadata(windows):
        ints = torch.tensor([9, 9, 9], dtype=torch.int32)
        return AttentionMetadata(
            slot_mapping=torch.zeros(3, dtype=torch.int64), query_start_loc=torch.arange(4, dtype=torch.int32),
            context_lens=ints, block_tables=torch.zeros(3, 1, dtype=torch.int32), max_query_len=1, max_context_len=9,
            kv_sinks=None if windows is None else torch.tensor([4, 4, 4], dtype=torch.int32),
            kv_windows=None if windows is None else torch.tensor(windows, dtype=torch.int32))

    exact = sliding_window_metadata(metadata(None), 512)
    assert exact.kv_windows.tolist() == [512] * 3 and exact.kv_sinks.tolist() == [0] * 3
    # a sequence's own window: 0 (exact), wider than the layer's, narrower: the narrower wins, sinks go
    own = sliding_window_metadata(metadata([0, 1000, 100]), 512)
    assert own.kv_windows.tolist() == [512, 512, 100] and own.kv_sinks.tolist() == [0] * 3


def test_runtime_auto_serves_dense_gemma3_in_torch_and_says_why(tiny_gemma3):
    """F32 layers leave ``weights="auto"`` dense, which only the torch runtime multiplies."""
    llm = LLM(str(tiny_gemma3), kv_cache_budget="8MiB")
    assert llm.engine.runtime.name == "torch"
    assert "weights 'auto' leave the layers dense" in llm.engine.runtime.why
    with pytest.raises(ConfigError, match="runtime 'native' cannot serve.*weights 'auto' leave the layers dense"):
        LLM(str(tiny_gemma3), kv_cache_budget="8MiB", runtime="native")


def test_heads_wider_than_the_c_kernels_take_attend_in_the_torch_reference_on_the_cpu():
    from ricllm.engine.runtime.gemma3 import attention_backend_name

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert attention_backend_name("auto", cpu, 512) == "torch"
    assert attention_backend_name("auto", cpu, 256) == "auto"  # the C kernel takes Gemma 3's heads
    assert attention_backend_name("auto", gpu, 512) == "auto"
    with pytest.raises(ConfigError, match="heads are 512 wide.*at most 256"):
        attention_backend_name("cpu", cpu, 512)


def test_the_weight_cache_gives_back_the_converted_model(tmp_path, monkeypatch):
    """Q8_0 layers packed int8 (bf16 activations): converted from the file, then mapped from the cache."""
    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gemma3_gguf(tmp_path / "tiny_q8.gguf", seed=5, quant="Q8_0")
    prompts = random_prompts(317, (9, 20))
    texts = []
    for source in ("file", "cache"):
        llm = LLM(str(path), dtype="bfloat16", kv_cache_budget="8MiB", runtime="torch")
        assert llm.engine.runtime.weights_source.startswith(source)
        assert llm.engine.runtime.weight_formats == ("int8", "dense")
        texts.append([o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))])
    assert texts[0] == texts[1]


def test_a_chat_request_without_a_chat_template_takes_the_plain_form_and_hits_its_pinned_prefix(tiny_gemma3):
    """A base model's file has no chat template: a conversation is its contents one per line, the
    last message after a blank line; a pinned conversation is the same lines, so a request after it
    reuses its blocks."""
    llm = LLM(str(tiny_gemma3), dtype="float32", kv_cache_budget="8MiB", block_size=4)
    context = [{"role": "system", "content": "Answer as the policy says, in one word."},
               {"role": "user", "content": "PRB usage: high."}, {"role": "assistant", "content": "offload"}]
    question = {"role": "user", "content": "PRB usage: low."}
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    expected = llm.tokenizer.encode("Answer as the policy says, in one word.\nPRB usage: high.\noffload\n\nPRB usage: low.")
    assert llm.chat(context + [question], params)[0].prompt_token_ids == expected
    assert llm.chat([question], params)[0].prompt_token_ids == llm.tokenizer.encode("PRB usage: low.")
    pinned = LLM(str(tiny_gemma3), dtype="float32", kv_cache_budget="8MiB", block_size=4)
    pinned.pin_prefix(context)
    out = pinned.chat(context + [question], params)[0]
    assert out.prompt_token_ids == expected and out.num_cached_tokens >= 8


def test_the_command_line_generates_chats_in_the_plain_form_and_shows_the_windows(tiny_gemma3):
    def generate(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ricllm.cli", "generate", "--model", str(tiny_gemma3),
                               "--dtype", "float32", "--max-tokens", "4", "--ignore-eos", *flags, "the cell"],
                              capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env={**os.environ, "RICLLM_LOG_LEVEL": "warning"})

    done = generate("--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(done.stdout)["token_ids"]) == 4
    chat = generate("--chat", "--system", "Answer briefly.", "--json")
    assert chat.returncode == 0 and "Traceback" not in chat.stderr, chat.stderr[-2000:]
    assert json.loads(chat.stdout)["prompt_tokens"] > json.loads(done.stdout)["prompt_tokens"]
    info = subprocess.run([sys.executable, "-m", "ricllm.cli", "info", str(tiny_gemma3)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert "8 tokens in 6 of 7 layers (their RoPE theta 10000.0)" in info.stdout, info.stderr[-2000:]


# ---------------------------------------------------------------- the installed Gemma 3 270M

PROMPTS = [
    "The O-RAN near-real-time RIC hosts xApps that",
    "Cell 17 reports RRU.PrbUsedDl=92 of 106 PRBs and DRB.UEThpDl=12000 kbps. The load is",
    "def fibonacci(n):\n    ",
]


@pytest.fixture(scope="module")
def gemma3_270m():
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def gemma3_270m_fp32(gemma3_270m):
    # no weight cache: an fp32 entry of this model would take 1.1 GB of disk
    return LLM("gemma3-270m", dtype="float32", kv_cache_budget="64MiB", enable_prefix_caching=False,
               weight_cache=False)


@pytest.mark.slow
def test_gemma3_270m_is_found_by_its_short_name_with_its_shape(gemma3_270m, gemma3_270m_fp32):
    from ricllm.model.loader import read_tensor_types, resolve_model_path

    assert resolve_model_path("gemma3-270m") == gemma3_270m == gemma3_270m_fp32.engine.model_path
    spec, types = gemma3_270m_fp32.engine.spec, read_tensor_types(gemma3_270m)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (18, 4, 1, 256)
    assert spec.vocab_size == 262_144 and spec.tie_word_embeddings and spec.hidden_size == 640
    assert spec.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert (spec.rope_theta, spec.rope_local_theta, spec.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    assert set(types.values()) == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    assert sum(kind == "Q5_0" for kind in types.values()) == 81
    tokenizer = gemma3_270m_fp32.tokenizer
    assert tokenizer.encode("Hi")[0] == tokenizer.bos_token_id == 2 and not tokenizer.has_chat_template


@pytest.mark.slow
def test_greedy_tokens_match_hf_on_gemma3_270m(gemma3_270m_fp32, gemma3_270m_hf):
    """32 greedy tokens on three prompts are HF's: at every position HF's argmax over the prompt and
    ricllm's tokens so far (one teacher-forced HF pass, which two cores afford) is ricllm's token."""
    llm = gemma3_270m_fp32
    assert llm.engine.runtime.name == "torch" and llm.engine.runtime.weight_formats == ("dense", "dense")
    for out in llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True)):
        full = out.prompt_token_ids + out.token_ids
        positions = list(range(len(out.prompt_token_ids) - 1, len(full) - 1))
        with torch.no_grad():
            reference = gemma3_270m_hf(torch.tensor([full])).logits[0, positions].float()
        assert out.token_ids == reference.argmax(-1).tolist(), out.prompt
        torch.testing.assert_close(teacher_forced_logits(llm, full, positions), reference, atol=5e-4, rtol=0)


@pytest.mark.slow
def test_teacher_forced_agreement_and_perplexity_match_hf_on_gemma3_270m(gemma3_270m_fp32, gemma3_270m_text_oracle):
    """On a text longer than the 512-token window, read in prefill chunks of 512."""
    llm, oracle = gemma3_270m_fp32, gemma3_270m_text_oracle
    ids = llm.tokenizer.encode("\n\n".join([TEXT] * 3))
    assert len(ids) > 700 and ids == oracle["ids"]
    ours = teacher_forced_logits(llm, ids, list(range(len(ids) - 1)))
    agreement = (ours.argmax(-1) == oracle["argmax"]).float().mean().item()
    ppl = math.exp(F.cross_entropy(ours, torch.tensor(ids[1:])).item())
    assert agreement >= 0.99, f"greedy agreement with HF fp32 {agreement:.1%}"
    assert abs(ppl / oracle["perplexity"] - 1) <= 0.001, f"perplexity {ppl:.4f} vs HF fp32 {oracle['perplexity']:.4f}"
