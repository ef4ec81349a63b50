"""Gemma 3 in the native runtime: its C attention kernels at head dim 256 against a numpy reference, a tiny
random Gemma 3 of 256-wide heads against the torch runtime (prompts past its window, prefill chunks past
64 rows), an adapter served, and the installed Gemma 3 270M giving the torch runtime's packed
path's greedy tokens, past its 512-token window too; a file of mixed tensor types (Q4_K_M's) packed per
projection, 4-bit and 8-bit, alike in both runtimes."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ricllm import LLM, SamplingParams
from ricllm.errors import CapacityError
from tests.helpers import TINY_GEMMA3, gemma3_270m_path, require, write_tiny_gemma3_gguf
from tests.test_oracle_parity import random_prompts

# ---------------------------------------------------------------- the attention kernels at head dim 256

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 1, 256, 16  # Gemma 3 270M's attention


def bf16(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bf16 bit patterns (to nearest even)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def attention_case(q_lens, ctx_lens, *, windows=None, head_dim=HEAD_DIM, seed=0, num_blocks=256):
    """bf16 queries and a paged cache, random block tables; with ``windows`` the blocks no query of a
    sequence reads are evicted (table entries -1) and their rows poisoned with NaN."""
    rng = np.random.default_rng(seed)
    k_cache, v_cache = (bf16(rng.standard_normal((num_blocks, BLOCK, KV_HEADS, head_dim))) for _ in range(2))
    width = max(-(-c // BLOCK) for c in ctx_lens)
    tables = rng.permutation(num_blocks)[:len(ctx_lens) * width].reshape(len(ctx_lens), width).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = bf16(rng.standard_normal((int(starts[-1]), HEADS, head_dim)))
    if windows is not None:
        for b, (q_len, ctx, w) in enumerate(zip(q_lens, ctx_lens, windows)):
            first_seen = max(0, ctx - q_len - w + 1)  # the first query's window starts there
            for i in range(first_seen // BLOCK):
                k_cache[tables[b, i]] = v_cache[tables[b, i]] = 0x7FC0  # NaN: a read shows
                tables[b, i] = -1
    return query, k_cache, v_cache, tables, starts, np.asarray(ctx_lens, dtype=np.int32)


def reference(query, k_cache, v_cache, tables, starts, lens, scale, windows=None) -> np.ndarray:
    """Causal attention per sequence in fp64, each query seeing the last ``window`` keys (0: all)."""
    q, out = widen(query).astype(np.float64), np.zeros(query.shape)
    k_all, v_all = widen(k_cache).astype(np.float64), widen(v_cache).astype(np.float64)
    group = HEADS // KV_HEADS
    for b in range(len(lens)):
        for j, t in enumerate(range(starts[b], starts[b + 1])):
            p = lens[b] - (starts[b + 1] - starts[b]) + j
            low = 0 if windows is None or not windows[b] else max(0, p - windows[b] + 1)
            keys = np.arange(low, p + 1)
            rows = tables[b, keys // BLOCK] * BLOCK + keys % BLOCK
            k = k_all.reshape(-1, KV_HEADS, q.shape[-1])[rows]
            v = v_all.reshape(-1, KV_HEADS, q.shape[-1])[rows]
            for h in range(HEADS):
                scores = k[:, h // group] @ q[t, h] * scale
                weights = np.exp(scores - scores.max())
                out[t, h] = weights @ v[:, h // group] / weights.sum()
    return out


def c_attention(entry: str, query, k_cache, v_cache, tables, starts, lens, scale, windows=None) -> np.ndarray:
    from ricllm.kernels.cpu_library import library

    out = np.empty_like(query)
    sinks = None if windows is None else np.zeros(len(lens), dtype=np.int32)
    windows = None if windows is None else np.asarray(windows, dtype=np.int32)
    code = getattr(library(), entry)(
        query.ctypes.data, k_cache.ctypes.data, v_cache.ctypes.data, out.ctypes.data, tables.ctypes.data,
        starts.ctypes.data, lens.ctypes.data, len(lens), HEADS, KV_HEADS, query.shape[-1], BLOCK, tables.shape[1],
        scale, 1, 1, None if sinks is None else sinks.ctypes.data, None if windows is None else windows.ctypes.data, 2)
    assert code == 0, f"{entry} refused the shape (code {code})"
    return widen(out)


@pytest.fixture(scope="module")
def kernels():
    require(shutil.which("cc") is not None or shutil.which("gcc") is not None, "no C compiler (cc/gcc)")
    from ricllm.kernels.cpu_library import cpu_kernels_available

    ok, reason = cpu_kernels_available()
    assert ok, reason


def assert_attends_like_the_reference(entry, case, windows=None):
    scale = HEAD_DIM ** -0.5
    got = c_attention(entry, *case, scale, windows)
    expected = reference(*case, scale, windows)
    error = np.abs(got - expected).max()
    assert error < 2e-2, f"{entry}: max abs error {error:.2e}"


def test_decode_and_short_chunks_at_head_dim_256_match_the_reference(kernels):
    """The paged kernel: decodes over 1-700 keys and a 9-query chunk, 4 query heads on one KV head."""
    case = attention_case([1, 1, 1, 9], [1, 100, 700, 300])
    assert_attends_like_the_reference("ricllm_paged_attention", case)


def test_sliding_windows_at_head_dim_256_read_only_their_keys(kernels):
    """A 512-token window over 700-key contexts, evicted blocks poisoned: a read of one would show as NaN."""
    windows = [512, 512, 512]
    case = attention_case([1, 40, 1], [700, 800, 90], windows=windows, seed=1)
    assert_attends_like_the_reference("ricllm_attention", case, windows)


def test_the_prefill_kernel_at_head_dim_256_matches_the_reference(kernels):
    """Prompt chunks of 65+ queries (whole, and after a cached prefix), and decodes beside them in the
    kernel the C side picks."""
    case = attention_case([100, 80], [100, 300], seed=2)
    assert_attends_like_the_reference("ricllm_prefill_attention", case)
    case = attention_case([70, 1, 1], [70, 200, 30], seed=3)
    assert_attends_like_the_reference("ricllm_attention", case)


def test_the_reference_check_can_fail(kernels):
    """Another case's answer (a window it does not keep) is far from the reference."""
    case = attention_case([1], [700], seed=4)
    scale = HEAD_DIM ** -0.5
    assert np.abs(c_attention("ricllm_attention", *case, scale, [64]) - reference(*case, scale)).max() > 2e-2


