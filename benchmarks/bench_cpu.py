"""The CPU benchmark: ricllm (int4, int8, bf16 weights; native, torch and ONNX runtimes) vs llama.cpp vs HF transformers.

One run, peers side by side, on the same GGUF (default: the installed SmolLM2-135M-Instruct
Q4_1) and the same prompts, 2 threads everywhere (ricllm threads=2, llama.cpp
n_threads=2, OMP_NUM_THREADS=2 in every child). Each engine configuration runs in its own
subprocess, which prints one JSON line; this process collects them and prints the tables.

Every configuration runs --repeats times (default 3), interleaved: repeat 1 of every
configuration, then repeat 2 with the order rotated by one, and so on, so a slow minute of a
shared machine lands on different configurations. Tables show the median [min–max] of the
repeats; a ratio (ricllm / llama.cpp) is the median [min–max] of the per-repeat ratios.

Measured, for every engine:
  1. one stream: a 256-token prompt, 128 new tokens, greedy, EOS ignored: decode tok/s, the
     median of 5 such generations (another prompt each): one takes about half a second, short
     enough that a shared VM's noise (±15 % between runs in one process) would decide a single one
     (--multi-stream-trials N does the same with N generations at 8 or more streams);
  2. aggregate decode tok/s at 8, 16 and 32 streams (each stream its own 256-token prompt,
     128 new tokens). Decode tok/s = streams * (new - 1) / (total - time to the last stream's
     first token): ricllm from one generate() (its TTFTs); HF from two generate() calls (1 and
     128 new tokens); llama.cpp from its own loop: one batch prefills every stream, then each
     step decodes one token of every stream in one llama_decode (one seq_id per stream, as
     llama-batched-bench does), argmax over the logits; ORT GenAI from one Generator over the
     batch (its first token: append_tokens, the prefill, then the first generate_next_token);
  3. prompt throughput: tokens/s prefilling one 512-token prompt and sampling its first token
     (median of 3 different prompts);
  4. time to ready: wall time from starting a fresh process to a model ready to generate.
     ricllm twice per format: first start (RICLLM_CACHE_DIR is an empty temporary folder, so it
     converts the GGUF and writes the weight cache) and second start (reads that cache);
  5. peak RSS: VmHWM of the measuring child (its own peak), in MB (10^6 bytes). Not ru_maxrss:
     Linux carries the forking parent's peak into a child's ru_maxrss across exec, so every
     child would read at least this script's own peak (it imports torch);
  6. the bandwidth roofline: this process sweeps 1 GiB read-only in 2 threads (numpy
     reductions over two halves, best of 5) for the machine's read bandwidth B. One-stream
     decode cannot beat B / (weight bytes read per token + KV bytes per context token * the
     mean decode context); the table gives each configuration's fraction of that bound. Each
     child counts its own weight bytes (ricllm: as its latency roofline does; llama.cpp: the
     model's tensor bytes; HF: its parameters; ORT GenAI: its graph's initializers but the RoPE
     tables), the embedding table only where it is the head.

ricllm: LLM(model, dtype="bfloat16", weights=W, kv_cache_budget="256MiB", runtime=R). On a Q4_1
file weights="int4" resolves to int4 layers + int8 head, which is what "auto" gives; with the
native runtime (no torch in the process) it is what LLM() runs by default here (labelled).
auto:onnx is LLM(model, dtype="float32", runtime="onnx"): the GGUF as an ONNX graph in ONNX
Runtime (MatMulNBits on the file's 4- and 8-bit blocks, an fp32 KV pool: half the tokens per byte,
so its budget is twice, 512MiB: the same tokens as the others' 256MiB).
--ortgenai adds ONNX Runtime GenAI as a peer (benchmarks/ortgenai_peer.py): the same GGUF unpacked
by transformers into an fp32 HF folder, built by ORT GenAI's model builder into an int4 CPU model
with its CPU recipe (RTN int4, block 32, accuracy level 4), both once into $RICLLM_CACHE_DIR/ortgenai/;
its Generator takes the streams as one batch, greedy, its decoder session at THREADS intra-op
threads. A second table divides every other ricllm configuration and ORT GenAI by the default.
--no-amx, --avx2-only and --ricllm-env set the ricllm children's environment (--no-amx: the C kernels
without AMX, and torch's MKL and oneDNN capped below AMX: what an AMD EPYC Zen 4 runs; --avx2-only:
what an AVX2-only CPU runs; see cpu_caps.py); each
child reports the kernel family it ran. llama.cpp keeps its own build (its system info line says
whether AMX_INT8 is on), so against it a --no-amx ratio is conservative.
llama.cpp runs under this interpreter (llama-cpp-python from `bash scripts/setup.sh --bench`;
--llamacpp-python picks another), twice: flash attention off and on; ricllm is compared with
the better of the two per measurement.
--avx2-like-for-like measures an AVX2-only CPU on a machine with AVX-512: the ricllm children as
with --avx2-only (HF's torch held to AVX2 too), and beside the native llama.cpp build a second one
held to AVX2 (its CMake options: native detection off, AVX2/FMA/F16C/BMI2 on, every AVX-512 and AMX
option off; the version constraints.txt locks), built once from source into
$RICLLM_CACHE_DIR/llamacpp-avx2-VERSION (--llamacpp-avx2-python names one built elsewhere). The
ratios and targets are against the AVX2 build; the native build runs as a reference. The notes
give both builds' system info lines and CMake flags.
Prompts are fixed-seed random token ids in [100, vocab - 100), identical for every engine.
The summary, ratios and the decode targets (PASS/FAIL) are appended to benchmarks/RESULTS.md.

    python benchmarks/bench_cpu.py                      # full run (an hour or more on 2 cores)
    python benchmarks/bench_cpu.py --quick --repeats 1  # smoke test: tiny sizes, prints only
    python benchmarks/bench_cpu.py [--configs int4:native int4:torch int8:native bf16:torch] [--repeats N]
        [--no-amx] [--ricllm-env KEY=VALUE ...] [--skip-hf] [--skip-llamacpp] [--no-publish]
    python benchmarks/bench_cpu.py --avx2-like-for-like   # the avx2 family against an AVX2-only llama.cpp
    python benchmarks/bench_cpu.py --configs int4:native auto:onnx --ortgenai   # both ONNX Runtime paths
    python benchmarks/bench_cpu.py --tree main=../main-tree --tree branch=. --skip-hf --skip-llamacpp
        # two revisions of ricllm side by side, interleaved, under this script's one harness

This file is also the children's program (``--child measure|ready``, spec as JSON on stdin):
its module level imports only the standard library, so any python with llama-cpp-python runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

try:  # stdlib only, as this module
    from benchmarks.cpu_caps import AVX2_ONLY, WITHOUT_AMX
    from benchmarks.ortgenai_peer import Peer, prepare as prepare_ortgenai
except ImportError:  # run as a script (the children too): this folder is the first sys.path entry
    from cpu_caps import AVX2_ONLY, WITHOUT_AMX
    from ortgenai_peer import Peer, prepare as prepare_ortgenai

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
THREADS = 2
KV_BUDGET = "256MiB"
ONNX_KV_BUDGET = "512MiB"  # the ONNX runtime's pool is fp32: the tokens KV_BUDGET buys the others at bf16
RESULT_MARK, READY_MARK = "BENCH_RESULT ", "BENCH_READY "
FULL = {"prompt_len": 256, "new_tokens": 128, "streams": [1, 8, 16, 32], "prefill_len": 512, "prefill_repeats": 3,
        "single_stream_trials": 5}
QUICK = {"prompt_len": 32, "new_tokens": 8, "streams": [1, 4], "prefill_len": 32, "prefill_repeats": 1,
         "single_stream_trials": 1}
# the targets for ricllm's default (int4 native); ratios are ratios of medians
TARGETS = {"decode_1_vs_llama": 2.0, "decode_1_roofline": 0.80, "decode_32_vs_llama": 3.0, "native_vs_torch": 1.0,
           "prompt_vs_llama": 3.0, "peak_rss_mb": 480.0, "ready_cached_s": 0.44}
CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
SETUP_HINT = "bash scripts/setup.sh --bench"
# llama.cpp held to AVX2 (x86-64-v3), what it compiles for an AVX2-only CPU: ggml's CMake options, native
# detection off and every AVX-512 and AMX path off (a machine with AVX-512 would otherwise build them in)
AVX2_LLAMACPP_CMAKE = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
                       "-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF "
                       "-DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
TORCH_AVX2 = {k: v for k, v in AVX2_ONLY.items() if not k.startswith("RICLLM_")}  # torch's own kernels at AVX2


def progress(message: str) -> None:
    print(f"[bench_cpu] {message}", file=sys.stderr, flush=True)


def kv_budget(runtime: str) -> str:
    """The KV budget of a ricllm configuration: the same tokens for every runtime."""
    return ONNX_KV_BUDGET if runtime == "onnx" else KV_BUDGET


def peak_rss_mb() -> float:
    """This process's own peak RSS in MB (10^6 bytes): VmHWM, in KiB."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024 / 1e6
    except (OSError, StopIteration):  # not Linux: ru_maxrss (which may include the parent's, see above)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


