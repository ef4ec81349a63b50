"""Packed weights (``weights="int8"|"int4"|"auto"``, CPU, bf16) compute what dense weights compute.

Two packed layouts: ricllm's own kernels' reproduces GGUF Q4_1 and Q8_0 weights exactly and
multiplies within bf16 rounding (4-bit on bf16 activations: AMX tiles, AVX2) or the error of its
int8 activations (8-bit, and 4-bit on VNNI); torch's packs a Q4_1 weight exactly up to
the bf16 rounding of its scales, and its int8 per-row packing errs by at most half a step of its row; the default model keeps its greedy choices and
its perplexity in every format; and with packed weights continuous batching and prefix caching
give a request its solo logits (its greedy tokens, but where two tokens tie within bf16 rounding)
and the KV budget holds, as with dense weights.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ricllm import LLM, SamplingParams
from ricllm.errors import ConfigError
from ricllm.kernels.cpu_library import cpu_family
from ricllm.model.packed_linear import INT4_GROUP, PackedLinear, can_pack, resolve_formats, vnni_layout_available
from tests.helpers import require, write_tiny_llama_gguf
from tests.recorder import LogitsRecorder
from tests.smollm2_oracle import TEXT
from tests.test_budget import assert_budget_held, generate_checking_pool
from tests.test_oracle_parity import random_prompts

# Every LLM in this file converts its weights from the file (weight_cache=False): a cached entry
# would hide a change to the packing code, which the cache key does not cover.
CPU = torch.device("cpu")
BF16_ROUNDOFF = 2 ** -8  # bf16 keeps 8 significant bits
BF16_REL_TOL = 2 * BF16_ROUNDOFF  # relative to the output's norm
FORMATS = ("bf16", "int8", "int4")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def gguf_weight(rows: int, cols: int, seed: int = 0, kind: str = "Q4_1") -> torch.Tensor:
    """What the loader makes of a Q4_1 tensor (``w = d·q + m`` per group of 32, ``q`` spanning
    0..15) or a Q8_0 one (``w = d·q``, ``q`` in -127..127)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    source = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(source, qtype), qtype).copy()).float()


def gguf_q4_1_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return gguf_weight(rows, cols, seed, "Q4_1")


def need_layout(layout: str, fmt: str = "int8") -> None:
    if layout == "vnni":
        require(vnni_layout_available(fmt), f"ricllm's {fmt} kernel needs AVX-512 VNNI"
                f"{' and BF16' if fmt == 'int4' else ''} and a C compiler")


# --------------------------------------------------------------------- packed_linear units

# rounding activations to int8 per group of 32 (step amax/127, about 2.5σ/127 for normal activations)
# errs by step/√12 ≈ 0.6% of σ each, and a product by as much relative to its norm: 0.01 leaves 1.7×
ACTIVATION_INT8_TOL = 0.01