# ---------------------------------------------------------------- a tiny Gemma 3 of 256-wide heads

TINY_WINDOW = 8


@pytest.fixture(scope="module")
def tiny_gemma3_wide(tmp_path_factory) -> Path:
    """Gemma 3 270M's attention (4 heads on 1 KV head, 256 wide) in seven layers, Q8_0, windows of 8."""
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("tiny_gemma3_wide") / "tiny.gguf", seed=7, quant="Q8_0",
                                  pad_vocab_to=16, head_dim=256, kv_heads=1, window=TINY_WINDOW)


def tiny(path: Path, runtime: str, **kwargs) -> LLM:
    return LLM(str(path), weights="int8", runtime=runtime, weight_cache=False, kv_cache_budget="16MiB", **kwargs)


def recorded_logits(llm: LLM, prompts, params):
    from tests.recorder import LogitsRecorder

    recorder = LogitsRecorder(llm.engine)
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [recorder.stacked(o.request_id)[1] for o in outs]


def runtimes_logits(path: Path, prompts, params, **settings):
    """Each runtime's (greedy tokens, recorded logits)."""
    results = {}
    for runtime in ("native", "torch"):
        llm = tiny(path, runtime, **settings)
        assert llm.engine.runtime.name == runtime and llm.engine.spec.head_dim == 256
        results[runtime] = recorded_logits(llm, prompts, params)
    return results["native"], results["torch"]


def test_the_tiny_gemma3_gives_the_torch_runtimes_logits_bit_for_bit(tiny_gemma3_wide):
    """Prompts of 5-64 tokens against windows of 8, then 16 decodes: where the torch runtime attends
    in the same C kernel (steps of up to 64 rows) and runs Gemma's norms, QK-norm and GeGLU in the
    native stack's C kernels, the two compute the same bits."""
    import torch

    prompts = random_prompts(317, (5, 23, 64), seed=1)
    (native_tokens, native_logits), (torch_tokens, torch_logits) = runtimes_logits(
        tiny_gemma3_wide, prompts, SamplingParams(max_tokens=16, ignore_eos=True), max_num_batched_tokens=64)
    assert native_tokens == torch_tokens
    for ours, theirs in zip(native_logits, torch_logits, strict=True):
        assert torch.equal(ours, theirs)


