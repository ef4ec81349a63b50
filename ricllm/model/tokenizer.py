"""Tokenizer and chat template for GGUF files and HF model folders.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, merges and special token ids as
``tokenizer.ggml.*`` metadata. We rebuild a ``tokenizers.Tokenizer`` from that metadata, so the
fast Rust BPE does the work and ids match HF transformers for the same vocabulary.

Pre-tokenization follows the ``tokenizer.ggml.pre`` value the way llama.cpp (the reference runtime
for GGUF) defines it, which is also what each model's original ``tokenizer.json`` does. One known
case where transformers' own GGUF loader differs: it has no entry for ``smollm`` (and ``starcoder``,
``default``, ...) and falls back to plain GPT-2 splitting, so it never isolates digits. The two then
disagree on whitespace runs before a digit (``"Steps:\\n\\n1."`` -> ``ĊĊ 1`` for the model,
``Ċ Ċ 1`` for transformers). Pass ``pre="gpt-2"`` to :meth:`Tokenizer.from_gguf` to reproduce
transformers exactly.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

if TYPE_CHECKING:  # jinja2 is imported when a chat template first renders: a start never needs it
    from ricllm.model.gguf_file import GGUFFile
    import jinja2
    import jinja2.sandbox

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Texts that end a turn or a document. llama.cpp stops on these too ("end of generation" tokens),
# so a chat model whose GGUF names <|endoftext|> as EOS still stops at <|im_end|>.
END_OF_TURN_TEXTS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<｜end▁of▁sentence｜>",
)

# --- pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe applies them (src/llama-vocab.cpp) ---
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"

# Each family: the regexes applied one after another (each splits the pieces the previous one left,
# keeping matches and gaps as pieces), and whether a pre-token found whole in the vocab skips BPE.
_PRE_FAMILIES: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False),
    "gpt2": ((_GPT2,), False),
    "starcoder": ((r"\p{N}", _GPT2), False),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"), False),
    "llama3": ((_LLAMA3,), True),
    "llama3-merges": ((_LLAMA3,), False),
    "qwen2": ((_QWEN2,), False),
    "tekken": ((_TEKKEN,), True),
    "gpt4o": ((_GPT4O,), False),
    "poro": ((_PORO,), False),
    "viking": ((_PORO, r"\p{N}"), False),
}

# tokenizer.ggml.pre value -> family, as llama.cpp's llama_vocab::load maps them.
_PRE_ALIASES: dict[str, str] = {
    **dict.fromkeys(("", "default"), "default"),
    **dict.fromkeys((
        "gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
        "a.x-4.0", "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion",
        "granite-docling", "jina-v1-en", "jina-v2-code", "roberta-bpe",
    ), "gpt2"),
    **dict.fromkeys((
        "starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
    ), "starcoder"),
    "falcon": "falcon",
    **dict.fromkeys((
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
        "jina-v5-nano",
    ), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), "llama3-merges"),
    **dict.fromkeys((
        "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
    ), "qwen2"),
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o"),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), "poro"),
    "viking": "viking",
}

SUPPORTED_GGUF_MODELS = ("gpt2", "llama")


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model.

    Build it with :meth:`from_gguf` or :meth:`from_hf_dir`; the constructor takes an already
    configured ``tokenizers.Tokenizer`` plus the facts the files state about special tokens.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.bos_token = self.id_to_token(bos_token_id)
        self.eos_token = self.id_to_token(eos_token_id)
        self.pad_token = self.id_to_token(pad_token_id)
        self.unk_token = self.id_to_token(unk_token_id)
        # Where tokenizer.json brings a post-processor it adds BOS/EOS itself; otherwise we do.
        self._manual_specials = backend.post_processor is None
        if self._manual_specials:
            if add_bos_token and bos_token_id is None:
                raise ValueError("the tokenizer says add_bos_token but names no BOS token")
            if add_eos_token and eos_token_id is None:
                raise ValueError("the tokenizer says add_eos_token but names no EOS token")
            self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        else:
            self.add_bos_token, self.add_eos_token = self._probe_post_processor()
        self.eos_token_ids: set[int] = self._end_of_generation_ids(extra_eos_token_ids)
        self.chat_template = chat_template
        self._compiled_template: tuple[str, jinja2.Template] | None = None  # (source, compiled)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, reader: "GGUFFile", pre: str | None = None) -> "Tokenizer":
        """Rebuild the tokenizer a GGUF file describes in its ``tokenizer.ggml.*`` metadata.

        ``pre`` overrides the file's ``tokenizer.ggml.pre`` (e.g. ``"gpt-2"`` to match
        transformers' GGUF loader on files it has no pre-tokenizer entry for).
        """
        meta = _GgufTokenizerMeta(reader)
        if meta.model == "gpt2":
            backend = _byte_level_bpe(meta, meta.pre if pre is None else pre)
        elif meta.model == "llama":
            backend = _sentencepiece_bpe(meta)
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {meta.model!r} (tokenizer.ggml.model); "
                f"supported: {', '.join(SUPPORTED_GGUF_MODELS)}"
            )
        _add_gguf_special_tokens(backend, meta)
        return cls(
            backend,
            bos_token_id=meta.get("bos_token_id"),
            eos_token_id=meta.get("eos_token_id"),
            pad_token_id=meta.get("padding_token_id"),
            unk_token_id=meta.get("unknown_token_id"),
            add_bos_token=meta.add_bos(pre),
            add_eos_token=bool(meta.get("add_eos_token", False)),
            chat_template=reader.fields.get("tokenizer.chat_template"),
            extra_eos_token_ids=[
                i for i in (meta.get("eot_token_id"), meta.get("eom_token_id")) if i is not None
            ],
        )

    def to_state(self) -> dict:
        """Plain JSON-able data from which :meth:`from_state` rebuilds this tokenizer exactly."""
        return {"backend": self._backend.to_str(), "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
                "unk_token_id": self.unk_token_id, "add_bos_token": self.add_bos_token,
                "add_eos_token": self.add_eos_token, "chat_template": self.chat_template,
                "extra_eos_token_ids": sorted(self.eos_token_ids - {self.eos_token_id})}

    @classmethod
    def from_state(cls, state: dict) -> "Tokenizer":
        kwargs = dict(state)
        return cls(_Backend.from_str(kwargs.pop("backend")), **kwargs)

    def to_compact_state(self) -> CompactState | None:
        """:meth:`to_state` with a BPE vocabulary and its merges taken out of the backend's JSON, as
        plain lists that :meth:`from_compact_state` hands to ``models.BPE``: that builds the same
        tokenizer in well under half the time of parsing them from the JSON (SmolLM2: 80-110 ms).
        None where the backend has no such form (not BPE, ids with gaps, an added token outside
        the vocabulary) or the rebuilt tokenizer would differ in any way: keep :meth:`to_state`."""
        whole = self._backend.to_str()
        backend = json.loads(whole)
        model = backend["model"]
        if model.get("type") != "BPE":
            return None
        vocab: dict[str, int] = model["vocab"]
        tokens = sorted(vocab, key=vocab.__getitem__)
        added = backend.get("added_tokens") or []
        if ([vocab[t] for t in tokens] != list(range(len(tokens)))
                or any(vocab.get(t["content"]) != t["id"] for t in added)):
            return None
        merges = [(vocab[left], vocab[right]) for left, right in map(_merge_pair, model["merges"])]
        # the skeleton's vocabulary keeps what parsing it must resolve: the added tokens' ids and the unk token
        kept = {t["content"] for t in added} | ({model["unk_token"]} & vocab.keys())
        model["vocab"], model["merges"] = {t: vocab[t] for t in kept}, []
        compact = CompactState(dict(self.to_state(), backend=json.dumps(backend, ensure_ascii=False)), tokens, merges)
        rebuilt = Tokenizer.from_compact_state(compact.state, tokens, [m[0] for m in merges], [m[1] for m in merges])
        return compact if rebuilt.to_state() == self.to_state() else None

    @classmethod
    def from_compact_state(cls, state: dict, tokens: list[str], left: Sequence[int],
                           right: Sequence[int]) -> Tokenizer:
        """The tokenizer :meth:`to_compact_state` took apart: ``tokens`` in id order, merge ``i``
        joins ``tokens[left[i]]`` and ``tokens[right[i]]``. The skeleton is parsed first, so its
        added tokens keep their ids; then the whole BPE model replaces its stub."""
        kwargs = dict(state)
        skeleton = kwargs.pop("backend")
        backend = _Backend.from_str(skeleton)
        options = {k: v for k, v in json.loads(skeleton)["model"].items()
                   if k not in ("type", "vocab", "merges") and v is not None}  # None: the default
        merges = list(zip(map(tokens.__getitem__, left), map(tokens.__getitem__, right)))
        backend.model = models.BPE(vocab=dict(zip(tokens, range(len(tokens)))), merges=merges, **options)
        return cls(backend, **kwargs)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load ``tokenizer.json`` plus ``tokenizer_config.json`` from an HF model folder.

        Like transformers, BOS/EOS come from the ``tokenizer.json`` post-processor unless
        ``tokenizer_config.json`` sets ``add_bos_token``/``add_eos_token`` explicitly.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        backend = _Backend.from_file(str(tokenizer_file))
        config = {**_read_json(folder / "special_tokens_map.json"), **_read_json(folder / "tokenizer_config.json")}
        ids = {name: _special_id(backend, config.get(f"{name}_token")) for name in ("bos", "eos", "pad", "unk")}
        explicit = "add_bos_token" in config or "add_eos_token" in config
        if explicit:  # transformers then rebuilds the post-processor from these flags
            backend.post_processor = None
        add_bos, add_eos = bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
        return cls(
            backend,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
            unk_token_id=ids["unk"],
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=_hf_chat_template(folder, config),
            extra_eos_token_ids=_generation_config_eos(folder),
        )

    def _probe_post_processor(self) -> tuple[bool, bool]:
        """(adds BOS, adds EOS) as tokenizer.json's post-processor really behaves."""
        probe = self._backend.encode("", add_special_tokens=True).ids
        adds_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        adds_eos = len(probe) > int(adds_bos) and probe[-1] == self.eos_token_id
        return adds_bos, adds_eos

    def _end_of_generation_ids(self, extra: Iterable[int]) -> set[int]:
        """EOS plus the end-of-turn tokens a chat model emits instead (llama.cpp's EOG set)."""
        found = {self.token_to_id(text) for text in END_OF_TURN_TEXTS}
        ids = (found | set(extra) | {self.eos_token_id}) - {None}
        return {int(i) for i in ids}

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; special tokens written in the text become their single id.

        ``add_special_tokens`` adds BOS/EOS only where the model asks for them.
        """
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._manual_specials:
            if self.add_bos_token:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; incomplete UTF-8 at either end shows as U+FFFD."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int | None) -> str | None:
        """The vocabulary string of one id (byte-level form for GPT-2 style vocabularies)."""
        return None if token_id is None else self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None when the vocabulary lacks it."""
        return self._backend.token_to_id(token)

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer`` (for batch encoding or offsets)."""
        return self._backend

    # ------------------------------------------------------------------ chat template

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template, as transformers does.

        Same sandboxed environment and variables (``bos_token``, ``eos_token``, ``raise_exception``,
        ``tools``/``documents`` = None unless given), so the prompt text is identical.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; build the prompt text yourself")
        if self._compiled_template is None or self._compiled_template[0] != self.chat_template:
            self._compiled_template = (self.chat_template, _chat_environment().from_string(self.chat_template))
        variables: dict[str, Any] = {"tools": None, "documents": None}
        for name in ("bos", "eos", "unk", "pad"):
            if (token := getattr(self, f"{name}_token")) is not None:
                variables[f"{name}_token"] = token
        variables.update(template_kwargs)
        return self._compiled_template[1].render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"add_bos_token={self.add_bos_token}, chat_template={self.has_chat_template})"
        )


@dataclass(frozen=True)
class CompactState:
    """What :meth:`Tokenizer.to_compact_state` gives: the state whose backend lacks the BPE vocabulary
    and merges, the vocabulary in id order, and the merges as (left, right) token ids in rank order."""

    state: dict
    tokens: list[str]
    merges: list[tuple[int, int]]


def _merge_pair(merge: str | list[str]) -> tuple[str, str]:
    """A merge as tokenizers serializes it: ``[left, right]`` (0.20 on) or ``"left right"`` before."""
    return _split_merge(merge) if isinstance(merge, str) else (merge[0], merge[1])


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text, emitting only text that can no longer change.

    Each step decodes a short window ending at the new token and emits the part past the text
    already emitted. A byte-level token can carry half of a UTF-8 character, so while the window's
    text ends in U+FFFD we hold back and wait for the rest of the bytes. A few prompt tokens give
    the window left context, so a leading space (SentencePiece ``▁``) comes out as it should.
    """

    _PROMPT_CONTEXT = 5
    _TRIM_AT = 4096

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids or [])[-self._PROMPT_CONTEXT:]
        self._prefix = 0  # window start: a few ids before the first not-yet-emitted one
        self._read = len(self._ids)  # ids before this are emitted
        self.output_token_ids: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> str:
        """Feed one generated id; return the newly stable text (often "", never retracted)."""
        self._ids.append(int(token_id))
        self.output_token_ids.append(int(token_id))
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self._ids))
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        return self._emit(after[len(before):])

    def finish(self) -> str:
        """Emit whatever is held back (an unfinished UTF-8 character shows as U+FFFD)."""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self._ids))
        return self._emit(after[len(before):]) if len(after) > len(before) else ""

    def _emit(self, delta: str) -> str:
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > self._TRIM_AT:  # keep the id list short on long generations
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self.text += delta
        return delta

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)


