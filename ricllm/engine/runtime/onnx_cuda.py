"""The ONNX runtime on an NVIDIA GPU: the paged graph (``onnx_paged_attention``) in ONNX Runtime's CUDA
execution provider, with ricllm's pool resident on the GPU (``onnx_runtime`` builds them into a ``Runtime``).

The pool is every layer's K and V as fp16 ``OrtValue``s on the device, ``[num_blocks, block_size, n_kv,
d_h]``: the engine's layout, so its block tables and slot mapping index it as they are. One step is one
``run_with_iobinding``: the step's arrays (``paged_step_inputs``) are bound from host memory, ONNX
Runtime copies them to the GPU (``attention_metadata`` stays on the host, where PagedAttention reads
it), each layer's pool is bound as both its ``*_cache`` input and its ``*_cache_out`` output (the same
device buffer: PagedAttention writes the step's K/V into it, nothing is copied), and only the sampled
rows' logits come back to the host. Numpy and ONNX Runtime only: this module never imports torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ricllm.cache.kv_cache import CacheGeometry, cache_shape
from ricllm.engine.runtime.flat_batch import FlatBatch
from ricllm.engine.runtime.onnx_model import GraphStepRunner
from ricllm.engine.runtime.onnx_paged_attention import CACHE_DTYPE
from ricllm.errors import ConfigError
from ricllm.model.spec import ModelSpec

PROVIDER = "CUDAExecutionProvider"
INSTALL_HINT = ("install ricllm[onnx-gpu] (ONNX Runtime's CUDA build, onnxruntime-gpu, with NVIDIA's CUDA "
                "libraries) in place of ricllm[onnx]: the two install the same module and exclude each other")


def device_index(device: str) -> int:
    """``cuda`` -> 0, ``cuda:N`` -> N."""
    return int(device.partition(":")[2] or 0)


def cuda_provider_problem() -> str | None:
    """Why this process's ONNX Runtime cannot run on a GPU (None: it offers the CUDA provider)."""
    import onnxruntime as ort

    if PROVIDER in ort.get_available_providers():
        return None
    return (f"this ONNX Runtime ({ort.__version__}) has no {PROVIDER} (it offers "
            f"{', '.join(ort.get_available_providers())}): {INSTALL_HINT}")


def paged_step_inputs(flat: FlatBatch) -> dict[str, np.ndarray]:
    """The paged graph's step inputs: sequence ``b`` has ``q_b`` new tokens (rows ``cu[b]:cu[b+1]`` of the
    step) after ``past_b`` cached ones, reads its cache through ``block_table[b]`` and writes its new
    tokens' K/V at ``slot_mapping``; ``attention_metadata`` is (the longest ``q_b``, the longest
    ``past_b + q_b``): PagedAttention sizes its kernels by them instead of reading the lengths back."""
    cumulative = np.asarray(flat.query_start_loc, dtype=np.int32)
    context = np.asarray(flat.context_lens, dtype=np.int32)
    new = np.diff(cumulative)
    return {"input_ids": np.asarray(flat.input_ids, dtype=np.int64),
            "positions": np.asarray(flat.positions, dtype=np.int64),
            "cumulative_sequence_length": cumulative, "past_seqlens": context - new,
            "block_table": np.asarray(flat.block_tables, dtype=np.int32),
            "slot_mapping": np.asarray(flat.slot_mapping, dtype=np.int32),
            "attention_metadata": np.asarray([new.max(), context.max()], dtype=np.int32),
            "logits_rows": np.asarray(flat.logits_rows, dtype=np.int64)}


class OnnxCudaKVCache:
    """The pool on the GPU: ``layers[i] = (k, v)``, fp16 ``OrtValue``s ``[num_blocks, block_size, n_kv,
    d_h]``, zeroed at start (a block's unwritten rows are never read, but zeros keep a masked key finite)."""

    def __init__(self, spec: ModelSpec, geometry: CacheGeometry, device: int):
        import onnxruntime as ort

        shape = cache_shape(spec, geometry)
        zeros = np.zeros(shape, dtype=CACHE_DTYPE)
        self.geometry, self.device = geometry, device
        self.layers = [tuple(ort.OrtValue.ortvalue_from_numpy(zeros, "cuda", device) for _ in range(2))
                       for _ in range(spec.num_layers)]
        self.layer_bytes = zeros.nbytes

    def total_bytes(self) -> int:
        return 2 * len(self.layers) * self.layer_bytes


class OnnxCudaModel:
    """The ONNX Runtime session of the paged graph on ``CUDAExecutionProvider`` (device ``device``)."""

    decoder_stack = None  # the latency model's key: no C decoder stack runs here

    def __init__(self, path: Path, spec: ModelSpec, threads: int, device: int):
        import onnxruntime as ort

        problem = cuda_provider_problem()
        if problem is not None:
            raise ConfigError(f"device 'cuda': {problem}")
        ort.preload_dlls()  # the CUDA and cuDNN libraries of NVIDIA's wheels, which no torch has loaded here
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(str(path), options,
                                                providers=[(PROVIDER, {"device_id": device}), "CPUExecutionProvider"])
        except Exception as exc:  # ONNX Runtime's own error types: no CUDA device, driver or library
            raise ConfigError(f"device 'cuda:{device}': ONNX Runtime could not start the paged graph on "
                              f"{PROVIDER}: {exc}") from exc
        if PROVIDER not in self.session.get_providers():
            raise ConfigError(f"device 'cuda:{device}': ONNX Runtime started without {PROVIDER} "
                              "(no CUDA device, or its libraries did not load)")
        self.spec, self.path, self.threads, self.device = spec, path, threads, device

    def weight_bytes(self) -> int:
        return self.path.stat().st_size


class OnnxCudaModelRunner(GraphStepRunner):
    def __init__(self, model: OnnxCudaModel, kv_cache: OnnxCudaKVCache):
        self.model, self.kv_cache = model, kv_cache
        self.block_size = kv_cache.geometry.block_size

    def compute(self, flat: FlatBatch) -> np.ndarray:
        """One graph run: the logits of the step's rows ``flat.logits_rows``; the step's K/V written into
        the pool, in place, by PagedAttention."""
        if flat.kv_windows is not None:
            raise ConfigError("the ONNX runtime does not serve windowed KV caches yet")
        binding = self.model.session.io_binding()
        binding.bind_output("logits", "cpu")  # the first output bound: get_outputs()[0]
        for name, array in paged_step_inputs(flat).items():
            binding.bind_cpu_input(name, array)
        for layer, pair in enumerate(self.kv_cache.layers):
            for kind, pool in zip(("key", "value"), pair):
                binding.bind_ortvalue_input(f"{kind}_cache_{layer}", pool)
                binding.bind_ortvalue_output(f"{kind}_cache_out_{layer}", pool)
        self.model.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()
