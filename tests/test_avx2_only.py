"""The suite's CPU-dependent part again on an emulated AVX2-only CPU (AMD Zen 2/3, Xeons before Skylake-SP),
whatever CPU runs the suite: ricllm's avx2 kernel family, its bf16 probe answering no, and torch's own
kernels (ATen, MKL, oneDNN) held to AVX2 (``benchmarks/cpu_caps.py``'s ``AVX2_ONLY``). The kernel family
and torch's instruction sets are chosen once per process, so each area runs in one child process.

An AVX2 CPU multiplies bf16 nowhere in hardware; ``dtype="auto"`` still takes bf16 there, as ricllm's
packed-weight kernels do the products (the file's 4-bit weights stay packed), so the default model is
served packed by both runtimes and must keep its greedy choices and perplexity against HF fp32.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ricllm.kernels import cpu_library
from tests.helpers import output_tail, python_with_env
from tests.smollm2_oracle import ORACLE_FILE_ENV

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: no folder of ours shadows an installed package

from benchmarks.cpu_caps import AVX2_ONLY  # noqa: E402

AVX2_FAMILY = "avx2 (int4: int8 activations on maddubs, every row count)"
MISSING = sorted(cpu_library.FAMILIES["avx2"][1] - cpu_library.cpu_flags())
pytestmark = pytest.mark.skipif(not cpu_library.IS_X86 or bool(MISSING),
                                reason=f"this CPU cannot run the avx2 family (x86-64-v3; it lacks "
                                       f"{' '.join(MISSING) or 'x86-64'})")

# a child pytest run that first says which kernel family its process got (built before any test runs)
PYTEST = """
import sys
import pytest
from ricllm.kernels.cpu_library import kernel_family
print("kernel family:", kernel_family(), flush=True)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def avx2_only(*args: str, timeout: int = 900, env: dict[str, str] | None = None):
    return python_with_env({**AVX2_ONLY, **(env or {})}, *args, timeout=timeout)


def pytest_avx2_only(*args: str, at_least: int, timeout: int = 900, env: dict[str, str] | None = None) -> str:
    """Run pytest on ``args`` under the emulation: it must run on the avx2 family and pass ``at_least`` tests."""
    done = avx2_only("-c", PYTEST, *args, timeout=timeout, env=env)
    passed = re.search(r"(\d+) passed", done.stdout)
    assert f"kernel family: {AVX2_FAMILY}\n" in done.stdout, output_tail(done)
    assert done.returncode == 0 and passed and int(passed[1]) >= at_least, output_tail(done)
    return done.stdout


EMULATION = """
import json, torch
from ricllm.config import EngineConfig
from ricllm.kernels.cpu_library import cpu_bf16, kernel_family
print(json.dumps({"family": kernel_family(), "bf16": cpu_bf16(), "aten": torch.backends.cpu.get_cpu_capability(),
                  "auto": EngineConfig().auto_cpu_dtype()}))
"""


def test_the_emulation_runs_the_avx2_family_without_bf16_products():
    """What the other tests here rely on: the child runs the avx2 family, ricllm's probe finds no bf16
    products, ATen runs its AVX2 code, and dtype auto still takes bf16 (the packed kernels serve)."""
    done = avx2_only("-c", EMULATION, timeout=300)
    assert done.returncode == 0, output_tail(done)
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["family"] == AVX2_FAMILY, said
    assert said["bf16"] == [False, "RICLLM_CPU_BF16=0"], said
    assert said["aten"] == "AVX2", said
    assert said["auto"][0] == "bfloat16" and "packed-weight kernels do the products" in said["auto"][1], said


def test_the_avx2_familys_products_match_the_reference():
    """test_quant_gemm's parity tests (every row range, both widths, bf16 and fp32 activations) and the
    half-step bound of the int8 activations (every avx2 row count runs on them)."""
    pytest_avx2_only("tests/kernels/test_quant_gemm.py", "-k", "parity or quantization_step", at_least=7)


