"""Shared test helpers: optional-tool gating, the installed models, and tiny random Llama and Gemma 3 GGUF files."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"
ROOT = Path(__file__).resolve().parents[1]


def require(condition: bool, reason: str) -> None:
    """Skip on a user's machine when an optional tool is missing; fail in CI, where it must run."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: .ci/run must install it)")
    pytest.skip(reason)


def require_module(name: str) -> None:
    require(importlib.util.find_spec(name) is not None, f"python package {name!r} is not installed")


def python_with_env(env: dict[str, str], *args: str, timeout: int = 900,
                    unset: tuple[str, ...] = ("RICLLM_NO_AMX",)) -> subprocess.CompletedProcess:
    """``python *args`` in a child process from the repository root, ``env`` set over this process's
    environment and ``unset`` removed: ricllm's kernel family and torch's instruction sets are chosen once
    per process, so a test runs another CPU's code (``benchmarks/cpu_caps.py``) in a child."""
    child = {**os.environ, "RICLLM_LOG_LEVEL": "warning", **env}
    for name in unset:
        child.pop(name, None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=child, cwd=ROOT,
                          timeout=timeout, check=False)


def output_tail(done: subprocess.CompletedProcess) -> str:
    """What a failed child said last: the end of its stdout, then of its stderr."""
    return f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"


def cache_with_kernels(folder: Path) -> Path:
    """``folder`` as an empty ricllm cache (``RICLLM_CACHE_DIR``) but for the CPU kernels this run
    has built, so that a child process started on it does not compile them again (10 s on two
    cores). For tests of what the cache holds of a model; tests of the build itself start bare."""
    from ricllm.kernels.cpu_library import cpu_kernels_available
    from ricllm.paths import cache_dir

    (folder / "kernels").mkdir(parents=True, exist_ok=True)
    if cpu_kernels_available()[0]:
        for built in (cache_dir() / "kernels").glob("*.so"):
            target = folder / "kernels" / built.name
            if not target.exists():
                try:
                    os.link(built, target)
                except OSError:  # another file system (a tmpfs /tmp beside a home cache): copy it
                    shutil.copy2(built, target)
    return folder


def smollm2_path() -> Path:
    from ricllm.errors import ModelLoadError
    from ricllm.model.loader import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as exc:
        require(False, str(exc))


def gemma3_270m_path() -> Path:
    """The Gemma 3 270M GGUF that scripts/setup.sh assembles into the venv."""
    from ricllm.errors import ModelLoadError
    from ricllm.model.loader import installed_model_path

    try:
        return installed_model_path("gemma3-270m")
    except ModelLoadError as exc:
        require(False, str(exc))


TINY = dict(vocab=None, hidden=64, heads=4, kv_heads=2, layers=2, ffn=128, context=512)


