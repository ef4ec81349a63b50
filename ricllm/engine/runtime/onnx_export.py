"""A Llama-family GGUF as one ONNX graph for ONNX Runtime: the ONNX runtime's model (``onnx_runtime``).
A Gemma 3 GGUF's graph is ``onnx_gemma3``'s, written through ``export`` alike.

The weights stay as compact as the file stores them: Q4_0, Q4_1 and Q8_0 blocks become ``com.microsoft``
``MatMulNBits`` weights block for block (32 codes, one scale each). Q4_1's ``d·q + m`` is MatMulNBits'
``d·(q − 8)`` plus the offsets ``m + 8d`` times each block's activation sum, a small fp32 product: exact
(``matmul_nbits_weights`` says why not MatMulNBits' float zero point). Q4_0 is ``d·(q − 8)``, MatMulNBits'
default 4-bit zero point; Q8_0's signed codes are stored plus 128, its default 8-bit one. A Q8_0 embedding is
looked up with ``GatherBlockQuantized`` and, tied, is the head as an 8-bit MatMulNBits over the same codes.
Any other type (F32, F16, the K-quants) is dequantized to fp32 and multiplied by ``MatMul``.

One graph run is one engine step over its ``T`` flattened tokens of ``B`` sequences:

    inputs   input_ids, positions [T]; query_rows [B, Q]; past_slots [B, P]; attention_bias [B, 1, 1, Q, P+Q];
             token_rows [T]; logits_rows [N]; past_key_i, past_value_i [S, n_kv, d_h] for each layer i
    outputs  logits [N, vocab]; present_key_i, present_value_i [T, n_kv, d_h]

``past_key_i`` is layer i's whole paged K pool, read in place; each sequence's cached tokens are
gathered from it by slot (``past_slots``: its block table resolved, padded to the step's longest) and
its new tokens' K/V (computed here) are appended, so a sequence of ``Q`` padded queries attends over
``P + Q`` keys, the bias masking padding and the future (causal within the new tokens). ONNX Runtime
cannot write an input in place, so the new K/V are outputs that the runner writes into the pool by
slot mapping. Attention is standard ONNX (Gather, MatMul, Softmax) rather than ``GroupQueryAttention``,
whose CPU kernel takes one contiguous past per sequence that it extends itself: gathering into it costs
the same gather as here, and this form serves mixed prefill, chunked-prefill and decode rows in one run.
RMSNorm is ONNX's ``RMSNormalization`` and, with the residual add, ``SkipSimplifiedLayerNormalization``;
RoPE (rotate-half, the rows unpermuted from llama.cpp's interleaving) and SwiGLU are elementwise ops.
``export(graph=PagedLlamaGraph)`` writes the graph for ONNX Runtime's CUDA provider instead, each layer's
attention one ``PagedAttention`` over the pool (``onnx_paged_attention``, which names both graphs by
their attention: ``ATTENTION_GRAPHS``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

# the graphs' building blocks (``onnx_graph``, which the Gemma graph builds on too) are this module's names as well
from ricllm.engine.runtime.onnx_graph import (  # noqa: F401
    ACCURACY_LEVEL, BLOCK, MASKED, MS_DOMAIN, PACKED_TYPES, DecoderGraph, FileTensor, GraphBuilder,
    OnnxExportUnsupported, matmul_nbits, matmul_nbits_weights, read_tensors, rms_norm, rope_row_order, rotate_halves)
from ricllm.logging import get_logger
from ricllm.paths import cache_dir, evict_least_recent, file_digest, touch_used
from ricllm.version import __version__

log = get_logger("ricllm.onnx")
FORMAT_VERSION = 1
MAX_ENTRIES = 4

# ------------------------------------------------------------------------------ the graph


class LlamaGraph(DecoderGraph):
    """Writes the decoder's nodes into a ``GraphBuilder`` from the file's tensors."""

    def linear(self, x: str, names: list[str], stem: str, row_orders: list[np.ndarray | None] | None = None) -> str:
        """``x @ W.T`` with W the file's tensors ``names`` stacked by rows (q, k, v as one product)."""
        parts = [self.tensors[n] for n in names]
        orders = row_orders or [None] * len(parts)
        kinds = {p.kind for p in parts}
        g, columns = self.g, parts[0].columns
        if len(kinds) == 1 and kinds <= set(PACKED_TYPES) and columns % BLOCK == 0:
            blocks = np.concatenate([p.blocks if o is None else p.blocks[o] for p, o in zip(parts, orders)])
            self.formats[stem] = "int8" if parts[0].kind == "Q8_0" else "int4"
            return matmul_nbits(g, x, parts[0].kind, blocks, stem)
        values = np.concatenate([p.values() if o is None else p.values()[o] for p, o in zip(parts, orders)])
        self.formats[stem] = "dense"
        return g.one("MatMul", [x, g.constant(f"{stem}_weight", values.T)])

    def embedding_and_head(self, ids: str) -> tuple[str, Callable[[str], str]]:
        """The embedding rows of ``ids`` ``[T, hidden]``, and a function giving the head's logits of rows."""
        g, embed = self.g, self.tensors["token_embd.weight"]
        tied = "output.weight" not in self.tensors
        if embed.kind == "Q8_0" and embed.columns % BLOCK == 0:
            codes, scales, _, _ = matmul_nbits_weights("Q8_0", embed.blocks)
            codes_name = g.constant("embedding_codes", codes)  # [vocab, hidden/32, 32]: shared with the head
            gather_scales = g.constant("embedding_scales", scales.reshape(embed.rows, -1, 1))
            rows = g.one("GatherBlockQuantized", [codes_name, ids, gather_scales], domain=MS_DOMAIN,
                         gather_axis=0, quantize_axis=2, block_size=BLOCK, bits=8)
            x = g.one("Reshape", [rows, g.shape(-1, embed.columns)])
            self.formats["embedding"] = "int8"
            if tied:
                self.formats["head"] = "int8"
                head_scales = g.one("Reshape", [gather_scales, g.shape(-1)])
                return x, lambda h: matmul_nbits(g, h, "Q8_0", embed.blocks, "head", scales_name=head_scales,
                                                 weight_name=codes_name)
        else:
            table = embed.values()
            x = g.one("Gather", [g.constant("embedding", table), ids], axis=0)
            self.formats["embedding"] = "dense"
            if tied:
                self.formats["head"] = "dense"
                return x, lambda h: g.one("MatMul", [h, g.constant("head_weight", table.T)])
        return x, lambda h: self.linear(h, ["output.weight"], "head")

    def rope_tables(self, positions: str) -> tuple[str, str]:
        """cos and sin ``[T, 1, d_h/2]`` at ``positions``."""
        spec, g = self.spec, self.g
        dim = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if spec.rope_scaling is not None:
            if spec.rope_scaling.kind != "linear":
                raise OnnxExportUnsupported(f"RoPE scaling {spec.rope_scaling.kind!r} is not in the ONNX graph yet")
            inv_freq = inv_freq / spec.rope_scaling.factor
        angles = np.outer(np.arange(spec.max_position_embeddings, dtype=np.float32), inv_freq.astype(np.float32))
        unsqueeze = g.constant("axis", np.asarray([1], dtype=np.int64))
        return tuple(g.one("Unsqueeze", [g.one("Gather", [g.constant(stem, table), positions], axis=0), unsqueeze])
                     for stem, table in (("rope_cos", np.cos(angles)), ("rope_sin", np.sin(angles))))

    def rotate(self, x: str, cos: str, sin: str) -> str:
        """RoPE on ``x [T, heads, d_h]``: halves (a, b) -> (a·cos − b·sin, b·cos + a·sin)."""
        return rotate_halves(self.g, x, cos, sin)

    def qkv(self, layer: int, h: str) -> list[str]:
        """The layer's q, k and v ``[T, width]``: one product, its q and k rows in RoPE's order."""
        spec, g, prefix = self.spec, self.g, f"blk.{layer}"
        orders = [rope_row_order(spec.q_size, spec.num_heads), rope_row_order(spec.kv_size, spec.num_kv_heads), None]
        qkv = self.linear(h, [f"{prefix}.attn_q.weight", f"{prefix}.attn_k.weight", f"{prefix}.attn_v.weight"],
                          f"layer{layer}_qkv", orders)
        return g.op("Split", [qkv, g.constant("split", np.asarray([spec.q_size, spec.kv_size, spec.kv_size],
                                                                   dtype=np.int64))], 3, axis=-1)

    def attention(self, layer: int, h: str, cos: str, sin: str, steps: dict[str, str]) -> str:
        spec, g = self.spec, self.g
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        prefix = f"blk.{layer}"
        q, k, v = self.qkv(layer, h)
        q = self.rotate(g.one("Reshape", [q, g.shape(-1, heads, dim)]), cos, sin)
        g.op("Identity", [self.rotate(g.one("Reshape", [k, g.shape(-1, kv_heads, dim)]), cos, sin)],
             [f"present_key_{layer}"])
        g.op("Reshape", [v, g.shape(-1, kv_heads, dim)], [f"present_value_{layer}"])
        out = self.attend_over_pool(layer, q, "past_slots", "attention_bias", steps["scores5"], steps["scores4"], steps)
        return self.linear(out, [f"{prefix}.attn_output.weight"], f"layer{layer}_o")

    def mlp(self, layer: int, h: str) -> str:
        return self.gated_mlp(layer, h, lambda gate: self.g.one("Mul", [gate, self.g.one("Sigmoid", [gate])]))

    def build(self):
        from onnx import TensorProto, helper

        spec, g = self.spec, self.g
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        group = heads // kv_heads
        batch, queries = g.one("Shape", ["query_rows"], start=0, end=1), g.one("Shape", ["query_rows"], start=1, end=2)
        keys = g.one("Shape", ["attention_bias"], start=4, end=5)
        minus_one = g.constant("minus_one", np.asarray([-1], dtype=np.int64))

        dims = self.dims
        steps = {"scale": g.constant("scale", np.asarray(spec.attention_scale, dtype=np.float32)),
                 "grouped": dims(batch, kv_heads, minus_one, dim),
                 "scores5": dims(batch, kv_heads, group, queries, keys),
                 "scores4": dims(batch, kv_heads, minus_one, keys),
                 "heads": dims(batch, heads, queries, dim)}
        x, head = self.embedding_and_head("input_ids")
        cos, sin = self.rope_tables("positions")
        delta = None
        for layer in range(spec.num_layers):
            h, x = self.norm(x, delta, f"blk.{layer}.attn_norm.weight")
            h, x = self.norm(x, self.attention(layer, h, cos, sin, steps), f"blk.{layer}.ffn_norm.weight")
            delta = self.mlp(layer, h)
        h, _ = self.norm(x, delta, "output_norm.weight")
        g.op("Identity", [head(g.one("Gather", [h, "logits_rows"], axis=0))], ["logits"])

        f32, i64 = TensorProto.FLOAT, TensorProto.INT64
        inputs = [helper.make_tensor_value_info("input_ids", i64, ["T"]),
                  helper.make_tensor_value_info("positions", i64, ["T"]),
                  helper.make_tensor_value_info("query_rows", i64, ["B", "Q"]),
                  helper.make_tensor_value_info("past_slots", i64, ["B", "P"]),
                  helper.make_tensor_value_info("attention_bias", f32, ["B", 1, 1, "Q", "PQ"]),
                  helper.make_tensor_value_info("token_rows", i64, ["T"]),
                  helper.make_tensor_value_info("logits_rows", i64, ["N"])]
        outputs = [helper.make_tensor_value_info("logits", f32, ["N", spec.vocab_size])]
        for layer in range(spec.num_layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_{kind}_{layer}", f32, ["S", kv_heads, dim]))
                outputs.append(helper.make_tensor_value_info(f"present_{kind}_{layer}", f32, ["T", kv_heads, dim]))
        return g.model(spec.name or "llama", inputs, outputs)


def weight_formats(formats: dict[str, str]) -> tuple[str, str]:
    """(the layers', the head's) as the other runtimes name them: ``int4``, ``int8`` or ``dense`` (fp32 here);
    ``mixed`` for layers of several."""
    layers = {kind for stem, kind in formats.items() if stem.startswith("layer")}
    return (layers.pop() if len(layers) == 1 else "mixed"), formats["head"]


def export(model_path: Path, graph: type[LlamaGraph] = LlamaGraph):
    """(the ONNX ``ModelProto``, the spec, the tokenizer, (layers', head's weight format)) of a GGUF file,
    written by ``graph``: ``LlamaGraph`` (attention over the gathered pool, ONNX Runtime's CPU provider) or a
    subclass (``onnx_paged_attention.PagedLlamaGraph``: one ``PagedAttention`` per layer, its CUDA provider)."""
    from ricllm.model.gguf_file import GGUFFile
    from ricllm.model.loader import open_checkpoint

    checkpoint = open_checkpoint(model_path)
    spec = checkpoint.spec
    if checkpoint.format != "gguf":
        raise OnnxExportUnsupported("the ONNX export reads GGUF files; an HF folder is not exported yet")
    if spec.architecture == "gemma3" and graph is not LlamaGraph:
        raise OnnxExportUnsupported(f"Gemma 3 has no {graph.__name__}: its windowed cache groups are served on the "
                                    "CPU graph only (no PagedAttention graph for them yet)")
    if spec.architecture == "gemma3":
        return export_gemma3(checkpoint, GGUFFile(model_path))
    if spec.architecture != "llama":
        raise OnnxExportUnsupported(f"architecture {spec.architecture!r}: the ONNX export writes Llama-family "
                                    "and Gemma 3 graphs only")
    tensors = read_tensors(GGUFFile(model_path))
    if "rope_freqs.weight" in tensors:
        raise OnnxExportUnsupported("the file's RoPE frequency factors (Llama 3.1) are not in the ONNX graph yet")
    builder = graph(spec, tensors)
    model = builder.build()
    return model, spec, checkpoint.tokenizer, weight_formats(builder.formats)


def export_gemma3(checkpoint, reader):
    """``export``'s answer for a Gemma 3 file (``onnx_gemma3``)."""
    from ricllm.engine.runtime.onnx_gemma3 import Gemma3Graph, gemma3_weight_formats, quantized_blocks

    graph = Gemma3Graph(checkpoint.spec, read_tensors(reader), quantized_blocks(reader))
    model = graph.build()
    return model, checkpoint.spec, checkpoint.tokenizer, gemma3_weight_formats(graph.formats)


# ------------------------------------------------------------------------------ the cache

# the modules whose code writes a graph: a change to any of them makes a new cache entry
GRAPH_MODULES = ("onnx_export.py", "onnx_graph.py", "onnx_gemma3.py", "onnx_quants.py")


def entry_path(model_path: Path, graph: type[LlamaGraph] = LlamaGraph) -> Path:
    """Where this file's graph lives in the cache: keyed by its sha256, the graph class and the code that
    writes graphs."""
    import inspect

    modules = [(Path(__file__).parent / m).read_bytes() for m in GRAPH_MODULES]
    code = b"".join(modules + ([] if graph is LlamaGraph else [Path(inspect.getfile(graph)).read_bytes()]))
    key = {"sha256": file_digest(model_path), "format": FORMAT_VERSION, "ricllm": __version__,
           "code": hashlib.sha256(code).hexdigest()[:16], **({} if graph is LlamaGraph else {"graph": graph.__name__})}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "onnx" / f"{digest}.onnx"


def write(model_path: Path, out: Path, graph: type[LlamaGraph] = LlamaGraph) -> dict:
    """Write the graph of ``model_path`` to ``out`` (atomically) and, beside it, ``out.json``: the spec,
    the tokenizer's state and the weight formats, which the runtime reads without the GGUF."""
    import dataclasses

    model, spec, tokenizer, formats = export(model_path, graph)
    meta = {"spec": dataclasses.asdict(spec), "tokenizer": tokenizer.to_state(), "weight_formats": list(formats),
            "graph": graph.__name__}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".partial", delete=False) as handle:
        handle.write(model.SerializeToString())
    os.chmod(handle.name, 0o666 & ~_umask())  # a temporary file is private (0600); the graph is not
    meta_path = out.with_suffix(out.suffix + ".json")
    meta_path.write_text(json.dumps(meta))
    os.replace(handle.name, out)
    return meta


