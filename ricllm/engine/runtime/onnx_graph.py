"""What every ONNX graph of a GGUF file is built from: the ``GraphBuilder`` that names nodes and
initializers, the file's tensors (``read_tensors``), its Q4_0, Q4_1 and Q8_0 blocks as ``com.microsoft``
``MatMulNBits`` weights (``matmul_nbits``), and the constants the graphs and runners share. The graphs
themselves are ``onnx_export.LlamaGraph`` and ``onnx_gemma3.Gemma3Graph``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ricllm.model.spec import ModelSpec
from ricllm.version import __version__
OPSET = 23  # RMSNormalization
MS_DOMAIN = "com.microsoft"
BLOCK = 32  # weights per GGUF block of Q4_0, Q4_1 and Q8_0, and MatMulNBits' block_size here
MASKED = -1e30  # the bias of a key a query must not see: finite, so that a padded query row stays a number
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
# the accuracy MatMulNBits computes at on the CPU: 4 quantizes the activations to int8 per block (the
# VNNI path, as ricllm's native kernels), 0 keeps them fp32
ACCURACY_LEVEL = 4


class OnnxExportUnsupported(Exception):
    """The model cannot be written as this graph (the message says why)."""


@dataclass
class GraphBuilder:
    """Nodes and initializers of one graph, named as they are added."""

    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    counter: int = 0

    def name(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}_{self.counter}"

    def constant(self, stem: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.name(stem)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "",
           node: str | None = None, **attributes) -> list[str]:
        """Add a node (named ``node``, numbered; else after its type) and return its outputs' names."""
        from onnx import helper

        names = outputs if isinstance(outputs, list) else [self.name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=self.name(node or op_type), domain=domain,
                                           **attributes))
        return names

    def one(self, op_type: str, inputs: list[str], domain: str = "", node: str | None = None, **attributes) -> str:
        return self.op(op_type, inputs, 1, domain, node, **attributes)[0]

    def shape(self, *dims: int) -> str:
        return self.constant("shape", np.asarray(dims, dtype=np.int64))

    def model(self, name: str, inputs: list, outputs: list):
        """The ``ModelProto``: opset ``OPSET`` and com.microsoft 1, at the IR version ONNX Runtime 1.30 reads."""
        from onnx import helper

        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="ricllm", producer_version=__version__)
        model.ir_version = 10
        return model


# ------------------------------------------------------------------------------ the file's tensors


@dataclass(frozen=True)
class FileTensor:
    """One GGUF tensor: its storage type, its rows (out features) and columns (in), its raw blocks
    ``[rows, columns/32, block bytes]`` for a packed type (else None), and its fp32 values on demand."""

    kind: str
    rows: int
    columns: int
    blocks: np.ndarray | None
    values: Callable[[], np.ndarray]