def vnni_tolerance(fmt: str, rows: int) -> float:
    """8-bit, and 4-bit where its path takes int8 activations (VNNI): the int8 rounding's error;
    4-bit on bf16 activations (AMX tiles, AVX2): only the bf16 output rounds."""
    from ricllm.kernels.cpu_library import int4_path

    int8_activations = fmt == "int8" or int4_path(rows).startswith("int8")
    return ACTIVATION_INT8_TOL if int8_activations else BF16_REL_TOL


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """What the int8 paths multiply: x rounded per group of 32 to a step of amax/127."""
    groups = x.float().view(x.shape[0], -1, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    return (torch.round(groups * (1 / step)) * step).view(x.shape)


@pytest.mark.parametrize("kind,fmt", [("Q4_1", "int4"), ("Q8_0", "int8")])
def test_vnni_packing_reproduces_a_gguf_weight_exactly(kind, fmt):
    need_layout("vnni", fmt)
    from ricllm.kernels import cpu_quant

    w = gguf_weight(96, 256, kind=kind)
    packed = PackedLinear.pack(w, fmt, max_packed_rows=None, layout="vnni")  # packed at every row count
    bits = 4 if fmt == "int4" else 8
    buffers = (packed.packed_weight, packed.packed_scales, packed.packed_offsets)
    assert torch.equal(cpu_quant.unpack(*buffers, bits), w)
    # one row, per-row blocks (full and partial), AMX's blocks of 16 rows (full and partial) with
    # exact scales, and from 64 rows on AMX on weights dequantized to bf16 (panels of 128 rows)
    for rows in (1, 2, 5, 8, 13, 16, 40, 64, 150):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        err = rel_err(packed(x), F.linear(x.float(), w))
        assert err < vnni_tolerance(fmt, rows), f"{fmt} output for {rows} rows is off by {err:.4f} relative"
    # the tolerance catches a scale off by one part in 64 (the kernel must apply what it stores)
    packed.packed_scales[:, :, 0] *= 1 + 1 / 64
    packed.packed_scales[:, :, 1] *= 1 + 1 / 64
    assert rel_err(packed(x), F.linear(x.float(), w)) > vnni_tolerance(fmt, x.shape[0]) / 2


@pytest.mark.parametrize("rows", [1, 4, 17, 70])
def test_vnni_int4_takes_an_odd_number_of_groups(rows):
    need_layout("vnni", "int4")
    w = gguf_weight(48, 96, seed=7)  # 3 groups of 32: the AMX path pairs groups and has one left over
    packed = PackedLinear.pack(w, "int4", max_packed_rows=None, layout="vnni")
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert rel_err(packed(x), F.linear(x.float(), w)) < vnni_tolerance("int4", rows)


@pytest.mark.parametrize("rows", [3, 20])
def test_vnni_int4_with_fp32_activations_rounds_them_as_its_path_says(rows):
    """fp32 activations are rounded once, to what the path multiplies: int8 per group (VNNI) or
    bf16 (AMX tiles); past that, an fp32 output differs only by the accumulation's rounding."""
    need_layout("vnni", "int4")
    from ricllm.kernels.cpu_library import int4_path

    w = gguf_weight(32, 64, seed=5)
    packed = PackedLinear.pack(w, "int4", max_packed_rows=None, layout="vnni")
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(6))
    y = packed(x)
    assert y.dtype == torch.float32
    rounded = int8_activations(x) if int4_path(rows).startswith("int8") else x.bfloat16().float()
    assert rel_err(y, F.linear(rounded, w)) < 1e-5


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_vnni_layout_is_used_only_where_the_shape_fits(fmt):
    need_layout("vnni", fmt)
    assert PackedLinear.pack(gguf_q4_1_weight(96, 256), fmt, 16).layout == "vnni"
    odd = gguf_q4_1_weight(40, 256)  # 40 rows: not whole tiles of 16
    if fmt == "int8":
        packed = PackedLinear.pack(odd, fmt, 16)
        assert packed.layout == "torch" and packed(torch.ones(1, 256).bfloat16()).shape == (1, 40)
    else:  # torch's int4 packing needs tiles of 16 rows too: such a projection stays dense
        assert not can_pack(odd, fmt)


def test_a_q8_0_embedding_is_served_exactly_from_its_packed_head_and_others_are_not():
    need_layout("vnni", "int8")
    from ricllm.model.packed_linear import PackedEmbedding

    exact = gguf_weight(96, 256, seed=9, kind="Q8_0")  # a Q8_0 tensor, dequantized
    head = PackedLinear.pack(exact, "int8", max_packed_rows=None)
    q8_0 = exact.bfloat16()  # what the model's embedding holds
    assert PackedEmbedding.serves(head, q8_0)
    ids = torch.tensor([0, 95, 7, 7, 50])
    assert torch.equal(PackedEmbedding(head, torch.bfloat16)(ids), q8_0[ids])
    with pytest.raises(IndexError, match=r"token id out of range \[0, 96\)"):
        PackedEmbedding(head, torch.bfloat16)(torch.tensor([96]))
    float_weights = (torch.randn(96, 256, generator=torch.Generator().manual_seed(3)) * 0.05).bfloat16()
    assert not PackedEmbedding.serves(PackedLinear.pack(float_weights.float(), "int8", None), float_weights)


