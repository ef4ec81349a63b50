"""Run by test_triton_aot.py in a subprocess: compile the Triton kernels for sm_90 without a GPU.

Triton compiles ahead of time for a named target (its bundled ptxas needs no driver), so this
checks on a CPU machine what the interpreter cannot: that the kernels lower for Hopper, that the
K/V loads are pipelined 16-byte ``cp.async`` copies, that fp16/bf16 dots use tensor cores, and
that nothing spills to local memory. Prints one JSON object per kernel variant.
Needs ``TRITON_INTERPRET`` unset (interpreted functions cannot be compiled).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ricllm.kernels import triton_decode as td  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_kernel(fn, pointers: dict[str, str], floats: set[str], constexprs: dict,
                   num_warps: int, num_stages: int = 2, odd_strides: frozenset[str] = frozenset(),
                   **options):
    """Compile ``fn`` for Hopper with pointers and strides marked 16-divisible, as the JIT does
    (except ``odd_strides``: an int8 row of ``head_dim + 4`` bytes is only 4-divisible)."""
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
        if name in pointers or (name.startswith("stride_") and name not in odd_strides):
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages, **options})


def summary(compiled, **labels) -> dict:
    """Resource use (cuobjdump) and the PTX features the tests look for."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    regs, stack, local = (int(v) for v in re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage).groups())
    ptx = compiled.asm["ptx"]
    return {**labels, "regs": regs, "stack": stack, "local": local,
            "shared": compiled.metadata.shared,
            "cp_async_16": len(re.findall(r"cp\.async\.cg\.shared\.global .*, 0x10", ptx)),
            "mma": ptx.count("mma.sync")}


def decode_variant(dtype: str, head_dim: int, block_size: int, split: bool, cache: str = "",
                   windowed: bool = False) -> dict:
    """``cache``: the cache's element type when not the query's (``"int8"``: uint8 rows + scales)."""
    config = td.DEFAULT_CONFIG
    out = "fp32" if split else dtype
    quantized = cache == "int8"
    cache_ty = "u8" if quantized else (cache or dtype)
    pointers = {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{cache_ty}", "v_cache_ptr": f"*{cache_ty}",
                "table_ptr": "*i32", "ctx_ptr": "*i32", "sinks_ptr": "*i32", "windows_ptr": "*i32",
                "out_ptr": f"*{out}", "lse_ptr": f"*{out}"}
    constexprs = dict(BLOCK_SIZE=block_size, TILE=block_size * max(1, config.tile_tokens // block_size),
                      HEAD_DIM=head_dim, GROUP_PAD=16, D_PAD=head_dim, SPLIT=split,
                      FP32_DOT=dtype == "fp32", NUM_STAGES=config.num_stages,
                      QUANTIZED=quantized, WINDOWED=windowed)
    kernel = compile_kernel(td._decode_kernel, pointers, {"qk_scale"}, constexprs, config.num_warps,
                            odd_strides=frozenset({"stride_ch"} if quantized else ()))
    return summary(kernel, kernel="decode", dtype=dtype, cache=cache or dtype, windowed=windowed,
                   head_dim=head_dim, block_size=block_size, split=split)


def merge_variant() -> dict:
    pointers = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*fp16"}
    kernel = compile_kernel(td._merge_splits_kernel, pointers, set(),
                            dict(HEAD_DIM=128, S_PAD=8, D_PAD=128), num_warps=4)
    return summary(kernel, kernel="merge")


def store_variant(cache: str = "fp16") -> dict:
    quantized = cache == "int8"
    pointers = {name: "*fp16" for name in ("key_ptr", "value_ptr")}
    pointers |= {name: "*u8" if quantized else "*fp16" for name in ("k_cache_ptr", "v_cache_ptr")}
    pointers["slot_ptr"] = "*i64"
    kernel = compile_kernel(td._store_kv_kernel, pointers, set(),
                            dict(BLOCK_SIZE=16, HEAD_DIM=128, KV_PAD=8, D_PAD=128, QUANTIZED=quantized),
                            num_warps=4, odd_strides=frozenset({"stride_ch"} if quantized else ()),
                            enable_fp_fusion=False)  # as store_kv launches it
    return summary(kernel, kernel="store_kv", cache=cache)


def main() -> None:
    variants = [decode_variant(d, h, b, s) for d, h, b, s in [
        ("fp16", 128, 16, False), ("fp16", 128, 16, True), ("fp16", 64, 32, False),
        ("bf16", 128, 16, True), ("fp32", 64, 16, False)]]
    variants += [decode_variant("bf16", 64, 16, True, cache="int8"), decode_variant("fp32", 64, 16, False, "int8"),
                 decode_variant("fp16", 128, 16, True, windowed=True),
                 decode_variant("bf16", 64, 16, False, cache="int8", windowed=True)]
    for result in [*variants, merge_variant(), store_variant(), store_variant("int8")]:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