def quantize_q4_k(array: np.ndarray) -> np.ndarray:
    """``array`` ``[rows, cols]`` (cols a multiple of 256) as GGML Q4_K blocks (gguf-py dequantizes
    them but does not write them): per 256 values an fp16 scale and minimum, per 32 a 6-bit multiple
    of each, ``w = d·sc·q − dmin·m``. Scales and minima are rounded to 6 bits from each sub-block's
    range, and every other sub-block's step is widened by 15/14, so its values span 0..14 only: in
    llama.cpp's fitted files many sub-blocks span fewer than 16 levels (a sixth of Gemma 3 270M's)."""
    rows, cols = array.shape
    sub = array.astype(np.float32).reshape(-1, 8, 32)  # [super-blocks, sub-blocks, 32]
    low = np.minimum(sub.min(-1), 0)
    scale, minimum = (sub.max(-1) - low) / 15, -low
    scale[:, 1::2] *= 15 / 14
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minimum.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d[:, None].astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(minimum / np.maximum(dmin[:, None].astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    step = d[:, None].astype(np.float32) * sc
    offset = dmin[:, None].astype(np.float32) * m
    q = np.clip(np.round((sub + offset[..., None]) / np.maximum(step, 1e-30)[..., None]), 0, 15).astype(np.uint8)
    # the 12 scale bytes: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minima);
    # 4-7 in bytes 8-11's nibbles, their top 2 bits in bytes 0-7's high bits
    scales = np.zeros((sub.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # pair p: sub-block 2p low nibbles, 2p+1 high
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


def quantize_q6_k(array: np.ndarray) -> np.ndarray:
    """``array`` ``[rows, cols]`` (cols a multiple of 256) as GGML Q6_K blocks (gguf-py dequantizes them
    but does not write them): per 256 values an fp16 scale, per 16 an int8 multiple of it, ``w = d·sc·(q − 32)``
    with 6-bit ``q``; q's low nibbles in ``ql`` (two halves of 128 values, 64 bytes each: value ``b`` low,
    ``b + 64`` high), its top 2 bits in ``qh`` (value ``32s + c`` of a half at bits ``2s`` of byte ``c``)."""
    rows, cols = array.shape
    sub = array.astype(np.float32).reshape(-1, 16, 16)  # [super-blocks, sub-blocks, 16]
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d[:, None].astype(np.float32), 1e-30)), -128, 127).astype(np.int8)
    step = d[:, None].astype(np.float32) * sc
    q = np.clip(np.round(sub / np.maximum(step, 1e-30)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(-1, 256)
    halves = q.reshape(-1, 2, 2, 64)
    ql = ((halves[:, :, 0] & 0x0F) | ((halves[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    quarters = q.reshape(-1, 2, 4, 32) >> 4
    qh = (quarters[:, :, 0] | (quarters[:, :, 1] << 2) | (quarters[:, :, 2] << 4) | (quarters[:, :, 3] << 6))
    blocks = np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d[:, None].view(np.uint8)], axis=1)
    return blocks.reshape(rows, cols // 256 * 210)


def _random_tensors(writer, rng, quant):
    """``add(name, shape, scale, quantize, offset)``: a random tensor written to ``writer``, stored in
    ``quant`` (a GGML type name) where ``quantize`` asks for it, else as F32. ``quant`` may instead
    be a function of the tensor's name giving its type (None: F32), for every tensor."""
    import gguf

    def add(name: str, shape: tuple[int, ...], scale: float = 0.08, quantize: bool = False,
            offset: float = 0.0) -> None:
        array = (offset + rng.standard_normal(shape) * scale).astype(np.float32)
        kind = quant(name) if callable(quant) else quant if quantize else None
        if kind == "Q4_K":
            writer.add_tensor(name, quantize_q4_k(array), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        elif kind == "Q6_K":
            writer.add_tensor(name, quantize_q6_k(array), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        elif kind is not None:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)

    return add


def write_tiny_llama_gguf(path: Path, *, seed: int = 0, tied: bool = False, kv_heads: int = 2,
                          quant: str | None = None, rope_theta: float = 10000.0, pad_vocab_to: int = 1,
                          embedding_quant: str | None = None) -> Path:
    """A random Llama GGUF that both ricllm and HF transformers load (the oracle needs no download).

    ``quant`` ("Q8_0" or "Q4_1") stores the 2-D layer weights quantized, to test dequantization.
    ``pad_vocab_to`` pads the vocabulary with unused tokens to a multiple (16: a head that tiles).
    ``embedding_quant`` ("Q8_0") stores the embedding quantized, as SmolLM2's file does.
    """
    import gguf

    from tests.fixtures_tokenizer import add_tiny_tokenizer

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    vocab = add_tiny_tokenizer(writer, pad_vocab_to=pad_vocab_to).vocab_size
    h, heads, ffn, layers = TINY["hidden"], TINY["heads"], TINY["ffn"], TINY["layers"]
    head_dim = h // heads
    writer.add_name("tiny-random-llama")
    writer.add_block_count(layers)
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(rope_theta)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    add = _random_tensors(writer, rng, quant)

    if embedding_quant is None:
        add("token_embd.weight", (vocab, h), 0.5)
    else:
        _random_tensors(writer, rng, embedding_quant)("token_embd.weight", (vocab, h), 0.5, quantize=True)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (h,), 0.1, offset=1.0)
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, h), quantize=True)
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, h), quantize=True)
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, h), quantize=True)
        add(f"blk.{i}.attn_output.weight", (h, heads * head_dim), quantize=True)
        add(f"blk.{i}.ffn_norm.weight", (h,), 0.1, offset=1.0)
        add(f"blk.{i}.ffn_gate.weight", (ffn, h), quantize=True)
        add(f"blk.{i}.ffn_up.weight", (ffn, h), quantize=True)
        add(f"blk.{i}.ffn_down.weight", (h, ffn), quantize=True)
    add("output_norm.weight", (h,), 0.1, offset=1.0)
    if not tied:
        add("output.weight", (vocab, h), 0.2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sample_server_stats(inbound: int = 0):
    """A complete ``stats`` reply body, as a server of this version sends it."""
    from ricllm import protocol as p
    from ricllm.engine.stats import KVCacheStats, LatencyStats

    kv = KVCacheStats(num_blocks=728, block_size=16, bytes_per_block=368640, budget_bytes=268435456,
                      allocated_bytes=268369920, used_blocks=10, free_blocks=718, cached_free_blocks=4,
                      pinned_blocks=2, peak_used_blocks=12, prefix_cache_queries_tokens=640,
                      prefix_cache_hits_tokens=512, preemptions=0, waits=0)
    model = p.ModelIdentity(name="SmolLM2-135M-Instruct", served_name="SmolLM2-135M-Instruct", path="/m.gguf",
                            dtype="bfloat16",
                            weights=p.WeightFormats(layers="int4", head="int4"), attention_backend="cpu",
                            device="cpu", threads=2, runtime="native", ricllm="0.1.0")
    return p.ServerStats(model=model, kv_cache=kv,
                         queues=p.QueueStats(inbound=inbound, inbound_capacity=1024, running=1, waiting=0,
                                             in_flight=1),
                         admission=p.AdmissionSummary(policy="deadline", counts={"admitted": 3}, reserved_blocks=5),
                         deadlines={"met": 3, "missed": 0},
                         latency_model=LatencyStats(steps=40, median_abs_error=0.05, p95_abs_error=0.2,
                                                    decode_multiplier=1.02, prefill_multiplier=1.01,
                                                    after_idle_multiplier=1.3, correction=1.02),
                         templates={"t-1": p.TemplateStats(num_tokens=37, pinned=True, num_pinned_tokens=32)},
                         draining=False)


TINY_GEMMA3 = dict(hidden=64, heads=4, kv_heads=2, head_dim=32, layers=7, ffn=128, context=512, window=8)


def write_tiny_gemma3_gguf(path: Path, *, seed: int = 0, quant=None, window: int = 8,
                           pad_vocab_to: int = 1, head_dim: int = TINY_GEMMA3["head_dim"],
                           kv_heads: int = TINY_GEMMA3["kv_heads"]) -> Path:
    """A random Gemma 3 GGUF (``gemma3``: seven layers, so six windowed ones of ``window`` tokens around
    one global layer, heads 32 wide against a hidden size of 64) that both ricllm and HF transformers load.

    Its norms are stored as llama.cpp's converter stores Gemma's: ``1 + w``. ``quant`` ("Q8_0" or "Q5_0")
    stores the 2-D layer weights quantized, or (a function of the tensor's name) gives each tensor's type; ``pad_vocab_to`` pads the vocabulary with unused tokens to
    a multiple (16: a head that tiles). ``head_dim`` and ``kv_heads`` widen or narrow the attention (256
    and 1: Gemma 3 270M's)."""
    import gguf

    from tests.fixtures_tokenizer import add_tiny_spm_tokenizer

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    vocab = add_tiny_spm_tokenizer(writer, pad_vocab_to=pad_vocab_to).vocab_size
    t = TINY_GEMMA3
    h, heads, ffn = t["hidden"], t["heads"], t["ffn"]
    writer.add_name("tiny-random-gemma3")
    writer.add_block_count(t["layers"])
    writer.add_context_length(t["context"])
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(window)
    writer.add_vocab_size(vocab)
    add = _random_tensors(writer, rng, quant)

    add("token_embd.weight", (vocab, h), 0.1)
    for i in range(t["layers"]):
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            add(f"blk.{i}.{norm}.weight", (h,), 0.1, offset=1.0)
        add(f"blk.{i}.attn_q_norm.weight", (head_dim,), 0.1, offset=1.0)
        add(f"blk.{i}.attn_k_norm.weight", (head_dim,), 0.1, offset=1.0)
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, h), quantize=True)
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, h), quantize=True)
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, h), quantize=True)
        add(f"blk.{i}.attn_output.weight", (h, heads * head_dim), quantize=True)
        add(f"blk.{i}.ffn_gate.weight", (ffn, h), quantize=True)
        add(f"blk.{i}.ffn_up.weight", (ffn, h), quantize=True)
        add(f"blk.{i}.ffn_down.weight", (h, ffn), quantize=True)
    add("output_norm.weight", (h,), 0.1, offset=1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