def read_tensors(reader) -> dict[str, FileTensor]:
    from gguf.quants import dequantize

    tensors = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        shape = [int(n) for n in t.shape]  # GGUF lists the columns first
        columns, rows = shape[0], int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        blocks = np.asarray(t.data).reshape(rows, columns // BLOCK, -1) if kind in PACKED_TYPES else None
        tensors[t.name] = FileTensor(kind, rows, columns, blocks,
                                     functools.partial(_values, t.data, t.tensor_type, rows, columns, dequantize))
    return tensors


def _values(data, tensor_type, rows, columns, dequantize) -> np.ndarray:
    return np.asarray(dequantize(data, tensor_type), dtype=np.float32).reshape(rows, columns)


def rope_row_order(rows: int, num_heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (interleaved RoPE pairs -> halves)."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(rows)


# ------------------------------------------------------------------------------ MatMulNBits weights


def matmul_nbits_weights(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None]:
    """(B ``uint8 [N, k_blocks, blob]``, scales ``fp32 [N·k_blocks]``, bits, Q4_1's block offsets
    ``fp32 [N, k_blocks]`` or None) for MatMulNBits at its default zero point (8 at 4 bits, 128 at 8)
    from GGUF blocks ``[N, k_blocks, bytes]``.

    A Q4_1 block ``d·q + m`` is ``d·(q − 8)`` plus the offset ``m + 8d`` times the sum of the block's
    activations (``matmul_nbits`` adds that term): exact up to fp32 rounding. MatMulNBits' float zero
    point ``−m/d`` would be exact too, but ONNX Runtime's CPU kernels (1.31) then dequantize the whole
    weight on every call, about a hundred times slower than with integer zero points."""
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return np.ascontiguousarray(codes), d.reshape(-1), 8, None
    if kind == "Q4_0":
        return _pack_nibbles(_gguf_nibbles(blocks[..., 2:])), d.reshape(-1), 4, None
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return _pack_nibbles(_gguf_nibbles(blocks[..., 4:])), d.reshape(-1), 4, m + 8 * d


def _gguf_nibbles(qs: np.ndarray) -> np.ndarray:
    """Codes ``[..., 32]``: GGUF's byte j holds code j (low nibble) and code j+16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """MatMulNBits' 4-bit blob: byte i holds code 2i (low nibble) and code 2i+1 (high)."""
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def matmul_nbits(g: GraphBuilder, x: str, kind: str, blocks: np.ndarray, stem: str,
                 accuracy_level: int = ACCURACY_LEVEL, scales_name: str | None = None,
                 weight_name: str | None = None) -> str:
    """``x [T, K] @ W.T`` for W the GGUF blocks ``[N, K/32, bytes]`` of ``kind``: one MatMulNBits node
    (``scales_name``/``weight_name``: initializers already in the graph, shared)."""
    weight, scales, bits, offsets = matmul_nbits_weights(kind, blocks)
    inputs = [weight_name or g.constant(f"{stem}_weight", weight), scales_name or g.constant(f"{stem}_scales", scales)]
    y = g.one("MatMulNBits", [x, *inputs], domain=MS_DOMAIN, K=blocks.shape[1] * BLOCK, N=blocks.shape[0],
              bits=bits, block_size=BLOCK, accuracy_level=accuracy_level)
    if offsets is None:
        return y
    # Q4_1's offsets: Σ_b offset[n, b] · Σ_{k in block b} x[k], one small fp32 product [T, k_blocks] @ [k_blocks, N]
    block_sums = g.one("ReduceSum", [g.one("Reshape", [x, g.shape(0, blocks.shape[1], BLOCK)]),
                                     g.constant("axes", np.asarray([-1], dtype=np.int64))], keepdims=0)
    return g.one("Add", [y, g.one("MatMul", [block_sums, g.constant(f"{stem}_offsets", offsets.T)])])


# ------------------------------------------------------------------------------ shared nodes


def rotate_halves(g: GraphBuilder, x: str, cos: str, sin: str) -> str:
    """RoPE on ``x [T, heads, d_h]``: halves (a, b) -> (a·cos − b·sin, b·cos + a·sin)."""
    a, b = g.op("Split", [x], 2, axis=-1, num_outputs=2)
    first = g.one("Sub", [g.one("Mul", [a, cos]), g.one("Mul", [b, sin])])
    second = g.one("Add", [g.one("Mul", [b, cos]), g.one("Mul", [a, sin])])
    return g.one("Concat", [first, second], axis=-1)


def rms_norm(g: GraphBuilder, x: str, delta: str | None, gamma: np.ndarray, eps: float) -> tuple[str, str]:
    """(RMSNorm of ``x + delta`` times ``gamma``, ``x + delta``); ``delta`` None: of ``x``."""
    weight = g.constant("norm_weight", gamma.reshape(-1))
    if delta is None:
        return g.one("RMSNormalization", [x, weight], axis=-1, epsilon=eps), x
    normed, _, _, total = g.op("SkipSimplifiedLayerNormalization", [delta, x, weight], 4, domain=MS_DOMAIN,
                               epsilon=eps)
    return normed, total


class DecoderGraph:
    """What every architecture's graph is built of besides its attention: the file's tensors written into one
    ``GraphBuilder``, its RMSNorm and its gated MLP. A subclass gives ``linear`` and ``build``."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, FileTensor]):
        self.spec, self.tensors, self.g = spec, tensors, GraphBuilder()
        self.formats: dict[str, str] = {}

    def norm(self, x: str, delta: str | None, weight: str) -> tuple[str, str]:
        """(RMSNorm of ``x + delta``, ``x + delta``); ``delta`` None: of ``x``."""
        return rms_norm(self.g, x, delta, self.tensors[weight].values(), self.spec.rms_norm_eps)

    def gated_mlp(self, layer: int, h: str, activation: Callable[[str], str]) -> str:
        """``down(activation(gate(h)) · up(h))``, gate and up one product."""
        g, inter = self.g, self.spec.intermediate_size
        gate_up = self.linear(h, [f"blk.{layer}.ffn_gate.weight", f"blk.{layer}.ffn_up.weight"],
                              f"layer{layer}_gate_up")
        gate, up = g.op("Split", [gate_up, g.constant("split", np.asarray([inter, inter], dtype=np.int64))], 2, axis=-1)
        return self.linear(g.one("Mul", [activation(gate), up]), [f"blk.{layer}.ffn_down.weight"], f"layer{layer}_down")

    def dims(self, *parts: str | int) -> str:
        """A shape ``[parts]`` for ``Reshape``: node outputs (1-element int64) and numbers, concatenated."""
        g = self.g
        return g.one("Concat", [p if isinstance(p, str) else g.constant("dim", np.asarray([p], dtype=np.int64))
                                for p in parts], axis=0)

    def attend_over_pool(self, layer: int, q: str, past_slots: str, bias: str, scores5: str, scores4: str,
                         steps: dict) -> str:
        """The step's queries ``q [T, heads, d_h]`` against each sequence's cached K/V, gathered from the pool by
        ``past_slots``, and the step's own (``present_*_{layer}``), masked by ``bias``: ``[rows, heads·d_h]`` for
        the step's ``token_rows``. The nodes named ``past_gather`` and ``kv_concat`` are what serving the paged
        pool costs over a contiguous past (benchmarks/bench_onnx_step.py measures them)."""
        g, heads, dim = self.g, self.spec.num_heads, self.spec.head_dim
        keys, values = (g.one("Concat", [g.one("Gather", [f"past_{kind}_{layer}", past_slots], axis=0,
                                               node="past_gather"),
                                         g.one("Gather", [f"present_{kind}_{layer}", "query_rows"], axis=0)],
                              axis=1, node="kv_concat")
                        for kind in ("key", "value"))  # [B, P+Q, n_kv, d_h]
        queries = g.one("Gather", [g.one("Mul", [q, steps["scale"]]), "query_rows"], axis=0)  # [B, Q, heads, d_h]
        # [B, n_kv, group·Q, d_h]: query head j·group + i attends with KV head j
        queries = g.one("Reshape", [g.one("Transpose", [queries], perm=[0, 2, 1, 3]), steps["grouped"]])
        scores = g.one("MatMul", [queries, g.one("Transpose", [keys], perm=[0, 2, 3, 1])])
        scores = g.one("Add", [g.one("Reshape", [scores, scores5]), bias])
        probs = g.one("Reshape", [g.one("Softmax", [scores], axis=-1), scores4])
        out = g.one("MatMul", [probs, g.one("Transpose", [values], perm=[0, 2, 1, 3])])  # [B, n_kv, group·Q, d_h]
        out = g.one("Transpose", [g.one("Reshape", [out, steps["heads"]])], perm=[0, 2, 1, 3])  # [B, Q, heads, d_h]
        return g.one("Gather", [g.one("Reshape", [out, g.shape(-1, heads * dim)]), "token_rows"], axis=0)
