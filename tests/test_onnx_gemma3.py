"""Gemma 3 on the ONNX runtime: each GGUF block type as MatMulNBits exactly, the windowed layers' view of
the hybrid paged cache, the torch runtime's tokens and logits (to a stated difference) on tiny random Gemmas,
and the installed Gemma 3 270M held to HF transformers fp32."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ricllm import LLM, SamplingParams
from tests.helpers import write_tiny_gemma3_gguf
from tests.recorder import LogitsRecorder
from tests.test_oracle_parity import random_prompts

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, ignore_eos=True)
# F32 weights as fp32 MatMul: ONNX Runtime's sums against torch's
FP32_MAX_LOGIT_DIFFERENCE = 1e-4
# Q4_K, Q6_K, Q5_0, Q8_0 and Q4_1 layers at accuracy_level 4 (activations quantized to int8 per block)
# against the torch runtime's fp32 products of the same dequantized weights, on logits up to 2.3 in
# size; measured 0.055
PACKED_MAX_LOGIT_DIFFERENCE = 0.15
# MatMulNBits at accuracy_level 0 against fp32 products of gguf-py's dequantized weights
EXACT_RELATIVE = 1e-4
WINDOW = 8


pytestmark = pytest.mark.usefixtures("onnx_modules")


def q4_k_m_like_types(name: str) -> str | None:
    """Every type of llama.cpp's Q4_K_M Gemma file, and Q4_1: attn_output Q4_K in even layers and Q6_K in
    odd ones (their 1024-wide rows take K-quants); ffn_down Q8_0 / Q4_1 (128-wide rows); attn_v Q8_0 / Q5_0;
    the other projections Q5_0; the tied embedding Q8_0; norms F32."""
    parts = name.split(".")
    if parts[0] != "blk":
        return "Q8_0" if name == "token_embd.weight" else None
    odd = int(parts[1]) % 2
    return {"attn_output": ("Q4_K", "Q6_K")[odd], "ffn_down": ("Q8_0", "Q4_1")[odd],
            "attn_v": ("Q8_0", "Q5_0")[odd], "attn_q": "Q5_0", "attn_k": "Q5_0", "ffn_gate": "Q5_0",
            "ffn_up": "Q5_0"}.get(parts[2])


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> Path:
    """F32 weights, seven layers (six windowed ones of 8 tokens), GQA 4:2."""
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("tiny_onnx_gemma3") / "tiny.gguf", seed=3, window=WINDOW)


@pytest.fixture(scope="module")
def tiny_gemma3_mixed(tmp_path_factory) -> Path:
    """Gemma 3 270M's attention (4 heads on 1 KV head, 256 wide) and its file's mix of types."""
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("tiny_onnx_gemma3_mixed") / "tiny.gguf", seed=11,
                                  quant=q4_k_m_like_types, pad_vocab_to=16, head_dim=256, kv_heads=1, window=WINDOW)


def onnx_llm(path: Path, **kwargs) -> LLM:
    kwargs.setdefault("weight_cache", False)
    kwargs.setdefault("kv_cache_budget", "16MiB")
    return LLM(str(path), runtime="onnx", **kwargs)


def torch_llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), runtime="torch", dtype="float32", kv_cache_budget="16MiB", weight_cache=False, **kwargs)


def recorded(llm: LLM, prompts, params=GREEDY) -> tuple[list[list[int]], list[torch.Tensor]]:
    recorder = LogitsRecorder(llm.engine)
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [recorder.stacked(o.request_id)[1] for o in outs]


def largest_difference(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


# ---------------------------------------------------------------- GGUF blocks as MatMulNBits


def random_blocks(kind: str, rows: int, columns: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random GGUF blocks ``[rows, columns / type block, bytes]`` of ``kind`` (every code and packed scale
    drawn at random, the fp16 scales set to small positive numbers), and gguf-py's dequantized weight."""
    import gguf

    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    fp16_fields = {"Q8_0": [(0, 0.02)], "Q5_0": [(0, 0.02)], "Q4_0": [(0, 0.02)], "Q4_1": [(0, 0.02), (2, 0.1)],
                   "Q4_K": [(0, 0.002), (2, 0.002)], "Q6_K": [(208, 0.001)]}[kind]
    for offset, scale in fp16_fields:
        values = (rng.random((rows, columns // block, 1)) * scale + scale / 10).astype(np.float16)
        raw[..., offset:offset + 2] = values.view(np.uint8)
    return raw, gguf.quants.dequantize(raw.reshape(rows, -1), qtype).reshape(rows, columns)


def run_one_node_graph(g, output: str, feed: dict[str, np.ndarray], input_type, input_shape) -> np.ndarray:
    import onnxruntime as ort
    from onnx import TensorProto, helper

    (name, value), = feed.items()
    model = g.model("one", [helper.make_tensor_value_info(name, input_type, input_shape)],
                    [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0]


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q6_K", "Q4_K", "Q4_0", "Q4_1"])
def test_each_gguf_block_type_is_matmul_nbits_exactly(kind):
    """Random blocks of each type: MatMulNBits at accuracy_level 0 multiplies what gguf-py dequantizes (fp32
    products within ``EXACT_RELATIVE``), and GatherBlockQuantized over the same codes looks its rows up."""
    from onnx import TensorProto

    from ricllm.engine.runtime.onnx_export import GraphBuilder
    from ricllm.engine.runtime.onnx_quants import nbits_gather, nbits_matmul, nbits_weight

    rows, columns = 48, 512
    blocks, weight = random_blocks(kind, rows, columns)
    mapped = nbits_weight(kind, blocks)
    assert (mapped.bits, mapped.block_size) == {"Q6_K": (8, 16), "Q4_K": (4, 32), "Q4_0": (4, 32),
                                                "Q4_1": (4, 32)}.get(kind, (8, 32))
    x = np.random.default_rng(1).standard_normal((7, columns)).astype(np.float32)
    g = GraphBuilder()
    y = nbits_matmul(g, "x", mapped, "w", accuracy_level=0)
    got = run_one_node_graph(g, y, {"x": x}, TensorProto.FLOAT, ["M", columns])
    expected = x.astype(np.float64) @ weight.T.astype(np.float64)
    assert np.abs(got - expected).max() <= EXACT_RELATIVE * np.abs(expected).max()
    g = GraphBuilder()
    looked_up, _, _ = nbits_gather(g, "ids", mapped, "table")
    ids = np.array([3, 0, 47, 3, 21], dtype=np.int64)
    rows_got = run_one_node_graph(g, looked_up, {"ids": ids}, TensorProto.INT64, ["T"])
    np.testing.assert_allclose(rows_got, weight[ids], rtol=0, atol=EXACT_RELATIVE * np.abs(weight).max())


def test_the_check_of_a_mapping_can_fail():
    """A Q6_K weight read as if its codes were Q5_0's (zero point 16 off) misses the file's weight."""
    from ricllm.engine.runtime.onnx_quants import NBitsWeight, nbits_weight

    blocks, weight = random_blocks("Q6_K", 16, 256)
    mapped = nbits_weight("Q6_K", blocks)
    shifted = NBitsWeight(mapped.codes - np.uint8(16), mapped.scales, 8, 16, None)
    dequantized = ((shifted.codes.astype(np.float32) - 128) * shifted.scales[..., None]).reshape(16, 256)
    assert np.abs(dequantized - weight).max() > 1e-3
    exact = ((mapped.codes.astype(np.float32) - 128) * mapped.scales[..., None]).reshape(16, 256)
    np.testing.assert_array_equal(exact, weight)


# ---------------------------------------------------------------- the windowed layers' view of the cache


def test_a_windowed_view_gathers_only_the_window_and_masks_what_lies_behind_it():
    """One sequence decoding at position 50 beside one reading a 10-token chunk after 3 cached tokens,
    windows of 8: the windowed view gathers the 7 cached keys before each first query through its own
    group's blocks; the full view all of them through group 0's."""
    from ricllm.engine.runtime.flat_batch import FlatBatch
    from ricllm.engine.runtime.onnx_model import view_step_inputs

    block = 4
    full_tables = [list(range(13)), [20, 21, 22, 23] + [0] * 9]
    # the windowed group's first blocks of the long sequence are gone (-1), as the pool evicts them
    window_tables = [[-1] * 10 + [40, 41, 42], [30, 31, 32, 33] + [0] * 9]
    flat = FlatBatch(input_ids=[5] * 11, positions=[50, *range(3, 13)], slot_mapping=[0] * 11,
                     query_start_loc=[0, 1, 11], context_lens=[51, 13], block_tables=full_tables,
                     logits_rows=[0, 10], max_query_len=10, prefill_rows=10, prefill_products=130,
                     group_slot_mappings=[[0] * 11], group_block_tables=[window_tables])
    inputs = view_step_inputs(flat, block, [(0, 0), (1, WINDOW)])
    windowed = inputs[f"past_slots_1_{WINDOW}"]
    assert windowed.shape == (2, WINDOW - 1)
    # positions 43..49 of sequence 0: blocks 10, 11, 12 of its windowed table
    assert windowed[0].tolist() == [40 * block + 3, *(41 * block + i for i in range(4)), 42 * block, 42 * block + 1]
    assert windowed[1, :3].tolist() == [30 * block, 30 * block + 1, 30 * block + 2]
    assert inputs["past_slots_0_0"].shape == (2, 50)
    bias = inputs[f"attention_bias_{WINDOW}"][:, 0, 0]  # [B, Q, P + Q]
    seen = bias == 0
    assert seen[0, 0, :WINDOW - 1].all() and seen[0, 0, WINDOW - 1]  # the 7 cached keys and itself
    # the chunk's last query (position 12) sees positions 5..12: none of the cached 0..2, new keys 2..9
    assert not seen[1, 9, :WINDOW - 1].any() and seen[1, 9, WINDOW - 1 + 2:].all() and not seen[1, 9, WINDOW - 1 + 1]
    full = inputs["attention_bias_0"][:, 0, 0] == 0
    assert full[1, 9, :3].all() and full[1, 9, 50:].all()  # the full view sees every key of the sequence


def test_fp32_logits_and_greedy_tokens_match_the_torch_runtime_past_the_window(tiny_gemma3):
    """F32 weights, prompts of 5-50 tokens against windows of 8, read in chunks of 16 and batched with
    decodes: every sampled logit within ``FP32_MAX_LOGIT_DIFFERENCE`` of the torch runtime's fp32, same tokens."""
    prompts = random_prompts(300, (5, 30, 50), seed=1)
    ours = recorded(onnx_llm(tiny_gemma3, max_num_batched_tokens=16), prompts)
    theirs = recorded(torch_llm(tiny_gemma3, max_num_batched_tokens=16), prompts)
    assert ours[0] == theirs[0]
    difference = largest_difference(ours[1], theirs[1])
    assert difference <= FP32_MAX_LOGIT_DIFFERENCE, difference


def test_the_window_decides_the_logits_of_a_sequence_longer_than_it(tiny_gemma3, tmp_path):
    """The same weights with windows wider than the prompts give other logits past position 8: a graph
    whose windowed layers saw the whole sequence would miss the torch runtime's logits above."""
    wide = write_tiny_gemma3_gguf(tmp_path / "wide.gguf", seed=3, window=512)
    prompts = random_prompts(300, (30,), seed=5)
    narrow_logits = recorded(onnx_llm(tiny_gemma3), prompts, FIRST)[1]
    wide_llm = onnx_llm(wide)
    wide_logits = recorded(wide_llm, prompts, FIRST)[1]
    assert largest_difference(wide_logits, recorded(torch_llm(wide), prompts, FIRST)[1]) <= FP32_MAX_LOGIT_DIFFERENCE
    assert largest_difference(narrow_logits, wide_logits) > 100 * FP32_MAX_LOGIT_DIFFERENCE


def test_prefix_cache_hits_through_both_groups_give_the_torch_runtimes_tokens(tiny_gemma3):
    """A second request behind the same 40-token prompt reads the first one's blocks from the pool in every
    cache group, and still gets the torch runtime's tokens; a choice constraint gives one of its choices."""
    prompt = random_prompts(300, (40,), seed=9)[0]
    llm = onnx_llm(tiny_gemma3, block_size=4)
    assert len(llm.engine.runtime.kv_cache.geometry.groups) == 7  # one global group, six windowed ones
    first = llm.generate([prompt], GREEDY)[0].token_ids
    again = llm.generate([prompt + [7, 8]], GREEDY)[0]
    assert again.num_cached_tokens == 40
    reference = torch_llm(tiny_gemma3, block_size=4)
    assert first == reference.generate([prompt], GREEDY)[0].token_ids
    assert again.token_ids == reference.generate([prompt + [7, 8]], GREEDY)[0].token_ids
    choice = llm.generate(["cell load"], SamplingParams(max_tokens=8, structured={"choice": ["high", "low"]}))[0]
    assert choice.text in ("high", "low")


def test_a_process_serves_gemma3_through_onnx_runtime_without_importing_torch(tiny_gemma3, tmp_path):
    """The Gemma graph's modules, like the Llama graph's, keep torch out of the serving process."""
    from tests.test_onnx_runtime import SERVE_WITHOUT_TORCH

    prompts = random_prompts(300, (5, 30), seed=1)
    env = {**os.environ, "RICLLM_CACHE_DIR": str(tmp_path), "RICLLM_LOG_LEVEL": "warning"}
    done = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_TORCH, str(tiny_gemma3), json.dumps(prompts)],
                          check=False, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert run["runtime"] == "onnx" and not run["torch"], run
    assert run["tokens"] == [o.token_ids for o in torch_llm(tiny_gemma3).generate(prompts, GREEDY)]


# ---------------------------------------------------------------- Q4_K_M's types


def test_the_graph_of_a_mixed_file_passes_the_checkers_and_keeps_each_type_packed(tiny_gemma3_mixed):
    """onnx.checker, ONNX Runtime's symbolic shape inference and its own contrib schemas; every projection a
    MatMulNBits node (none dequantized to fp32 MatMul), the embedding looked up quantized."""
    import onnx
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    from ricllm.engine.runtime.onnx_export import export

    model, spec, _, formats = export(tiny_gemma3_mixed)
    assert formats == ("int4+int8", "int8")
    onnx.checker.check_model(model)
    inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=False, guess_output_rank=False)
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*inferred.graph.value_info, *inferred.graph.output]}
    assert shapes["logits"] == ["N", spec.vocab_size]
    assert shapes["present_key_0"] == ["T", 1, 256]
    unshaped = [out for node in model.graph.node for out in node.output if out not in shapes]
    assert not unshaped, unshaped
    schemas = {(s.domain, s.name): s for s in get_all_operator_schema()}
    nbits = []
    for node in model.graph.node:
        if node.domain == "com.microsoft":
            schema = schemas[(node.domain, node.op_type)]
            assert schema.min_input <= len(node.input) <= schema.max_input, node.op_type
            assert {a.name for a in node.attribute} <= set(schema.attributes), node.op_type
            if node.op_type == "MatMulNBits":
                nbits.append({a.name: a.i for a in node.attribute})
    assert not [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1].endswith("_weight")]
    layouts = {(n["bits"], n["block_size"]) for n in nbits}
    assert layouts == {(8, 32), (8, 16), (4, 32)}  # Q8_0/Q5_0, Q6_K, Q4_K/Q4_1
    assert any(n.op_type == "GatherBlockQuantized" for n in model.graph.node)


