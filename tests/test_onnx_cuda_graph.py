"""The ONNX runtime's CUDA path, as far as a CPU can check it: the paged graph (one com.microsoft
PagedAttention per layer) is valid ONNX, its shapes infer, every PagedAttention node fits the schema ONNX
Runtime registers and the kernel's own input rules for the model's geometry; the step's arrays are the
engine's block tables, lengths and slots; a start without ONNX Runtime's CUDA build names the extra.

ONNX Runtime's CPU build has no PagedAttention kernel, so nothing here runs the graph:
benchmarks/gpu_onnx.py does, on a machine with an NVIDIA GPU and onnxruntime-gpu."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ricllm import LLM
from ricllm.engine.runtime.flat_batch import FlatBatch
from ricllm.errors import ConfigError

MS = "com.microsoft"
pytestmark = pytest.mark.usefixtures("onnx_modules")


@pytest.fixture(scope="module")
def paged(tiny_smollm_like):
    """(the paged graph, its spec, its symbolically inferred {name: (dims, element type)})."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    from ricllm.engine.runtime.onnx_export import export
    from ricllm.engine.runtime.onnx_paged_attention import ATTENTION_GRAPHS

    model, spec, _, _ = export(tiny_smollm_like, ATTENTION_GRAPHS["paged"])
    inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=False, guess_output_rank=False)
    return model, spec, value_infos(inferred)


def value_infos(model) -> dict[str, tuple[list, int]]:
    return {v.name: ([d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim], v.type.tensor_type.elem_type)
            for v in [*model.graph.input, *model.graph.value_info, *model.graph.output]}


def test_the_paged_graph_passes_the_onnx_checker_and_ort_symbolic_shape_inference(paged):
    """Symbolic shape inference knows PagedAttention (its output is the query's shape, its cache outputs
    the caches'): every node's outputs get a shape; the logits and each cache output are as declared."""
    import onnx

    model, spec, shapes = paged
    onnx.checker.check_model(model)  # the standard ops; the checker skips com.microsoft
    unshaped = [out for node in model.graph.node for out in node.output if out not in shapes]
    assert not unshaped, unshaped
    assert shapes["logits"][0] == ["N", spec.vocab_size]
    pool = (["num_blocks", "block_size", spec.num_kv_heads, spec.head_dim], onnx.TensorProto.FLOAT16)
    for layer in range(spec.num_layers):
        assert shapes[f"key_cache_{layer}"] == shapes[f"key_cache_out_{layer}"] == pool
        assert shapes[f"value_cache_{layer}"] == shapes[f"value_cache_out_{layer}"] == pool
    attention = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert len(attention) == spec.num_layers and all(n.domain == MS for n in attention)
    assert shapes[attention[0].output[0]] == (["T", spec.num_heads * spec.head_dim], onnx.TensorProto.FLOAT16)
    assert not [n for n in model.graph.node if n.op_type == "Softmax"]  # no attention of its own beside the op's