# ---------------------------------------------------------------------- GGUF helpers


class _GgufTokenizerMeta:
    """The ``tokenizer.ggml.*`` values of one file, read once."""

    def __init__(self, reader: "GGUFFile") -> None:
        self._reader = reader
        self.model: str | None = self.get("model")
        if self.model is None:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model missing)")
        self.pre: str = self.get("pre", "default")
        self.tokens: list[str] = self.get("tokens") or []
        if not self.tokens:
            raise ValueError("GGUF file has no tokenizer.ggml.tokens")
        self.token_types: list[int] | None = self.get("token_type")
        self.scores: list[float] | None = self.get("scores")
        self.merges: list[str] | None = self.get("merges")

    def get(self, name: str, default: Any = None) -> Any:
        return self._reader.fields.get(f"tokenizer.ggml.{name}", default)

    def add_bos(self, pre_override: str | None) -> bool:
        """The file's add_bos_token, else llama.cpp's default for this vocabulary type."""
        stated = self.get("add_bos_token")
        if stated is not None:
            return bool(stated)
        if self.model == "llama":
            return True
        pre = self.pre if pre_override is None else pre_override
        return _PRE_ALIASES.get(pre) in ("llama3", "tekken")

    def types_or_default(self) -> list[int]:
        """Token types; files without them get BOS/EOS/UNK/PAD/EOT marked as control tokens."""
        if self.token_types is not None:
            return list(self.token_types)
        types = [TOKEN_TYPE_NORMAL] * len(self.tokens)
        for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id"):
            if (i := self.get(key)) is not None and 0 <= i < len(types):
                types[i] = TOKEN_TYPE_CONTROL
        return types


