"""Training a LoRA adapter on a template's labelled examples (``ricllm.replay.adapt``) with HF
transformers and ``peft`` on the CPU, and judging it.

The base model is HF transformers' reading of the same checkpoint ricllm serves (a GGUF file
or an HF folder), in fp32. The adapter is plain LoRA on q, k, v, o, gate, up and down, saved in
the PEFT layout that ``ricllm.model.lora.load_lora_adapter`` reads. Accuracy is the share of
rows whose answer, among every answer the policy can give, is the one the model finds most
likely (the sum of its tokens' log-probabilities after the chat request): the choice a
constrained decoder makes between the policy's answers, without running the engine. Judging
computes the tokens every request shares (the system prompt, or a template's conversation) once,
as a pinned template is served, and each row's request once, its answers branching after it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import itertools
import json
import random
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ricllm.model.spec import ModelSpec
from ricllm.model.tokenizer import Tokenizer
from ricllm.replay.adapt import (IGNORE_INDEX, Example, TemplatePolicy, TokenizedExample, answer_ids,
                                 request_ids, tokenize_example)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MANIFEST = "ricllm_adapt.json"
# What transformers and peft say of a GGUF read as an HF model and of a LoRA wrapped around it: nothing a
# user can act on (ricllm reads no HF tokenizer config and turns no checkpointing on), so not printed.
THIRD_PARTY_NOISE = ((FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
                     (UserWarning, r"Could not find a config file in"))


@dataclass(frozen=True)
class TrainingSettings:
    rank: int = 8
    alpha: int = 16
    steps: int = 100
    batch_size: int = 8
    learning_rate: float = 1e-3
    seed: int = 0
    bf16: bool = False  # products in bf16 (torch's CPU autocast), weights, adapter and optimizer in fp32
    schedule: str = "constant"  # the learning rate over the steps: constant, or cosine down to zero at the last
    average_last: float = 0.0  # keep the mean of the weights over this share of the last steps (0: the last step's)


def bf16_training(asked: str) -> tuple[bool, str]:
    """Whether training multiplies in bf16 for ``asked`` (``auto``, ``float32``, ``bfloat16``), and why:
    ``auto`` takes bf16 where the CPU multiplies it in hardware, about 1.4 times the fp32 steps on
    2 cores of an AVX-512 BF16 CPU; elsewhere torch would widen each bf16 product to fp32, slower than
    fp32 itself."""
    from ricllm.kernels.cpu_library import cpu_bf16

    if asked != "auto":
        return asked == "bfloat16", f"asked for {asked}"
    has, why = cpu_bf16()
    return has, f"auto: {'the CPU multiplies bf16' if has else 'the CPU does not multiply bf16'} ({why})"


@dataclass
class TrainingResult:
    losses: list[float] = field(default_factory=list)


def load_base_model(path: Path, spec: ModelSpec | None = None, progress: bool = True):
    """HF transformers' model of ``path`` (a .gguf file or an HF folder), fp32, for training. For a
    Gemma 3 GGUF, ``spec`` (ricllm's reading of the file) gives what HF's GGUF reader leaves at its
    defaults: the attention scale (``query_pre_attn_scalar``, 256 there, the head dim of Gemma 3 270M
    but not of every Gemma 3) and the final logit softcap, so the model trained is the one ricllm serves.
    ``progress``: transformers' own bars while it reads the file (its GGUF reader's takes no setting,
    so without them what it writes to stderr meanwhile is dropped)."""
    from transformers import AutoModelForCausalLM

    with contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO()):
        if path.is_dir():
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        scalar = None if spec is None else spec.query_pre_attn_scalar
        read_as_served = {} if spec is None or spec.architecture != "gemma3" else {  # HF's config takes a whole scalar
            "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
            "final_logit_softcapping": spec.final_logit_softcapping}
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                    **read_as_served)


def head_logits(network, hidden: torch.Tensor) -> torch.Tensor:
    """The head's logits of ``hidden``, fp32, capped as the model's own forward caps them
    (``c · tanh(logits / c)`` where its config sets ``final_logit_softcapping``, as Gemma's may)."""
    logits = network.lm_head(hidden).float()
    cap = getattr(network.config, "final_logit_softcapping", None)
    return logits if cap is None else cap * torch.tanh(logits / cap)


def with_lora(model, settings: TrainingSettings):
    """``model`` wrapped by PEFT with a fresh LoRA adapter on every projection of every layer."""
    import peft

    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0,
                             target_modules=list(LORA_TARGETS), bias="none")
    torch.manual_seed(settings.seed)
    with _quiet_third_party():
        return peft.get_peft_model(model, config)


