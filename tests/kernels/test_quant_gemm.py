"""Weight-only int4/int8 products in every kernel family this CPU runs (amx, avx512, avx2): each one
matches the torch reference at every row range its paths split on, both widths, bf16 and fp32
activations, and a few tiles' products are the whole product's columns bit for bit; the family
follows the CPU's flags and the cap (RICLLM_CPU_KERNELS, RICLLM_NO_AMX).

The library is built once per process for one family, so the other families run this file's
parity tests (and the runtimes' bit-identity test) again in a subprocess with the cap set."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
import torch.nn.functional as F
from ricllm.errors import ConfigError
from ricllm.kernels import cpu_library, cpu_quant
from tests.helpers import python_with_env

# every row range the paths split on: VNNI int8 (AMX family: 1-13), AMX tiles (14-63), AMX dequantized
# (64+); the panels of the int8 paths (VNNI 64 rows, AVX2 32)
ROWS = (1, 2, 3, 7, 8, 9, 13, 14, 16, 33, 64, 100)
BF16_OUT_TOL = 2 ** -8  # a bf16 output is rounded once (relative to the output's norm)
FP32_OUT_TOL = 1e-5  # an fp32 output: only the accumulation order differs from the reference's
needs_products = pytest.mark.skipif(not cpu_library.quant_gemm_available(8),
                                    reason="ricllm's packed products do not run here (no x86-64-v3 CPU or no compiler)")

SAPPHIRE_RAPIDS = cpu_library.FAMILIES["amx"][1] | {"amx_int8", "avx512_fp16"}
ZEN4 = cpu_library.FAMILIES["avx512"][1] | {"avx512ifma", "sha_ni"}
ZEN3 = cpu_library.FAMILIES["avx2"][1] | {"sha_ni", "vaes"}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def int8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The 8-bit contract: activations quantized per group of 32 (amax/127, round half to even),
    then exact products: only the fp32 accumulation rounds."""
    groups = x.float().view(x.shape[0], -1, cpu_quant.GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    quantized = torch.round(groups * (1 / scale)) * scale
    return F.linear(quantized.view_as(x).double(), weight.double()).float()


def int4_activations(rows: int) -> str:
    """What a 4-bit product does to the activations at this row count, as the library says its path
    (``cpu_library.int4_path``): ``int8`` (VNNI), ``bf16`` (AMX tiles, AVX2's FMAs), or ``bf16
    weights too`` (AMX's dequantized tiles, as a dense bf16 copy holds the weights)."""
    path = cpu_library.int4_path(rows)
    return "int8" if path.startswith("int8") else "bf16 weights too" if path.startswith("dequantized") else "bf16"


def reference(x: torch.Tensor, weight: torch.Tensor, bits: int) -> torch.Tensor:
    """8-bit, and 4-bit on int8 activations: ``int8_reference`` (the 4-bit kernel's c·Σx uses the
    quantized activations' sum, so it too is the exact product with the quantized activations);
    4-bit otherwise: activations rounded to bf16 (and on AMX from 64 rows the weights too), then
    exact products."""
    path = int4_activations(x.shape[0])
    if bits == 8 or path == "int8":
        return int8_reference(x, weight)
    if path == "bf16 weights too":
        weight = weight.bfloat16()
    return F.linear(x.bfloat16().double(), weight.double()).float()


@needs_products
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_parity_with_the_torch_reference_at_every_row_range(bits, dtype):
    weight = torch.randn(96, 3 * 32 * 3, generator=torch.Generator().manual_seed(bits)) * 0.05  # 9 groups: odd
    packed, scales, offsets = (cpu_quant.pack_int4 if bits == 4 else cpu_quant.pack_int8)(weight)
    exact = cpu_quant.unpack(packed, scales, offsets, bits)
    tolerance = BF16_OUT_TOL if dtype == torch.bfloat16 else FP32_OUT_TOL
    for rows in ROWS:
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        y = cpu_quant.quant_gemm(x, packed, scales, offsets, bits, weight.shape[0])
        assert y.dtype == dtype
        err = rel_err(y, reference(x, exact, bits))
        assert err < tolerance, f"{cpu_library.kernel_family()}: {bits}-bit, {rows} rows, {dtype}: off by {err:.2e}"


@needs_products
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_parity_of_a_few_tiles_with_the_whole_product_bit_for_bit(bits, dtype):
    """``quant_gemm_tiles`` (an LM head on a constraint's allowed tokens) gives the listed tiles'
    columns of ``quant_gemm``, the same bits, wherever the row count's path computes each output
    from its own weight row (8-bit; 4-bit on int8 activations); a 4-bit AMX path is refused."""
    weight = torch.randn(96, 288, generator=torch.Generator().manual_seed(bits)) * 0.05  # 6 tiles, 9 groups
    packed, scales, offsets = (cpu_quant.pack_int4 if bits == 4 else cpu_quant.pack_int8)(weight)
    tiles = torch.tensor([4, 0, 5], dtype=torch.int32)  # in any order
    columns = (tiles[:, None].long() * cpu_quant.TILE + torch.arange(cpu_quant.TILE)).flatten()
    for rows in ROWS:
        x = torch.randn(rows, 288, generator=torch.Generator().manual_seed(rows)).to(dtype)
        if bits == 4 and int4_activations(rows) != "int8":
            with pytest.raises(ValueError, match=r"code -2"):
                cpu_quant.quant_gemm_tiles(x, packed, scales, offsets, bits, 96, tiles)
            continue
        whole = cpu_quant.quant_gemm(x, packed, scales, offsets, bits, 96)
        part = cpu_quant.quant_gemm_tiles(x, packed, scales, offsets, bits, 96, tiles)
        assert part.shape == (rows, 48) and torch.equal(part, whole[:, columns]), f"{bits}-bit, {rows} rows, {dtype}"
    with pytest.raises(ValueError, match=r"code -1"):  # a tile past the weight
        cpu_quant.quant_gemm_tiles(x, packed, scales, offsets, bits, 96, torch.tensor([6], dtype=torch.int32))


@needs_products
@pytest.mark.parametrize("scale", [0, 1])
def test_parity_breaks_when_a_scale_is_not_applied(scale):
    """The tolerance catches a d or c off by one part in 256 (the kernels apply what is stored)."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    packed, scales, offsets = cpu_quant.pack_int4(weight)
    exact = cpu_quant.unpack(packed, scales, offsets, 4)
    scales[:, :, scale] *= 1 + 1 / 256
    for rows in (1, 5, 20, 64):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        assert rel_err(cpu_quant.quant_gemm(x, packed, scales, offsets, 4, 32), reference(x, exact, 4)) > FP32_OUT_TOL


@needs_products
def test_int8_activations_stay_within_half_a_quantization_step():
    """Where a 4-bit product runs on int8 activations, each output is off the unquantized product
    by at most Σ_k |w[n,k]|·dx/2 (each activation rounds by half its group's step dx = amax/127 at
    most), and in aggregate by about the uniform rounding noise's spread, not more."""
    weight = torch.randn(64, 288, generator=torch.Generator().manual_seed(5)) * 0.05
    packed, scales, offsets = cpu_quant.pack_int4(weight)
    exact = cpu_quant.unpack(packed, scales, offsets, 4)
    rows = [r for r in ROWS if int4_activations(r) == "int8"]
    if not rows:
        pytest.skip(f"{cpu_library.kernel_family()}: no row count runs on int8 activations")
    for count in rows:
        x = torch.randn(count, 288, generator=torch.Generator().manual_seed(count))
        y = cpu_quant.quant_gemm(x, packed, scales, offsets, 4, 64).double()
        unquantized = F.linear(x.double(), exact.double())
        step = x.view(count, -1, cpu_quant.GROUP).abs().amax(-1) / 127  # [rows, groups]
        bound = (exact.abs().view(64, -1, cpu_quant.GROUP).sum(-1).double() @ step.double().T).T / 2
        assert ((y - unquantized).abs() <= bound * (1 + 1e-4) + 1e-6).all(), f"{count} rows"
        noise = (exact.double() ** 2 @ (step.repeat_interleave(cpu_quant.GROUP, 1).double() ** 2 / 12).T).T.sqrt()
        assert ((y - unquantized) / noise).pow(2).mean().sqrt() < 1.5, f"{count} rows: more than rounding noise"


def with_family(family: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return python_with_env({"RICLLM_CPU_KERNELS": family}, *args, timeout=timeout)


def runs_here(family: str) -> bool:
    return cpu_library.IS_X86 and cpu_library.FAMILIES[family][1] <= cpu_library.cpu_flags()


FAMILY_NAMES = {"amx": "amx", "avx512": "avx512-bf16", "avx2": "avx2"}
INT4_PATHS = {  # what kernel_family() says of each family's 4-bit paths (read from the C library)
    "amx": "int8 activations on VNNI 1-13 rows, bf16 AMX tiles 14-63 rows, dequantized AMX tiles 64+",
    "avx512": "int8 activations on VNNI, every row count",
    "avx2": "int8 activations on maddubs, every row count",
}


@pytest.mark.parametrize("family", list(cpu_library.FAMILIES))
def test_each_family_this_cpu_runs_matches_the_reference(family):
    if not runs_here(family):
        pytest.skip(f"this CPU lacks the {family} family's flags "
                    f"({' '.join(sorted(cpu_library.FAMILIES[family][1] - cpu_library.cpu_flags()))})")
    said = with_family(family, "-c", "from ricllm.kernels.cpu_library import kernel_family; print(kernel_family())")
    assert said.stdout.strip() == f"{FAMILY_NAMES[family]} (int4: {INT4_PATHS[family]})", said.stdout + said.stderr[-2000:]
    done = with_family(family, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                       "parity or quantization_step")
    passed = re.search(r"(\d+) passed", done.stdout)  # the quantization-step test skips where no path is int8
    assert done.returncode == 0 and passed and int(passed[1]) >= 6, done.stdout[-3000:] + done.stderr[-2000:]


INT8_PRODUCTS = """
import hashlib, torch
from ricllm.kernels import cpu_quant
weight = torch.randn(48, 320, generator=torch.Generator().manual_seed(11)) * 0.05
digest = hashlib.sha256()
for bits, pack in ((4, cpu_quant.pack_int4), (8, cpu_quant.pack_int8)):
    packed = pack(weight)
    for rows in (1, 2, 3, 13, 40):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows)).to(dtype)
            digest.update(cpu_quant.quant_gemm(x, *packed, bits, 48).view(torch.uint8).numpy().tobytes())
print(digest.hexdigest())
"""


def test_the_int8_activation_paths_compute_the_same_bits_in_every_family():
    """AVX2's maddubs emulates VNNI's products exactly and scales in the same order: where both run
    on int8 activations (4-bit at every row count below AMX's, and 8-bit), the outputs are the same bits."""
    families = [f for f in ("avx2", "avx512") if runs_here(f)]
    if len(families) < 2:
        pytest.skip("needs a CPU that runs both the avx2 and the avx512 family")
    digests = {f: with_family(f, "-c", INT8_PRODUCTS) for f in families}
    assert all(done.returncode == 0 for done in digests.values()), [d.stderr[-2000:] for d in digests.values()]
    assert len({done.stdout for done in digests.values()}) == 1, {f: d.stdout for f, d in digests.items()}


@pytest.mark.parametrize("family", list(cpu_library.FAMILIES))
def test_each_family_serves_both_runtimes_bit_identically(family):
    """The runtimes' bit-identity test, rerun on each family (the native runtime serves on all)."""
    if not runs_here(family):
        pytest.skip(f"this CPU lacks the {family} family's flags")
    done = with_family(family, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_native_runtime.py",
                       "-k", "bit_identical or unchunked")
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.parametrize("flags,cap,no_amx,expected", [
    (SAPPHIRE_RAPIDS, "", "", "amx"),
    (ZEN4, "", "", "avx512"),
    (ZEN3, "", "", "avx2"),
    (ZEN3 - {"fma"}, "", "", None),  # no x86-64-v3: the torch kernels serve
    (SAPPHIRE_RAPIDS, "avx2", "", "avx2"),
    (SAPPHIRE_RAPIDS, "avx512", "", "avx512"),
    (SAPPHIRE_RAPIDS, "", "1", "avx512"),  # RICLLM_NO_AMX caps at avx512
    (SAPPHIRE_RAPIDS, "avx2", "1", "avx2"),  # the lower cap wins
    (ZEN3, "amx", "", "avx2"),  # a cap above the CPU: the CPU's best
])
def test_the_family_follows_the_cpu_flags_and_the_cap(monkeypatch, flags, cap, no_amx, expected):
    monkeypatch.setattr(cpu_library, "IS_X86", True)
    monkeypatch.setattr(cpu_library, "cpu_flags", lambda: set(flags))
    monkeypatch.setenv("RICLLM_CPU_KERNELS", cap)
    monkeypatch.setattr(cpu_library, "AMX_DISABLED", bool(no_amx))
    cpu_library.cpu_family.cache_clear()
    try:
        assert cpu_library.cpu_family() == expected
    finally:
        cpu_library.cpu_family.cache_clear()


def test_a_cap_that_names_no_family_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv("RICLLM_CPU_KERNELS", "sse4")
    cpu_library.cpu_family.cache_clear()
    try:
        with pytest.raises(ConfigError, match="sse4.*avx2, avx512, amx"):
            cpu_library.cpu_family()
    finally:
        cpu_library.cpu_family.cache_clear()