def test_the_avx2_familys_lora_updates_match_the_reference():
    """test_cpu_lora's parity tests: several adapters per batch, fp32 and bf16 activations and weights."""
    pytest_avx2_only("tests/kernels/test_cpu_lora.py", "-k", "parity", at_least=28)


def test_the_runtimes_compute_the_same_bits_on_the_avx2_family():
    pytest_avx2_only("tests/test_native_runtime.py", "-k", "bit_identical or unchunked", at_least=2)


def test_a_short_replay_runs_on_the_avx2_family():
    """The in-process replay of the tiny model (24 requests, about 2 s of arrivals) and its report's checks."""
    pytest_avx2_only("tests/replay/test_replay.py", "-k", "in_process_replay_report", at_least=1)


SERVE_DEFAULT_MODEL = """
import json
from ricllm import LLM, SamplingParams
from ricllm.model.packed_linear import PackedLinear
question = [{"role": "user", "content": "What is the capital of France?"}]
for settings in ({"runtime": "native"}, {"runtime": "torch"}, {"runtime": "torch", "weights": "int4"}):
    llm = LLM(kv_cache_budget="16MiB", **settings)
    runtime = llm.engine.runtime
    said = {"settings": settings, "runtime": runtime.name, "dtype": str(runtime.dtype).removeprefix("torch."),
            "formats": runtime.weight_formats,
            "tokens": llm.chat(question, SamplingParams(max_tokens=16))[0].token_ids}
    if runtime.name == "torch":
        model = runtime.model
        projections = [p for layer in model.layers for p in (layer.attn.qkv_proj, layer.attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        said["layers"] = sorted({f"{type(p).__name__} {getattr(p, 'layout', '')}" for p in projections})
        said["head"] = f"{type(model.packed_head).__name__} {getattr(model.packed_head, 'layout', '')}"
        said["stack"] = model.decoder_stack is not None
    print(json.dumps(said), flush=True)
"""


@pytest.mark.slow
def test_both_runtimes_serve_the_default_model_packed_in_bf16(smollm2):
    """``dtype="auto"`` on a CPU without bf16 products: bf16 activations, 4-bit layers and an 8-bit head in
    ricllm's own layout (``weights="auto"``: the file's 4-bit layers kept; ``"int4"``: asked for), through
    the C decoder stack; the torch runtime answers the native runtime's tokens (same kernels, same order)."""
    done = avx2_only("-c", SERVE_DEFAULT_MODEL, timeout=600)
    assert done.returncode == 0, output_tail(done)
    native, auto, int4 = (json.loads(line) for line in done.stdout.strip().splitlines()[-3:])
    assert native["runtime"] == "native" and native["dtype"] == "bfloat16" and native["formats"] == ["int4", "int8"]
    for said in (auto, int4):
        assert said["runtime"] == "torch" and said["dtype"] == "bfloat16" and said["formats"] == ["int4", "int8"], said
        assert said["layers"] == ["PackedLinear vnni"] and said["head"] == "PackedLinear vnni", said
        assert said["stack"], said
    assert auto["tokens"] == native["tokens"] and len(native["tokens"]) == 16


@pytest.mark.slow
def test_the_avx2_family_keeps_the_default_models_greedy_choices_and_perplexity(smollm2_oracle_file):
    """test_weight_formats' oracle checks of the native runtime (int8 and int4 layers) on the avx2 family:
    teacher-forced greedy agreement with HF fp32 >= 95%, perplexity within 2% of fp32's. The HF fp32
    figures are this run's (the oracle is the same whatever the CPU)."""
    said = pytest_avx2_only("-s", "tests/test_weight_formats.py", "-k", "native_runtime", at_least=4, timeout=900,
                            env={ORACLE_FILE_ENV: str(smollm2_oracle_file)})
    measured = re.findall(r"native int[48] \(\w+ family\): .*", said)
    assert len(measured) == 4 and all("(avx2 family)" in line for line in measured), said[-3000:]
    print("\n".join(measured))