def test_mixed_file_logits_stay_within_the_stated_difference(tiny_gemma3_mixed):
    """The first sampled position (the same context in both runtimes) of prompts up to 64 tokens, read in
    chunks of 16: within ``PACKED_MAX_LOGIT_DIFFERENCE`` of the torch runtime's fp32 products."""
    prompts = random_prompts(317, (5, 23, 64), seed=4)
    llm = onnx_llm(tiny_gemma3_mixed, max_num_batched_tokens=16)
    assert llm.engine.runtime.weight_formats == ("int4+int8", "int8")
    ours = recorded(llm, prompts, FIRST)[1]
    theirs = recorded(torch_llm(tiny_gemma3_mixed, max_num_batched_tokens=16), prompts, FIRST)[1]
    difference = largest_difference(ours, theirs)
    assert 0 < difference <= PACKED_MAX_LOGIT_DIFFERENCE, difference


# ---------------------------------------------------------------- the installed Gemma 3 270M


def gemma3_teacher_forced(llm: LLM, token_ids: list[int], chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(the graph's argmax, its log-probability of the next token) at every position but the last, from
    prefill chunks of ``chunk`` tokens on the engine's pool: each cache group through blocks of its own
    (``llm`` must hold no cached prefix)."""
    from ricllm.engine.runtime.flat_batch import FlatBatch

    runner = llm.engine.runtime.runner
    size, groups = runner.block_size, len(llm.engine.runtime.kv_cache.geometry.groups)
    count = -(-len(token_ids) // size)
    tables = [list(range(g * count, (g + 1) * count)) for g in range(groups)]
    argmax, logprobs = [], []
    for start in range(0, len(token_ids) - 1, chunk):
        end = min(start + chunk, len(token_ids))
        slots = [[table[p // size] * size + p % size for p in range(start, end)] for table in tables]
        flat = FlatBatch(input_ids=token_ids[start:end], positions=list(range(start, end)), slot_mapping=slots[0],
                         query_start_loc=[0, end - start], context_lens=[end], block_tables=[tables[0]],
                         logits_rows=list(range(min(end, len(token_ids) - 1) - start)), max_query_len=end - start,
                         prefill_rows=end - start, prefill_products=(end - start) * end,
                         group_slot_mappings=slots[1:], group_block_tables=[[t] for t in tables[1:]])
        logits = torch.from_numpy(runner.compute(flat))
        argmax.append(logits.argmax(-1))
        targets = torch.tensor(token_ids[start + 1:start + 1 + len(logits)])
        logprobs.append(F.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0])
    return torch.cat(argmax), torch.cat(logprobs)


@pytest.mark.slow
def test_gemma3_270m_on_onnx_agrees_with_hf_fp32_past_the_window(gemma3_270m_text_oracle):
    """``LLM("gemma3-270m", runtime="onnx")``: teacher-forced on the oracle's text (over 700 tokens, in
    prefill chunks of 512 through the hybrid cache), greedy agreement with HF fp32 ≥ 95% and perplexity
    within 2%; and it generates."""
    llm = LLM("gemma3-270m", runtime="onnx", kv_cache_budget="64MiB", enable_prefix_caching=False,
              weight_cache=False)
    assert llm.engine.runtime.name == "onnx" and llm.engine.runtime.weight_formats == ("int4+int8", "int8")
    ids = gemma3_270m_text_oracle["ids"]
    assert len(ids) > 700
    argmax, logprobs = gemma3_teacher_forced(llm, ids)
    agreement = (argmax == gemma3_270m_text_oracle["argmax"]).float().mean().item()
    ppl = math.exp(-logprobs.mean().item())
    change = ppl / gemma3_270m_text_oracle["perplexity"] - 1
    said = (f"onnx gemma3-270m: greedy agreement with HF fp32 {agreement:.1%}, perplexity {ppl:.3f} vs "
            f"{gemma3_270m_text_oracle['perplexity']:.3f} ({change:+.2%})")
    print(said)
    assert agreement >= 0.95 and abs(change) <= 0.02, said
    out = llm.generate(["The O-RAN near-real-time RIC hosts xApps that"], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens and out.text.strip()
