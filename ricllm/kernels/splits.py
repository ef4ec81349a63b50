"""Split-K heuristic shared by the Triton and CUDA decode kernels (torch only, no triton).

A decode program handles one (sequence, KV head, split). When ``batch * n_kv`` programs are
too few to keep every SM streaming, each context is cut into ``num_splits`` runs whose
partial outputs a second kernel merges; the extra traffic is ``num_splits * n_heads * d``
floats per sequence, negligible next to the K/V bytes.
"""

from __future__ import annotations

import functools

import torch

# Aim for this many programs per SM (several resident programs hide the gather latency).
TARGET_PROGRAMS_PER_SM = 4
# No split shorter than this many keys: shorter runs cost more in merging than they gain.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Number of streaming multiprocessors of CUDA device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, n_kv: int, max_context_len: int, device: torch.device) -> int:
    """Context splits per sequence so that ``batch * n_kv * splits`` programs fill the GPU.

    Target: ``TARGET_PROGRAMS_PER_SM`` programs per SM. 1 (the one-pass path) off CUDA, or when
    the batch alone gives at least half the target: there, splitting would only add a second,
    mostly idle wave of programs and the merge. Otherwise enough splits to reach the target,
    no split shorter than ``MIN_TOKENS_PER_SPLIT`` keys. Always in ``[1, MAX_SPLITS]``.
    Untuned guesses (no GPU measurement yet): ``benchmarks/gpu_kernels.py --tune`` checks them.
    """
    if device.type != "cuda":
        return 1
    target = TARGET_PROGRAMS_PER_SM * sm_count(device.index if device.index is not None
                                               else torch.cuda.current_device())
    programs = max(1, batch * n_kv)
    if 2 * programs >= target:
        return 1
    by_length = max(1, max_context_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(-(-target // programs), by_length, MAX_SPLITS))
