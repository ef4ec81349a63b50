"""The Llama-family graph for ONNX Runtime's CUDA execution provider: each layer's attention is one
``com.microsoft`` ``PagedAttention`` node over ricllm's own paged pool (``export(path, PagedLlamaGraph)``;
``ATTENTION_GRAPHS`` names both graphs by their attention).

One graph run is one engine step over its ``T`` flattened tokens of ``B`` sequences:

    inputs   input_ids, positions [T] int64; cumulative_sequence_length [B+1], past_seqlens [B],
             block_table [B, M], slot_mapping [T] int32; attention_metadata [2] int32 (host memory:
             the step's longest query and longest context); logits_rows [N] int64;
             key_cache_i, value_cache_i [num_blocks, block_size, n_kv, d_h] fp16 for each layer i
    outputs  logits [N, vocab] fp32; key_cache_out_i, value_cache_out_i: the same buffers as
             key_cache_i, value_cache_i (the op writes the step's K/V into them at ``slot_mapping``)

The pool keeps the engine's layout and slot arithmetic (``slot = block · block_size + offset``), so
the engine's block tables, slot mapping and context lengths go in as they are. The op's cache outputs
must be the very buffers of its cache inputs (its CUDA kernel refuses anything else): the runner binds
each layer's pool as both with IO binding, and nothing is copied per step.

Everything but attention is ``LlamaGraph``'s, in fp32: the projections (``MatMulNBits`` from the file's
blocks), the norms, SwiGLU and RoPE. PagedAttention's element types are fp16 or bf16 only, so q, k and v
are cast to fp16 at its inputs and its output back to fp32; the pool is fp16 (numpy has fp16 and no
bf16, so the runner builds and the CPU tests check every array with numpy).

RoPE stays the graph's own rotate-half in fp32, not the op's ``do_rotary``: the angles and the rotation
are computed in fp32 before the cast (the op's cos/sin caches would be fp16 tables, about 3 decimal
digits at every position), the CPU graph and this one share one RoPE (its scaling rule included), and
the op would derive each token's position from ``past_seqlens`` where the graph reads the engine's
``positions``. The cost is a handful of elementwise nodes per layer.
"""

from __future__ import annotations

import numpy as np

from ricllm.engine.runtime.onnx_export import MS_DOMAIN, LlamaGraph

# PagedAttention's inputs by position (its schema in ONNX Runtime 1.31); "" is an absent optional input
PAGED_INPUTS = ("query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length",
                "past_seqlens", "block_table", "cos_cache", "sin_cache", "slot_mapping", "head_sink",
                "q_norm_weight", "k_norm_weight", "k_scale", "v_scale", "attention_metadata")
STEP_INPUTS = ("cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping", "attention_metadata")
CACHE_DTYPE = np.float16


class PagedLlamaGraph(LlamaGraph):
    """``LlamaGraph`` with each layer's attention one ``PagedAttention`` node on the pool."""

    def attention(self, layer: int, h: str, cos: str, sin: str, steps: dict[str, str] | None = None) -> str:
        from onnx import TensorProto

        spec, g = self.spec, self.g
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        prefix = f"blk.{layer}"
        q, k, v = self.qkv(layer, h)

        def rotated(x: str, n: int) -> str:  # [T, n·d_h] -> RoPE per head -> [T, n·d_h]
            return g.one("Reshape", [self.rotate(g.one("Reshape", [x, g.shape(-1, n, dim)]), cos, sin),
                                     g.shape(-1, n * dim)])

        def half(x: str) -> str:
            return g.one("Cast", [x], to=TensorProto.FLOAT16)

        by_position = {"query": half(rotated(q, heads)), "key": half(rotated(k, kv_heads)), "value": half(v),
                       "key_cache": f"key_cache_{layer}", "value_cache": f"value_cache_{layer}",
                       **{name: name for name in STEP_INPUTS}}
        inputs = [by_position.get(name, "") for name in PAGED_INPUTS]
        while not inputs[-1]:
            inputs.pop()
        out = g.op("PagedAttention", inputs,
                   [g.name("pagedattention"), f"key_cache_out_{layer}", f"value_cache_out_{layer}"],
                   domain=MS_DOMAIN, num_heads=heads, kv_num_heads=kv_heads, scale=float(spec.attention_scale))[0]
        return self.linear(g.one("Cast", [out], to=TensorProto.FLOAT), [f"{prefix}.attn_output.weight"],
                           f"layer{layer}_o")

    def build(self):
        from onnx import TensorProto, helper

        spec, g = self.spec, self.g
        x, head = self.embedding_and_head("input_ids")
        cos, sin = self.rope_tables("positions")
        delta = None
        for layer in range(spec.num_layers):
            h, x = self.norm(x, delta, f"blk.{layer}.attn_norm.weight")
            h, x = self.norm(x, self.attention(layer, h, cos, sin), f"blk.{layer}.ffn_norm.weight")
            delta = self.mlp(layer, h)
        h, _ = self.norm(x, delta, "output_norm.weight")
        g.op("Identity", [head(g.one("Gather", [h, "logits_rows"], axis=0))], ["logits"])

        f32, f16, i32, i64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT32, TensorProto.INT64
        inputs = [helper.make_tensor_value_info("input_ids", i64, ["T"]),
                  helper.make_tensor_value_info("positions", i64, ["T"]),
                  helper.make_tensor_value_info("cumulative_sequence_length", i32, ["B_plus_1"]),
                  helper.make_tensor_value_info("past_seqlens", i32, ["B"]),
                  helper.make_tensor_value_info("block_table", i32, ["B", "M"]),
                  helper.make_tensor_value_info("slot_mapping", i32, ["T"]),
                  helper.make_tensor_value_info("attention_metadata", i32, [2]),
                  helper.make_tensor_value_info("logits_rows", i64, ["N"])]
        outputs = [helper.make_tensor_value_info("logits", f32, ["N", spec.vocab_size])]
        pool = ["num_blocks", "block_size", spec.num_kv_heads, spec.head_dim]
        for layer in range(spec.num_layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"{kind}_cache_{layer}", f16, pool))
                outputs.append(helper.make_tensor_value_info(f"{kind}_cache_out_{layer}", f16, pool))
        return g.model(spec.name or "llama", inputs, outputs)


# the export's graphs by their attention: ``gather`` for ONNX Runtime's CPU provider, ``paged`` for its CUDA one
ATTENTION_GRAPHS: dict[str, type[LlamaGraph]] = {"gather": LlamaGraph, "paged": PagedLlamaGraph}