def test_a_prompt_chunk_past_64_rows_gives_the_torch_runtimes_tokens(tiny_gemma3_wide):
    """A 100-token prompt read in one chunk: its global layer attends in the blocked prefill kernel
    here, in SDPA or the prefill kernel in the torch runtime; the logits agree to bf16 rounding."""
    import torch

    prompts = random_prompts(317, (100, 9), seed=3)
    (native_tokens, native_logits), (torch_tokens, torch_logits) = runtimes_logits(
        tiny_gemma3_wide, prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert native_tokens == torch_tokens
    for ours, theirs in zip(native_logits, torch_logits, strict=True):
        scale = theirs.abs().max().item()
        assert torch.allclose(ours, theirs, atol=0.02 * scale, rtol=0), (ours - theirs).abs().max().item()


def test_the_tiny_gemma3_in_chunks_gives_its_unchunked_tokens(tiny_gemma3_wide):
    """Prefill in chunks of 5 through the hybrid cache: the sliding-window groups let go of their
    early blocks while the prompt is read, and later chunks read only what their windows keep."""
    prompts = random_prompts(317, (41, 60), seed=2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    whole = [o.token_ids for o in tiny(tiny_gemma3_wide, "native").generate(prompts, params)]
    llm = tiny(tiny_gemma3_wide, "native", max_num_batched_tokens=5, enable_prefix_caching=False)
    assert len(llm.engine.kv_cache.geometry.groups) > 1  # a hybrid cache: one table per group
    assert [o.token_ids for o in llm.generate(prompts, params)] == whole


def test_an_adapter_on_gemma3_is_served_in_the_native_runtime_and_refused_by_name_without_slots(
        tiny_gemma3_wide, tmp_path):
    """An adapter changes the native runtime's greedy tokens on 256-wide heads (``tests/test_gemma3_lora.py``
    holds its logits to PEFT's); with max_loras=0 loading one is refused naming it."""
    from ricllm.lora_request import LoRARequest
    from tests.lora_adapters import write_lora_adapter

    llm = tiny(tiny_gemma3_wide, "native", max_loras=1)
    assert llm.engine.runtime.name == "native"
    path = write_lora_adapter(tmp_path / "adapter", llm.engine.spec, std=0.5)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = random_prompts(317, (5, 12), seed=4)
    base = [o.token_ids for o in llm.generate(prompts, params)]
    tuned = [o.token_ids for o in llm.generate(prompts, params, lora_request=LoRARequest("policy", str(path)))]
    assert tuned != base
    none = tiny(tiny_gemma3_wide, "native", max_loras=0)
    with pytest.raises(CapacityError, match="cannot load adapter 'policy'.*no adapter slots"):
        none.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=LoRARequest("policy", str(path)))


# ---------------------------------------------------------------- mixed tensor types: bits per projection

def q4_k_m_types(name: str) -> str | None:
    """The tiny model's tensor types, as llama.cpp's Q4_K_M types Gemma 3 270M's: attn_output Q4_K;
    ffn_down 4-bit (Q4_1 here: its 128-wide rows take no K-quant) in odd layers, 8-bit in even ones;
    attn_v Q8_0 in even layers; the other projections Q5_0; the tied embedding Q8_0; norms F32."""
    parts = name.split(".")
    if parts[0] != "blk":
        return "Q8_0" if name == "token_embd.weight" else None
    odd = int(parts[1]) % 2
    return {"attn_output": "Q4_K", "ffn_down": ("Q8_0", "Q4_1")[odd], "attn_v": ("Q8_0", "Q5_0")[odd],
            "attn_q": "Q5_0", "attn_k": "Q5_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_0"}.get(parts[2])


@pytest.fixture(scope="module")
def tiny_gemma3_mixed(tmp_path_factory) -> Path:
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("tiny_gemma3_mixed") / "tiny.gguf", seed=11,
                                  quant=q4_k_m_types, pad_vocab_to=16, head_dim=256, kv_heads=1, window=TINY_WINDOW)


def projection_bits(llm: LLM) -> list[list[int]]:
    """Each layer's bits per projection (qkv, o, gate_up, down) as the runtime holds its weights."""
    from ricllm.model.formats import PROJECTIONS

    model = llm.engine.runtime.model
    if llm.engine.runtime.name == "native":
        return [[layer.projections[p].bits for p in PROJECTIONS] for layer in model.weights.layers]
    return [[4 if m.fmt == "int4" else 8 for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                                                  layer.mlp.down_proj)] for layer in model.layers]


