"""Grammar engines for structured output on ricllm's own tokenizer: llguidance vs xgrammar.

Both engines get SmolLM2-135M's tokenizer (the one ``Tokenizer.from_gguf`` builds, 49152 tokens,
EOS 0 and 2) and the same four constraints: the RAN decision schema, a larger schema (nested
objects, an array of objects, strings with maxLength), a choice of four strings and a regex. Per
engine it reports:

- whether it imports and masks with torch, and then transformers, made unimportable (the native
  runtime's process never imports torch), its declared dependencies and their installed size;
- tokenizer setup time, compile time per constraint and the first mask of a new matcher;
- the time to fill the next-token bitmask, median over the steps of a valid answer (its tokens as
  our tokenizer encodes it, then EOS), for 1, 8 and 32 matchers filled together (llguidance:
  ``LLExecutor`` + ``fill_next_token_bitmask_par``; xgrammar: ``BatchGrammarMatcher``), and the time
  to accept a token;
- forced tokens (llguidance ``compute_ff_tokens``, xgrammar ``find_jump_forward_tokens``): a decode
  of the decision answer that appends forced tokens without the model and lets the "model" pick the
  longest allowed token that continues the answer;
- the JSON form each engine generates by default and with its compact option (the forced prefix of
  the decision schema shows it).

The bitmask is int32 [N, 1536], bit j of word k allowing token 32k+j, in both engines, so applying it
to fp32 logits [N, 49152] is measured once, with numpy (what the native runtime would run), and with
the helpers the engines ship for reference. Configurations run interleaved, ``--repeats`` times (the
engines' order alternates); cells are the median over repeats with the range in brackets.
xgrammar is optional: without it the script measures llguidance and says so.

    python benchmarks/bench_grammar_engines.py [--repeats 5] [--threads 2] [--no-append]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

from benchmarks.results import publish  # noqa: E402

VOCAB = 49152
BATCHES = (1, 8, 32)

DECISION = {"type": "object",
            "properties": {"action": {"enum": ["offload", "hold", "escalate", "rebalance"]},
                           "cio_delta_db": {"type": "integer", "minimum": -6, "maximum": 6}},
            "required": ["action", "cio_delta_db"], "additionalProperties": False}
DECISION_ANSWER = '{"action":"escalate","cio_delta_db":-3}'

_ACTION = {"type": "object",
           "properties": {"action": {"enum": ["offload", "hold", "escalate", "rebalance"]},
                          "target_cell": {"type": "string", "maxLength": 32},
                          "cio_delta_db": {"type": "integer", "minimum": -6, "maximum": 6},
                          "reason": {"type": "string", "maxLength": 120}},
           "required": ["action", "target_cell", "cio_delta_db", "reason"], "additionalProperties": False}
LARGE = {"type": "object",
         "properties": {"cell_id": {"type": "string", "maxLength": 32},
                        "severity": {"enum": ["info", "minor", "major", "critical"]},
                        "summary": {"type": "string", "maxLength": 160},
                        "kpis": {"type": "object",
                                 "properties": {"prb_util_pct": {"type": "number", "minimum": 0, "maximum": 100},
                                                "ue_count": {"type": "integer", "minimum": 0},
                                                "rsrp_dbm": {"type": "number"}},
                                 "required": ["prb_util_pct", "ue_count", "rsrp_dbm"],
                                 "additionalProperties": False},
                        "actions": {"type": "array", "minItems": 1, "maxItems": 4, "items": _ACTION},
                        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                        "needs_human": {"type": "boolean"}},
         "required": ["cell_id", "severity", "summary", "kpis", "actions", "confidence", "needs_human"],
         "additionalProperties": False}
LARGE_ANSWER = json.dumps({
    "cell_id": "gNB-0042/cell-3", "severity": "major",
    "summary": "PRB utilisation above 90% for the last 5 minutes while the neighbour cell runs at 35%; "
               "handover failures are rising.",
    "kpis": {"prb_util_pct": 93.5, "ue_count": 187, "rsrp_dbm": -101.25},
    "actions": [{"action": "offload", "target_cell": "gNB-0042/cell-1", "cio_delta_db": 3,
                 "reason": "neighbour has headroom and overlapping coverage"},
                {"action": "hold", "target_cell": "gNB-0042/cell-2", "cio_delta_db": 0,
                 "reason": "already loaded above 80%"}],
    "confidence": 0.82, "needs_human": False}, separators=(",", ":"))
CHOICE = ["offload", "hold", "escalate", "rebalance"]
REGEX = r"cell-[0-9]{1,5}: (offload|hold|escalate|rebalance) [+-][0-6] dB \([a-z ]{1,40}\)"
REGEX_ANSWER = "cell-1234: offload +3 dB (high prb load)"

CONSTRAINTS = {  # name -> (kind, value, a valid answer)
    "decision schema": ("json", DECISION, DECISION_ANSWER),
    "larger schema": ("json", LARGE, LARGE_ANSWER),
    "choice of 4": ("choice", CHOICE, "escalate"),
    "regex": ("regex", REGEX, REGEX_ANSWER),
}
WALKS = ("decision schema", "larger schema")  # answers walked for the per-token mask time


# ---------------------------------------------------------------------------------------------
# the two engines behind one small interface


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, threads: int) -> None:
        import llguidance
        import llguidance.numpy as lln
        self.llg, self.lln = llguidance, lln
        self.version = metadata.version("llguidance")
        started = time.perf_counter()
        self.lt = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=sorted(tok.eos_token_ids))
        self.setup_s = time.perf_counter() - started
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def grammar(self, kind: str, value, compact: bool = True) -> str:
        m = self.llg.LLMatcher
        if kind == "json":
            return m.grammar_from_json_schema(value, defaults={"whitespace_flexible": False} if compact else None)
        if kind == "choice":
            return self.llg.grammar_from("choice", json.dumps(value))
        return m.grammar_from_regex(value)

    def compile(self, kind: str, value, compact: bool = True):
        """llguidance has no compiled-grammar object: building a matcher from the grammar text is
        the compile, paid by each request (the lexer is built lazily, at the first masks)."""
        grammar = self.grammar(kind, value, compact)
        matcher = self.llg.LLMatcher(self.lt, grammar)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {matcher.get_error()}")
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.lt, compiled)

    def fill(self, matchers: list, bitmask: np.ndarray, loop: bool = False) -> None:
        if loop or len(matchers) == 1:
            for i, m in enumerate(matchers):
                self.lln.fill_next_token_bitmask(m, bitmask, i)
        else:
            self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def forced_tokens(self, matcher) -> list[int]:
        return matcher.compute_ff_tokens()

    def forced_text(self, matcher) -> str:
        return matcher.compute_ff_bytes().decode("utf-8", "replace")


XGR_COMPACT = {"any_whitespace": False, "separators": (",", ":")}


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, threads: int) -> None:
        import xgrammar
        self.xgr = xgrammar
        self.version = metadata.version("xgrammar")
        started = time.perf_counter()
        # TokenizerInfo.from_huggingface wants a transformers tokenizer; the constructor takes the
        # encoded (byte-level, "Ġ" for space) vocabulary, which our tokenizers.Tokenizer has.
        encoded = [tok.backend.id_to_token(i) for i in range(tok.backend.get_vocab_size())]
        self.info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=VOCAB,
                                           stop_token_ids=sorted(tok.eos_token_ids), add_prefix_space=False)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.setup_s = time.perf_counter() - started
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, value, compact: bool = True):
        if kind == "json":
            return self.compiler.compile_json_schema(value, **(XGR_COMPACT if compact else {}))
        if kind == "choice":  # no choice API: an EBNF alternation, as vLLM builds it
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in value))
        return self.compiler.compile_regex(value)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: np.ndarray, loop: bool = False) -> None:
        # a numpy int32 array is accepted (DLPack); allocate_token_bitmask would return a torch tensor
        if loop or len(matchers) == 1:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def forced_tokens(self, matcher) -> list[int]:
        return matcher.find_jump_forward_tokens()

    def forced_text(self, matcher) -> str:
        return matcher.find_jump_forward_string()


def have_xgrammar() -> str | None:
    """None when xgrammar imports here, else why not."""
    try:
        import xgrammar  # noqa: F401
    except ImportError as exc:  # not installed, or a dependency of it missing
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------------------------------
# measurements


def new_bitmask(n: int) -> np.ndarray:
    return np.full((n, (VOCAB + 31) // 32), -1, dtype=np.int32)


def allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def time_compile(engine, kind: str, value, times: int) -> tuple[float, float]:
    """(compile s, first mask of a new matcher s), medians of ``times`` fresh compiles."""
    compiles, firsts = [], []
    bitmask = new_bitmask(1)
    for _ in range(times):
        started = time.perf_counter()
        compiled = engine.compile(kind, value)
        compiles.append(time.perf_counter() - started)
        matcher = engine.matcher(compiled)
        started = time.perf_counter()
        engine.fill([matcher], bitmask)
        firsts.append(time.perf_counter() - started)
    return statistics.median(compiles), statistics.median(firsts)


def time_new_matcher(engine, compiled, times: int = 20) -> float:
    started = time.perf_counter()
    for _ in range(times):
        engine.matcher(compiled)
    return (time.perf_counter() - started) / times


def walk(engine, compiled, tokens: list[int], n: int, loop: bool = False) -> tuple[float, float, np.ndarray]:
    """``n`` new matchers step through ``tokens`` (then EOS) together: (median s per batch fill, or
    per loop of single fills with ``loop``, median s per accepted token, the masks of matcher 0)."""
    matchers = [engine.matcher(compiled) for _ in range(n)]
    bitmask = new_bitmask(n)
    fills, accepts, masks = [], [], []
    for step, token in enumerate(tokens):
        started = time.perf_counter()
        engine.fill(matchers, bitmask, loop)
        fills.append(time.perf_counter() - started)
        masks.append(bitmask[0].copy())
        for row in range(n):
            if not allowed(bitmask, row, token):
                raise RuntimeError(f"{engine.name}: token {token} (step {step}) masked out in row {row}")
        started = time.perf_counter()
        for m in matchers:
            if not engine.accept(m, token):
                raise RuntimeError(f"{engine.name}: token {token} (step {step}) refused")
        accepts.append((time.perf_counter() - started) / n)
    return statistics.median(fills), statistics.median(accepts), np.stack(masks)


def forced_decode(engine, compiled, answer: str, vocab_bytes: dict[int, bytes], by_bytes: dict[bytes, int],
                  ours: list[int]) -> tuple[int, int, int]:
    """Decode ``answer`` with jump-forward: forced tokens are appended without the model; otherwise
    the "model" picks the longest allowed token that continues the answer. (forced, sampled, forced
    tokens in runs that are not ``ours``, our tokenizer's encoding of the answer, at that place)."""
    target = answer.encode()
    at, offset = {}, 0  # byte offset -> index of our token starting there
    for i, t in enumerate(ours):
        at[offset] = i
        offset += len(vocab_bytes[t])
    other = 0
    longest = max(len(b) for b in by_bytes)
    matcher, bitmask = engine.matcher(compiled), new_bitmask(1)
    produced, forced, sampled = b"", 0, 0
    while True:
        ff = engine.forced_tokens(matcher)
        if ff:
            for token in ff:
                if not engine.accept(matcher, token):
                    raise RuntimeError(f"{engine.name}: forced token {token} refused")
            i = at.get(len(produced))
            if i is None or ours[i:i + len(ff)] != list(ff):
                other += len(ff)
            produced += b"".join(vocab_bytes[t] for t in ff)
            forced += len(ff)
            if not target.startswith(produced):
                raise RuntimeError(f"{engine.name}: forced tokens left the answer: {produced!r}")
            continue
        rest = target[len(produced):]
        if not rest:
            return forced, sampled, other  # only EOS is left
        engine.fill([matcher], bitmask)
        for size in range(min(longest, len(rest)), 0, -1):
            token = by_bytes.get(rest[:size])
            if token is not None and allowed(bitmask, 0, token):
                break
        else:
            raise RuntimeError(f"{engine.name}: no allowed token continues {rest[:20]!r}")
        if not engine.accept(matcher, token):
            raise RuntimeError(f"{engine.name}: token {token} refused")
        produced += vocab_bytes[token]
        sampled += 1


def apply_numpy(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """Masked-out logits to -inf, in place: the bits unpacked to one byte a token, then putmask."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, count=logits.shape[-1], bitorder="little")
    np.putmask(logits, bits == 0, -np.inf)


def time_apply(fn, logits: np.ndarray, bitmask: np.ndarray, loops: int) -> float:
    work = logits.copy()
    fn(work, bitmask)  # warm
    started = time.perf_counter()
    for _ in range(loops):
        np.copyto(work, logits)
        fn(work, bitmask)
    copy_started = time.perf_counter()
    for _ in range(loops):
        np.copyto(work, logits)
    copy_s = time.perf_counter() - copy_started
    return max(0.0, (copy_started - started - copy_s) / loops)


# ---------------------------------------------------------------------------------------------
# the import check runs in a fresh interpreter with torch (then transformers) made unimportable

IMPORT_CHECK = r"""
import json, sys, traceback
from pathlib import Path
engine, tok_path, blocked = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (made unimportable for this check)")
        return None
sys.meta_path.insert(0, _Block())
schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
try:
    import numpy as np, tokenizers
    backend = tokenizers.Tokenizer.from_file(tok_path)
    bitmask = np.full((1, (backend.get_vocab_size() + 31) // 32), -1, dtype=np.int32)
    if engine == "llguidance":
        import llguidance, llguidance.numpy as lln
        lt = llguidance.LLTokenizer(backend.to_str(), eos_token=[0, 2])
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(schema))
        lln.fill_next_token_bitmask(m, bitmask)
    else:
        import xgrammar as xgr
        vocab = [backend.id_to_token(i) for i in range(backend.get_vocab_size())]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, stop_token_ids=[0, 2])
        xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(schema)).fill_next_token_bitmask(bitmask)
    loaded = sorted({n.split(".")[0] for n in sys.modules} & {"torch", "transformers", "triton"})
    print(json.dumps({"ok": True, "loaded": loaded}))
except Exception as exc:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" in f.filename]
    where = f"{Path(frames[-1].filename).parent.name}/{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    print(json.dumps({"ok": False, "error": str(exc), "where": where}))
"""


def import_check(engine: str, tok_path: str, blocked: str) -> str:
    out = subprocess.run([sys.executable, "-c", IMPORT_CHECK, engine, tok_path, blocked],
                         check=False, capture_output=True, text=True, timeout=120)
    try:
        result = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return f"check failed: {out.stderr.strip()[-200:]}"
    if result["ok"]:
        return "yes" + (f" (but loaded {', '.join(result['loaded'])})" if result["loaded"] else "")
    return f"no: `{result['where']}` imports {blocked.split(',')[0]}"


def dist_size_mb(name: str) -> float | None:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    total = 0
    for f in dist.files or []:
        path = f.locate()
        if path.is_file():
            total += path.stat().st_size
    return total / 2**20


def dependencies(name: str) -> str:
    """The distribution's unconditional Requires-Dist (extras left out), each with its installed size."""
    parts = []
    for req in metadata.requires(name) or []:
        if "extra ==" in req:
            continue
        dep = req.split(";")[0].strip()
        base = dep.split("[")[0]
        for sep in "<>=!~ ":
            base = base.split(sep)[0]
        size = dist_size_mb(base)
        parts.append(f"{dep} ({size:.0f} MB)" if size is not None else f"{dep} (not installed)")
    return ", ".join(parts) if parts else "none"


# ---------------------------------------------------------------------------------------------


def cpu_line() -> str:
    model = ""
    try:
        out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True, timeout=10).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                      if line.startswith("Model name")), "")
    except (OSError, subprocess.SubprocessError):
        pass
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    amx = sorted(f for f in flags if f.startswith("amx"))
    avx512 = "avx512f" in flags
    return (f"lscpu model name: {model or 'unknown'}; AMX: {'yes (' + ', '.join(amx) + ')' if amx else 'no'}; "
            f"AVX-512: {'yes' if avx512 else 'no'}")


