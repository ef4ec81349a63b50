"""The ONNX runtime's model, KV pool and runner (``onnx_runtime`` builds them into a ``Runtime``).

One step is one ``session.run`` over the step's flattened tokens: the runner turns the step's block
tables into ``past_slots`` (each sequence's cached tokens' pool rows), its query layout into
``query_rows`` and ``token_rows``, and its causal and padding mask into ``attention_bias``; every
layer's K and V pool is an input read in place (ONNX Runtime wraps a contiguous numpy array of the
input's type without copying it on the CPU). The step's new K/V come back as outputs and are written
into the pool by ``slot_mapping``: ONNX Runtime has no way to write an input, so the write-back is
the runner's, after the run. Numpy and ONNX Runtime only: this module never imports torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pathlib import Path

import numpy as np

from ricllm.cache.kv_cache import CacheGeometry, cache_shape, store_slots
from ricllm.engine.runtime.flat_batch import FlatBatch, flatten
from ricllm.engine.runtime.narrow_head import StepLogits, plan_head, step_logits
from ricllm.engine.runtime.onnx_gemma3 import bias_input, layer_views, slots_input
from ricllm.engine.runtime.onnx_graph import MASKED
from ricllm.engine.scheduler import ScheduledBatch
from ricllm.errors import ConfigError
from ricllm.model.spec import ModelSpec


class OnnxKVCache:
    """The pool as fp32 numpy arrays, ``layers[i] = (k, v)`` each ``[num_blocks, block_size, n_kv, d_h]``
    (the other runtimes' shapes and slot arithmetic), zeroed and resident from the start."""

    def __init__(self, spec: ModelSpec, geometry: CacheGeometry):
        shape = cache_shape(spec, geometry)
        num_slots, slot_of_layer = store_slots(spec, geometry)
        self.geometry = geometry
        self.pool = np.zeros((num_slots, 2, *shape), dtype=np.float32)
        self.pool.reshape(-1)[:: 4096 // 4] = 0  # touch every page now: a node short of memory fails at start
        self.slots = [(self.pool[i, 0], self.pool[i, 1]) for i in range(num_slots)]
        self.layers = [self.slots[slot] for slot in slot_of_layer]

    def total_bytes(self) -> int:
        return self.pool.nbytes


class OnnxModel:
    """The ONNX Runtime session and what its graph was made from."""

    decoder_stack = None  # the latency model's key: no C decoder stack runs here

    def __init__(self, path: Path, spec: ModelSpec, threads: int):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.spec, self.path, self.threads = spec, path, threads
        self.present_names = [f"present_{kind}_{layer}" for layer in range(spec.num_layers)
                              for kind in ("key", "value")]
        # Gemma 3's layers attend through views (cache group, window); a Llama graph through one layout
        self.views, self.view_of_layer = layer_views(spec) if spec.architecture == "gemma3" else (None, None)

    def weight_bytes(self) -> int:
        """The graph file's bytes: its weights, as the file stores them, are nearly all of it."""
        return self.path.stat().st_size


class GraphStepRunner(ABC):
    """One engine step as one graph run (``compute``, in a subclass): this is what the engine asks of it."""

    block_size: int

    def run(self, batch: ScheduledBatch, allowed: list[np.ndarray | None] | None = None
            ) -> tuple[np.ndarray | StepLogits, list[int]]:
        """Logits ``[N, vocab]`` (fp32) for the rows that sample, and those rows' batch indices;
        with ``allowed`` a ``StepLogits`` whose constrained rows are gathered from the whole head."""
        flat = flatten(batch, self.block_size)
        logits = self.compute(flat)
        if allowed is None:
            return logits, flat.logits_rows
        plan = plan_head(allowed, 1, False)  # every row whole: the graph has one head
        by_row = step_logits(plan, allowed, logits, None, lambda matrix, row, columns: matrix[row, columns])
        return by_row, flat.logits_rows

    @abstractmethod
    def compute(self, flat: FlatBatch) -> np.ndarray:
        """The logits of the step's rows ``flat.logits_rows``, the step's K/V written into the pool."""


class OnnxModelRunner(GraphStepRunner):
    def __init__(self, model: OnnxModel, kv_cache: OnnxKVCache):
        self.model, self.kv_cache = model, kv_cache
        self.block_size = kv_cache.geometry.block_size
        rows = kv_cache.geometry.num_blocks * self.block_size
        spec = model.spec
        # each layer's pool as the graph reads it: [slots, n_kv, d_h], views of the pool
        self.pools = {f"past_{kind}_{layer}": array.reshape(rows, spec.num_kv_heads, spec.head_dim)
                      for layer, pair in enumerate(kv_cache.layers) for kind, array in zip(("key", "value"), pair)}

    def compute(self, flat: FlatBatch) -> np.ndarray:
        """One graph run: the logits ``[len(flat.logits_rows), vocab]`` of the step's rows
        ``flat.logits_rows``; the step's K/V written into the pool at ``flat.slot_mapping``."""
        if flat.kv_windows is not None:
            raise ConfigError("the ONNX runtime does not serve windowed KV caches yet")
        model = self.model
        inputs = (step_inputs(flat, self.block_size) if model.views is None
                  else view_step_inputs(flat, self.block_size, model.views))
        outputs = model.session.run(["logits", *model.present_names], {**inputs, **self.pools})
        by_group = [np.asarray(mapping, dtype=np.int64) for mapping in (flat.slot_mapping, *flat.group_slot_mappings)]
        for index, (name, present) in enumerate(zip(model.present_names, outputs[1:])):
            group = 0 if model.views is None else model.views[model.view_of_layer[index // 2]][0]
            self.pools[name.replace("present", "past")][by_group[group]] = present
        return outputs[0]


def step_inputs(flat: FlatBatch, block_size: int) -> dict[str, np.ndarray]:
    """The graph's step inputs: sequence ``b`` has ``q_b`` new tokens after ``p_b`` cached ones,
    laid out as ``B`` rows of ``Q = max q_b`` queries and ``P = max(1, max p_b)`` cached keys."""
    starts = np.asarray(flat.query_start_loc, dtype=np.int64)
    new = np.diff(starts)
    past = np.asarray(flat.context_lens, dtype=np.int64) - new
    batch, queries, keys = len(new), int(new.max()), max(1, int(past.max()))
    query_index = np.arange(queries)
    real_query = query_index[None, :] < new[:, None]  # [B, Q]
    query_rows = np.where(real_query, starts[:-1, None] + query_index[None, :], 0)
    tables = np.asarray(flat.block_tables, dtype=np.int64)
    key_index = np.arange(keys)
    blocks = np.take_along_axis(tables, np.minimum(key_index // block_size, tables.shape[1] - 1)[None, :]
                                .repeat(batch, 0), axis=1)
    real_key = key_index[None, :] < past[:, None]
    past_slots = np.where(real_key, blocks * block_size + key_index % block_size, 0)
    bias = np.full((batch, queries, keys + queries), MASKED, dtype=np.float32)
    bias[:, :, :keys] = np.where(real_key[:, None, :], 0.0, MASKED)
    causal = (query_index[None, :, None] >= query_index[None, None, :]) & real_query[:, None, :]
    bias[:, :, keys:] = np.where(causal, 0.0, MASKED)
    token_rows = (np.repeat(np.arange(batch), new) * queries + np.arange(len(flat.input_ids))
                  - np.repeat(starts[:-1], new))
    return {"input_ids": np.asarray(flat.input_ids, dtype=np.int64),
            "positions": np.asarray(flat.positions, dtype=np.int64),
            "query_rows": query_rows, "past_slots": past_slots, "attention_bias": bias[:, None, None],
            "token_rows": token_rows, "logits_rows": np.asarray(flat.logits_rows, dtype=np.int64)}


def view_step_inputs(flat: FlatBatch, block_size: int, views: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """A Gemma 3 graph's step inputs: ``step_inputs``' query layout, and per view ``(group, window)`` the
    pool rows of the cached keys its queries may see, read through the group's block tables: all ``p_b``
    for a full-attention view (window 0), the last ``window − 1`` for a sliding-window one (the first new
    query at ``p_b`` sees keys ``> p_b − window``); per window the bias that masks padding, the future and
    keys ``window`` or more positions behind a query."""
    starts = np.asarray(flat.query_start_loc, dtype=np.int64)
    new = np.diff(starts)
    past = np.asarray(flat.context_lens, dtype=np.int64) - new
    batch, queries = len(new), int(new.max())
    query_index = np.arange(queries)
    real_query = query_index[None, :] < new[:, None]  # [B, Q]
    inputs = {"input_ids": np.asarray(flat.input_ids, dtype=np.int64),
              "positions": np.asarray(flat.positions, dtype=np.int64),
              "query_rows": np.where(real_query, starts[:-1, None] + query_index[None, :], 0),
              "token_rows": (np.repeat(np.arange(batch), new) * queries + np.arange(len(flat.input_ids))
                             - np.repeat(starts[:-1], new)),
              "logits_rows": np.asarray(flat.logits_rows, dtype=np.int64)}
    tables = [np.asarray(t, dtype=np.int64) for t in (flat.block_tables, *flat.group_block_tables)]
    query_at = past[:, None] + query_index[None, :]  # [B, Q]: each query's position
    for window in sorted({w for _, w in views}):
        first = np.maximum(past - (window - 1), 0) if window else np.zeros_like(past)
        keys = max(1, int((past - first).max()))
        key_at = first[:, None] + np.arange(keys)[None, :]  # [B, P]: each cached key's position
        real_key = key_at < past[:, None]
        sees = real_key[:, None, :] & (key_at[:, None, :] > query_at[:, :, None] - window if window else True)
        behind = query_index[:, None] - query_index[None, :]  # [Q, Q]: query i's distance to new key j
        sees_new = (behind >= 0) & ((behind < window) if window else True) & real_query[:, None, :]
        bias = np.where(np.concatenate([np.broadcast_to(sees, (batch, queries, keys)),
                                        np.broadcast_to(sees_new, (batch, queries, queries))], axis=-1),
                        np.float32(0.0), np.float32(MASKED))
        inputs[bias_input(window)] = bias[:, None, None]
        for group, _ in (v for v in views if v[1] == window):
            table = tables[group]
            blocks = np.take_along_axis(table, np.minimum(key_at // block_size, table.shape[1] - 1), axis=1)
            inputs[slots_input(group, window)] = np.where(real_key, blocks * block_size + key_at % block_size, 0)
    return inputs