@pytest.mark.parametrize("pack_rows", [32, 64])  # 3 slices of 2 tiles; 2 slices, the last one shorter
@pytest.mark.parametrize("kind,fmt", [("Q4_1", "int4"), ("Q8_0", "int8")])
def test_vnni_packing_a_slice_at_a_time_gives_the_whole_weights_packing(kind, fmt, pack_rows, monkeypatch):
    """A first start packs a vocabulary-wide head in slices (a few MB of fp32 at a time)."""
    need_layout("vnni", fmt)
    from ricllm.kernels import cpu_quant

    from ricllm.model.packed_linear import PackedEmbedding

    w = gguf_weight(96, 256, seed=11, kind=kind)
    whole = PackedLinear.pack(w, fmt, max_packed_rows=None, layout="vnni")
    monkeypatch.setattr(cpu_quant, "PACK_ROWS", pack_rows)
    sliced = PackedLinear.pack(w, fmt, max_packed_rows=None, layout="vnni")
    for name in ("packed_weight", "packed_scales", "packed_offsets"):
        assert torch.equal(getattr(sliced, name), getattr(whole, name)), name
    if fmt == "int8":  # the exactness check runs a slice at a time too, and sees the last slice
        assert PackedEmbedding.serves(sliced, w.bfloat16())
        off = w.bfloat16()
        off[-1, -1] += 0.25
        assert not PackedEmbedding.serves(sliced, off)