def paged_attention_problems(model, spec, shapes: dict) -> list[str]:
    """What is wrong with the graph's PagedAttention nodes against ONNX Runtime's registered schema (which
    inputs are required, each formal parameter's allowed types, attributes) and the CUDA kernel's input
    checks (paged_attention_helper.h in ONNX Runtime): query [T, heads·d_h], key and value [T, n_kv·d_h],
    d_h a multiple of 8, both caches [num_blocks, block_size, n_kv, d_h] of one type, cumulative lengths
    [B+1], past lengths [B], block table [B, M], slot mapping [T], attention metadata [2] or [3]; the
    cache outputs the graph's outputs, each alias of its cache input."""
    from onnx import TensorProto, helper
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    schema = next(s for s in get_all_operator_schema() if (s.domain, s.name) == (MS, "PagedAttention"))
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    formal = schema.inputs
    required = {f.name for f in formal if str(f.option).endswith("Single")}
    d, heads, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    graph_outputs = {o.name for o in model.graph.output}
    problems = []
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    if len(nodes) != spec.num_layers:
        problems.append(f"{len(nodes)} PagedAttention nodes for {spec.num_layers} layers")
    for node in nodes:
        where = node.name
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        problems += [f"{where}: unknown attribute {a}" for a in set(attributes) - set(schema.attributes)]
        problems += [f"{where}: attribute {a} is {attributes.get(a)}, the model has {want}"
                     for a, want in (("num_heads", heads), ("kv_num_heads", kv)) if attributes.get(a) != want]
        if not schema.min_input <= len(node.input) <= schema.max_input:
            problems.append(f"{where}: {len(node.input)} inputs")
        given = {f.name: name for f, name in zip(formal, node.input) if name}
        problems += [f"{where}: required input {name} missing" for name in sorted(required - set(given))]
        types: dict[str, set[str]] = {}
        for f in formal:
            if f.name in given:
                dims, element = shapes[given[f.name]]
                type_name = f"tensor({helper.tensor_dtype_to_np_dtype(element).name})"
                types.setdefault(f.typeStr, set()).add(type_name)
                if type_name not in allowed[f.typeStr]:
                    problems.append(f"{where}: {f.name} is {type_name}, the schema allows {sorted(allowed[f.typeStr])}")
        problems += [f"{where}: {param} bound to several types {sorted(seen)}" for param, seen in types.items()
                     if len(seen) > 1]
        dims = {name: shapes[value][0] for name, value in given.items()}
        tokens = dims.get("query", [None])[0]
        batch = dims.get("past_seqlens", [None])[0]
        expected = {"query": [tokens, heads * d], "key": [tokens, kv * d], "value": [tokens, kv * d],
                    "key_cache": ["num_blocks", "block_size", kv, d],
                    "value_cache": ["num_blocks", "block_size", kv, d],
                    "cumulative_sequence_length": ["B_plus_1"], "past_seqlens": [batch],
                    "block_table": [batch, "M"], "slot_mapping": [tokens]}
        problems += [f"{where}: {name} has dims {dims[name]}, expected {want}" for name, want in expected.items()
                     if name in dims and dims[name] != want]
        if "attention_metadata" in dims and dims["attention_metadata"] not in ([2], [3]):
            problems.append(f"{where}: attention_metadata has dims {dims['attention_metadata']}")
        if d % 8:
            problems.append(f"{where}: head_size {d} is not a multiple of 8")
        for out_index, in_name in ((1, "key_cache"), (2, "value_cache")):
            out = node.output[out_index] if len(node.output) > out_index else ""
            if not out or out not in graph_outputs or shapes.get(out) != shapes.get(given.get(in_name, "")):
                problems.append(f"{where}: output {out_index} must be a graph output shaped as its {in_name}")
        if shapes.get(given.get("query", ""), ([], None))[1] != TensorProto.FLOAT16:
            problems.append(f"{where}: query is not float16, the pool's type")
    return problems


def test_each_paged_attention_node_fits_the_schema_and_the_models_geometry(paged):
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    model, spec, shapes = paged
    assert paged_attention_problems(model, spec, shapes) == []
    schemas = {(s.domain, s.name): s for s in get_all_operator_schema()}
    for node in model.graph.node:  # every other contrib node too, as tests/test_onnx_runtime.py checks the CPU graph
        if node.domain == MS:
            schema = schemas[(node.domain, node.op_type)]
            assert schema.min_input <= len(node.input) <= schema.max_input, node.op_type
            assert {a.name for a in node.attribute} <= set(schema.attributes), node.op_type


def _wrong_kv_heads(node, spec):
    from onnx import helper

    node.attribute.remove(next(a for a in node.attribute if a.name == "kv_num_heads"))
    node.attribute.append(helper.make_attribute("kv_num_heads", spec.num_heads))


def _no_block_table(node, spec):
    node.input[7] = ""


def _cache_out_not_aliased(node, spec):
    node.output[1] = "some_other_buffer"


@pytest.mark.parametrize(("break_it", "said"), [(_wrong_kv_heads, "kv_num_heads"),
                                                (_no_block_table, "required input block_table missing"),
                                                (_cache_out_not_aliased, "output 1 must be a graph output")])
def test_the_paged_attention_check_fails_a_broken_node(paged, break_it, said):
    """The check above can fail: one broken node of a copy of the graph is named."""
    model, spec, shapes = paged
    broken = copy.deepcopy(model)
    node = next(n for n in broken.graph.node if n.op_type == "PagedAttention")
    break_it(node, spec)
    problems = paged_attention_problems(broken, spec, shapes)
    assert problems and all(node.name in p for p in problems) and any(said in p for p in problems), problems


