"""A Gemma 3 GGUF as one ONNX graph for ONNX Runtime (``onnx_export.export`` writes it for a gemma3 file).

The math is ``gemma3.py``'s, in fp32:

    x = embed(ids) · √hidden
    each layer:  h = x + n_post_attn(W_o · Attn_w(RoPE_θ(n_q(q)), RoPE_θ(n_k(k)), v)),  q, k, v = W_qkv · n_attn(x)
                 x = h + n_post_ffn(W_down · (gelu_tanh(W_gate · n_ffn(h)) ⊙ W_up · n_ffn(h)))
    logits = head(n(x))   (c · tanh(logits / c) where the model caps them)

The norms' weights are the file's (llama.cpp's converter stores HF's ``1 + w``), so every norm is ONNX's
``RMSNormalization`` or, with the residual add before it, ``SkipSimplifiedLayerNormalization``. RoPE rotates
halves (Gemma's q/k rows are stored unpermuted) with its cos/sin computed from the step's positions, one
base for the sliding-window layers (10,000) and the file's for the others: a table of every position would
take 16 MiB per base and function at Gemma's 32,768 positions and head dim 256.

Each layer attends through a view (``layer_views``): its KV cache group's block tables and its window.
The step brings, per view, ``past_slots_<group>_<window>`` ``[B, P_w]`` (the pool rows of the cached keys
its queries may see: for a sliding-window layer only the ``window − 1`` before the step's first query, so
the gather stays bounded however long the sequence) and, per window, ``attention_bias_<window>``
``[B, 1, 1, Q, P_w + Q]`` (padding, causality and the window). ``past_key_i``/``past_value_i`` are layer
i's slot of the store, as the runner hands it; layers of different groups at one place in their groups
share a slot, each through its own group's blocks.

Weights: every quantized type as MatMulNBits block for block (``onnx_quants``), q/k/v in one product and
gate/up in another where their types share a layout; a quantized tied embedding is looked up with
``GatherBlockQuantized`` over the codes its head multiplies.
"""

from __future__ import annotations

import numpy as np

from ricllm.cache.kv_groups import kv_cache_groups, layer_groups
from ricllm.engine.runtime.onnx_graph import DecoderGraph, FileTensor, OnnxExportUnsupported, rotate_halves
from ricllm.engine.runtime.onnx_quants import NBITS_TYPES, nbits_gather, nbits_matmul, nbits_weight, stacked
from ricllm.model.formats import MIXED
from ricllm.model.spec import ModelSpec


def layer_views(spec: ModelSpec) -> tuple[list[tuple[int, int]], list[int]]:
    """The distinct ``(cache group, window)`` pairs the layers attend through, and each layer's index
    among them. A one-group cache (every layer of one kind) attends through group 0 with each layer's
    own window."""
    groups = kv_cache_groups(spec)
    group_of = layer_groups(groups, spec.num_layers) if len(groups) > 1 else [0] * spec.num_layers
    keys = [(group_of[i], spec.layer_window(i)) for i in range(spec.num_layers)]
    views = list(dict.fromkeys(keys))
    return views, [views.index(key) for key in keys]


def slots_input(group: int, window: int) -> str:
    return f"past_slots_{group}_{window}"


def bias_input(window: int) -> str:
    return f"attention_bias_{window}"


def gemma3_weight_formats(formats: dict[str, str]) -> tuple[str, str]:
    """(the layers', the head's), named as the other runtimes name a Q4_K_M file's: ``int4+int8`` for the mix."""
    layers = {kind for stem, kind in formats.items() if stem.startswith("layer")}
    if layers == {"int4", "int8"}:
        return MIXED, formats["head"]
    return (layers.pop() if len(layers) == 1 else "mixed"), formats["head"]