def test_int4_packing_of_a_q4_1_weight_is_exact_to_bf16_precision():
    w = gguf_q4_1_weight(96, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = F.linear(x.float(), w)
    packed = PackedLinear.pack(w, "int4", max_packed_rows=16, layout="torch")
    err = rel_err(packed(x), ref)
    assert err < BF16_REL_TOL, f"int4 output is off by {err:.4f} relative (tolerance {BF16_REL_TOL:.4f})"
    # the tolerance catches a zero point off by half a step (e.g. (q - 7.5)·scale + zero)
    scale, zero = packed.packed_scales.float().unbind(-1)
    packed.packed_scales = torch.stack([scale, zero + scale / 2], -1).bfloat16()
    assert rel_err(packed(x), ref) > BF16_REL_TOL


def test_int8_packing_error_is_at_most_half_a_step_of_each_row():
    gen = torch.Generator().manual_seed(2)
    row_scales = torch.logspace(-3, 0, 64)[:, None]  # rows of very different sizes: the scale must be per row
    w = torch.randn(64, 96, generator=gen) * row_scales
    packed = PackedLinear.pack(w, "int8", max_packed_rows=16, layout="torch")
    restored = packed.packed_weight.float() * packed.packed_scales.float()[:, None]
    row_max = w.abs().amax(1, keepdim=True)
    bound = row_max * (1 / 254 + BF16_ROUNDOFF)  # half a step (row max / 127), plus the bf16-rounded scale
    worst = ((restored - w).abs() / bound).max().item()
    assert worst <= 1, f"int8 error reaches {worst:.2f}× the per-row bound"
    x = torch.randn(4, 96, generator=gen).bfloat16()
    y = packed(x)
    assert rel_err(y, F.linear(x.float(), restored)) < BF16_REL_TOL  # the kernel multiplies by what it stores
    err = rel_err(y, F.linear(x.float(), w))
    assert err < 0.01, f"int8 output is off by {err:.4f} relative"


@pytest.mark.parametrize("layout", ["torch", "vnni"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_rows_above_max_packed_rows_use_the_dense_bf16_weight(fmt, layout):
    need_layout(layout, fmt)
    w = gguf_q4_1_weight(64, 128, seed=3)
    packed = PackedLinear.pack(w, fmt, max_packed_rows=8, layout=layout)
    gen = torch.Generator().manual_seed(4)
    few, many = torch.randn(8, 128, generator=gen).bfloat16(), torch.randn(9, 128, generator=gen).bfloat16()
    if layout == "vnni":
        from ricllm.kernels.cpu_quant import quant_gemm

        kernel = quant_gemm(few, packed.packed_weight, packed.packed_scales, packed.packed_offsets,
                            4 if fmt == "int4" else 8, 64)
    elif fmt == "int4":
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(few, packed.packed_weight, INT4_GROUP,
                                                            packed.packed_scales)
    else:
        kernel = torch.ops.aten._weight_int8pack_mm(few, packed.packed_weight, packed.packed_scales)
    assert torch.equal(packed(few), kernel)
    assert torch.equal(packed(many), F.linear(many, w.bfloat16()))


Q4_1_FILE = {"token_embd.weight": "Q8_0", "output_norm.weight": "F32", "blk.0.attn_norm.weight": "F32",
             "blk.0.attn_q.weight": "Q4_1", "blk.0.ffn_down.weight": "Q4_1"}
Q8_0_FILE = {"token_embd.weight": "F16", "blk.0.attn_norm.weight": "F32", "blk.0.attn_q.weight": "Q8_0"}
# llama.cpp's Q4_K_M as Gemma 3 270M has it: Q4_K where the row length allows K-quants, Q5_0 or Q8_0 elsewhere
Q4_K_M_FILE = {"token_embd.weight": "Q8_0", "output_norm.weight": "F32", **{
    f"blk.{i}.{name}.weight": kind for i in range(2) for name, kind in (
        ("attn_norm", "F32"), ("attn_q", "Q5_0"), ("attn_k", "Q5_0"), ("attn_v", ("Q8_0", "Q5_0")[i]),
        ("attn_output", "Q4_K"), ("ffn_gate", "Q5_0"), ("ffn_up", "Q5_0"), ("ffn_down", ("Q6_K", "Q4_K")[i]))}}


@pytest.mark.parametrize("requested, types, dtype, expected", [
    ("auto", Q4_1_FILE, torch.bfloat16, ("int4", "int8")),
    ("auto", Q8_0_FILE, torch.bfloat16, ("int8", "dense")),
    ("bf16", Q4_1_FILE, torch.bfloat16, ("dense", "dense")),
    ("int8", Q4_1_FILE, torch.bfloat16, ("int8", "int8")),
    ("auto", Q4_1_FILE, torch.float32, ("dense", "dense")),  # packed kernels need bf16 activations
    ("auto", Q4_K_M_FILE, torch.bfloat16, ("int4+int8", "int8")),
    ("int8", Q4_K_M_FILE, torch.bfloat16, ("int8", "int8")),
])
def test_resolve_formats(requested, types, dtype, expected):
    assert resolve_formats(requested, types, dtype, CPU) == expected


def test_auto_packs_each_projection_of_a_mixed_file_by_its_tensors_types():
    """4-bit where every tensor fused into the projection is 4-bit; the 5-, 6- and 8-bit ones 8-bit."""
    from ricllm.model.formats import projection_formats

    layers, _ = resolve_formats("auto", Q4_K_M_FILE, torch.bfloat16, CPU)
    assert [projection_formats(layers, Q4_K_M_FILE, i) for i in range(2)] == [
        ("int8", "int4", "int8", "int8"), ("int8", "int4", "int8", "int4")]
    assert projection_formats("int8", Q4_K_M_FILE, 1) == ("int8",) * 4


def test_a_q4_k_weight_packs_int4_as_the_file_stores_it():
    """A Q4_K sub-block is ``d·sc·q − dmin·m``; where its values span fewer than 16 levels, min/max
    would requantize it (errors up to half a step), the grid it lies on keeps it: the packed int4
    weight is the file's up to the fp16 rounding of the step and offset, closer than int8 packs it."""
    import gguf

    from ricllm.kernels import cpu_quant
    from tests.helpers import quantize_q4_k

    source = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32) * 0.05
    weight = torch.from_numpy(gguf.quants.dequantize(quantize_q4_k(source), gguf.GGMLQuantizationType.Q4_K).copy())
    int4 = (cpu_quant.unpack(*cpu_quant.pack_int4(weight), 4) - weight).abs()
    int8 = (cpu_quant.unpack(*cpu_quant.pack_int8(weight), 8) - weight).abs()
    fp16_rounding = 3 * weight.abs().max().item() * 2 ** -11  # of (step·15 + |offset|) <= 3·max|w|
    assert int4.max().item() <= fp16_rounding, int4.max().item()
    assert int4.mean().item() < int8.mean().item() / 4


def test_packed_weights_with_float32_are_refused_naming_the_problem():
    with pytest.raises(ConfigError, match=r"weights='int4' needs dtype bfloat16 on the CPU \(got float32 on cpu"):
        resolve_formats("int4", Q4_1_FILE, torch.float32, CPU)
    with pytest.raises(ConfigError, match="unknown weights format 'int3'"):
        resolve_formats("int3", Q4_1_FILE, torch.bfloat16, CPU)


# --------------------------------------------------------------------- shared instruments

@contextlib.contextmanager
def packed_calls(model):
    """Record ``(fmt, rows, packed path taken)`` of every PackedLinear call inside the block."""
    calls, handles = [], []
    for module in model.modules():
        if isinstance(module, PackedLinear):
            def hook(m, args):
                rows = args[0].shape[0]
                calls.append((m.fmt, rows, m.weight is None or rows <= m.max_packed_rows))
            handles.append(module.register_forward_pre_hook(hook))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def layer_formats(model) -> tuple[set[str], str]:
    """(formats of every layer projection, head format); ``dense`` for an unpacked projection."""
    def fmt(m):
        return m.fmt if isinstance(m, PackedLinear) else "dense"

    layers = {fmt(p) for layer in model.layers
              for p in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)}
    return layers, "dense" if model.packed_head is None else fmt(model.packed_head)


def teacher_forced_logits(llm: LLM, token_ids: list[int], positions: list[int]) -> torch.Tensor:
    """fp32 logits at ``positions`` (each predicts the next token) from one prefill of ``token_ids``.

    The prefill runs in steps of ``max_num_batched_tokens`` rows and the head in slices of at
    most its packed row count, so the packed kernels compute what they would compute in decode.
    """
    model, hidden = llm.engine.runtime.model, {}

    def keep(module, args, out):
        for pos, row in zip(args[1].tolist(), out):
            hidden[pos] = row.clone()

    handle = model.register_forward_hook(keep)
    try:
        llm.generate([token_ids], SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        handle.remove()
    rows = torch.stack([hidden[p] for p in positions])
    head_rows = len(positions) if model.packed_head is None else model.packed_head.max_packed_rows or len(positions)
    return torch.cat([model.compute_logits(chunk) for chunk in rows.split(head_rows)])


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    logits = teacher_forced_logits(llm, token_ids, list(range(len(token_ids) - 1)))
    nll = F.cross_entropy(logits, torch.tensor(token_ids[1:]))
    return math.exp(nll.item())


# --------------------------------------------------------------------- the default model keeps its quality

@pytest.fixture(scope="module")
def oracle_choices(smollm2_oracle):
    """(prompt + 128 greedy tokens, positions, the HF fp32 oracle's argmax at each position)."""
    return smollm2_oracle["choices"]


@pytest.fixture(scope="module")
def smollm2_checkpoint(smollm2):
    from ricllm.model.loader import open_checkpoint

    return open_checkpoint(smollm2)


@pytest.fixture(scope="module")
def reference_perplexity(smollm2_oracle):
    """TEXT's perplexity under the HF fp32 oracle (= ricllm with dense fp32 weights)."""
    return smollm2_oracle["perplexity"]


@pytest.fixture(scope="module", params=FORMATS)
def smollm2_in_format(request, smollm2):
    # steps of at most max_packed_rows (16) rows keep the layers on their packed kernels
    return request.param, LLM(str(smollm2), dtype="bfloat16", weights=request.param, kv_cache_budget="64MiB",
                              enable_prefix_caching=False, max_num_batched_tokens=16, weight_cache=False,
                              runtime="torch")


@pytest.mark.slow
def test_auto_packs_the_default_model_as_int4_layers_and_int8_head(smollm2_checkpoint):
    types = smollm2_checkpoint.tensor_types()
    assert resolve_formats("auto", types, torch.bfloat16, CPU) == ("int4", "int8")


@pytest.mark.slow
def test_the_default_model_keeps_its_vocabulary_once(smollm2, tmp_path, monkeypatch):
    """Tied Q8_0 embedding, packed head at every size: lookups come from the head, exactly."""
    from ricllm.model.packed_linear import PackedEmbedding

    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path))
    need_layout("vnni", "int8")
    with_copy = LLM(str(smollm2), dtype="bfloat16", kv_cache_budget="8MiB", max_packed_rows=16, weight_cache=False)
    ids = torch.arange(with_copy.engine.spec.vocab_size)
    for start in ("file", "cache"):
        lean = LLM(str(smollm2), dtype="bfloat16", kv_cache_budget="8MiB", runtime="torch")
        assert lean.engine.runtime.weights_source.startswith(start)
        assert isinstance(lean.engine.runtime.model.embed, PackedEmbedding)
        assert "embed.weight" not in lean.engine.runtime.model.state_dict()
        assert torch.equal(lean.engine.runtime.model.embed(ids), with_copy.engine.runtime.model.embed(ids))


