"""Tiny tokenizers written as GGUF metadata, for tests that must not depend on a real model.

``add_tiny_tokenizer(writer)`` puts a ~300-token GPT-2 style byte-level BPE vocabulary (the
shape SmolLM2 uses) into a ``gguf.GGUFWriter``; tiny random models reuse it. Ids 0..255 are the
256 single bytes (id == byte value), then merged tokens, then the special tokens.
``add_tiny_spm_tokenizer(writer)`` does the same for a SentencePiece-style ``llama`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Applied in this order; each result is a vocabulary token. Digit and space merges make the
# pre-tokenizer visible in the ids (e.g. "Ġ1" exists only where spaces may join digits).
TINY_MERGES = (
    "Ġ t", "h e", "Ġ a", "i n", "Ġt he", "e r", "o n", "Ġ s", "r e", "a t", "e n", "o r",
    "Ġ w", "Ġ o", "i s", "l l", "Ġ b", "Ġ h", "i t", "Ġ i", "e s", "a n", "o u", "Ġ c",
    "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "Ġ 1", "1 2", "12 3", "Ġw or", "l d", "Ġwor ld", "h i",
    "Ġ he", "ll o", "Ġhe llo", "Ġ T", "T he", "Ġ 8", "8 7", "' s", "Ã ©",
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_USER_DEFINED_TOKENS = ("<think>",)


@dataclass(frozen=True)
class TinyTokenizerInfo:
    """What a model writer needs to size its embedding and set its special ids."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE stores tokens in this form)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def tiny_bpe_tokens() -> tuple[list[str], list[str]]:
    """(tokens, merges) of the tiny byte-level vocabulary, specials last."""
    spelled = bytes_to_unicode()
    tokens = [spelled[b] for b in range(256)]
    for merge in TINY_MERGES:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens, f"merge {merge!r} uses an unknown token"
        tokens.append(left + right)
    tokens += list(TINY_SPECIAL_TOKENS) + list(TINY_USER_DEFINED_TOKENS)
    return tokens, list(TINY_MERGES)


def add_tiny_tokenizer(
    writer: gguf.GGUFWriter, pre: str = "gpt-2", chat_template: str | None = CHATML_TEMPLATE,
    pad_vocab_to: int = 1,
) -> TinyTokenizerInfo:
    """Write a tiny byte-level BPE tokenizer (model "gpt2") into ``writer``'s metadata.

    ``pre`` is the tokenizer.ggml.pre value; "gpt-2" (llama.cpp's spelling) is read the same by
    llama.cpp, transformers and ricllm. BOS = <|im_start|>, EOS = PAD = <|im_end|>, no BOS added.
    """
    tokens, merges = tiny_bpe_tokens()
    base = len(tokens)
    tokens = tokens + [f"<|unused_{i}|>" for i in range(-len(tokens) % pad_vocab_to)]  # as real vocabularies pad
    types = [gguf.TokenType.NORMAL] * base + [gguf.TokenType.UNUSED] * (len(tokens) - base)
    for token in TINY_SPECIAL_TOKENS:
        types[tokens.index(token)] = gguf.TokenType.CONTROL
    for token in TINY_USER_DEFINED_TOKENS:
        types[tokens.index(token)] = gguf.TokenType.USER_DEFINED
    info = TinyTokenizerInfo(
        vocab_size=len(tokens),
        bos_token_id=tokens.index("<|im_start|>"),
        eos_token_id=tokens.index("<|im_end|>"),
        pad_token_id=tokens.index("<|im_end|>"),
    )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(info.bos_token_id)
    writer.add_eos_token_id(info.eos_token_id)
    writer.add_unk_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(info.pad_token_id)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    return info


# SentencePiece pieces with their scores: higher scores merge first.
TINY_SPM_PIECES = (
    "▁t", "he", "▁the", "in", "▁a", "er", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁he",
    "llo", "▁hello", "▁▁", "is", "▁is", "at", "en", "on", "▁T", "▁The",
)
TINY_SPM_CHARS = "▁abcdefghijklmnopqrstuvwxyzTHW.,!?'"


def add_tiny_spm_tokenizer(writer: gguf.GGUFWriter, pad_vocab_to: int = 1) -> TinyTokenizerInfo:
    """Write a tiny SentencePiece-style tokenizer (model "llama", byte fallback) into ``writer``.

    <unk>=0, <s>=1 (added at the start), </s>=2, then <0x00>..<0xFF>, then pieces and characters,
    then unused tokens up to a multiple of ``pad_vocab_to``.
    """
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = list(dict.fromkeys(TINY_SPM_PIECES)) + [c for c in TINY_SPM_CHARS if c not in TINY_SPM_PIECES]
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-float(rank) if len(piece) > 1 else -1000.0 - rank)
    unused = -len(tokens) % pad_vocab_to  # as real vocabularies pad
    tokens += [f"<unused{i}>" for i in range(unused)]
    types += [gguf.TokenType.UNUSED] * unused
    scores += [0.0] * unused
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    return TinyTokenizerInfo(vocab_size=len(tokens), bos_token_id=1, eos_token_id=2, pad_token_id=2)


def write_tokenizer_only_gguf(path: Path, add_tokenizer=add_tiny_tokenizer, **kwargs) -> Path:
    """A GGUF holding only tokenizer metadata (transformers loads a tokenizer from that alone)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    add_tokenizer(writer, **kwargs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_tokenizer_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a tokenizer-only GGUF with the tiny byte-level BPE vocabulary."""
    return write_tokenizer_only_gguf(tmp_path_factory.mktemp("tiny_tok") / "tiny.gguf")
