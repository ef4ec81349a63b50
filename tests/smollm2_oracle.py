"""The default model's HF fp32 oracle figures, which the packed-weight checks hold every format and
kernel family to: HF's greedy choice at each position of ricllm's fp32 continuation of ``PROMPTS``,
and the perplexity of ``TEXT``.

They are computed once per pytest session and kept in a file (``conftest.smollm2_oracle_file``). A
child pytest run that a test starts on another CPU's kernels (``tests/test_avx2_only.py``) is given
that file in ``ORACLE_FILE_ENV``: HF fp32 is the oracle whatever the CPU, so the child measures only
its own kernels.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

ORACLE_FILE_ENV = "RICLLM_TEST_SMOLLM2_ORACLE"

PROMPTS = [
    "The O-RAN near-real-time RIC hosts xApps that",
    "Cell 17 reports RRU.PrbUsedDl=92 of 106 PRBs and DRB.UEThpDl=12000 kbps. The load is",
    "Photosynthesis is the process by which plants",
    "Here is a short story about a lighthouse keeper who",
]
CONTINUATION = 128

TEXT = (
    "Radio access networks connect phones, sensors and cars to the core network through base "
    "stations spread across a city. Each base station serves a few cells, and each cell shares a "
    "limited number of physical resource blocks among the users it serves. When many users are "
    "active at the same time, the resource blocks run out, throughput drops and calls may fail. "
    "Operators therefore watch key performance indicators such as resource block usage, the number "
    "of connected users and the downlink throughput of every cell, often once per second. "
    "The O-RAN Alliance opened this control loop to third parties: a near-real-time RAN intelligent "
    "controller runs small applications, called xApps, that read these indicators and adjust the "
    "network within ten milliseconds to one second. An xApp may hand users over to a neighbouring "
    "cell, change the transmit power, or switch off a carrier at night to save energy. Because the "
    "decisions must arrive in time, every xApp has to answer within a strict deadline, and an answer "
    "that comes too late is worth nothing. Language models can explain what they see in plain words, "
    "but they are large and slow, so engineers keep them small, quantize their weights and share the "
    "memory of their attention cache between many requests."
)


def compute_oracle_figures(path: Path, hf_model) -> dict:
    """``{"choices": [(prompt + 128 greedy tokens, positions, HF's argmax at each), ...], "perplexity":
    TEXT's perplexity under HF fp32}``.

    The continuation comes from ricllm with dense fp32 weights, whose greedy tokens are HF's
    (test_smollm2); the oracle's choices come from one teacher-forced HF forward pass, which is much
    cheaper on two cores than HF's own token-by-token generation.
    """
    from ricllm import LLM, SamplingParams

    reference = LLM(str(path), dtype="float32", kv_cache_budget="64MiB", weight_cache=False)
    assert reference.engine.runtime.weight_formats == ("dense", "dense")  # auto packs only with bf16
    choices = []
    for out in reference.generate(PROMPTS, SamplingParams(max_tokens=CONTINUATION, ignore_eos=True)):
        full = out.prompt_token_ids + out.token_ids
        positions = list(range(len(out.prompt_token_ids) - 1, len(full) - 1))
        with torch.no_grad():
            choices.append((full, positions, hf_model(torch.tensor([full])).logits[0, positions].argmax(-1)))
    ids = reference.tokenizer.encode(TEXT)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
    return {"choices": choices, "perplexity": math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())}