@pytest.mark.slow
def test_greedy_choices_agree_with_hf_fp32_in_every_format(smollm2_in_format, oracle_choices):
    fmt, llm = smollm2_in_format
    expected_layers = {"bf16": "dense", "int8": "int8", "int4": "int4"}[fmt]
    assert layer_formats(llm.engine.runtime.model) == ({expected_layers}, "dense" if fmt == "bf16" else "int8")
    agree = total = 0
    with packed_calls(llm.engine.runtime.model) as calls:
        for full, positions, choices in oracle_choices:
            agree += (teacher_forced_logits(llm, full, positions).argmax(-1) == choices).sum().item()
            total += len(positions)
    assert fmt == "bf16" or (calls and all(packed for _, _, packed in calls)), "the packed kernels did not run"
    assert agree / total >= 0.95, f"weights={fmt}: greedy agreement with HF fp32 {agree}/{total} = {agree / total:.1%}"


@pytest.mark.slow
def test_perplexity_stays_within_two_percent_of_fp32(smollm2_in_format, reference_perplexity):
    fmt, llm = smollm2_in_format
    ids = llm.tokenizer.encode(TEXT)
    assert 200 <= len(ids) <= 300
    ppl = perplexity(llm, ids)
    change = ppl / reference_perplexity - 1
    assert abs(change) <= 0.02, (
        f"weights={fmt}: perplexity {ppl:.3f} vs fp32 {reference_perplexity:.3f} ({change:+.2%})")