# ================================================================== engines (run in the children)

class RicllmEngine:
    """ricllm's offline API with one weight format."""

    def __init__(self, spec: dict):
        from ricllm import LLM, SamplingParams  # no torch import here: the native runtime runs without it

        self.params = SamplingParams
        onnx = spec["runtime"] == "onnx"  # ONNX Runtime computes in fp32, on the file's own weight formats
        self.llm = LLM(spec["model"], dtype="float32" if onnx else "bfloat16",
                       weights="auto" if onnx else spec["weights"], kv_cache_budget=kv_budget(spec["runtime"]),
                       threads=THREADS,
                       runtime=spec["runtime"])
        assert self.llm.engine.runtime.name == spec["runtime"], self.llm.engine.runtime.why
        self.preemptions: dict[int, int] = {}

    def describe(self) -> dict:
        engine = self.llm.engine
        return {"formats": list(engine.runtime.weight_formats), "weights_from": engine.runtime.weights_source,
                "preemptions": self.preemptions, "torch_imported": "torch" in sys.modules}

    def facts(self) -> dict:
        """Read after the measurements: the roofline's bytes as ricllm's own latency roofline counts
        them (its bandwidth copy is not used), and the kernels that ran: ricllm's family under this
        child's env, or ONNX Runtime's."""
        from ricllm.kernels.cpu_library import kernel_family

        from ricllm.engine.calibration import roofline_of

        roofline = roofline_of(self.llm.engine)
        facts = {"weight_bytes": roofline.weight_bytes, "kv_bytes_per_token": roofline.kv_bytes_per_token}
        if self.llm.engine.runtime.name != "onnx":
            return dict(facts, kernel_family=kernel_family())
        import onnxruntime  # the runtime has loaded it: its kernels run the model, not ricllm's

        return dict(facts, kernel_family=f"ONNX Runtime {onnxruntime.__version__}'s CPU kernels")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        before = self.llm.kv_cache_stats()["preemptions"]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, self.params(max_tokens=new_tokens, temperature=0, ignore_eos=True))
        total = time.perf_counter() - start
        assert all(len(o.token_ids) == new_tokens for o in outs)
        self.preemptions[len(prompts)] = self.llm.kv_cache_stats()["preemptions"] - before
        self.first_tokens = outs[0].token_ids
        return max(o.ttft_s for o in outs), total

    def prefill(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.llm.generate([prompt], self.params(max_tokens=1, temperature=0, ignore_eos=True))
        return time.perf_counter() - start


class HFEngine:
    """HF transformers, bf16, loading the same GGUF (dequantized)."""

    def __init__(self, spec: dict):
        import torch

        torch.set_num_threads(THREADS)
        from transformers import AutoModelForCausalLM

        self.torch = torch
        model = Path(spec["model"])
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model.parent), gguf_file=model.name, dtype=torch.bfloat16).eval()

    def describe(self) -> dict:
        import transformers

        return {"version": transformers.__version__}

    def facts(self) -> dict:
        """Every parameter once (a tied head is the embedding); an untied embedding is only looked up."""
        model, config = self.model, self.model.config
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        embedding = model.get_input_embeddings().weight
        if embedding is not model.get_output_embeddings().weight:
            weights -= embedding.numel() * embedding.element_size()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * embedding.element_size()
        return {"weight_bytes": weights, "kv_bytes_per_token": kv_per_token}

    def _generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = self.torch.tensor(prompts)
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.model.config.eos_token_id)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + new_tokens
        self.first_tokens = out[0, ids.shape[1]:].tolist()
        return elapsed

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        first = self._generate(prompts, 1)
        return first, self._generate(prompts, new_tokens)

    def prefill(self, prompt: list[int]) -> float:
        return self._generate([prompt], 1)


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python's low-level API: every stream in one llama_decode per step."""

    def __init__(self, spec: dict):
        import llama_cpp
        from llama_cpp._logger import set_verbose

        set_verbose(False)
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.extra_buffers = spec.get("extra_buffers", True)
        self.model = llama_cpp.llama_model_load_from_file(spec["model"].encode(), self._model_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {spec['model']}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_batch = 512
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        streams = max(spec["streams"])
        self.flash_attn = bool(spec["flash_attn"])
        self.decode_ctx = self._context(streams, spec["prompt_len"] + spec["new_tokens"])
        self.context_params = {"n_ctx": self.lib.llama_n_ctx(self.decode_ctx), "n_seq_max": streams,
                               "n_batch": self.n_batch}
        self.prefill_ctx = None
        self.prefill_len = spec["prefill_len"]

    def _model_params(self):
        """llama.cpp's defaults; ``use_extra_bufts`` (its AMX and repacked-weight buffers) off only
        where the parent's probe saw that path crash."""
        params = self.lib.llama_model_default_params()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = self.extra_buffers
        return params

    def _context(self, n_seq_max: int, tokens_per_seq: int):
        """A context with its own KV stream per sequence, each rounded up to 256 cells as llama.cpp does."""
        params = self.lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_seq_max * -(-tokens_per_seq // 256) * 256, n_seq_max
        params.n_batch, params.n_ubatch = self.n_batch, self.n_batch
        params.n_threads = params.n_threads_batch = THREADS
        params.kv_unified = False  # one KV stream per sequence, as llama-batched-bench by default
        set_flash_attention(self.lib, params, self.flash_attn)
        params.no_perf = True
        ctx = self.lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx {params.n_ctx}, n_seq_max {n_seq_max})")
        return ctx

    def describe(self) -> dict:
        return {"version": self.lib.__version__, "context": self.context_params, "flash_attn": self.flash_attn,
                "extra_buffers": self.extra_buffers}

    def facts(self) -> dict:
        """The build (CPU features, CMake flags) and the roofline's bytes: every tensor of the model
        (SmolLM2 ties its head to token_embd, so that is read whole each step) and an f16 K and V."""
        lib, model = self.lib, self.model
        head_dim = lib.llama_model_n_embd(model) // lib.llama_model_n_head(model)
        kv_per_token = 2 * 2 * lib.llama_model_n_layer(model) * lib.llama_model_n_head_kv(model) * head_dim
        return {"weight_bytes": lib.llama_model_size(model), "kv_bytes_per_token": kv_per_token,
                "system_info": lib.llama_print_system_info().decode().strip(),
                "build_flags": llamacpp_build_flags(Path(lib.__file__).parent)}

    def _decode(self, ctx, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Run (token, position, seq_id, wants_logits) entries; argmax of every requested row."""
        import numpy as np

        chosen = []
        for begin in range(0, len(entries), self.n_batch):
            chunk = entries[begin:begin + self.n_batch]
            self._fill_batch(chunk)
            if self.lib.llama_decode(ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            rows = sum(1 for *_, wants in chunk if wants)
            if rows:
                logits = np.ctypeslib.as_array(self.lib.llama_get_logits(ctx), shape=(rows, self.n_vocab))
                chosen += logits.argmax(axis=1).tolist()
        return chosen

    def _fill_batch(self, chunk: list[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        for i, (token, position, seq, wants) in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = seq, wants
        batch.n_tokens = len(chunk)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        ctx = self.decode_ctx
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)
        start = time.perf_counter()
        tokens = self._decode(ctx, [(t, pos, seq, pos == len(p) - 1)
                                    for seq, p in enumerate(prompts) for pos, t in enumerate(p)])
        first, self.first_tokens = time.perf_counter() - start, [tokens[0]]
        for step in range(1, new_tokens):
            tokens = self._decode(ctx, [(t, len(prompts[seq]) + step - 1, seq, True) for seq, t in enumerate(tokens)])
            self.first_tokens.append(tokens[0])
        return first, time.perf_counter() - start

    def prefill(self, prompt: list[int]) -> float:
        if self.prefill_ctx is None:
            self.prefill_ctx = self._context(1, self.prefill_len + 1)
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.prefill_ctx), True)
        start = time.perf_counter()
        self._decode(self.prefill_ctx, [(t, pos, 0, pos == len(prompt) - 1) for pos, t in enumerate(prompt)])
        return time.perf_counter() - start


def set_flash_attention(lib, params, on: bool) -> None:
    """llama-cpp-python since 0.3.16 takes an enum ``flash_attn_type`` (its default is auto), older
    ones a bool ``flash_attn``: either way, set it explicitly."""
    if hasattr(params, "flash_attn_type"):
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if on else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    else:
        params.flash_attn = on


GGML_SETTINGS = ("GGML_VERSION", "GGML_BUILD_COMMIT", "GGML_NATIVE", "GGML_CPU_ALL_VARIANTS", "GGML_BACKEND_DL",
                 "GGML_OPENMP", "GGML_LLAMAFILE", "GGML_CPU_REPACK", "GGML_BLAS")
GGML_ISA_PREFIXES = ("GGML_AVX", "GGML_AMX", "GGML_F16C", "GGML_FMA", "GGML_BMI2")  # forced on when not native


def ggml_settings(config_text: str) -> dict[str, str]:
    """Every ``set(GGML_NAME "value")`` of ggml's installed CMake config (it expands its cache)."""
    settings = {}
    for line in config_text.splitlines():
        name, _, value = line.strip().removeprefix("set(").removesuffix(")").partition(" ")
        if line.strip().startswith("set(GGML_") and value.startswith('"'):
            settings[name] = value.strip('"')
    return settings


def llamacpp_build_flags(package: Path) -> str | None:
    """The CMake settings that decide llama.cpp's CPU code (native build, ISA flags forced on,
    OpenMP, llamafile kernels, repacking), from the ggml config llama-cpp-python installs beside
    its package; None where there is none."""
    for config in (package.parent / "lib/cmake/ggml/ggml-config.cmake", package / "lib/cmake/ggml/ggml-config.cmake"):
        if config.is_file():
            settings = ggml_settings(config.read_text())
            kept = [f"{k}={settings[k]}" for k in GGML_SETTINGS if k in settings]
            forced = [f"{k}=ON" for k, v in settings.items() if k.startswith(GGML_ISA_PREFIXES) and v == "ON"]
            return " ".join(kept + (forced or ["(no ISA flag forced on)"]))
    return None


class OrtGenAIEngine:
    """ONNX Runtime GenAI's Generator on the int4 model its builder wrote from the same GGUF
    (ortgenai_peer.py): the streams as one batch, every decode step one run for all of them."""

    def __init__(self, spec: dict):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(spec["ortgenai_model"])
        config.clear_providers()  # the CPU execution provider, ORT GenAI's default
        config.overlay(json.dumps(ORTGENAI_SESSION))
        self.model = og.Model(config)
        self.build = spec["ortgenai_build"]

    def describe(self) -> dict:
        return {"version": self.og.__version__, "device": self.model.device_type,
                "onnxruntime": Path(os.environ.get("ORT_LIB_PATH", "unknown")).name}

    def facts(self) -> dict:
        """The roofline's bytes as the peer's build counted them (its initializers, an fp32 K and V)."""
        return {"weight_bytes": self.build["weight_bytes"], "kv_bytes_per_token": self.build["kv_bytes_per_token"]}

    def _generator(self, prompts: list[list[int]], new_tokens: int):
        """A greedy generator for these prompts, its cache sized to prompt + new tokens (ORT GenAI
        allocates batch × max_length up front); EOS cannot end a stream before max_length."""
        assert len({len(p) for p in prompts}) == 1, "ORT GenAI's batch takes prompts of one length"
        params = self.og.GeneratorParams(self.model)
        length = len(prompts[0]) + new_tokens
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(prompts))
        return self.og.Generator(self.model, params)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        import numpy as np

        generator = self._generator(prompts, new_tokens)
        start = time.perf_counter()
        generator.append_tokens(np.array(prompts, dtype=np.int32))  # the prefill
        generator.generate_next_token()  # picks every stream's first token from the prefill's logits
        first = time.perf_counter() - start
        while not generator.is_done():
            generator.generate_next_token()  # one decode run for the batch, then the pick
        total = time.perf_counter() - start
        prompt_len = len(prompts[0])
        assert all(len(generator.get_sequence(i)) == prompt_len + new_tokens for i in range(len(prompts)))
        self.first_tokens = generator.get_sequence(0)[prompt_len:].tolist()
        return first, total

    def prefill(self, prompt: list[int]) -> float:
        return self.generate([prompt], 1)[0]


# ORT GenAI's decoder session: intra-op threads as every engine here; its other settings are its own
# (the CPU execution provider, spinning workers)
ORTGENAI_SESSION = {"model": {"decoder": {"session_options": {"intra_op_num_threads": THREADS,
                                                              "inter_op_num_threads": 1}}}}

ENGINES = {"ricllm": RicllmEngine, "hf": HFEngine, "llamacpp": LlamaCppEngine, "ortgenai": OrtGenAIEngine}


def measure(spec: dict) -> dict:
    """Every measurement of one configuration, in this process."""
    engine = ENGINES[spec["engine"]](spec)
    engine.generate(spec["warmup"], 4)  # warm-up, not measured
    new, decode = spec["new_tokens"], {}
    for streams, trials in spec["decode_prompts"].items():
        rates = []
        for prompts in trials:
            first, total = engine.generate(prompts, new)
            rates.append(int(streams) * (new - 1) / max(total - first, 1e-9))
            progress(f"{spec['label']}: {streams} stream(s): {rates[-1]:.1f} decode tok/s "
                     f"(prefill {first:.2f} s, total {total:.2f} s; stream 0 starts {engine.first_tokens[:4]})")
        decode[streams] = statistics.median(rates)
    prompt_tps = statistics.median(len(p) / engine.prefill(p) for p in spec["prefill_prompts"])
    progress(f"{spec['label']}: prompt {spec['prefill_len']} tokens: {prompt_tps:.0f} tok/s")
    peak = peak_rss_mb()  # before facts(), which may allocate (ricllm's roofline copies 256 MB)
    described = engine.describe()  # before facts(): whether the serving path imported torch
    return dict(decode_tps=decode, prompt_tps=prompt_tps, peak_rss_mb=peak, **described, **engine.facts())


def child_main(mode: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    spec = json.loads(sys.stdin.read())
    if mode == "ready":
        engine = ENGINES[spec["engine"]](spec)
        print(READY_MARK + json.dumps(dict(engine.describe(), rss_at_ready_mb=peak_rss_mb())), flush=True)
    elif mode == "probe":  # one short prefill and decode: does this engine's build run here at all?
        ENGINES[spec["engine"]](spec).generate(spec["warmup"], 2)
        print(RESULT_MARK + json.dumps({}), flush=True)
    else:
        print(RESULT_MARK + json.dumps(measure(spec)), flush=True)


# ================================================================== the parent: run children

def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Fixed-seed token ids away from both ends of the vocabulary (special tokens sit at the start)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def workload_spec(model: Path, vocab: int, sizes: dict) -> dict:
    """Everything a measuring child needs besides its engine: sizes and the shared prompts."""
    def trials(streams: int) -> list[list[list[int]]]:
        count = sizes["single_stream_trials"] if streams == 1 else sizes.get("multi_stream_trials", 1)
        return [random_prompts(streams, sizes["prompt_len"], vocab, seed=1000 + streams + 100 * t) for t in range(count)]

    decode = {str(s): trials(s) for s in sizes["streams"]}
    return dict(model=str(model), **sizes, warmup=random_prompts(1, 16, vocab, seed=999), decode_prompts=decode,
                prefill_prompts=random_prompts(sizes["prefill_repeats"], sizes["prefill_len"], vocab, seed=2000))


@dataclass
class Config:
    """One engine configuration: what its children run, under which interpreter and extra env."""

    label: str
    engine: str  # a key of ENGINES
    python: str
    spec: dict = field(default_factory=dict)  # added to the workload spec
    env: dict = field(default_factory=dict)  # added to its children's environment


def child_env(extra: dict, cache_dir: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), PYTHONUNBUFFERED="1",
               TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error", **extra)
    if cache_dir is not None:
        env["RICLLM_CACHE_DIR"] = cache_dir
    return env


def run_child(python: str, mode: str, spec: dict, env: dict) -> tuple[float, dict | None]:
    """Start ``python bench_cpu.py --child MODE``; (seconds until its marked line, that line's JSON)."""
    mark = READY_MARK if mode == "ready" else RESULT_MARK
    start = time.perf_counter()
    proc = subprocess.Popen([python, str(THIS), "--child", mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True, cwd=ROOT)
    proc.stdin.write(json.dumps(spec))
    proc.stdin.close()
    elapsed, payload = 0.0, None
    for line in proc.stdout:
        if line.startswith(mark) and payload is None:
            elapsed, payload = time.perf_counter() - start, json.loads(line[len(mark):])
    if proc.wait() != 0 or payload is None:
        progress(f"{spec['label']}: child ({mode}) failed with exit status {proc.returncode}; see its stderr above")
        return elapsed, None
    return elapsed, payload


def time_to_ready(python: str, spec: dict, env: dict, which: str) -> tuple[float | None, float | None]:
    """(seconds from process start to a loaded model, peak RSS in MB at that point)."""
    slim = {k: v for k, v in spec.items() if not k.endswith("prompts") and k != "warmup"}
    elapsed, info = run_child(python, "ready", slim, env)
    if info is None:
        return None, None
    progress(f"{spec['label']}: ready ({which}) in {elapsed:.2f} s, RSS {info['rss_at_ready_mb']:.0f} MB "
             f"{info.get('weights_from', '')}")
    return elapsed, info["rss_at_ready_mb"]


def flatten(result: dict) -> dict:
    """One repeat's numbers under flat keys (``decode_8``, ``prompt_tps``, ...), facts kept."""
    flat = {k: v for k, v in result.items() if k != "decode_tps"}
    flat.update({f"decode_{streams}": tps for streams, tps in result["decode_tps"].items()})
    return flat


def run_once(config: Config, base: dict) -> dict | None:
    """One repeat of one configuration: time to ready (twice for ricllm: converting into an empty
    cache, then from that cache), then the measurements; None if a child failed."""
    spec = dict(base, **config.spec, engine=config.engine, label=config.label)
    with tempfile.TemporaryDirectory(prefix="ricllm-bench-cache-") as cache_dir:
        env = child_env(config.env, cache_dir if config.engine == "ricllm" else None)
        ready = dict(zip(("ready_s", "rss_first_start_mb"), time_to_ready(config.python, spec, env, "first start")))
        ready["rss_at_ready_mb"] = ready["rss_first_start_mb"]
        if config.engine == "ricllm":
            ready.update(zip(("ready_cached_s", "rss_at_ready_mb"),
                             time_to_ready(config.python, spec, env, "weight cache")))
        _, result = run_child(config.python, "measure", spec, env)
    if result is None:
        return None
    progress(f"{config.label}: peak RSS {result['peak_rss_mb']:.0f} MB")
    return dict(ready, **flatten(result))


def interleaved_order(configs: int, repeats: int) -> list[tuple[int, int]]:
    """(repeat, configuration index) in run order: every configuration once per repeat, each
    repeat's order rotated by one, so no configuration always runs first (or right after another)."""
    return [(repeat, (repeat + i) % configs) for repeat in range(repeats) for i in range(configs)]


def llamacpp_problem(python: str) -> str | None:
    """Why llama.cpp cannot run under ``python`` (with how to fix it), or None."""
    try:
        check = subprocess.run([python, "-c", "import llama_cpp"], check=False, capture_output=True, text=True)
        reason = (check.stderr.strip().splitlines() or [""])[-1] if check.returncode else None
    except OSError as error:
        reason = str(error)
    if reason is None:
        return None
    return (f"`import llama_cpp` fails under {python} ({reason}); install llama-cpp-python with "
            f"`{SETUP_HINT}` (or pass --llamacpp-python)")


def llamacpp_extra_buffers_run(python: str, base: dict) -> bool:
    """Whether llama.cpp decodes with its extra buffer types (AMX tiles, repacked weights) on: a
    native build of llama-cpp-python 0.3.36 on an AMX Xeon crashes in ggml_backend_amx_mul_mat on
    the first prefill (SIGSEGV), so a short probe child tries them before the measured runs."""
    spec = dict(base, engine="llamacpp", label="llama.cpp probe (extra buffers on)", flash_attn=False,
                extra_buffers=True, streams=[1], decode_prompts={}, prefill_prompts=[])
    _, result = run_child(python, "probe", spec, child_env({}))
    if result is None:
        progress("llama.cpp crashed with its extra buffer types (AMX / repacked weights) on: it runs without them")
    return result is not None


def locked_version(distribution: str) -> str:
    """The version constraints.txt locks for ``distribution`` (what `setup.sh --bench` installs)."""
    pin = f"{distribution.replace('-', '_')}=="
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.replace("-", "_").lower().startswith(pin):
            return line.split("==", 1)[1].strip()
    raise SystemExit(f"bench_cpu: constraints.txt locks no version of {distribution}")


def avx2_llamacpp_python(folder: Path) -> tuple[str, str | None]:
    """The interpreter of a venv in ``folder`` with llama-cpp-python (the locked version) compiled
    from source with AVX2_LLAMACPP_CMAKE, built there on first use (several minutes on 2 cores);
    (its python, why it cannot run llama.cpp or None)."""
    python = folder / "bin" / "python"
    if python.is_file() and llamacpp_problem(str(python)) is None:
        return str(python), None
    version = locked_version("llama-cpp-python")
    progress(f"building llama-cpp-python {version} held to AVX2 into {folder} (once; several minutes)")
    env = dict(os.environ, CMAKE_ARGS=AVX2_LLAMACPP_CMAKE, CMAKE_BUILD_PARALLEL_LEVEL=str(THREADS))
    steps = [[sys.executable, "-m", "venv", str(folder)], [str(python), "-m", "pip", "install", "--quiet", "numpy"],
             [str(python), "-m", "pip", "install", "--quiet", "--no-binary", "llama-cpp-python",
              f"llama-cpp-python=={version}"]]
    for step in steps:
        if subprocess.run(step, env=env, check=False).returncode != 0:
            return str(python), f"building the AVX2 llama.cpp failed at `{' '.join(step)}` (its output is above)"
    return str(python), llamacpp_problem(str(python))


def model_facts(model: Path) -> tuple[int, tuple[str, str]]:
    """(vocabulary size, what weights="auto" resolves to on this file), from its metadata."""
    from ricllm.model.formats import resolve_formats
    from ricllm.model.loader import open_checkpoint

    checkpoint = open_checkpoint(model)
    return checkpoint.spec.vocab_size, resolve_formats("auto", checkpoint.tensor_types(), packable=True)


def configurations(args, llamacpp_ok: bool, extra_buffers: bool = True,
                   avx2_peer: tuple[str, bool] | None = None, ortgenai: Peer | None = None) -> list[Config]:
    """ricllm's configurations (with the --no-amx / --avx2-only / --ricllm-env environment), then the
    peers. ``avx2_peer``: the AVX2 llama.cpp's (interpreter, extra buffers on), which the ratios are
    against; the native build is then a reference only. ``ortgenai``: ORT GenAI's packages and model."""
    avx2 = args.avx2_only or args.avx2_like_for_like
    ricllm_env = {**args.ricllm_env, **(WITHOUT_AMX if args.no_amx else {}), **(AVX2_ONLY if avx2 else {})}
    trees = args.tree or [None]
    configs = [Config(f"ricllm {weights} {runtime}" + (f" [{tree[0]}]" if tree else ""), "ricllm", sys.executable,
                      {"weights": weights, "runtime": runtime},
                      {**ricllm_env, **({"PYTHONPATH": tree[1]} if tree else {})})
               for weights, runtime in (c.split(":") for c in args.configs) for tree in trees]
    build = "native build, " if avx2_peer else ""
    if llamacpp_ok:
        configs += [Config(f"llama.cpp, {build}flash attention {'on' if on else 'off'}", "llamacpp",
                           args.llamacpp_python, {"flash_attn": on, "extra_buffers": extra_buffers,
                                                  "compared": avx2_peer is None}) for on in (False, True)]
    if avx2_peer:
        configs += [Config(f"llama.cpp, AVX2 build, flash attention {'on' if on else 'off'}", "llamacpp", avx2_peer[0],
                           {"flash_attn": on, "extra_buffers": avx2_peer[1], "compared": True}) for on in (False, True)]
    if ortgenai:
        configs.append(Config(ORTGENAI_LABEL, "ortgenai", ortgenai.python,
                              {"ortgenai_model": str(ortgenai.model_dir), "ortgenai_build": ortgenai.build},
                              ortgenai.env))
    if not args.skip_hf:
        configs.append(Config("HF transformers bf16", "hf", sys.executable, env=TORCH_AVX2 if avx2 else {}))
    return configs


ORTGENAI_LABEL = "ORT GenAI int4 (RTN, block 32, accuracy level 4)"


def compared_peers(series: list["Series"]) -> list["Series"]:
    """The llama.cpp configurations ricllm's ratios and targets are against (with a second, AVX2
    build: that one's)."""
    return [s for s in series if s.config.engine == "llamacpp" and s.config.spec.get("compared", True)]


def run_all(configs: list[Config], base: dict, repeats: int) -> dict[str, list[dict | None]]:
    """Every configuration ``repeats`` times, interleaved; per label, one entry per repeat."""
    runs: dict[str, list[dict | None]] = {c.label: [None] * repeats for c in configs}
    for repeat, index in interleaved_order(len(configs), repeats):
        config = configs[index]
        progress(f"repeat {repeat + 1} of {repeats}: {config.label}")
        runs[config.label][repeat] = run_once(config, base)
    return runs


def read_bandwidth(gib: int = 1, threads: int = THREADS, tries: int = 5) -> float:
    """Bytes/s of a read-only sweep over ``gib`` GiB, split in ``threads`` parts each summed by its
    own thread (numpy's reductions release the GIL); the best of ``tries``. The pages are written
    once before, so the sweep reads resident memory."""
    import numpy as np

    data = np.ones((gib << 30) // 8, dtype=np.int64)
    parts = np.array_split(data, threads)
    best = float("inf")
    for _ in range(tries):
        workers = [threading.Thread(target=np.add.reduce, args=(part,)) for part in parts]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


# ================================================================== summary (pure functions)

@dataclass(frozen=True)
class Stat:
    """The median and range of one measurement over the repeats that produced it."""

    median: float
    low: float
    high: float
    count: int


def stat(values: list[float | None]) -> Stat | None:
    """Median [min–max] of the values present (a failed repeat is None); None if there are none."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return Stat(statistics.median(present), min(present), max(present), len(present))


def per_repeat_ratios(ours: list[float | None], theirs: list[float | None]) -> list[float]:
    """ours[i] / theirs[i] for every repeat i where both were measured."""
    return [a / b for a, b in zip(ours, theirs, strict=True) if a is not None and b]


def ratio_of_medians(ours: Stat | None, theirs: Stat | None) -> float | None:
    return None if ours is None or theirs is None or not theirs.median else ours.median / theirs.median


def scaled(value: Stat | None, factor: float) -> Stat | None:
    if value is None:
        return None
    return Stat(value.median * factor, value.low * factor, value.high * factor, value.count)


def mean_decode_context(prompt_len: int, new_tokens: int) -> float:
    """Mean tokens attended over by the decode steps behind decode tok/s: step i (1 ≤ i < new) reads
    the prompt and i generated tokens, so the mean is prompt + new / 2."""
    return prompt_len + new_tokens / 2


def roofline_tps(bandwidth: float, weight_bytes: float, kv_bytes_per_token: float, context: float) -> float:
    """The one-stream decode bound: each token reads every weight once and the KV of its context."""
    return bandwidth / (weight_bytes + kv_bytes_per_token * context)


@dataclass
class Series:
    """One configuration's runs, one entry per repeat (None: a child of that repeat failed)."""

    config: Config
    runs: list[dict | None]
    label: str = ""

    def __post_init__(self):
        self.label = self.label or self.config.label

    def values(self, key: str) -> list[float | None]:
        return [None if run is None else run.get(key) for run in self.runs]

    def stat(self, key: str) -> Stat | None:
        return stat(self.values(key))

    def fact(self, key: str):
        """What every repeat reports alike (formats, weight bytes, versions): the first present."""
        return next((run[key] for run in self.runs if run is not None and key in run), None)


def roofline_fraction(series: Series, bandwidth: float, sizes: dict) -> Stat | None:
    """One-stream decode tok/s over this configuration's roofline (its own weight and KV bytes)."""
    weight_bytes, kv_per_token = series.fact("weight_bytes"), series.fact("kv_bytes_per_token")
    if weight_bytes is None or kv_per_token is None:
        return None
    context = mean_decode_context(sizes["prompt_len"], sizes["new_tokens"])
    return scaled(series.stat("decode_1"), 1 / roofline_tps(bandwidth, weight_bytes, kv_per_token, context))


def better_peer(peers: list[Series], key: str) -> Series | None:
    """The peer configuration with the higher median for this (higher-is-better) measurement."""
    measured = [p for p in peers if p.stat(key) is not None]
    return max(measured, key=lambda p: p.stat(key).median, default=None)


def ratio_stat(ours: Series, peer: Series | None, key: str) -> Stat | None:
    """The median [min–max] of the per-repeat ratios ours / peer for one measurement."""
    return None if peer is None else stat(per_repeat_ratios(ours.values(key), peer.values(key)))


# ================================================================== verdicts (pure functions)

@dataclass(frozen=True)
class Check:
    """One of the targets: ``value`` against ``target`` (at least, or at most)."""

    name: str
    value: float | None
    target: float
    at_least: bool
    unit: str  # "×", "%" (value a fraction), " MB" or " s"
    detail: str = ""

    @property
    def passed(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.target if self.at_least else self.value <= self.target


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    if unit == "%":
        return f"{100 * value:.0f}%"
    return f"{value:{'.0f' if unit == ' MB' else '.2f'}}{unit}"


def check_line(check: Check) -> str:
    """``- name: value (target ≥ x; detail): PASS|FAIL|not measured``."""
    verdict = {None: "not measured", True: "PASS", False: "FAIL"}[check.passed]
    target = f"target {'≥' if check.at_least else '≤'} {fmt_value(check.target, check.unit)}"
    detail = f"; {check.detail}" if check.detail else ""
    return f"- {check.name}: {fmt_value(check.value, check.unit)} ({target}{detail}): {verdict}"


def vs_peer_check(name: str, ours: Series, peers: list[Series], key: str, target: float) -> Check:
    peer = better_peer(peers, key)
    value = ratio_of_medians(ours.stat(key), peer and peer.stat(key))
    missing = "llama.cpp not measured" if not peers else "not measured at this size in this run"
    return Check(name, value, target, True, "×", f"vs {peer.label}" if peer else missing)


def native_vs_torch_check(ours: Series, twin: Series | None, streams: list[int]) -> Check:
    """The native runtime against the torch runtime on the same formats: the worst stream count."""
    ratios = {s: ratio_of_medians(ours.stat(f"decode_{s}"), twin and twin.stat(f"decode_{s}")) for s in streams}
    present = {s: r for s, r in ratios.items() if r is not None}
    worst = min(present.values()) if len(present) == len(ratios) else None
    detail = ", ".join(f"{s}: {r:.2f}×" for s, r in present.items()) or "the torch runtime was not measured"
    return Check("decode, native ≥ torch runtime at every stream count (worst)", worst,
                 TARGETS["native_vs_torch"], True, "×", detail)


def issue_checks(ours: Series, twin: Series | None, peers: list[Series], bandwidth: float, sizes: dict) -> list[Check]:
    """Issue 21's targets for ricllm's default configuration, as ratios of medians."""
    fraction = roofline_fraction(ours, bandwidth, sizes)
    rss, ready = ours.stat("peak_rss_mb"), ours.stat("ready_cached_s")
    return [
        vs_peer_check("decode, 1 stream vs llama.cpp", ours, peers, "decode_1", TARGETS["decode_1_vs_llama"]),
        Check("decode, 1 stream: fraction of the roofline", fraction and fraction.median,
              TARGETS["decode_1_roofline"], True, "%", f"{bandwidth / 1e9:.1f} GB/s read"),
        vs_peer_check("decode, 32 streams vs llama.cpp", ours, peers, "decode_32", TARGETS["decode_32_vs_llama"]),
        native_vs_torch_check(ours, twin, sizes["streams"]),
        vs_peer_check(f"prompt ({sizes['prefill_len']} tokens) vs llama.cpp", ours, peers, "prompt_tps",
                      TARGETS["prompt_vs_llama"]),
        Check("peak RSS, whole run", rss and rss.median, TARGETS["peak_rss_mb"], False, " MB"),
        Check("time to ready from the weight cache", ready and ready.median, TARGETS["ready_cached_s"], False, " s")]


# ================================================================== report

def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def fmt_stat(value: Stat | None, spec: str = ".1f", suffix: str = "") -> str:
    """``median [min–max]`` (the range left out when one repeat produced it)."""
    if value is None:
        return "–"
    text = f"{value.median:{spec}}{suffix}"
    return text if value.count == 1 else f"{text} [{value.low:{spec}}–{value.high:{spec}}]"


def label_series(configs: list[Config], runs: dict[str, list[dict | None]],
                 auto_formats: tuple[str, str]) -> list[Series]:
    """Series in configuration order; a ricllm label names the formats it ran and the default."""
    series = [Series(c, runs[c.label]) for c in configs]
    for s in series:
        formats = s.fact("formats")
        if s.config.engine == "ricllm" and formats:
            default = tuple(formats) == tuple(auto_formats) and s.config.spec["runtime"] == "native"
            s.label += f" ({formats[0]} layers, {formats[1]} head{'; the default' if default else ''})"
            s.config.spec["is_default"] = default
    return series


def side_by_side(series: list[Series], sizes: dict, bandwidth: float) -> str:
    lines = ["| measurement | " + " | ".join(s.label for s in series) + " |", "|---|" + "---:|" * len(series)]

    def add(name: str, cells: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    for n in sizes["streams"]:
        add("decode, 1 stream (tok/s)" if n == 1 else f"decode, {n} streams aggregate (tok/s)",
            [fmt_stat(s.stat(f"decode_{n}")) for s in series])
    add("decode, 1 stream: % of roofline", [fmt_stat(scaled(roofline_fraction(s, bandwidth, sizes), 100), ".0f", "%")
                                             for s in series])
    add(f"prompt, {sizes['prefill_len']}-token prefill (tok/s)",
        [fmt_stat(s.stat("prompt_tps"), ".0f") for s in series])
    for key, name, spec in (("ready_s", "time to ready, first start (s)", ".2f"),
                            ("ready_cached_s", "time to ready, from weight cache (s)", ".2f"),
                            ("rss_first_start_mb", "peak RSS to ready, first start (MB; ricllm: converting)", ".0f"),
                            ("rss_at_ready_mb", "RSS when ready (MB; ricllm: from weight cache)", ".0f"),
                            ("peak_rss_mb", "peak RSS, whole run (MB)", ".0f")):
        add(name, [fmt_stat(s.stat(key), spec) for s in series])
    add("weight bytes read per token (MB)", [fmt(s.fact("weight_bytes") and s.fact("weight_bytes") / 1e6, ".1f")
                                             for s in series])
    return "\n".join(lines)


def ratio_table(ours: list[Series], peers: list[Series], sizes: dict) -> str:
    """Per measurement: ricllm / the better llama.cpp configuration, median [min–max] of the per-repeat ratios."""
    if not peers or not ours:
        return "No ratios: llama.cpp was not measured."
    lines = ["| ricllm / llama.cpp | " + " | ".join(s.label for s in ours) + " | llama.cpp reference |",
             "|---|" + "---:|" * len(ours) + "---|"]
    keys = [(f"decode_{n}", f"decode, {n} stream{'s' if n > 1 else ''}") for n in sizes["streams"]]
    for key, name in keys + [("prompt_tps", f"prompt ({sizes['prefill_len']} tokens)")]:
        peer = better_peer(peers, key)
        cells = [fmt_stat(ratio_stat(s, peer, key), ".2f", "×") for s in ours]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {peer.label if peer else '–'} |")
    return "\n".join(lines)


def native_ratio_table(series: list[Series], sizes: dict) -> str | None:
    """Per measurement: every other ricllm configuration and ORT GenAI / ricllm's default (int4
    native), median [min–max] of the per-repeat ratios; None without the default or anything to compare."""
    default = next((s for s in series if s.config.spec.get("is_default")), None)
    others = [s for s in series if s is not default and s.config.engine in ("ricllm", "ortgenai")]
    if default is None or not others:
        return None
    lines = ["| / " + default.label + " | " + " | ".join(s.label for s in others) + " |",
             "|---|" + "---:|" * len(others)]
    keys = [(f"decode_{n}", f"decode, {n} stream{'s' if n > 1 else ''}") for n in sizes["streams"]]
    for key, name in keys + [("prompt_tps", f"prompt ({sizes['prefill_len']} tokens)")]:
        cells = [fmt_stat(ratio_stat(s, default, key), ".2f", "×") for s in others]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_lines(series: list[Series], bandwidth: float, sizes: dict) -> str:
    """Issue 21's targets against the default-format ricllm configuration (int4 native)."""
    ours = next((s for s in series if s.config.spec.get("is_default")), None)
    if ours is None:
        return "Targets: not checked (the default configuration, int4 native on a Q4_1 file, was not run)."
    twin = next((s for s in series if s.config.engine == "ricllm" and s.config.spec["runtime"] == "torch"
                 and s.config.spec["weights"] == ours.config.spec["weights"]), None)
    peers = compared_peers(series)
    lines = [f"Targets ({ours.label}, {KV_BUDGET} KV; ratios of medians):"]
    return "\n".join(lines + [check_line(c) for c in issue_checks(ours, twin, peers, bandwidth, sizes)])


def cpu_flags() -> str:
    """The CPU flags that decide which kernels run (ricllm's families, llama.cpp's paths)."""
    try:
        flags = next(line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown (no /proc/cpuinfo)"
    return " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + " ".join(CPU_FLAGS)


def series_notes(s: Series) -> list[str]:
    lines = []
    preempted = [{n: c for n, c in (run.get("preemptions") or {}).items() if c} for run in s.runs if run]
    if any(preempted):
        lines.append(f"{s.label}: KV preemptions per repeat (streams: count) {preempted} under the "
                     f"{kv_budget(s.config.spec['runtime'])} budget.")
    failed = sum(run is None for run in s.runs)
    if failed:
        lines.append(f"{s.label}: {failed} of {len(s.runs)} repeats failed (their children's stderr is above).")
    if s.config.engine == "ricllm":
        env = " ".join(f"{k}={v}" for k, v in s.config.env.items()) or "none"
        lines.append(f"{s.label}: kernels: {s.fact('kernel_family')} (extra env: {env}); torch "
                     f"{'was' if s.fact('torch_imported') else 'was not'} imported by the serving process.")
    if s.config.engine == "ortgenai":
        lines += ortgenai_notes(s)
    if s.config.engine == "hf":
        lines.append(f"HF: transformers {s.fact('version')}, `generate` with min_new_tokens; its TTFT is a separate "
                     f"1-token `generate`.")
    return lines


def ortgenai_notes(s: Series) -> list[str]:
    """What ORT GenAI ran (versions, provider, session, builder) and where it is not like for like."""
    build = s.config.spec["ortgenai_build"]
    session = ORTGENAI_SESSION["model"]["decoder"]["session_options"]
    hf_folder = (f"the HF folder {build['hf_folder_s']} s" if build["hf_folder_s"] is not None else
                 "the HF folder of an earlier build")
    return [(f"ORT GenAI: onnxruntime-genai {s.fact('version')} on ONNX Runtime {s.fact('onnxruntime')} "
             f"({s.fact('device')} execution provider), under {s.config.python}"
             f"{' with ' + s.config.env['PYTHONPATH'] if 'PYTHONPATH' in s.config.env else ''}; decoder session "
             f"options {json.dumps(session)} set through og.Config.overlay, the rest ORT GenAI's defaults "
             f"(spinning workers); ONNX Runtime picks its own kernels for this CPU, whatever --no-amx or "
             f"--avx2-only set for ricllm."),
            (f"ORT GenAI's model: `{build['builder']}` (onnxruntime-genai {build['versions']['onnxruntime-genai']}, "
             f"onnx-ir {build['versions']['onnx-ir']}) on an fp32 HF folder that transformers {build['transformers']} "
             f"unpacked from {build['gguf']} (benchmarks/ortgenai_peer.py; built once: {hf_folder}, then the "
             f"builder {build['builder_s']} s; not in the table, whose time to ready loads the built folder)."),
            ("ORT GenAI is not like for like in: its weights, the GGUF's Q4_1 unpacked and quantized again "
             "(symmetric int4, blocks of 32, fp32 scales; the head int4 over codes shared with the embedding, "
             "where ricllm's head is int8); its KV, fp32 (GroupQueryAttention over each stream's contiguous past, "
             "allocated for batch × (prompt + new tokens) when a generator starts); and its batch, static: every "
             "stream prefilled in one run, then one run per step for all of them. Its first token is "
             "append_tokens (the prefill) plus the first generate_next_token.")]


def llamacpp_notes(peers: list[Series], problems: list[str]) -> list[str]:
    """Each peer build (one per interpreter): version, the CPU features it was built with, its CMake flags."""
    notes = [f"llama.cpp was not measured: {problem}." for problem in problems]
    builds = {}
    for peer in peers:
        builds.setdefault(peer.config.python, peer)
    for peer in builds.values():
        name = "llama.cpp" + (", AVX2 build" if "AVX2 build" in peer.label else
                              ", native build" if "native build" in peer.label else "")
        flags = peer.fact("build_flags") or "not recorded in the installed package: pip's defaults, GGML_NATIVE on"
        role = "ricllm compared with the better per measurement" if peer.config.spec.get("compared", True) else \
            "a reference only: the ratios are against the AVX2 build"
        notes += [(f"{name}: llama-cpp-python {peer.fact('version')} under {peer.config.python}, decode context "
                   f"{peer.fact('context')} (llama.cpp rounds each sequence's KV up to a multiple of 256 cells), one "
                   f"KV stream per sequence, f16 KV; flash attention off and on, {role}."),
                  f"{name} system info: {peer.fact('system_info')}", f"{name} CMake flags: {flags}",
                  f"{name} extra buffer types (AMX tiles, repacked weights): " + (
                      "on (its default)" if peer.fact("extra_buffers") else
                      "OFF: a probe decode crashed with them on, so it ran its AVX-512/AVX2 path "
                      "(use_extra_bufts=false); ricllm without AMX (--no-amx) is the like-for-like comparison")]
    return notes


def roofline_note(bandwidth: float, sizes: dict) -> str:
    context = mean_decode_context(sizes["prompt_len"], sizes["new_tokens"])
    return (f"Roofline: {bandwidth / 1e9:.1f} GB/s read (1 GiB swept read-only by {THREADS} threads, best of 5); "
            f"one-stream bound = bandwidth / (weight bytes + KV bytes per token × {context:g} tokens, the mean "
            f"decode context). Weight bytes, counted by each child: ricllm as its latency roofline does "
            f"(ricllm.engine.calibration.roofline_of: packed projections with their scales, not the 8-bit "
            f"offsets one-row products recompute; norms, the head; the embedding only where it is the head), "
            f"llama.cpp llama_model_size (every tensor; "
            f"the tied head is token_embd), HF its parameters once each (bf16), ORT GenAI its graph's "
            f"initializers but the RoPE tables (the int4 head's codes are also its embedding).")


def report(series: list[Series], sizes: dict, model: Path, bandwidth: float, problems: list[str], failed: list[str],
           append: bool, ortgenai_problem: str | None = None) -> None:
    from benchmarks.results import publish

    ours = [s for s in series if s.config.engine == "ricllm"]
    peers = compared_peers(series)
    every_peer = [s for s in series if s.config.engine == "llamacpp"]
    notes = [n for s in series for n in series_notes(s)] + llamacpp_notes(every_peer, problems) + (
        [f"ORT GenAI was not measured: {ortgenai_problem}."] if ortgenai_problem else []) + [
        f"{label}: no repeat produced results (its children's errors are in the log)." for label in failed]
    tables = [side_by_side(series, sizes, bandwidth), ratio_table(ours, peers, sizes),
              native_ratio_table(series, sizes)]
    body = "\n\n".join([t for t in tables if t] + [target_lines(series, bandwidth, sizes),
                                                   roofline_note(bandwidth, sizes), "\n".join(notes)])
    repeats = max(len(s.runs) for s in series)
    families = sorted({f"{s.fact('kernel_family')}" for s in ours if s.config.spec["runtime"] != "onnx"}) or [
        "not run"]
    details = (f"CPU flags: {cpu_flags()}. ricllm kernel family: {'; '.join(families)}. "
               f"Model: {model.name}. {sizes['prompt_len']}-token prompts, "
               f"{sizes['new_tokens']} new tokens, greedy, EOS ignored, decode tok/s the median of "
               f"{sizes['single_stream_trials']} generations at one stream and of "
               f"{sizes.get('multi_stream_trials', 1)} at more; prompt throughput: one "
               f"{sizes['prefill_len']}-token prompt (median of {sizes['prefill_repeats']}); ricllm KV budget "
               f"{KV_BUDGET} ({ONNX_KV_BUDGET} for the ONNX runtime's fp32 pool: the same tokens); each "
               f"configuration in its own process, {repeats} repeat{'s' if repeats > 1 else ''} interleaved: median "
               f"[min–max]; ratios: median [min–max] of the per-repeat ratios.")
    publish("CPU benchmark: ricllm vs llama.cpp vs HF", details, body, append=append)


def env_pair(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` for --ricllm-env (argparse reports a malformed one as a usage error)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def source_tree(text: str) -> tuple[str, str]:
    """``NAME=PATH`` for --tree: PATH must be a checkout with ricllm/ in it."""
    name, sep, path = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    if not (Path(path) / "ricllm" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{path!r} is not a checkout of ricllm (no ricllm/__init__.py in it)")
    return name, str(Path(path).resolve())


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number ≥ 1, got {text!r}")
    return int(text)


def parse_args() -> argparse.Namespace:
    return parse_args_from(sys.argv[1:])


def parse_args_from(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the installed SmolLM2 Q4_1)")
    parser.add_argument("--configs", nargs="+", default=["int4:native", "int4:torch", "int8:native", "bf16:torch",
                                                         "auto:onnx"],
                        choices=[f"{w}:{r}" for w in ("auto", "int4", "int8", "bf16") for r in ("native", "torch")]
                        + ["auto:onnx"],
                        help="ricllm configurations, WEIGHTS:RUNTIME (bf16 runs on torch only; onnx: the file's "
                             "formats in ONNX Runtime, fp32 activations; default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs of every configuration, interleaved (default: %(default)s; 1 for a smoke run)")
    parser.add_argument("--multi-stream-trials", type=positive_int, default=1,
                        help="generations per repeat at 8 or more streams, each with other prompts, their median "
                             "kept (default: %(default)s; one stream always takes the median of five)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (32-token prompts, 8 new "
                        "tokens, streams 1 and 4); never publishes")
    parser.add_argument("--no-amx", action="store_true", help="run the ricllm children as on a CPU without AMX "
                        "(an AMD EPYC, an older Xeon): ricllm's C kernels without AMX (RICLLM_NO_AMX=1), and torch's "
                        "MKL and oneDNN capped below AMX too (cpu_caps.py), so the torch runtime runs its non-AMX path")
    parser.add_argument("--avx2-only", action="store_true", help="run the ricllm children as on an AVX2-only CPU (AMD "
                        "Zen 2/3): ricllm's avx2 family, its bf16 probe answering no, torch's ATen, MKL and oneDNN "
                        "held to AVX2 (cpu_caps.AVX2_ONLY)")
    parser.add_argument("--avx2-like-for-like", action="store_true",
                        help="an AVX2-only CPU measured like for like on this one: --avx2-only (HF's torch held to "
                             "AVX2 too), and a second llama.cpp held to AVX2 (native detection, AVX-512 and AMX off; "
                             "built once from source into $RICLLM_CACHE_DIR/llamacpp-avx2-VERSION, several minutes) "
                             "that the ratios and targets are against; the native llama.cpp runs as a reference, "
                             "and both builds' system info and CMake flags are recorded")
    parser.add_argument("--llamacpp-avx2-python", default=None, metavar="PYTHON",
                        help="with --avx2-like-for-like: an interpreter whose llama-cpp-python is already held to "
                             "AVX2 (default: build one as above)")
    parser.add_argument("--ricllm-env", type=env_pair, action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the ricllm children only (repeatable), e.g. a kernel cap")
    parser.add_argument("--tree", type=source_tree, action="append", default=[], metavar="NAME=PATH",
                        help="run every ricllm configuration once per source tree (a checkout of another revision, "
                             "e.g. from `git worktree add --detach PATH REV`), interleaved in the same run, labelled "
                             "[NAME]: the ricllm children import ricllm from PATH")
    parser.add_argument("--skip-hf", action="store_true", help="do not run HF transformers")
    parser.add_argument("--skip-llamacpp", action="store_true", help="do not run llama.cpp")
    parser.add_argument("--llamacpp-python", default=sys.executable,
                        help=f"interpreter with llama-cpp-python (default: this one, %(default)s; `{SETUP_HINT}` "
                             f"installs it)")
    parser.add_argument("--ortgenai", action="store_true",
                        help="add ONNX Runtime GenAI as a peer: its int4 CPU model built from the same GGUF "
                             "(an fp32 HF folder written by transformers, then ORT GenAI's builder with its CPU "
                             "recipe: RTN int4, block 32, accuracy level 4), both once into "
                             "$RICLLM_CACHE_DIR/ortgenai/ (a minute or two), nothing downloaded; see "
                             "benchmarks/ortgenai_peer.py")
    parser.add_argument("--ortgenai-python", default=None, metavar="PYTHON",
                        help="with --ortgenai: an interpreter with onnxruntime-genai and onnx-ir (default: this one; "
                             "where it lacks them, ortgenai_peer.VERSIONS are installed into "
                             "$RICLLM_CACHE_DIR/ortgenai-VERSION, over this venv's ONNX Runtime)")
    parser.add_argument("--no-publish", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--child", choices=["measure", "ready", "probe"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ricllm_env = dict(args.ricllm_env)
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        return child_main(args.child)
    sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package
    import torch

    torch.set_num_threads(THREADS)  # also what results.machine() reports
    from ricllm.model.loader import default_model_path

    model = Path(args.model).resolve() if args.model else default_model_path()
    sizes = dict(QUICK if args.quick else FULL, multi_stream_trials=args.multi_stream_trials)
    problem = None if args.skip_llamacpp else llamacpp_problem(args.llamacpp_python)
    if problem:
        progress(f"SKIP llama.cpp: {problem}")
    avx2_python, avx2_problem = None, None
    if args.avx2_like_for_like and not args.skip_llamacpp:
        from ricllm.paths import cache_dir

        avx2_python, avx2_problem = (args.llamacpp_avx2_python, llamacpp_problem(args.llamacpp_avx2_python)) \
            if args.llamacpp_avx2_python else \
            avx2_llamacpp_python(cache_dir() / f"llamacpp-avx2-{locked_version('llama-cpp-python')}")
        if avx2_problem:
            avx2_problem = f"the AVX2 build: {avx2_problem}"
            progress(f"SKIP llama.cpp's AVX2 build: {avx2_problem}")
    bandwidth = read_bandwidth()
    progress(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    vocab, auto_formats = model_facts(model)
    base = workload_spec(model, vocab, sizes)
    llamacpp_ok = not args.skip_llamacpp and problem is None
    extra_buffers = llamacpp_ok and llamacpp_extra_buffers_run(args.llamacpp_python, base)
    avx2_peer = None
    if avx2_python and avx2_problem is None:
        avx2_peer = (avx2_python, llamacpp_extra_buffers_run(avx2_python, base))
    ortgenai, ortgenai_problem = None, None
    if args.ortgenai:
        ortgenai, ortgenai_problem = prepare_ortgenai(model, args.ortgenai_python)
        if ortgenai_problem:
            progress(f"SKIP ORT GenAI: {ortgenai_problem}")
    configs = configurations(args, llamacpp_ok, extra_buffers, avx2_peer, ortgenai)
    runs = run_all(configs, base, args.repeats)
    labelled = label_series(configs, runs, auto_formats)
    series, failed = [s for s in labelled if any(s.runs)], [s.label for s in labelled if not any(s.runs)]
    if not series:
        sys.exit("no configuration produced results (see the children's errors above)")
    problems = [p for p in (problem, avx2_problem) if p]
    report(series, sizes, model, bandwidth, problems, failed, append=not (args.quick or args.no_publish),
           ortgenai_problem=ortgenai_problem)


if __name__ == "__main__":
    main()