def test_a_mixed_file_packs_each_projection_in_its_own_bits_alike_in_both_runtimes(tiny_gemma3_mixed):
    """``weights="auto"`` on Q4_K_M's mix of types: the 4-bit tensors (Q4_K, Q4_1) pack int4, the Q5_0 and
    Q8_0 ones int8, each projection of a layer in its own bits; the two runtimes compute the same bits."""
    import torch

    expected = [[8, 4, 8, 4 if i % 2 else 8] for i in range(TINY_GEMMA3["layers"])]
    prompts = random_prompts(317, (5, 23, 64), seed=4)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = {}
    for runtime in ("native", "torch"):
        llm = LLM(str(tiny_gemma3_mixed), dtype="bfloat16", runtime=runtime, weight_cache=False,
                  kv_cache_budget="16MiB", max_num_batched_tokens=64)
        assert llm.engine.runtime.name == runtime
        assert llm.engine.runtime.weight_formats == ("int4+int8", "int8")
        assert projection_bits(llm) == expected
        runs[runtime] = recorded_logits(llm, prompts, params)
    (native_tokens, native_logits), (torch_tokens, torch_logits) = runs["native"], runs["torch"]
    assert native_tokens == torch_tokens
    for ours, theirs in zip(native_logits, torch_logits, strict=True):
        assert torch.equal(ours, theirs)


# ---------------------------------------------------------------- the installed Gemma 3 270M

PROMPTS = [
    "The O-RAN near-real-time RIC hosts xApps that",
    "Cell 17 reports RRU.PrbUsedDl=92 of 106 PRBs and DRB.UEThpDl=12000 kbps. The load is",
    "def fibonacci(n):\n    ",
]


@pytest.fixture(scope="module")
def gemma3_270m_runtimes() -> dict[str, LLM]:
    """The native runtime and the torch runtime's packed path (bf16, ``weights="auto"``), each once. Steps
    of at most 64 rows: there the torch runtime attends in the C kernels as the native one does (larger
    prefills it gives to SDPA, whose roundings differ), so the two compute the same logits."""
    gemma3_270m_path()
    return {runtime: LLM("gemma3-270m", runtime=runtime, kv_cache_budget="64MiB", enable_prefix_caching=False,
                         max_num_batched_tokens=64)
            for runtime in ("native", "torch")}


@pytest.mark.slow
def test_gemma3_270m_native_gives_the_torch_runtimes_greedy_tokens(gemma3_270m_runtimes):
    """32 greedy tokens on three prompts, in one batch."""
    native, torch_llm = gemma3_270m_runtimes["native"], gemma3_270m_runtimes["torch"]
    assert native.engine.runtime.name == "native" and torch_llm.engine.runtime.name == "torch"
    assert native.engine.runtime.weight_formats == torch_llm.engine.runtime.weight_formats
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    tokens = {name: [o.token_ids for o in llm.generate(PROMPTS, params)]
              for name, llm in gemma3_270m_runtimes.items()}
    assert all(len(t) == 32 for t in tokens["native"])
    assert tokens["native"] == tokens["torch"]


@pytest.mark.slow
def test_gemma3_270m_native_past_the_512_token_window_gives_the_torch_runtimes_tokens(gemma3_270m_runtimes):
    """A 700-token prompt in chunks of 64: the sliding-window layers read only their group's last window
    of blocks (the torch runtime attends the global layers' later chunks in SDPA)."""
    from tests.test_weight_formats import TEXT

    native = gemma3_270m_runtimes["native"]
    ids = native.tokenizer.encode("\n\n".join([TEXT] * 3))[:700]
    assert len(ids) == 700
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    tokens = {name: llm.generate([ids], params)[0].token_ids for name, llm in gemma3_270m_runtimes.items()}
    assert tokens["native"] == tokens["torch"]


@pytest.mark.slow
def test_gemma3_270m_native_k_wide_head_chooses_what_its_whole_head_chooses(gemma3_270m_runtimes):
    """A constrained choice on the 262,144-token tied head: computed on the allowed tiles, the same
    answers and decision confidences as the whole head's."""
    from tests.test_constrained_head import count_narrow_steps

    llm = gemma3_270m_runtimes["native"]
    choice = SamplingParams(max_tokens=8, structured={"choice": ["congested", "normal", "degraded"]})
    runner, answers = llm.engine.runtime.runner, {}
    narrow_steps = count_narrow_steps(llm)
    for narrow in (True, False):
        runner.narrow_head = narrow
        before = narrow_steps[0]
        outs = llm.generate(PROMPTS[:2], choice)
        answers[narrow] = [(o.text, o.confidence) for o in outs]
        assert (narrow_steps[0] > before) == narrow  # the k-wide head ran, and only when on
    runner.narrow_head = True
    assert all(text in ("congested", "normal", "degraded") and 0 < confidence <= 1
               for text, confidence in answers[True])
    assert answers[True] == answers[False]
