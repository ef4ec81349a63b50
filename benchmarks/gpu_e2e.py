"""SmolLM2-shaped model end to end on a GPU: decode tok/s with the Triton vs the torch backend.

Imports only torch (and Triton through the kernels): the GPU machine has none of ricllm's other
dependencies, so the model is random with SmolLM2's shape instead of the GGUF, and the batch
metadata is built here instead of by the scheduler.
"""

from __future__ import annotations

import time

import torch

from ricllm.attention.backends import select_backend
from ricllm.attention.metadata import AttentionMetadata
from ricllm.cache.kv_cache import KVCache, plan_cache
from ricllm.cache.kv_format import kv_format
from ricllm.engine.runtime.llama import LlamaModel
from ricllm.model.spec import ModelSpec

SMOLLM2 = ModelSpec(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, name="SmolLM2-135M (random)")


def random_model(backend_name: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaModel:
    model = LlamaModel.build(SMOLLM2, select_backend(backend_name, device), dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32) * 0.05)
    return model


def step_metadata(context_lens: list[int], num_new: list[int], block_size: int, blocks_per_seq: int,
                  device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
    """Sequence ``i`` owns blocks ``i*blocks_per_seq ...``; returns positions and metadata."""
    positions, slots, starts = [], [], [0]
    for i, (ctx, n) in enumerate(zip(context_lens, num_new)):
        for p in range(ctx - n, ctx):
            positions.append(p)
            slots.append((i * blocks_per_seq + p // block_size) * block_size + p % block_size)
        starts.append(starts[-1] + n)
    tables = [[i * blocks_per_seq + j for j in range(blocks_per_seq)] for i in range(len(context_lens))]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(num_new), max_context_len=max(context_lens))
    return torch.tensor(positions, dtype=torch.int64, device=device), meta


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_throughput(backend_name: str, batch: int, prompt_len: int, steps: int,
                      dtype: torch.dtype = torch.bfloat16, block_size: int = 16,
                      device: str = "cuda") -> tuple[float, torch.Tensor]:
    """Aggregate decode tok/s over ``steps`` steps after a ``prompt_len`` prefill, and the first decode
    step's logits (later steps may pick different tokens per backend, so only the first compares)."""
    device = torch.device(device)
    model = random_model(backend_name, dtype, device)
    blocks_per_seq = -(-(prompt_len + steps + 1) // block_size)
    budget = SMOLLM2.kv_bytes_per_token(2) * block_size * blocks_per_seq * batch
    cache = KVCache(SMOLLM2, plan_cache(SMOLLM2, budget, block_size, kv_format("auto", str(dtype))), dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, SMOLLM2.vocab_size, (batch * prompt_len,), generator=gen, device=device)
    positions, meta = step_metadata([prompt_len] * batch, [prompt_len] * batch, block_size, blocks_per_seq, device)
    hidden = model(tokens, positions, cache.layers, meta)
    next_ids = model.compute_logits(hidden.view(batch, prompt_len, -1)[:, -1]).argmax(-1)
    _sync(device)
    elapsed, first_logits = 0.0, None
    for step in range(steps):
        ctx = prompt_len + step + 1
        positions, meta = step_metadata([ctx] * batch, [1] * batch, block_size, blocks_per_seq, device)
        _sync(device)
        start = time.perf_counter()
        logits = model.compute_logits(model(next_ids, positions, cache.layers, meta))
        next_ids = logits.argmax(-1)
        _sync(device)
        if first_logits is None:
            first_logits = logits.float().clone()
        if step >= 2:  # first steps compile / warm up
            elapsed += time.perf_counter() - start
    return batch * (steps - 2) / elapsed, first_logits


def end_to_end_table(prompt_len: int = 512, steps: int = 34) -> list[str]:
    lines = [f"SmolLM2 shape (random weights), bf16, {prompt_len}-token prompts, greedy decode of {steps} steps",
             "", "| batch | torch backend (tok/s) | triton backend (tok/s) | triton / torch | max |Δlogit| |",
             "|---:|---:|---:|---:|---:|"]
    for batch in (1, 64):
        torch_tps, torch_logits = decode_throughput("torch", batch, prompt_len, steps)
        triton_tps, triton_logits = decode_throughput("triton", batch, prompt_len, steps)
        diff = (torch_logits - triton_logits).abs().max().item()
        lines.append(f"| {batch} | {torch_tps:.0f} | {triton_tps:.0f} | {triton_tps / torch_tps:.2f}× | {diff:.3g} |")
    return lines