class Gemma3Graph(DecoderGraph):
    """Writes Gemma 3's nodes into a ``GraphBuilder`` from the file's tensors and raw blocks
    (``blocks``: each quantized tensor's ``[rows, columns / type block, type bytes]``)."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, FileTensor], blocks: dict[str, np.ndarray]):
        super().__init__(spec, tensors)
        self.blocks = blocks
        self.views, self.view_of_layer = layer_views(spec)

    def linear(self, x: str, names: list[str], stem: str) -> str:
        """``x @ W.T`` with W the file's tensors ``names`` stacked by rows: one MatMulNBits where they share a
        layout, one per tensor concatenated where they do not, fp32 ``MatMul`` for float tensors."""
        g, parts = self.g, [self.tensors[n] for n in names]
        if all(p.kind in NBITS_TYPES for p in parts):
            weights = [nbits_weight(p.kind, self.blocks[n]) for p, n in zip(parts, names)]
            self.formats[stem] = "int4" if all(w.bits == 4 for w in weights) else (
                "int8" if all(w.bits == 8 for w in weights) else MIXED)
            one = stacked(weights)
            if one is not None:
                return nbits_matmul(g, x, one, stem)
            return g.one("Concat", [nbits_matmul(g, x, w, f"{stem}{i}") for i, w in enumerate(weights)], axis=-1)
        self.formats[stem] = "dense"
        values = np.concatenate([p.values() for p in parts])
        return g.one("MatMul", [x, g.constant(f"{stem}_weight", values.T)])

    def embedding_and_head(self, ids: str):
        """The embedding rows of ``ids`` times √hidden ``[T, hidden]``, and a function giving the head's
        (soft-capped) logits of rows."""
        g, embed = self.g, self.tensors["token_embd.weight"]
        tied = "output.weight" not in self.tensors
        if embed.kind in NBITS_TYPES:
            weight = nbits_weight(embed.kind, self.blocks["token_embd.weight"])
            rows, codes, scales = nbits_gather(g, ids, weight, "embedding")
            self.formats["embedding"] = f"int{weight.bits}"

            def tied_head(h: str) -> str:
                return nbits_matmul(g, h, weight, "head", codes_name=codes, scales_name=scales)
        else:
            table = embed.values()
            rows = g.one("Gather", [g.constant("embedding", table), ids], axis=0)
            self.formats["embedding"] = "dense"

            def tied_head(h: str) -> str:
                return g.one("MatMul", [h, g.constant("head_weight", table.T)])
        if tied:
            self.formats["head"] = self.formats["embedding"]
            head = tied_head
        else:
            def head(h: str) -> str:
                return self.linear(h, ["output.weight"], "head")
        # √hidden in fp32, as the torch model multiplies fp32 rows by it
        x = g.one("Mul", [rows, g.constant("embed_scale", np.asarray(self.spec.hidden_size ** 0.5, np.float32))])
        return x, lambda h: self.softcapped(head(h))

    def softcapped(self, logits: str) -> str:
        cap = self.spec.final_logit_softcapping
        if cap is None:
            return logits
        g, c = self.g, self.g.constant("softcap", np.asarray(cap, dtype=np.float32))
        return g.one("Mul", [g.one("Tanh", [g.one("Div", [logits, c])]), c])

    def rope_by_base(self, positions: str) -> list[tuple[str, str]]:
        """(cos, sin) ``[T, 1, d_h/2]`` at ``positions`` for the global base (index 0) and the local one (1),
        computed as the torch model computes them: fp32 ``position · θ^(-2i/d)``."""
        spec, g = self.spec, self.g
        if spec.rope_scaling is not None and spec.rope_scaling.kind != "linear":
            raise OnnxExportUnsupported(f"RoPE scaling {spec.rope_scaling.kind!r} is not in the ONNX graph yet")
        dim = spec.head_dim
        exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
        global_freq = 1.0 / (spec.rope_theta ** exponents)
        if spec.rope_scaling is not None:  # HF and llama.cpp scale the global layers only
            global_freq = global_freq / spec.rope_scaling.factor
        local_freq = 1.0 / ((spec.rope_local_theta or spec.rope_theta) ** exponents)
        where = g.one("Unsqueeze", [g.one("Cast", [positions], to=1), g.constant("axes", np.asarray([1, 2], np.int64))])
        tables = []
        for stem, freq in (("rope_global", global_freq), ("rope_local", local_freq)):
            angles = g.one("Mul", [where, g.constant(stem, freq.astype(np.float32).reshape(1, 1, -1))])
            tables.append((g.one("Cos", [angles]), g.one("Sin", [angles])))
        return tables

    def head_norm(self, x: str, weight: str) -> str:
        """RMSNorm of each head's ``d_h`` values (QK-norm), ``x [T, heads, d_h]``."""
        return self.norm(x, None, weight)[0]

    def attention(self, layer: int, h: str, rope: tuple[str, str], steps: dict) -> str:
        spec, g = self.spec, self.g
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        prefix = f"blk.{layer}"
        group, window = self.views[self.view_of_layer[layer]]
        qkv = self.linear(h, [f"{prefix}.attn_q.weight", f"{prefix}.attn_k.weight", f"{prefix}.attn_v.weight"],
                          f"layer{layer}_qkv")
        q, k, v = g.op("Split", [qkv, g.constant("split", np.asarray([spec.q_size, spec.kv_size, spec.kv_size],
                                                                      dtype=np.int64))], 3, axis=-1)
        q = rotate_halves(g, self.head_norm(g.one("Reshape", [q, g.shape(-1, heads, dim)]),
                                            f"{prefix}.attn_q_norm.weight"), *rope)
        k = rotate_halves(g, self.head_norm(g.one("Reshape", [k, g.shape(-1, kv_heads, dim)]),
                                            f"{prefix}.attn_k_norm.weight"), *rope)
        g.op("Identity", [k], [f"present_key_{layer}"])
        g.op("Reshape", [v, g.shape(-1, kv_heads, dim)], [f"present_value_{layer}"])
        out = self.attend_over_pool(layer, q, slots_input(group, window), bias_input(window), steps["scores5", window],
                                    steps["scores4", window], steps)
        return self.linear(out, [f"{prefix}.attn_output.weight"], f"layer{layer}_o")

    def mlp(self, layer: int, h: str) -> str:
        return self.gated_mlp(layer, h, lambda gate: self.g.one("Gelu", [gate], approximate="tanh"))

    def build(self):
        from onnx import TensorProto, helper

        spec, g = self.spec, self.g
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        windows = sorted({window for _, window in self.views})
        batch, queries = g.one("Shape", ["query_rows"], start=0, end=1), g.one("Shape", ["query_rows"], start=1, end=2)
        minus_one = g.constant("minus_one", np.asarray([-1], dtype=np.int64))

        dims = self.dims
        steps = {"scale": g.constant("scale", np.asarray(spec.attention_scale, dtype=np.float32)),
                 "grouped": dims(batch, kv_heads, minus_one, dim), "heads": dims(batch, heads, queries, dim)}
        for window in windows:
            keys = g.one("Shape", [bias_input(window)], start=4, end=5)
            steps["scores5", window] = dims(batch, kv_heads, heads // kv_heads, queries, keys)
            steps["scores4", window] = dims(batch, kv_heads, minus_one, keys)
        x, head = self.embedding_and_head("input_ids")
        rope = self.rope_by_base("positions")
        delta = None
        for layer in range(spec.num_layers):
            h, x = self.norm(x, delta, f"blk.{layer}.attn_norm.weight")
            attended = self.attention(layer, h, rope[1 if spec.layer_window(layer) else 0], steps)
            h, x = self.norm(x, self.norm(attended, None, f"blk.{layer}.post_attention_norm.weight")[0],
                             f"blk.{layer}.ffn_norm.weight")
            delta = self.norm(self.mlp(layer, h), None, f"blk.{layer}.post_ffw_norm.weight")[0]
        h, _ = self.norm(x, delta, "output_norm.weight")
        g.op("Identity", [head(g.one("Gather", [h, "logits_rows"], axis=0))], ["logits"])

        f32, i64 = TensorProto.FLOAT, TensorProto.INT64
        inputs = [helper.make_tensor_value_info("input_ids", i64, ["T"]),
                  helper.make_tensor_value_info("positions", i64, ["T"]),
                  helper.make_tensor_value_info("query_rows", i64, ["B", "Q"]),
                  *(helper.make_tensor_value_info(slots_input(group, window), i64, ["B", f"P{window}"])
                    for group, window in self.views),
                  *(helper.make_tensor_value_info(bias_input(window), f32, ["B", 1, 1, "Q", f"PQ{window}"])
                    for window in windows),
                  helper.make_tensor_value_info("token_rows", i64, ["T"]),
                  helper.make_tensor_value_info("logits_rows", i64, ["N"])]
        outputs = [helper.make_tensor_value_info("logits", f32, ["N", spec.vocab_size])]
        for layer in range(spec.num_layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_{kind}_{layer}", f32, ["S", kv_heads, dim]))
                outputs.append(helper.make_tensor_value_info(f"present_{kind}_{layer}", f32, ["T", kv_heads, dim]))
        return g.model(spec.name or "gemma3", inputs, outputs)


def quantized_blocks(reader) -> dict[str, np.ndarray]:
    """Each MatMulNBits-mappable tensor's raw blocks ``[rows, columns / type block, type bytes]``."""
    from gguf import GGML_QUANT_SIZES

    blocks = {}
    for t in reader.tensors:
        if t.tensor_type.name in NBITS_TYPES:
            block, size = GGML_QUANT_SIZES[t.tensor_type]
            columns = int(t.shape[0])
            blocks[t.name] = np.asarray(t.data).reshape(-1, columns // block, size)
    return blocks
