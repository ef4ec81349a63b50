"""The ONNX runtime's decode step, and what serving the paged pool costs in it.

One ONNX Runtime session of the default model's graph (``ricllm export-onnx``'s, from the cache),
profiled: decode steps of ``B`` streams, each ``C`` tokens into its sequence, its cached K/V
scattered over the pool's blocks as a busy pool leaves them. The table gives the step's median
time and the share of it spent in the nodes that exist only because the past is paged: the
gathers of each sequence's cached K/V from the pool by block table (``past_gather``) and their
concatenation with the step's new K/V (``kv_concat``); with ``GroupQueryAttention`` over a
contiguous past the same gather would run before the op. The write-back of the new K/V into the
pool (numpy, after the run) is timed apart. ``--threads`` sets ONNX Runtime's intra-op threads
(spinning off, as the runtime runs it).

A second table splits the step's kernel time into the parts profile_decode.py gives for the native
runtime: the layers' 4-bit products (MatMulNBits, with Q4_1's offset products and block sums), the
head (the 8-bit MatMulNBits over the vocabulary), attention (the scores' and values' MatMul, the
Softmax, the bias and the transposes that group query heads on their KV head), the paged-pool
nodes, and the rest (norms, RoPE, SwiGLU, reshapes, the embedding lookup). Where others load the machine, ``--threads 1
--cpu-time`` times the step by this process's CPU time (ONNX Runtime then runs every node on the
calling thread); the parts are shares of the profiled kernel time, which the load scales alike.

    python benchmarks/bench_onnx_step.py [--streams 1 8 32] [--context 256] [--steps 20] [--threads 2] [--cpu-time]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent.parent))  # last: no folder of ours shadows an installed package

from ricllm.engine.runtime.flat_batch import FlatBatch
from ricllm.engine.runtime.onnx_export import load_or_export
from ricllm.engine.runtime.onnx_model import step_inputs
from ricllm.model.loader import resolve_model_path
from ricllm.model.spec import ModelSpec

BLOCK_SIZE = 16
PAGED_NODES = ("past_gather", "kv_concat")
PARTS = ("products", "head", "attention", "paged pool", "rest")


def decode_batch(streams: int, context: int, num_blocks: int, rng: np.random.Generator) -> FlatBatch:
    """``streams`` decodes at position ``context``, each sequence's blocks drawn from the whole pool."""
    width = context // BLOCK_SIZE + 1
    tables = [rng.choice(num_blocks, width, replace=False).tolist() for _ in range(streams)]
    slots = [table[context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE for table in tables]
    return FlatBatch(input_ids=rng.integers(3, 1000, streams).tolist(), positions=[context] * streams,
                     slot_mapping=slots, query_start_loc=list(range(streams + 1)), context_lens=[context + 1] * streams,
                     block_tables=tables, logits_rows=list(range(streams)), max_query_len=1, prefill_rows=0,
                     prefill_products=0)


def node_parts(path: Path, vocab_size: int) -> dict[str, str]:
    """Each node's part of the step (PARTS), from the graph: its op, its name and what it reads."""
    import onnx

    parts = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        n = next((a.i for a in node.attribute if a.name == "N"), None)
        offsets = any(name.endswith("_offsets") or "_offsets_" in name for name in node.input)
        if node.op_type == "MatMulNBits":
            parts[node.name] = "head" if n == vocab_size else "products"
        elif node.name.startswith(PAGED_NODES):
            parts[node.name] = "paged pool"
        elif offsets or node.op_type == "ReduceSum":
            parts[node.name] = "products"  # Q4_1's offsets: block sums, then a small fp32 product
        elif node.op_type in ("MatMul", "Softmax", "Transpose") or "attention_bias" in node.input:
            parts[node.name] = "attention"  # scores, their softmax, the values; the query heads' grouping
        else:
            parts[node.name] = "rest"
    return parts


def measure(path: Path, spec: ModelSpec, streams: int, context: int, steps: int, threads: int,
            cpu_time: bool, parts_of: dict[str, str]) -> dict:
    import onnxruntime as ort

    clock = time.process_time if cpu_time else time.perf_counter

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "profile")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    num_blocks = max(streams * (context // BLOCK_SIZE + 1) * 2, 64)
    pools = {f"past_{kind}_{layer}": np.zeros((num_blocks * BLOCK_SIZE, spec.num_kv_heads, spec.head_dim), np.float32)
             for layer in range(spec.num_layers) for kind in ("key", "value")}
    rng = np.random.default_rng(0)
    step_s, write_s = [], []
    for step in range(steps + 2):
        flat = decode_batch(streams, context, num_blocks, rng)
        start = clock()
        outputs = session.run(None, {**step_inputs(flat, BLOCK_SIZE), **pools})
        middle = clock()
        slots = np.asarray(flat.slot_mapping)
        for name, present in zip([o.name for o in session.get_outputs()][1:], outputs[1:]):
            pools[name.replace("present", "past")][slots] = present
        if step >= 2:  # the first runs allocate
            step_s.append(middle - start)
            write_s.append(clock() - middle)
    events = json.loads(Path(session.end_profiling()).read_text())
    by_node: dict[str, float] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            by_node[event["name"].removesuffix("_kernel_time")] += event["dur"] * 1e-6
    total = sum(by_node.values())
    paged = sum(seconds for name, seconds in by_node.items() if name.startswith(PAGED_NODES))
    by_part = collections.Counter({part: 0.0 for part in PARTS})
    for name, seconds in by_node.items():
        by_part[parts_of.get(name, "rest")] += seconds
    return {"streams": streams, "context": context, "step_ms": statistics.median(step_s) * 1e3,
            "paged_share": paged / total, "write_back_ms": statistics.median(write_s) * 1e3,
            "part_shares": {part: by_part[part] / total for part in PARTS}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or installed model name (default: SmolLM2)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the step and the write-back by this process's CPU time, not the wall clock "
                             "(with --threads 1, the work's own time where others load the machine)")
    args = parser.parse_args()
    path, meta, _ = load_or_export(resolve_model_path(args.model), use_cache=True)
    spec = ModelSpec.from_dict(meta["spec"])
    parts_of = node_parts(path, spec.vocab_size)
    clock = "CPU time" if args.cpu_time else "wall clock"
    print(f"{spec.name}: layers {meta['weight_formats'][0]}, head {meta['weight_formats'][1]}, "
          f"{args.threads} threads, context {args.context}, {clock}")
    rows = [measure(path, spec, streams, args.context, args.steps, args.threads, args.cpu_time, parts_of)
            for streams in args.streams]
    print("| streams | step (ms) | tok/s | paged-pool nodes (gather + concat) | write-back (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['streams']} | {row['step_ms']:.1f} | {row['streams'] / row['step_ms'] * 1e3:.0f} | "
              f"{row['paged_share']:.1%} | {row['write_back_ms']:.2f} |")
    print("\n| streams | " + " | ".join(PARTS) + " |  (shares of the step's kernel time)")
    print("|---:|" + "---:|" * len(PARTS))
    for row in rows:
        print(f"| {row['streams']} | " + " | ".join(f"{row['part_shares'][part]:.1%}" for part in PARTS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