def spread(values: list[float], scale: float, digits: int) -> str:
    """'median [min–max]' of ``values`` times ``scale``."""
    v = sorted(x * scale for x in values)
    med = statistics.median(v)
    if len(v) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{v[0]:.{digits}f}–{v[-1]:.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="threads for llguidance's LLExecutor and xgrammar's compiler and batch matcher")
    parser.add_argument("--compiles", type=int, default=5, help="compiles per constraint per repeat")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()

    import gguf

    from ricllm.model.loader import resolve_model_path
    from ricllm.model.tokenizer import Tokenizer

    path = resolve_model_path(None)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert tok.backend.get_vocab_size() == VOCAB, tok.backend.get_vocab_size()
    load_start = os.getloadavg()[0]
    missing = have_xgrammar()
    kinds = [Llguidance] + ([Xgrammar] if missing is None else [])
    names = [k.name for k in kinds]

    tokens = {name: tok.encode(CONSTRAINTS[name][2], add_special_tokens=False) + [min(tok.eos_token_ids)]
              for name in WALKS}
    res: dict[tuple, list[float]] = {}

    def add(key: tuple, value: float) -> None:
        res.setdefault(key, []).append(value)

    facts: dict[str, dict[str, str]] = {n: {} for n in names}
    apply_masks = None
    for r in range(args.repeats):
        order = kinds if r % 2 == 0 else kinds[::-1]
        for kind in order:
            engine = kind(tok, args.threads)
            n = engine.name
            facts[n]["version"] = engine.version
            add((n, "setup"), engine.setup_s)
            compiled = {}
            for cname, (ckind, value, _) in CONSTRAINTS.items():
                c, first = time_compile(engine, ckind, value, args.compiles)
                add((n, "compile", cname), c)
                add((n, "first", cname), first)
                compiled[cname] = engine.compile(ckind, value)
            add((n, "new matcher"), time_new_matcher(engine, compiled["decision schema"]))
            for wname in WALKS:
                for b in BATCHES:
                    fill, accept, masks = walk(engine, compiled[wname], tokens[wname], b)
                    add((n, "fill", wname, b), fill)
                    if b == max(BATCHES):
                        add((n, "loop", wname, b), walk(engine, compiled[wname], tokens[wname], b, loop=True)[0])
                    if b == 1:
                        add((n, "accept", wname), accept)
                        if wname == "decision schema":
                            first = np.nonzero(np.unpackbits(masks[0].view(np.uint8), bitorder="little"))[0]
                            shown = ", ".join(f"`{tok.backend.id_to_token(int(t))}`" for t in first[:4])
                            facts[n]["first allowed"] = f"{len(first)}: {shown}" + (" ..." if len(first) > 4 else "")
                        if wname == "larger schema" and apply_masks is None:
                            apply_masks = masks
            if r == 0:
                facts[n]["engine"] = engine
                facts[n]["compiled"] = compiled
        # applying a mask is the same work whatever engine filled it
        rows = np.stack([apply_masks[i % len(apply_masks)] for i in range(max(BATCHES))])
        rng = np.random.default_rng(r)
        for b in BATCHES:
            logits = rng.standard_normal((b, VOCAB)).astype(np.float32)
            bitmask = np.ascontiguousarray(rows[:b])
            add(("apply", "numpy", b), time_apply(apply_numpy, logits, bitmask, 200 // b + 5))
            import llguidance.numpy as lln
            add(("apply", "llguidance.numpy", b),
                time_apply(lln.apply_token_bitmask_inplace, logits, bitmask, 40 // b + 3))
            if missing is None:
                import torch
                import xgrammar
                tl, tb = torch.from_numpy(logits.copy()), torch.from_numpy(bitmask)

                def xgr_apply(work, _bm, tl=tl, tb=tb):
                    xgrammar.apply_token_bitmask_inplace(tl, tb)

                add(("apply", "xgrammar (torch CPU)", b), time_apply(xgr_apply, logits, bitmask, 200 // b + 5))

    # the numpy apply must agree with the bits
    logits = np.zeros((1, VOCAB), np.float32)
    apply_numpy(logits, apply_masks[:1])
    for t in range(0, VOCAB, 61):
        assert (logits[0, t] == 0) == allowed(apply_masks, 0, t)

    # forced tokens and the generated JSON form (deterministic: once)
    vocab_bytes, by_bytes = {}, {}
    lt = facts["llguidance"]["engine"].lt
    for t in range(VOCAB):
        if lt.is_special_token(t):
            continue
        b = lt.decode_bytes([t])
        vocab_bytes[t] = b
        by_bytes.setdefault(b, t)
    answer_tokens = len(tokens["decision schema"]) - 1
    for n in names:
        engine, compiled = facts[n]["engine"], facts[n]["compiled"]
        forced, sampled, other = forced_decode(engine, compiled["decision schema"], DECISION_ANSWER, vocab_bytes,
                                               by_bytes, tokens["decision schema"][:-1])
        facts[n]["forced"] = (f"{forced} forced + {sampled} sampled (our encoding: {answer_tokens} tokens); "
                              f"forced tokens not as our tokenizer encodes the answer: {other}")
        m = engine.matcher(compiled["decision schema"])
        facts[n]["ff start"] = engine.forced_text(m)
        facts[n]["ff default"] = engine.forced_text(engine.matcher(engine.compile("json", DECISION, compact=False)))
        if n == "xgrammar":
            facts[n]["ff no-ws"] = engine.forced_text(engine.matcher(
                engine.compiler.compile_json_schema(DECISION, any_whitespace=False)))

    with tempfile.TemporaryDirectory() as tmp:
        tok_path = str(Path(tmp) / "tokenizer.json")
        tok.backend.save(tok_path)
        for n in ["llguidance", "xgrammar"]:
            facts.setdefault(n, {})
            facts[n]["no torch"] = import_check(n, tok_path, "torch,triton") if n in names else "-"
            facts[n]["no transformers"] = import_check(n, tok_path, "transformers") if n in names else "-"

    # ---- the tables
    def cell(n, *key, scale=1e3, digits=2):
        return spread(res[(n, *key)], scale, digits) if (n, *key) in res else "-"

    cols = ["llguidance", "xgrammar"]
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    def f(n, key, default="-"):
        return facts.get(n, {}).get(key, default)

    row("version", [f(n, "version", "not installed") for n in cols])
    row("imports and masks with torch unimportable", [f(n, "no torch") for n in cols])
    row("... with transformers unimportable", [f(n, "no transformers") for n in cols])
    sizes = {n: dist_size_mb(n) for n in cols}
    row("installed size", [f"{sizes[n]:.1f} MB" if sizes[n] is not None else "-" for n in cols])
    row("required packages (Requires-Dist, installed size)", [dependencies(n) if sizes[n] is not None else "-"
                                                              for n in cols])
    row("bitmask it fills", ["numpy int32 [N, 1536] (via its pointer)",
                             "any DLPack int32 array (numpy works); its allocate/apply helpers are torch"])
    row("tokenizer setup (ms)", [cell(n, "setup", digits=1) for n in cols])
    for cname in CONSTRAINTS:
        row(f"compile: {cname} (ms)", [cell(n, "compile", cname, digits=2) for n in cols])
    for cname in CONSTRAINTS:
        row(f"first mask of a new matcher: {cname} (ms)", [cell(n, "first", cname, digits=3) for n in cols])
    row("new matcher from the compiled decision schema (µs)",
        [f"{cell(n, 'new matcher', scale=1e6, digits=1)}" + (" (this is the compile: no compiled object)"
                                                            if n == "llguidance" else "") for n in cols])
    for wname in WALKS:
        steps = len(tokens[wname])
        for b in BATCHES:
            label = f"mask fill, {wname} ({steps} steps), {b} matcher{'s' if b > 1 else ''} (µs per step)"
            row(label, [cell(n, "fill", wname, b, scale=1e6, digits=1) for n in cols])
            if b == max(BATCHES):
                row(f"... the same {b}, one fill call each, in a loop (µs per step)",
                    [cell(n, "loop", wname, b, scale=1e6, digits=1) for n in cols])
        row(f"accept a token, {wname} (µs)", [cell(n, "accept", wname, scale=1e6, digits=1) for n in cols])
    row("forced tokens, decision answer (jump-forward)", [f(n, "forced") for n in cols])
    row("tokens the first mask of the decision answer allows", [f(n, "first allowed") for n in cols])
    row("forced prefix at the start, default options",
        [f"`{f(n, 'ff default')}`" if n in names else "-" for n in cols])
    row("... with the compact option",
        ["`" + f("llguidance", "ff start") + "` (`whitespace_flexible: False`)",
         (f"`{f('xgrammar', 'ff start')}` (`any_whitespace=False, separators=(',', ':')`); "
          f"`any_whitespace=False` alone: `{f('xgrammar', 'ff no-ws')}`") if "xgrammar" in names else "-"])

    apply_lines = ["| apply mask to fp32 logits [N, 49152] (µs) | N = " + " | N = ".join(map(str, BATCHES)) + " |",
                   "|---|" + "---:|" * len(BATCHES)]
    for method in ("numpy", "llguidance.numpy", "xgrammar (torch CPU)"):
        if ("apply", method, 1) in res:
            label = {"numpy": "numpy: `unpackbits` + `putmask`",
                     "llguidance.numpy": "`llguidance.numpy.apply_token_bitmask_inplace`",
                     "xgrammar (torch CPU)": "`xgrammar.apply_token_bitmask_inplace` (torch tensors, CPU)"}[method]
            apply_lines.append(f"| {label} | " + " | ".join(spread(res[("apply", method, b)], 1e6, 1)
                                                           for b in BATCHES) + " |")

    note = "" if missing is None else f"\n\nxgrammar not measured: it does not import here ({missing})."
    body = ("\n".join(lines) + "\n\n" + "\n".join(apply_lines) + note + "\n")
    details = (f"CPU: {cpu_line()}. Tokenizer: SmolLM2-135M's from `{path.name}` ({VOCAB} tokens, EOS "
               f"{sorted(tok.eos_token_ids)}). {args.repeats} repeats, engines interleaved; cells are median "
               f"[min–max] over repeats; compile times are each repeat's median of {args.compiles} fresh compiles "
               f"(xgrammar's cache off); mask fill times are each repeat's median over the answer's steps "
               f"(the answer as our tokenizer encodes it, then EOS); N matchers walk the same answer, filled "
               f"by one batch call ({args.threads} threads) for N > 1. Apply times use masks from the larger "
               f"schema's walk. JSON constraints compiled in the compact form. Load average (1 min) "
               f"{load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (this benchmark keeps about "
               f"one core busy; the rest is other processes on the machine).")
    publish("Grammar engine for structured output", details, body, append=not args.no_append)


if __name__ == "__main__":
    main()
