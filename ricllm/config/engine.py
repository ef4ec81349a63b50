"""The engine's pair: :class:`EngineSettings` (input) and :class:`EngineConfig` (resolved).

- :class:`EngineSettings` declares every engine field, its one default and its rule; its
  ``admission`` section (:class:`AdmissionSettings`) is part of it. The CLI flags
  (:mod:`ricllm.cli.flags`), the serve pair (:mod:`ricllm.config.serve`: these fields plus the
  service's), the descriptor's ``schema.json`` and a scenario's ``engine`` section all derive from
  it: adding a setting is adding a field here.
- :class:`EngineConfig` is what the engine runs with: the same fields, checked once, with the byte
  size parsed and the CPU list resolved on this host. A bad value raises :class:`ConfigError` naming
  the field.

Every field has one default, the engine's own (``admission.policy`` is ``off``, as in ``LLM``); the
server and the scenarios override it in their profiles, in the open (``SERVE_PROFILE``,
``SCENARIO_PROFILE``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, StringConstraints, ValidationError, field_validator, model_validator

from ricllm.affinity import check_engine_cpus
from ricllm.config.fields import ByteSize, CpuList, NonEmpty, StrictModel, describe_errors, setting
from ricllm.errors import ConfigError
from ricllm.units import parse_bytes

if TYPE_CHECKING:  # torch is imported only by the torch runtime (the native one runs without it)
    import torch

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # accepted names -> torch's name
RUNTIMES = ("auto", "native", "torch", "onnx")


class AdmissionSettings(StrictModel):
    """How requests are admitted, and the caps computed at start for the tightest deadline class."""

    policy: Literal["off", "deadline", "edf", "fcfs"] = setting(
        "off", "deadline: admit only what meets its deadline, and keep that promise; edf: queue every request "
        "(at most max_queue waiting), earliest deadline first; fcfs: the same, first come first served; off: "
        "refuse only what can never fit", flag="admission")
    safety_margin: float = setting(0.1, "finish bounds (the fit with its measured errors) are inflated by this "
                                        "fraction before comparing: room for a slowdown's first steps, before "
                                        "the step multipliers see it", ge=0, lt=10)
    max_queue: int = setting(256, "requests that may wait: best-effort ones under the deadline policy, every one "
                                  "under edf and fcfs", ge=0)
    on_late: Literal["finish", "abort", "end_early"] = setting(
        "finish", "a request that cannot meet its deadline: finish (late, counted as missed); abort (once the "
        "deadline has passed, finish_reason 'deadline'); end_early (answer on time with what it has, finish_reason "
        "'deadline', before a step that would end past the deadline)")
    pace_prefill: bool = setting(True, "cap each step's prefill tokens so running deadline requests keep the "
                                       "per-token pace their deadlines need; never at the cost of a promise")
    degrade: bool = setting(False, "admit a request that cannot be served in full with max_tokens shrunk to "
                                   "what fits (the reply says so) instead of rejecting it")
    best_effort_chunk: int = setting(32, "prefill tokens best-effort requests may add to a step while admitted "
                                         "deadline requests are in flight; the bound charges them to every step",
                                     ge=1)
    stall_reserve_steps: int = setting(
        1024, "every finish bound with a busy step also reserves the worst single-step overrun of the prediction "
              "seen over this many recent busy steps (a first step after an idle gap is charged apart, once), so "
              "one stalled step cannot break a promise; 0: no reserve", ge=0)
    stall_reserve_max_ms: float = setting(
        50.0, "the most the stall reserve holds (ms): a longer stall is the machine taken away, which the "
              "step multipliers and the slowdown detector answer, not one slow step", ge=0)
    stall_reserve_share: float = setting(
        0.4, "every finish bound with a busy step reserves at least this share of its mean step, whatever the "
             "stall reserve saw: one step of a request's plan may run that much past its bound (a neighbour's "
             "burst on the host), as large a share of a 400 ms step as of a 20 ms one; 0: none", ge=0)
    tightest_deadline_ms: float = setting(500.0, "the tightest deadline class: the context and batch caps are "
                                                 "computed for it at start (ms)", gt=0)
    tightest_deadline_tokens: int = setting(16, "output tokens of the tightest deadline class", ge=1)

    @model_validator(mode="before")
    @classmethod
    def _read_abort_late(cls, data: Any) -> Any:
        """``abort_late`` (before ``on_late`` existed) still reads: true is ``on_late: abort``."""
        if isinstance(data, dict) and "abort_late" in data:
            data = dict(data)
            abort = data.pop("abort_late")
            if not isinstance(abort, bool):
                raise ValueError(f"abort_late must be true or false (it is now on_late: abort), got {abort!r}")
            if abort and data.setdefault("on_late", "abort") != "abort":
                raise ValueError(f"abort_late: true contradicts on_late: {data['on_late']}; keep on_late only")
        return data


# read afresh at every admission decision or step, so they may change while the engine runs
# (LLMEngine.set_admission_controls); the others shape what was built at start
LIVE_ADMISSION_CONTROLS = ("safety_margin", "max_queue", "on_late", "pace_prefill")


class EngineSettings(StrictModel):
    """Every engine setting, with its one default. Sizes in bytes and tokens."""

    model: NonEmpty | None = setting(
        None, "GGUF file, HF checkpoint folder or an installed model's short name (smollm2-135m, gemma3-270m); "
              "null: the installed SmolLM2-135M-Instruct GGUF")
    served_model_name: NonEmpty | None = setting(
        None, "the name clients call the model by: the OpenAI API's model field and /v1/models, the metrics' "
              "model_name label, the ZeroMQ stats; null: the model file's own name (a GGUF's general.name), else "
              "its file name", metavar="NAME")
    kv_cache_budget: ByteSize = setting(
        "256MiB", "bytes for the whole KV cache: an integer, or a number with a unit (B, KB, MB, GB, TB, KiB, "
                  "MiB, GiB, TiB, K, M, G), e.g. 256MiB")
    block_size: int = setting(16, "tokens per KV block", ge=1, le=1024)
    max_num_seqs: int = setting(64, "most sequences per step", ge=1)
    # 512: a step's prefill chunk bounds the stall of running decodes and the step's activations; on a
    # CPU, 512-token chunks prefill as fast as 2048 (benchmarks/RESULTS.md)
    max_num_batched_tokens: int = setting(512, "token budget per step, prefill chunks included", ge=1)
    max_model_len: Annotated[int, Field(ge=1)] | None = setting(
        None, "cap on prompt + output tokens; null: the model's context")
    dtype: Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"] = setting(
        "auto", "activations and KV cache; auto: bfloat16 on a GPU, and on a CPU with bf16 products (AVX-512 BF16, "
                "AMX) or ricllm's packed-weight kernels (every x86-64-v3 CPU); else float32")
    kv_cache_dtype: Literal["auto", "int8"] = setting(
        "auto", "KV cache element type, one per engine: auto = the activations' (dtype); int8 = one byte per "
                "element plus an fp32 scale per (token, KV head) row, 1.9x the tokens per byte for head_dim 64, "
                "approximate (benchmarks/bench_kv_quality.py measures what it changes)")
    kv_window: Annotated[int, Field(ge=1)] | None = setting(
        None, "keep only the K/V of each request's last kv_window tokens (plus its first kv_sinks): blocks "
              "leaving the window return to the pool and each query sees only those keys; null: exact, every "
              "token kept. A request may set its own (SamplingParams.kv_window, 0: exact)")
    kv_sinks: int = setting(4, "first tokens of each windowed request kept visible (attention sinks); cover a "
                               "pinned template's length to keep it in view", ge=0)
    device: Annotated[str, StringConstraints(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")] = setting(
        "auto", "auto, cpu or cuda[:N]")
    attention_backend: Literal["auto", "torch", "cpu", "triton", "cuda"] = setting(
        "auto", "auto: the C kernel on the CPU, Triton on CUDA; torch: the reference")
    weights: Literal["auto", "bf16", "int8", "int4"] = setting(
        "auto", "weight-only quantized projections on the CPU; auto keeps the file's precision")
    # None: packed weights at every batch size, no bf16 copy (least memory; ricllm's AMX/AVX-512
    # kernels lead bf16 up to ~64 rows)
    max_packed_rows: Annotated[int, Field(ge=1)] | None = setting(
        None, "steps above this many rows use a dense bf16 copy of the weights; null: packed weights always "
              "(least memory)")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of shared prompt prefixes",
                                          flag="prefix-caching")
    weight_cache: bool = setting(True, "reuse converted weights from $RICLLM_CACHE_DIR/weights: later starts "
                                       "in about a second")
    jump_forward: bool = setting(True, "a constrained answer's forced tokens (its JSON keys, quotes and "
                                       "braces) are computed as one chunk in the next step; off: one per step")
    max_loras: int = setting(4, "LoRA adapters the runtime holds at once (its adapter slots): each adds its bytes to "
                                "the weights; 0: no adapters", ge=0)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    latency_fit: NonEmpty | None = setting(
        None, "JSON file of a latency-model fit (LatencyModel.save); null: calibrate at start (cached on disk)",
        metavar="FILE")
    seed: int = setting(0, "engine sampling seed", ge=0)
    threads: Annotated[int, Field(ge=1)] | None = setting(
        None, "CPU threads; null: one per engine_cpus CPU, else OMP_NUM_THREADS, else the physical cores")
    # ricllm.affinity says why the other threads keep off these CPUs
    engine_cpus: CpuList | None = setting(
        None, "CPUs the engine computes on (Linux), as a list or a cpulist such as '0-3,6', counted from 0 "
              "within the CPUs the process may run on (its affinity mask, e.g. a pod's cpuset); the server's "
              "socket, HTTP and ZeroMQ threads then run on the other CPUs. null: unpinned", metavar="LIST")
    pin_threads: bool = setting(
        True, "native runtime: while a step runs, each thread of the C kernels on a CPU of its own, where the "
              "engine's CPUs number its threads (a worker woken after a pause then starts at once; "
              "ricllm.kernels.team); false: the OS scheduler places them")
    runtime: Literal["auto", "native", "torch", "onnx"] = setting(
        "auto", "native: numpy and ricllm's C kernels, no torch in the process; torch: the torch model, every "
                "device and format; onnx: the model as an ONNX graph in ONNX Runtime (the [onnx] extra), no "
                "torch in the process; auto: native where it serves the model, else torch")

    @field_validator("admission", mode="before")
    @classmethod
    def _policy_shorthand(cls, value: Any) -> Any:
        """``admission="deadline"`` stands for ``admission={"policy": "deadline"}``."""
        return {"policy": value} if isinstance(value, str) else value


class EngineConfig(EngineSettings):
    """The settings the engine runs with, checked once: ``EngineConfig(model=..., admission="deadline")``.

    Unlike the files and flags it comes from, it holds resolved values: ``kv_cache_budget`` in bytes,
    ``engine_cpus`` as a sorted tuple of the CPU numbers it names (see ``ricllm.affinity``).
    """

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(describe_errors(exc)) from None

    @model_validator(mode="after")
    def _resolve(self) -> EngineConfig:
        self.kv_cache_budget = parse_bytes(self.kv_cache_budget)
        if self.engine_cpus is not None:
            self.engine_cpus = check_engine_cpus(self.engine_cpus)
        return self

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for, but torch sees no CUDA GPU")
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The torch runtime's activation type; ``auto``: see :meth:`auto_cpu_dtype` on a CPU, bf16 on a GPU."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, DTYPES[self.dtype])
        return getattr(torch, self.auto_cpu_dtype()[0] if device.type == "cpu" else "bfloat16")

    def auto_cpu_dtype(self) -> tuple[str, str]:
        """``(dtype, why)`` that ``dtype="auto"`` takes on this CPU.

        bf16 where the CPU multiplies it in hardware, and also where it does not but ricllm's
        packed-weight kernels serve the weights (every x86-64-v3 CPU): they take bf16 activations
        on every family and do the products themselves, so packed int4/int8 weights stay packed
        (an AVX2 server keeps the file's 4-bit weights instead of dense fp32 ones). Dense weights
        (``weights="bf16"``) on a CPU without bf16 products compute in fp32, torch's fast path there."""
        from ricllm.kernels.cpu_library import cpu_bf16, quant_gemm_available

        has_bf16, why = cpu_bf16()
        if has_bf16:
            return "bfloat16", f"bf16 products in hardware ({why})"
        if self.weights != "bf16" and quant_gemm_available(4) and quant_gemm_available(8):
            return "bfloat16", f"{why}: bf16 is storage, ricllm's packed-weight kernels do the products"
        return "float32", f"{why}, and the weights stay dense" if self.weights == "bf16" else \
            f"{why}, and ricllm's packed-weight kernels do not run here"

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