def mixed_step() -> FlatBatch:
    """Block size 16. Sequence 0: a 3-token prefill from nothing (block 5). Sequence 1: one decode token
    after 20 cached (blocks 2, 7; the token at position 20, slot 7·16 + 4). Sequence 2: a 4-token chunk
    after 30 cached tokens of which 16 came from the prefix cache (blocks 9, 3; positions 30-33 cross
    into block 4)."""
    return FlatBatch(input_ids=[11, 12, 13, 21, 31, 32, 33, 34], positions=[0, 1, 2, 20, 30, 31, 32, 33],
                     slot_mapping=[80, 81, 82, 116, 62, 63, 64, 65], query_start_loc=[0, 3, 4, 8],
                     context_lens=[3, 21, 34], block_tables=[[5, 0, 0], [2, 7, 0], [9, 3, 4]],
                     logits_rows=[2, 3, 7], max_query_len=4, prefill_rows=7, prefill_products=0)


def test_the_paged_step_inputs_are_the_engines_tables_lengths_and_slots():
    from ricllm.engine.runtime.onnx_cuda import paged_step_inputs

    arrays = paged_step_inputs(mixed_step())
    expected = {"input_ids": [11, 12, 13, 21, 31, 32, 33, 34], "positions": [0, 1, 2, 20, 30, 31, 32, 33],
                "cumulative_sequence_length": [0, 3, 4, 8], "past_seqlens": [0, 20, 30],
                "block_table": [[5, 0, 0], [2, 7, 0], [9, 3, 4]], "slot_mapping": [80, 81, 82, 116, 62, 63, 64, 65],
                "attention_metadata": [4, 34], "logits_rows": [2, 3, 7]}
    assert set(arrays) == set(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(arrays[name], np.asarray(want), err_msg=name)
    int32 = {"cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping", "attention_metadata"}
    assert {name for name, a in arrays.items() if a.dtype == np.int32} == int32  # PagedAttention's S
    assert all(arrays[name].dtype == np.int64 for name in set(arrays) - int32)


def test_the_paged_step_reads_the_keys_the_cpu_graph_gathers():
    """Each sequence's past keys, read through its block table as PagedAttention does (token j of sequence
    b at ``block_table[b, j // block_size]·block_size + j % block_size``), are the pool rows the CPU
    graph gathers (``past_slots``); its own new tokens' slots follow them."""
    from ricllm.engine.runtime.onnx_cuda import paged_step_inputs
    from ricllm.engine.runtime.onnx_model import step_inputs

    flat, block = mixed_step(), 16
    paged, gathered = paged_step_inputs(flat), step_inputs(flat, block)
    for b, past in enumerate(paged["past_seqlens"]):
        j = np.arange(past + np.diff(paged["cumulative_sequence_length"])[b])
        slots = paged["block_table"][b, j // block] * block + j % block
        np.testing.assert_array_equal(slots[:past], gathered["past_slots"][b, :past])
        start, end = paged["cumulative_sequence_length"][b:b + 2]
        np.testing.assert_array_equal(slots[past:], paged["slot_mapping"][start:end])


def _offers_cuda() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def test_the_gpu_path_refuses_what_paged_attention_does_not_serve_by_name(tiny_gguf):
    for settings, said in (({"dtype": "float32"}, "dtype 'float32': on a GPU the ONNX runtime attends in float16"),
                           ({"block_size": 8}, "block_size 8: PagedAttention takes a power of two of at least 16"),
                           ({"kv_cache_dtype": "int8"}, "kv_cache_dtype 'int8'")):
        with pytest.raises(ConfigError, match=f"runtime 'onnx' cannot serve this configuration: {said}"):
            LLM(str(tiny_gguf), runtime="onnx", device="cuda", weight_cache=False, **settings)


def test_cuda_without_onnx_runtimes_cuda_build_names_the_extra(tiny_gguf):
    """With ONNX Runtime's CPU build, --device cuda --runtime onnx says which install serves it: exit 2,
    no traceback."""
    if _offers_cuda():
        pytest.skip("this ONNX Runtime is the CUDA build: benchmarks/gpu_onnx.py runs the CUDA path")
    env = {**os.environ, "RICLLM_LOG_LEVEL": "warning"}
    result = subprocess.run([sys.executable, "-m", "ricllm.cli", "generate", "hello", "--model", str(tiny_gguf),
                             "--runtime", "onnx", "--device", "cuda", "--no-weight-cache"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "runtime 'onnx' cannot serve this configuration: device 'cuda': this ONNX Runtime" in result.stderr
    assert "has no CUDAExecutionProvider" in result.stderr and "install ricllm[onnx-gpu]" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_gpu_benchmark_says_why_it_did_not_run_and_exits_0():
    """On a machine without an NVIDIA GPU or without ONNX Runtime's CUDA build, benchmarks/gpu_onnx.py
    names what is missing and exits 0; --help explains what it measures."""
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_onnx.py"
    helped = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "PagedAttention" in helped.stdout and "--streams" in helped.stdout
    if _offers_cuda():
        pytest.skip("this ONNX Runtime is the CUDA build: the benchmark would run")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "benchmarks/gpu_onnx.py did not run: this ONNX Runtime" in done.stdout
    assert "pip install 'ricllm[onnx-gpu]'" in done.stdout and "Traceback" not in done.stderr


# ------------------------------------------------------------------ the paged graph evaluated on the CPU
# ONNX Runtime's CPU build has no PagedAttention kernel, so these two com.microsoft ops are evaluated here
# with onnx's reference evaluator, from their documented contracts (ContribOperators.md), in numpy.


def _reference_ops():
    from onnx.reference.op_run import OpRun

    class PagedAttention(OpRun):
        """Packed queries; each token's K/V written at its slot; sequence b's query i sees its keys
        0 .. past_b + i, read through its block table; GQA (query head h reads KV head h // group)."""

        op_domain = MS

        def _run(self, query, key, value, key_cache, value_cache, cumulative, past, table, cos=None, sin=None,
                 slots=None, *_, num_heads=None, kv_num_heads=None, scale=None):
            key_cache, value_cache = key_cache.copy(), value_cache.copy()
            blocks, block, kv, d = key_cache.shape
            k_rows, v_rows = key_cache.reshape(-1, kv, d), value_cache.reshape(-1, kv, d)
            k_rows[slots] = key.reshape(-1, kv, d)
            v_rows[slots] = value.reshape(-1, kv, d)
            out = np.zeros((len(query), num_heads, d), dtype=np.float32)
            kv_head = np.arange(num_heads) // (num_heads // kv)
            for b in range(len(past)):
                start, end = cumulative[b], cumulative[b + 1]
                j = np.arange(past[b] + end - start)
                rows = table[b, j // block] * block + j % block
                keys = k_rows[rows][:, kv_head].astype(np.float32)  # [keys, heads, d]
                values = v_rows[rows][:, kv_head].astype(np.float32)
                q = query[start:end].reshape(-1, num_heads, d).astype(np.float32)
                scores = np.einsum("qhd,khd->hqk", q, keys) * scale
                visible = j[None, :] <= past[b] + np.arange(end - start)[:, None]
                scores = np.where(visible[None], scores, -np.inf)
                probs = np.exp(scores - scores.max(-1, keepdims=True))
                probs /= probs.sum(-1, keepdims=True)
                out[start:end] = np.einsum("hqk,khd->qhd", probs, values)
            return out.reshape(len(query), -1).astype(query.dtype), key_cache, value_cache

    class SkipSimplifiedLayerNormalization(OpRun):
        op_domain = MS

        def _run(self, x, skip, gamma, epsilon=None):
            total = x + skip
            normed = total / np.sqrt(np.mean(total * total, axis=-1, keepdims=True) + epsilon) * gamma
            unused = np.zeros(0, dtype=x.dtype)
            return normed.astype(x.dtype), unused, unused, total

    return [PagedAttention, SkipSimplifiedLayerNormalization]


# the paged graph's fp16 q, k, v and pool against the CPU graph's fp32, tiny F32 model: measured 5.6e-4
REFERENCE_MAX_LOGIT_DIFFERENCE = 0.01


def two_steps() -> list[FlatBatch]:
    """Step 1: sequence 0 prefills 20 tokens (blocks 3, 1), sequence 1 prefills 7 (block 0). Step 2:
    sequence 0 decodes position 20 (block 1, slot 20), sequence 1 prefills a chunk of 12 (positions
    7-18, into block 2)."""
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 200, size=40).tolist()
    first = FlatBatch(input_ids=ids[:27], positions=[*range(20), *range(7)],
                      slot_mapping=[*range(48, 64), *range(16, 20), *range(7)], query_start_loc=[0, 20, 27],
                      context_lens=[20, 7], block_tables=[[3, 1], [0, 0]], logits_rows=[19, 26], max_query_len=20,
                      prefill_rows=27, prefill_products=0)
    second = FlatBatch(input_ids=ids[27:40], positions=[20, *range(7, 19)],
                       slot_mapping=[20, *range(7, 16), *range(32, 35)], query_start_loc=[0, 1, 13],
                       context_lens=[21, 19], block_tables=[[3, 1], [0, 2]], logits_rows=[0, 12], max_query_len=12,
                       prefill_rows=12, prefill_products=0)
    return [first, second]


def test_the_paged_graph_computes_the_cpu_graphs_logits_under_a_reference_paged_attention(tiny_gguf):
    """The paged graph, evaluated step by step on its own fp16 pool (each cache output fed back as the
    next step's cache, as the op's in-place update leaves it), gives the logits ONNX Runtime computes
    with the CPU graph for the same two steps (a batched prefill, then a decode beside a chunk that
    crosses into a new block): the wiring of q, k, v, the casts, RoPE, the scale, the step's arrays and
    the pool's layout. fp16 q/k/v and pool against fp32: within ``REFERENCE_MAX_LOGIT_DIFFERENCE``. Swapping
    k and v, past lengths off by one, or another sequence's block table each move the logits by 0.17-2.6."""
    from onnx.reference import ReferenceEvaluator

    from ricllm.engine.runtime.onnx_cuda import paged_step_inputs
    from ricllm.engine.runtime.onnx_export import export
    from ricllm.engine.runtime.onnx_paged_attention import ATTENTION_GRAPHS, CACHE_DTYPE

    model, spec, _, _ = export(tiny_gguf, ATTENTION_GRAPHS["paged"])
    evaluator = ReferenceEvaluator(model, new_ops=_reference_ops())
    pool = {f"{kind}_cache_{layer}": np.zeros((6, 16, spec.num_kv_heads, spec.head_dim), dtype=CACHE_DTYPE)
            for layer in range(spec.num_layers) for kind in ("key", "value")}
    cpu = LLM(str(tiny_gguf), runtime="onnx", weight_cache=False, kv_cache_budget="4MiB").engine.runtime.runner
    names = ["logits", *(name.replace("_cache_", "_cache_out_") for name in pool)]
    for flat in two_steps():
        logits, *caches = evaluator.run(names, {**paged_step_inputs(flat), **pool})
        pool = dict(zip(pool, caches))
        expected = cpu.compute(flat)
        assert logits.shape == expected.shape == (2, spec.vocab_size)
        assert np.abs(logits - expected).max() <= REFERENCE_MAX_LOGIT_DIFFERENCE, np.abs(logits - expected).max()
    assert np.count_nonzero(pool["key_cache_0"].reshape(-1, spec.num_kv_heads * spec.head_dim).any(-1)) == 40


def test_a_gemma3_file_is_refused_the_paged_graph_by_name(tmp_path):
    """Gemma 3's windowed cache groups are not in the paged graph: its export says so rather than writing a
    CPU graph that the CUDA runner would bind as a paged one."""
    from ricllm.engine.runtime.onnx_export import OnnxExportUnsupported, export
    from ricllm.engine.runtime.onnx_paged_attention import ATTENTION_GRAPHS
    from tests.helpers import write_tiny_gemma3_gguf

    path = write_tiny_gemma3_gguf(tmp_path / "tiny_gemma3.gguf", seed=3, window=8)
    with pytest.raises(OnnxExportUnsupported, match="Gemma 3 has no PagedLlamaGraph"):
        export(path, ATTENTION_GRAPHS["paged"])
