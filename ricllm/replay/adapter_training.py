"""Training a LoRA adapter on a template's labelled examples (``ricllm.replay.adapt``) with HF
transformers and ``peft`` on the CPU, and judging it.

The base model is HF transformers' reading of the same checkpoint ricllm serves (a GGUF file
or an HF folder), in fp32. The adapter is plain LoRA on q, k, v, o, gate, up and down, saved in
the PEFT layout that ``ricllm.model.lora.load_lora_adapter`` reads. Accuracy is the share of
rows whose answer, among every answer the policy can give, is the one the model finds most
likely (the sum of its tokens' log-probabilities after the chat request): the choice a
constrained decoder makes between the policy's answers, without running the engine. Judging
computes the tokens every request shares (the system prompt, or a template's conversation) once
and reads each batch after that prefix's K/V, as a pinned template is served.
"""

from __future__ import annotations

import copy
import inspect
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ricllm.model.tokenizer import Tokenizer
from ricllm.replay.adapt import (IGNORE_INDEX, Example, TemplatePolicy, TokenizedExample, answer_ids,
                                 request_ids, tokenize_example)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MANIFEST = "ricllm_adapt.json"


@dataclass(frozen=True)
class TrainingSettings:
    rank: int = 8
    alpha: int = 16
    steps: int = 100
    batch_size: int = 8
    learning_rate: float = 1e-3
    seed: int = 0


@dataclass
class TrainingResult:
    losses: list[float] = field(default_factory=list)


def load_base_model(path: Path):
    """HF transformers' model of ``path`` (a .gguf file or an HF folder), fp32, for training."""
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def with_lora(model, settings: TrainingSettings):
    """``model`` wrapped by PEFT with a fresh LoRA adapter on every projection of every layer."""
    import peft

    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0,
                             target_modules=list(LORA_TARGETS), bias="none")
    torch.manual_seed(settings.seed)
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


def train(model, tokenizer: Tokenizer, system: str, examples: Sequence[Example], settings: TrainingSettings,
          progress: bool = True) -> TrainingResult:
    """AdamW over the LoRA weights for ``settings.steps`` batches; the loss of each step."""
    from tqdm import tqdm

    items = [tokenize_example(tokenizer, system, example) for example in examples]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.learning_rate)
    model.train()
    result = TrainingResult()
    bar = tqdm(range(settings.steps), desc="training", unit="step", disable=not progress)
    batches = _batches(items, settings)
    for _ in bar:
        logits, targets, _ = answer_logits(model, collate(next(batches), pad_id))
        loss = torch.nn.functional.cross_entropy(logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        result.losses.append(loss.item())
        bar.set_postfix(loss=f"{result.losses[-1]:.4f}")
    model.eval()
    return result


@torch.no_grad()
def predict(model, tokenizer: Tokenizer, system: str | Sequence[Mapping[str, str]], template: TemplatePolicy,
            examples: Sequence[Example], batch_size: int = 16, progress: bool = True) -> list[dict[str, Any]]:
    """For each example, the policy's answer the model finds most likely after the chat request
    (``system``: a one-line system prompt, or the conversation a template starts with)."""
    from tqdm import tqdm

    answers = template.answers
    texts = [template.answer_text(answer) for answer in answers]
    items = []
    for example in examples:
        prompt = request_ids(tokenizer, system, example.user)
        for text in texts:
            answer = answer_ids(tokenizer, system, example.user, text)
            items.append(TokenizedExample(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer, len(prompt)))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    shared = shared_prefix_len(items)
    past = prefix_cache(model, items[0].input_ids[:shared]) if shared else None
    suffixes = [TokenizedExample(i.input_ids[shared:], i.labels[shared:], i.prompt_len - shared) for i in items]
    scores = []
    for start in tqdm(range(0, len(items), batch_size), desc="judging", unit="batch", disable=not progress):
        scores += _answer_log_probs(model, collate(suffixes[start:start + batch_size], pad_id), past)
    per_row = [scores[i:i + len(answers)] for i in range(0, len(scores), len(answers))]
    return [answers[max(range(len(row)), key=row.__getitem__)] for row in per_row]


def shared_prefix_len(items: Sequence[TokenizedExample]) -> int:
    """How many leading tokens every item has in common, short of the last prompt token (whose
    hidden state predicts the answer's first token, so it stays in each item)."""
    if not items:
        return 0
    first, limit = items[0].input_ids, min(item.prompt_len for item in items) - 1
    n = 0
    while n < limit and all(item.input_ids[n] == first[n] for item in items):
        n += 1
    return n


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
    ``past``: a prefix's K/V (``prefix_cache``) that every row of the batch continues."""
    network = model.get_base_model() if hasattr(model, "get_base_model") else model
    mask = batch["attention_mask"]
    if past is not None:
        rows = mask.shape[0]
        mask = torch.cat([torch.ones((rows, past.get_seq_length()), dtype=mask.dtype), mask], dim=1)
        past = copy.deepcopy(past)
        past.batch_repeat_interleave(rows)
    cached = {_cache_argument(network): past, "use_cache": True} if past is not None else {}
    hidden = network.model(input_ids=batch["input_ids"], attention_mask=mask, **cached).last_hidden_state
    targets = batch["labels"][:, 1:]
    keep = targets != IGNORE_INDEX
    rows = torch.arange(targets.shape[0]).unsqueeze(1).expand_as(targets)[keep]
    return network.lm_head(hidden[:, :-1][keep]).float(), targets[keep], rows


def _answer_log_probs(model, batch: dict[str, torch.Tensor], past=None) -> list[float]:
    """Each row's summed log-probability of its labelled tokens."""
    logits, targets, rows = answer_logits(model, batch, past)
    picked = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.zeros(batch["input_ids"].shape[0]).index_add_(0, rows, picked).tolist()


def accuracy(predicted: Sequence[dict[str, Any]], examples: Sequence[Example]) -> float:
    return sum(p == e.expected for p, e in zip(predicted, examples)) / len(examples)


def save_adapter(model, out: Path, manifest: dict[str, Any]) -> Path:
    """The adapter in PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``) and
    ``ricllm_adapt.json``: what it was trained on and how."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