def _byte_level_bpe(meta: _GgufTokenizerMeta, pre: str) -> _Backend:
    """GPT-2 style byte-level BPE: tokens are already in bytes_to_unicode form, merges are "a b"."""
    if meta.merges is None:
        raise ValueError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    family = _PRE_ALIASES.get(pre)
    if family is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
            f"supported: {', '.join(sorted(k for k in _PRE_ALIASES if k))}"
        )
    regexes, ignore_merges = _PRE_FAMILIES[family]
    vocab = {token: i for i, token in enumerate(meta.tokens)}
    merges = [_split_merge(m) for m in meta.merges]
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _split_merge(merge: str) -> tuple[str, str]:
    parts = merge.split(" ")
    if len(parts) != 2:
        raise ValueError(f"malformed GGUF merge {merge!r}: expected two tokens separated by one space")
    return parts[0], parts[1]


def _sentencepiece_bpe(meta: _GgufTokenizerMeta) -> _Backend:
    """SentencePiece-style BPE (``llama`` model): merges recovered from token scores, byte fallback.

    This is the shape of transformers' LlamaTokenizer: ``▁`` for spaces, one prefix ``▁`` at the
    start of the text when the file says add_space_prefix (default true, as in llama.cpp).
    """
    vocab = {token: i for i, token in enumerate(meta.tokens)}
    if meta.merges is not None:
        merges = [_split_merge(m) for m in meta.merges]
    elif meta.scores is not None:
        merges = _merges_from_scores(meta.tokens, meta.scores, vocab)
    else:
        raise ValueError("GGUF llama tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
    unk_id = meta.get("unknown_token_id")
    backend = _Backend(models.BPE(
        vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
        unk_token=meta.tokens[unk_id] if unk_id is not None else None,
    ))
    prefix = bool(meta.get("add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's "join into the best-scoring token" rule.

    Every way to cut a token into two vocabulary pieces is a merge, ranked by the token's score
    (ties: longer left piece first), exactly as transformers' ``generate_merges`` orders them.
    """
    ranked = []
    for token, score in zip(tokens, scores):
        cuts = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        cuts.sort(key=lambda cut: (vocab[cut[0]], vocab[cut[1]]))
        ranked.extend((score, left, right) for left, right in cuts)
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in ranked]


def _add_gguf_special_tokens(backend: _Backend, meta: _GgufTokenizerMeta) -> None:
    """Make control/unknown tokens special and user-defined ones plain added tokens.

    Either way the text is matched whole before BPE runs, so ``<|im_start|>`` is one id. The
    content is the vocab string itself, so each keeps its GGUF id.
    """
    special, added = [], []
    for token, kind in zip(meta.tokens, meta.types_or_default()):
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_TYPE_USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if added:
        backend.add_tokens(added)


# ---------------------------------------------------------------------- HF folder helpers


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _special_id(backend: _Backend, value: Any) -> int | None:
    """The id of a special token named in tokenizer_config.json (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    if not value:
        return None
    token_id = backend.token_to_id(value)
    if token_id is None:
        raise ValueError(f"special token {value!r} from tokenizer_config.json is not in the vocabulary")
    return token_id


def _hf_chat_template(folder: Path, config: dict) -> str | None:
    """The chat template: chat_template.jinja, chat_template.json or tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _generation_config_eos(folder: Path) -> list[int]:
    """Extra stop ids from generation_config.json (Llama 3 lists <|eot_id|> there)."""
    eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    if eos is None:
        return []
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])]


# ---------------------------------------------------------------------- chat template environment


@functools.cache
def _generation_tag() -> type:
    """Accept transformers' ``{% generation %}`` marker (it only tracks assistant spans there): a
    jinja2 extension, so the class is made on first use."""
    import jinja2.ext

    class _GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return _GenerationTag


def _raise_exception(message: str) -> None:
    import jinja2.exceptions

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """transformers' tojson: no HTML escaping, unicode kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """A sandboxed Jinja environment set up like transformers' chat template renderer."""
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tag(), jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