def _umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_meta(out: Path) -> dict:
    return json.loads(out.with_suffix(out.suffix + ".json").read_text())


def load_or_export(model_path: Path, use_cache: bool, private_dir: Path | None = None,
                   graph: type[LlamaGraph] = LlamaGraph) -> tuple[Path, dict, str]:
    """(the graph's path, its metadata, where it came from). ``use_cache`` False: written to
    ``private_dir`` (a temporary folder the caller removes)."""
    if not use_cache:
        out = (private_dir or Path(tempfile.mkdtemp(prefix="ricllm-onnx-"))) / "model.onnx"
        return out, write(model_path, out, graph), f"file {model_path}"
    out = entry_path(model_path, graph)
    if out.is_file():
        try:
            touch_used(out)
            return out, read_meta(out), f"cache {out}"
        except (OSError, ValueError) as exc:
            log.warning("onnx_graph_unreadable", path=str(out), error=str(exc))
    log.info("onnx_graph_exporting", model=str(model_path), out=str(out))
    meta = write(model_path, out, graph)
    for stale in evict_least_recent(out.parent, "*.onnx", MAX_ENTRIES):
        stale.with_suffix(stale.suffix + ".json").unlink(missing_ok=True)
        log.info("onnx_graph_evicted", path=str(stale))
    return out, meta, f"file {model_path}"
