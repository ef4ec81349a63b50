"""One engine configuration, checked once at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ricllm.errors import ConfigError
from ricllm.units import parse_bytes

if TYPE_CHECKING:  # torch is imported only by the torch runtime (the native one runs without it)
    import torch

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # accepted names -> torch's name
RUNTIMES = ("auto", "native", "torch")


@dataclass
class EngineConfig:
    """Sizes in bytes and tokens. ``dtype`` and ``device`` may be ``"auto"``."""

    model: str | None = None
    kv_cache_budget: int | str = "256MiB"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # a step's prefill chunk: bounds the stall of running decodes and
    # the step's activations; on a CPU, 512-token chunks prefill as fast as 2048 (benchmarks/RESULTS.md)
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    weights: str = "auto"  # auto, bf16, int8, int4: weight-only quantized projections on the CPU
    max_packed_rows: int | None = None  # None: packed weights at every batch size, no bf16 copy (least
    # memory; ricllm's AMX/AVX-512 kernels lead bf16 up to ~64 rows); N: a bf16 copy serves steps above N rows
    enable_prefix_caching: bool = True
    weight_cache: bool = True  # keep converted weights on disk ($RICLLM_CACHE_DIR/weights): later starts in seconds
    admission: str = "off"  # off: refuse only what can never fit (raise); deadline: promise deadlines; fcfs: queue all
    safety_margin: float = 0.1  # admission inflates predicted times by this fraction
    max_queue: int = 256  # best-effort requests that may wait
    abort_late: bool = False  # abort a request once its deadline passed (finish_reason "deadline")
    pace_prefill: bool = True  # cap a step's prefill so running deadline decodes keep their per-token pace
    degrade: bool = False  # admit a request that does not fit with max_tokens shrunk to what fits, and say so
    latency_fit: str | None = None  # JSON file of a latency-model fit; None: calibrate (cached on disk)
    tightest_deadline_ms: float = 500.0  # the tightest deadline class: caps are computed for it at start
    tightest_deadline_tokens: int = 16
    seed: int = 0
    threads: int | None = None  # None: len(engine_cpus), else OMP_NUM_THREADS, else the physical cores
    engine_cpus: str | tuple[int, ...] | None = None  # e.g. "0-3": the engine computes only there, and the
    # server keeps its socket, HTTP and ZeroMQ threads on the other CPUs (ricllm.engine.affinity says why)
    runtime: str = "auto"  # native: numpy + ricllm's C kernels, no torch in the process; torch: the torch
    # model; auto: native where it serves the model as configured (ricllm.engine.runtime says why not)

    def __post_init__(self) -> None:
        self.kv_cache_budget = parse_bytes(self.kv_cache_budget)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_packed_rows is not None and (not isinstance(self.max_packed_rows, int) or self.max_packed_rows < 1):
            raise ConfigError(f"max_packed_rows must be an integer >= 1 or None, got {self.max_packed_rows!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose auto, {', '.join(DTYPES)}")
        if self.admission not in ("off", "deadline", "fcfs"):
            raise ConfigError(f"unknown admission policy {self.admission!r}; choose off, deadline or fcfs")
        if not 0 <= self.safety_margin < 10:
            raise ConfigError(f"safety_margin must be in [0, 10), got {self.safety_margin}")
        if self.runtime not in RUNTIMES:
            raise ConfigError(f"unknown runtime {self.runtime!r}; choose one of {', '.join(RUNTIMES)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.engine_cpus is not None:
            from ricllm.engine.affinity import check_engine_cpus

            self.engine_cpus = check_engine_cpus(self.engine_cpus)

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ConfigError(f"unknown device {self.device!r}: {exc}") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for, but torch sees no CUDA GPU")
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """``auto``: bf16 where the hardware has it (CPU with AVX-512 BF16 / AMX, or CUDA), else fp32."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, DTYPES[self.dtype])
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32

    def requested_threads(self) -> int:
        """``threads``, else one per CPU of ``engine_cpus``, else ``OMP_NUM_THREADS``; 0: none asked for."""
        return self.threads or len(self.engine_cpus or ()) or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)

    def apply_threads(self) -> int:
        """Torch intra-op threads: :meth:`requested_threads`, else torch's default."""
        import torch

        threads = self.requested_threads()
        if threads:
            torch.set_num_threads(threads)
        return torch.get_num_threads()