def collate(batch: Sequence[TokenizedExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids, their attention mask, and labels ``IGNORE_INDEX`` on the prompt and padding."""
    width = max(len(item.input_ids) for item in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, item in enumerate(batch):
        n = len(item.input_ids)
        ids[row, :n] = torch.tensor(item.input_ids)
        labels[row, :n] = torch.tensor(item.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _batches(items: Sequence[TokenizedExample], settings: TrainingSettings) -> Iterator[list[TokenizedExample]]:
    """Batches over the examples in a seeded order, reshuffled on each pass."""
    rng = random.Random(settings.seed)
    order: list[int] = []
    while True:
        if len(order) < settings.batch_size:
            order += rng.sample(range(len(items)), len(items))
        yield [items[i] for i in order[:settings.batch_size]]
        order = order[settings.batch_size:]


def unit_batches(items: Sequence[TokenizedExample], units: Sequence[Sequence[int]],
                  settings: TrainingSettings) -> Iterator[list[TokenizedExample]]:
    """Batches of whole units (a report and its twin, or a report alone) in a seeded order,
    reshuffled on each pass: a unit that would not fit the batch starts the next one, so a batch
    may be one short of ``batch_size``."""
    rng = random.Random(settings.seed)
    batch: list[int] = []
    while True:
        for unit in rng.sample(list(units), len(units)):
            if batch and len(batch) + len(unit) > settings.batch_size:
                yield [items[i] for i in batch]
                batch = []
            batch += unit


def train(model, tokenizer: Tokenizer, system: str, examples: Sequence[Example], settings: TrainingSettings,
          progress: bool = True, units: Sequence[Sequence[int]] | None = None) -> TrainingResult:
    """AdamW over the LoRA weights for ``settings.steps`` batches; the loss of each step. ``units``
    (indices into ``examples``, each example in one) are kept together in a batch."""
    from tqdm import tqdm

    items = [tokenize_example(tokenizer, system, example) for example in examples]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    shared = _common_len([item.input_ids for item in items], min(item.prompt_len for item in items) - 1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.learning_rate)
    rate = learning_rate_schedule(optimizer, settings)
    model.train()
    result = TrainingResult()
    bar = tqdm(range(settings.steps), desc="training", unit="step", disable=not progress)
    batches = _batches(items, settings) if units is None else unit_batches(items, units, settings)
    trained = [p for p in model.parameters() if p.requires_grad]
    average = WeightAverage(trained) if settings.average_last > 0 else None
    averaged_from = settings.steps - max(round(settings.average_last * settings.steps), 1)
    for step in bar:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            loss = batch_loss(model, next(batches), shared, pad_id)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        rate.step()
        if average is not None and step >= averaged_from:
            average.add(trained)
        result.losses.append(loss.item())
        bar.set_postfix(loss=f"{result.losses[-1]:.4f}")
    if average is not None:
        average.write_to(trained)
    model.eval()
    return result


class WeightAverage:
    """The running mean of a set of tensors over the snapshots added. A constant learning rate leaves
    an adapter wherever its last few noisy steps put it, and a threshold the policy draws (PRB usage
    below 50 %) lands on either side of the rows near it by the seed; the mean over the last steps
    sits in the middle of that walk."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.sums = [torch.zeros_like(t, dtype=torch.float64) for t in tensors]
        self.count = 0

    @torch.no_grad()
    def add(self, tensors: Sequence[torch.Tensor]) -> None:
        for total, tensor in zip(self.sums, tensors):
            total += tensor.detach().double()
        self.count += 1

    @torch.no_grad()
    def write_to(self, tensors: Sequence[torch.Tensor]) -> None:
        for total, tensor in zip(self.sums, tensors):
            tensor.copy_((total / self.count).to(tensor.dtype))


def learning_rate_schedule(optimizer, settings: TrainingSettings):
    """``constant``: ``learning_rate`` at every step. ``cosine``: from ``learning_rate`` at the first
    step down to zero after the last, so the adapter a run ends with is not the last of a noisy walk
    at full step size: what it learnt moves little over its final steps."""
    if settings.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=settings.steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def batch_loss(model, batch: Sequence[TokenizedExample], shared: int, pad_id: int) -> torch.Tensor:
    """Mean cross-entropy over the batch's answer tokens. The first ``shared`` tokens, the same in
    every item (the system prompt), run once and their K/V serve every row, gradients included:
    the same loss as running each item whole, for about half the work on short requests."""
    network = model.get_base_model() if hasattr(model, "get_base_model") else model
    past = None
    if shared:
        out = network.model(input_ids=torch.tensor([batch[0].input_ids[:shared]]), use_cache=True)
        past = out.cache if hasattr(out, "cache") else out.past_key_values
        past.batch_repeat_interleave(len(batch))
    suffixes = [TokenizedExample(i.input_ids[shared:], i.labels[shared:], i.prompt_len - shared) for i in batch]
    logits, targets, _ = answer_logits(model, collate(suffixes, pad_id), past)
    return torch.nn.functional.cross_entropy(logits, targets)


@torch.no_grad()
def predict(model, tokenizer: Tokenizer, system: str | Sequence[Mapping[str, str]], template: TemplatePolicy,
            examples: Sequence[Example], progress: bool = True) -> list[dict[str, Any]]:
    """For each example, the policy's answer the model finds most likely after the chat request
    (``system``: a one-line system prompt, or the conversation a template starts with)."""
    answers = template.answers
    scores = answer_scores(model, tokenizer, system, [template.answer_text(a) for a in answers], examples, progress)
    return [answers[max(range(len(row)), key=row.__getitem__)] for row in scores]


@dataclass(frozen=True)
class _Branches:
    """One row to judge: ``stem`` its request after the prefix every row shares, then the tokens
    every answer starts with; ``tails`` each answer's remaining tokens."""

    stem: list[int]
    tails: list[list[int]]


def answer_scores(model, tokenizer: Tokenizer, system: str | Sequence[Mapping[str, str]], texts: Sequence[str],
                  examples: Sequence[Example], progress: bool = True,
                  tokens_per_batch: int = 8192) -> list[list[float]]:
    """Per example, each answer's log-probability after the request, up to a term every answer
    of that row shares: the tokens all its answers start with (``{"action":"``) add the same to
    each, so only the tails are read. The prefix every request shares runs once; each row's stem
    once; its answers' tails as a batch after the stem's K/V. Rows whose stems have one length
    run together, so nothing is padded but the tails' ends."""
    from tqdm import tqdm

    prompts = [request_ids(tokenizer, system, example.user) for example in examples]
    shared = _common_len(prompts, min(len(p) for p in prompts) - 1)
    rows = []
    for prompt, example in zip(prompts, examples):
        answered = [answer_ids(tokenizer, system, example.user, text) for text in texts]
        common = _common_len(answered, min(len(a) for a in answered) - 1)
        rows.append(_Branches(prompt[shared:] + answered[0][:common], [a[common:] for a in answered]))
    network = model.get_base_model() if hasattr(model, "get_base_model") else model
    past = prefix_cache(model, prompts[0][:shared]) if shared else None
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].stem))
    per_batch = max(1, tokens_per_batch // (len(texts) * (shared + max(len(r.stem) for r in rows) + 8)))
    groups = [group[start:start + per_batch] for _, same in itertools.groupby(order, key=lambda i: len(rows[i].stem))
              for group in [list(same)] for start in range(0, len(group), per_batch)]
    scores: list[list[float]] = [[] for _ in rows]
    for group in tqdm(groups, desc="judging", unit="batch", disable=not progress):
        for i, row_scores in zip(group, _branch_scores(network, past, [rows[i] for i in group])):
            scores[i] = row_scores
    return scores


def _common_len(sequences: Sequence[Sequence[int]], limit: int) -> int:
    """How many leading tokens every sequence has in common, at most ``limit``."""
    n = 0
    while n < limit and all(seq[n] == sequences[0][n] for seq in sequences):
        n += 1
    return n


def _branch_scores(network, past, rows: Sequence[_Branches]) -> list[list[float]]:
    """Each row's answers' summed tail log-probabilities: the stems (one length) run as a batch
    after ``past``, then every row's tails after its stem's K/V."""
    branches = len(rows[0].tails)
    out = network.model(input_ids=torch.tensor([row.stem for row in rows]), use_cache=True,
                        **_with_cache(network, _repeated(past, len(rows))))
    first = torch.log_softmax(head_logits(network, out.last_hidden_state[:, -1]), dim=-1)
    tails = [tail for row in rows for tail in row.tails]
    width = max(len(tail) for tail in tails)
    later = None
    if width > 1:  # a tail's last token is only predicted, never read
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        cache.batch_repeat_interleave(branches)
        ids = torch.tensor([tail[:-1] + [tail[0]] * (width - len(tail)) for tail in tails])  # padding never read
        hidden = network.model(input_ids=ids, use_cache=True, **_with_cache(network, cache)).last_hidden_state
        later = torch.log_softmax(head_logits(network, hidden), dim=-1)
    scores = []
    for j, tail in enumerate(tails):
        score = first[j // branches, tail[0]].item()
        score += sum(later[j, k - 1, tail[k]].item() for k in range(1, len(tail)))
        scores.append(score)
    return [scores[r * branches:(r + 1) * branches] for r in range(len(rows))]


def _repeated(past, rows: int):
    """A copy of a prefix's K/V for ``rows`` rows (None stays None)."""
    if past is None:
        return None
    copied = copy.deepcopy(past)
    copied.batch_repeat_interleave(rows)
    return copied


def _with_cache(network, cache) -> dict[str, Any]:
    """The keyword that hands ``cache`` to the installed transformers' model ({} for none)."""
    return {} if cache is None else {_cache_argument(network): cache}


def prefix_cache(model, ids: Sequence[int]):
    """The K/V of ``ids`` (a batch of one), for batches read after them."""
    network = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = network.model(input_ids=torch.tensor([list(ids)]), use_cache=True)
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _cache_argument(network) -> str:
    """The name the installed transformers gives a model's K/V cache argument."""
    return "cache" if "cache" in inspect.signature(network.model.forward).parameters else "past_key_values"


def answer_logits(model, batch: dict[str, torch.Tensor], past=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's logits at the positions that predict a labelled token only (the answer's few,
    not every prompt position over the whole vocabulary), those tokens, and each one's row.
    ``past``: the K/V of a prefix every row of the batch continues (one row per batch row)."""
    network = model.get_base_model() if hasattr(model, "get_base_model") else model
    mask, cached = batch["attention_mask"], {}
    if past is not None:
        before = torch.ones((mask.shape[0], past.get_seq_length()), dtype=mask.dtype)
        mask, cached = torch.cat([before, mask], dim=1), {**_with_cache(network, past), "use_cache": True}
    hidden = network.model(input_ids=batch["input_ids"], attention_mask=mask, **cached).last_hidden_state
    targets = batch["labels"][:, 1:]
    keep = targets != IGNORE_INDEX
    rows = torch.arange(targets.shape[0]).unsqueeze(1).expand_as(targets)[keep]
    return head_logits(network, hidden[:, :-1][keep]), targets[keep], rows


def answer_log_probs(model, batch: dict[str, torch.Tensor]) -> list[float]:
    """Each row's summed log-probability of its labelled tokens (the whole request run)."""
    logits, targets, rows = answer_logits(model, batch)
    picked = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.zeros(batch["input_ids"].shape[0]).index_add_(0, rows, picked).tolist()


def accuracy(predicted: Sequence[dict[str, Any]], examples: Sequence[Example]) -> float:
    return sum(p == e.expected for p, e in zip(predicted, examples)) / len(examples)


def save_adapter(model, out: Path, manifest: dict[str, Any]) -> Path:
    """The adapter in PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``) and
    ``ricllm_adapt.json``: what it was trained on and how."""
    out.mkdir(parents=True, exist_ok=True)
    with _quiet_third_party():
        model.save_pretrained(str(out))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


@contextlib.contextmanager
def _quiet_third_party() -> Iterator[None]:
    """Within it, ``THIRD_PARTY_NOISE`` is not shown; every other warning still is."""
    with warnings.catch_warnings():
        for category, message in THIRD_PARTY_NOISE:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
