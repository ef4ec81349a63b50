"""llama.cpp's side of ``bench_decisions.py``: the same prompts, the same constraint, the same GGUF.

The parent renders every request as ricllm does (its chat template, or the plain few-shot format of a
model without one) and sends the token ids, so both engines read identical input. Here each request
runs through llama-cpp-python greedily under a GBNF grammar made from the template's constraint
(``LlamaGrammar.from_json_schema`` for a JSON schema, alternatives for a choice), one at a time:
llama.cpp keeps the previous request's KV and evaluates only the tokens after the longest common
prefix, its own form of prefix caching for a template's shared system prompt and examples. Time to
decision is the median wall time of the first ``timed`` requests sent again after the pass, as the
parent measures ricllm's.

Run as a child (spec as JSON on stdin, one result line on stdout): its module level imports only the
standard library, so any python with llama-cpp-python runs it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

RESULT_MARK = "DECISIONS_RESULT "


def grammar_text(structured: dict) -> str:
    """The GBNF of a ``choice`` constraint; JSON schemas go through llama.cpp's own converter."""
    (kind, value), = structured.items()
    if kind != "choice":
        raise ValueError(f"no llama.cpp grammar for a {kind!r} constraint here (json and choice only)")
    return "root ::= " + " | ".join(json.dumps(option) for option in value)


def make_grammar(structured: dict):
    from llama_cpp import LlamaGrammar

    (kind, value), = structured.items()
    if kind == "json":
        return LlamaGrammar.from_json_schema(json.dumps(value), verbose=False)
    return LlamaGrammar.from_string(grammar_text(structured), verbose=False)


def answer(llm, tokens: list[int], grammar, max_tokens: int) -> tuple[str, str, float]:
    start = time.perf_counter()
    choice = llm.create_completion(tokens, max_tokens=max_tokens, temperature=0.0, grammar=grammar)["choices"][0]
    return choice["text"], choice["finish_reason"], (time.perf_counter() - start) * 1000


def run_variant(llm, variant: dict, timed: int) -> dict:
    grammar = make_grammar(variant["structured"])
    answers = [answer(llm, tokens, grammar, variant["max_tokens"]) for tokens in variant["prompts"]]
    again = [answer(llm, tokens, grammar, variant["max_tokens"])[2] for tokens in variant["prompts"][:timed]]
    return {"texts": [a[0] for a in answers], "finish_reasons": [a[1] for a in answers],
            "decision_ms": statistics.median(again)}


def main() -> None:
    spec = json.loads(sys.stdin.read())
    import llama_cpp

    longest = max(len(tokens) for variant in spec["variants"] for tokens in variant["prompts"])
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=longest + 64, n_batch=512, n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], flash_attn=spec["flash_attn"], verbose=False)
    results = [run_variant(llm, variant, spec["timed"]) for variant in spec["variants"]]
    system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    print(RESULT_MARK + json.dumps({"variants": results, "version": llama_cpp.__version__,
                                    "system_info": system_info, "omp_threads": os.environ.get("OMP_NUM_THREADS")}),
          flush=True)


if __name__ == "__main__":
    main()