def native_teacher_forced_logits(llm: LLM, token_ids: list[int], positions: list[int]) -> torch.Tensor:
    """The native runtime's fp32 logits at ``positions``, from prefill steps of
    ``max_num_batched_tokens`` rows through the C decoder stack (as it serves a prompt). It
    writes K/V into the pool's first blocks: ``llm`` must hold no cached prefix."""
    from ricllm.engine.runtime.flat_batch import FlatBatch

    engine, hidden = llm.engine, []
    model, bs, chunk = engine.runtime.model, engine.config.block_size, engine.config.max_num_batched_tokens
    table = list(range(-(-len(token_ids) // bs)))
    for start in range(0, len(token_ids), chunk):
        end = min(len(token_ids), start + chunk)
        rows = end - start
        flat = FlatBatch(token_ids[start:end], list(range(start, end)),
                         [table[p // bs] * bs + p % bs for p in range(start, end)], [0, rows], [end], [table], [],
                         max_query_len=rows, prefill_rows=rows, prefill_products=rows * end)
        hidden.append(model.forward(flat.input_ids, flat.positions, flat))
    rows = np.ascontiguousarray(np.concatenate(hidden)[positions])
    return torch.from_numpy(model.compute_logits(rows))


@pytest.fixture(scope="module", params=("int8", "int4"))
def smollm2_native(request, smollm2):
    llm = LLM(str(smollm2), weights=request.param, kv_cache_budget="64MiB", enable_prefix_caching=False,
              weight_cache=False, runtime="native")
    assert llm.engine.runtime.name == "native"
    return request.param, llm


@pytest.mark.slow
def test_native_runtime_greedy_choices_agree_with_hf_fp32(smollm2_native, oracle_choices):
    fmt, llm = smollm2_native
    agree = total = 0
    for full, positions, choices in oracle_choices:
        agree += (native_teacher_forced_logits(llm, full, positions).argmax(-1) == choices).sum().item()
        total += len(positions)
    said = f"native {fmt} ({cpu_family()} family): greedy agreement with HF fp32 {agree}/{total} = {agree / total:.1%}"
    print(said)  # tests/test_avx2_only.py reports the avx2 family's measure
    assert agree / total >= 0.95, said


@pytest.mark.slow
def test_native_runtime_perplexity_stays_within_two_percent_of_fp32(smollm2_native, reference_perplexity):
    fmt, llm = smollm2_native
    ids = llm.tokenizer.encode(TEXT)
    logits = native_teacher_forced_logits(llm, ids, list(range(len(ids) - 1)))
    ppl = math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())
    change = ppl / reference_perplexity - 1
    said = (f"native {fmt} ({cpu_family()} family): perplexity {ppl:.3f} vs fp32 {reference_perplexity:.3f} "
            f"({change:+.2%})")
    print(said)
    assert abs(change) <= 0.02, said


# --------------------------------------------------------------------- behaviour on the tiny model

BLOCK = 16
TINY_FORMATS = ("bf16", "int8", "int4", "auto")
# every weight format in the torch runtime, and the packed ones in the native runtime (whose model
# pads its vocabulary to whole tiles of 16 head rows: the stack needs every projection packed)
TINY_CASES = [*((w, "torch") for w in TINY_FORMATS), ("int8", "native"), ("int4", "native")]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
# Greedy tokens may part only where two tokens tie within bf16 rounding: the kernels a step uses
# (packed or dense weights, decode or prefill attention) depend on how many rows share it, and
# the tiny random model's logits (|logit| < 8, bf16 steps of 1/32) tie often. A real batching or
# caching fault moves logits by whole units.
LOGIT_TOL = 0.15


@pytest.fixture(scope="module")
def tiny_q4_1_gguf(tmp_path_factory):
    """GQA 4:2, untied F32 head, layer weights stored as Q4_1 (every input width a multiple of 32)."""
    from tests.helpers import TINY

    assert TINY["hidden"] % INT4_GROUP == 0 and TINY["ffn"] % INT4_GROUP == 0
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny_q4_1") / "tiny_q4_1.gguf", seed=2, quant="Q4_1")


@pytest.fixture(scope="module")
def tiny_models(tiny_q4_1_gguf, tmp_path_factory):
    """The Q4_1 tiny model per runtime: for the native one with its vocabulary padded to 304."""
    padded = write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny_native") / "tiny_q4_1_304.gguf", seed=2,
                                   quant="Q4_1", pad_vocab_to=16)
    return {"torch": tiny_q4_1_gguf, "native": padded}


@pytest.fixture(scope="module")
def tiny_vocab(tiny_q4_1_gguf):
    from ricllm.model.loader import open_checkpoint

    return open_checkpoint(tiny_q4_1_gguf).spec.vocab_size


def tiny_llm(path, weights: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_budget", "8MiB")
    kwargs.setdefault("runtime", "torch")
    return LLM(str(path), dtype="bfloat16", weights=weights, block_size=BLOCK, weight_cache=False, **kwargs)


@pytest.mark.parametrize("weights, layers, head", [
    ("bf16", "dense", "dense"), ("int8", "int8", "int8"), ("int4", "int4", "int8"),
    ("auto", "int4", "dense"),  # Q4_1 layers stay 4-bit; the file's F32 head stays dense
])
def test_packed_formats_really_pack_and_run_packed(tiny_q4_1_gguf, weights, layers, head):
    llm = tiny_llm(tiny_q4_1_gguf, weights)
    assert llm.engine.runtime.weight_formats == (layers, head)
    assert layer_formats(llm.engine.runtime.model) == ({layers}, head)
    # the per-op path, whose module calls the hooks see (the one-call stack runs the same
    # packed kernels: tests/kernels/test_cpu_decoder.py)
    llm.engine.runtime.model.decoder_stack = None
    with packed_calls(llm.engine.runtime.model) as calls:
        llm.generate([[5, 6, 7]], PARAMS)  # 3-token prefill and 1-row decodes: all under max_packed_rows
    assert {fmt for fmt, _, packed in calls if packed} == {layers, head} - {"dense"}
    assert all(packed for _, _, packed in calls)


def test_a_converting_start_never_holds_the_whole_dense_model(tiny_q4_1_gguf, monkeypatch):
    """Each weight gets memory as it is read and each layer is packed once complete, so at most
    one layer's dense projections exist at any moment of a conversion (a first start's peak)."""
    from ricllm.engine.runtime import llama_weights

    dense_when_packing = []
    pack_layer = llama_weights.pack_layer

    def recording(model, index, fmt, max_rows):
        dense_when_packing.append([i for i, layer in enumerate(model.layers) for m in (
            layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if not isinstance(m, PackedLinear) and not m.weight.is_meta])
        pack_layer(model, index, fmt, max_rows)

    monkeypatch.setattr(llama_weights, "pack_layer", recording)
    model = tiny_llm(tiny_q4_1_gguf, "int4").engine.runtime.model
    assert dense_when_packing == [[i] * 4 for i in range(len(model.layers))]
    assert not any(t.is_meta for t in model.state_dict().values())


def greedy_divergence(runs, reference_runs) -> tuple[list[int], float]:
    """(requests whose greedy tokens differ from the reference run's, largest logit gap).

    ``runs`` pair each output with the LogitsRecorder of its engine. The gap is taken over the
    positions where both runs had the same context, up to and including the first differing
    token: a bounded gap there means the runs only part where two tokens tie within it.
    """
    differing, gap = [], 0.0
    for i, ((out, rec), (ref, ref_rec)) in enumerate(zip(runs, reference_runs)):
        same = next((j for j, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)) if a != b), len(ref.token_ids))
        differing += [i] if same < len(ref.token_ids) else []
        ours, theirs = rec.stacked(out.request_id)[1], ref_rec.stacked(ref.request_id)[1]
        gap = max(gap, (ours[:same + 1] - theirs[:same + 1]).abs().max().item())
    return differing, gap


@pytest.mark.parametrize("weights, runtime", TINY_CASES)
def test_batched_requests_get_their_solo_logits_and_tokens(tiny_models, tiny_vocab, weights, runtime):
    tiny_q4_1_gguf = tiny_models[runtime]
    prompts = random_prompts(tiny_vocab, (3, 17, 31, 64, 90, 5, 9, 12), seed=7)
    batched_llm = tiny_llm(tiny_q4_1_gguf, weights, runtime=runtime)
    solo_llm = tiny_llm(tiny_q4_1_gguf, weights, runtime=runtime, max_num_seqs=1, enable_prefix_caching=False)
    batched_rec, solo_rec = LogitsRecorder(batched_llm.engine), LogitsRecorder(solo_llm.engine)
    batched = [(out, batched_rec) for out in batched_llm.generate(prompts, PARAMS)]
    solo = [(solo_llm.generate([p], PARAMS)[0], solo_rec) for p in prompts]
    differing, gap = greedy_divergence(batched, solo)
    assert gap <= LOGIT_TOL, (f"weights={weights}: batched logits differ from solo ones by up to {gap:.3f}; "
                              f"prompts {differing} of {len(prompts)} get other greedy tokens in a batch than alone")


@pytest.mark.parametrize("weights, runtime", TINY_CASES)
def test_shared_prefix_is_reused_with_the_uncached_logits_and_tokens(tiny_models, tiny_vocab, weights, runtime):
    tiny_q4_1_gguf = tiny_models[runtime]
    system, q1, q2 = random_prompts(tiny_vocab, (40, 9, 5), seed=3)
    llm = tiny_llm(tiny_q4_1_gguf, weights, runtime=runtime)
    cached_rec = LogitsRecorder(llm.engine)
    first = llm.generate([system + q1], PARAMS)[0]
    second = llm.generate([system + q2], PARAMS)[0]  # 13 new prompt rows: a packed prefill
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(system) // BLOCK) * BLOCK
    uncached_llm = tiny_llm(tiny_q4_1_gguf, weights, runtime=runtime, enable_prefix_caching=False)
    uncached_rec = LogitsRecorder(uncached_llm.engine)
    uncached = uncached_llm.generate([system + q2], PARAMS)[0]  # 45 prompt rows: a dense prefill
    differing, gap = greedy_divergence([(second, cached_rec)], [(uncached, uncached_rec)])
    assert gap <= LOGIT_TOL, (f"weights={weights}: a prefix-cache hit moves the logits by up to {gap:.3f}"
                              + (" and changes the greedy tokens" if differing else ""))


@pytest.mark.parametrize("weights, runtime", TINY_CASES)
def test_many_requests_on_a_small_budget_stay_inside_it(tiny_models, tiny_vocab, weights, runtime):
    tiny_q4_1_gguf = tiny_models[runtime]
    num_blocks = 24
    bytes_per_token = 2 * 2 * 2 * 16 * 2  # 2·L·n_kv·d_h·2 bytes (bf16) for the tiny model
    budget = num_blocks * BLOCK * bytes_per_token
    llm = tiny_llm(tiny_q4_1_gguf, weights, runtime=runtime, kv_cache_budget=budget, max_num_seqs=64)
    prompts = random_prompts(tiny_vocab, [5 + (7 * i) % 40 for i in range(48)], seed=11)
    params = [SamplingParams(max_tokens=8 + i % 17, ignore_eos=True) for i in range(48)]
    outputs = generate_checking_pool(llm, prompts, params)

    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert_budget_held(llm, num_blocks, budget)
