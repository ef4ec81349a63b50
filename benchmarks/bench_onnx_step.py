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

    python benchmarks/bench_onnx_step.py [--streams 1 8 32] [--context 256] [--steps 20] [--threads 2]
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


def decode_batch(streams: int, context: int, num_blocks: int, rng: np.random.Generator) -> FlatBatch:
    """``streams`` decodes at position ``context``, each sequence's blocks drawn from the whole pool."""
    width = context // BLOCK_SIZE + 1
    tables = [rng.choice(num_blocks, width, replace=False).tolist() for _ in range(streams)]
    slots = [table[context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE for table in tables]
    return FlatBatch(input_ids=rng.integers(3, 1000, streams).tolist(), positions=[context] * streams,
                     slot_mapping=slots, query_start_loc=list(range(streams + 1)), context_lens=[context + 1] * streams,
                     block_tables=tables, logits_rows=list(range(streams)), max_query_len=1, prefill_rows=0,
                     prefill_products=0)


def measure(path: Path, spec: ModelSpec, streams: int, context: int, steps: int, threads: int) -> dict:
    import onnxruntime as ort

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
        start = time.perf_counter()
        outputs = session.run(None, {**step_inputs(flat, BLOCK_SIZE), **pools})
        middle = time.perf_counter()
        slots = np.asarray(flat.slot_mapping)
        for name, present in zip([o.name for o in session.get_outputs()][1:], outputs[1:]):
            pools[name.replace("present", "past")][slots] = present
        if step >= 2:  # the first runs allocate
            step_s.append(middle - start)
            write_s.append(time.perf_counter() - middle)
    events = json.loads(Path(session.end_profiling()).read_text())
    by_node: dict[str, float] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            by_node[event["name"].rsplit("_", 3)[0]] += event["dur"] * 1e-6
    total = sum(by_node.values())
    paged = sum(seconds for name, seconds in by_node.items() if name.startswith(PAGED_NODES))
    return {"streams": streams, "context": context, "step_ms": statistics.median(step_s) * 1e3,
            "paged_share": paged / total, "write_back_ms": statistics.median(write_s) * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or installed model name (default: SmolLM2)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path, meta, _ = load_or_export(resolve_model_path(args.model), use_cache=True)
    spec = ModelSpec.from_dict(meta["spec"])
    print(f"{spec.name}: layers {meta['weight_formats'][0]}, head {meta['weight_formats'][1]}, "
          f"{args.threads} threads, context {args.context}")
    print("| streams | step (ms) | tok/s | paged-pool nodes (gather + concat) | write-back (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for streams in args.streams:
        row = measure(path, spec, streams, args.context, args.steps, args.threads)
        print(f"| {streams} | {row['step_ms']:.1f} | {streams / row['step_ms'] * 1e3:.0f} | "
              f"{row['paged_share']:.1%} | {row['write_back_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
