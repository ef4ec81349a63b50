"""Decision quality of small models on the bundled templates, and what constraining costs.

For each template of each scenario (default: ``default``) that declares a reference policy
(``expect``), KPI rows of the scenario's own trace are asked four ways: unconstrained or
constrained to the template's schema, zero-shot (the system prompt alone) or with the template's
worked examples; and a fifth where the template names a LoRA adapter (``adapter``, trained by its
recipe on first use, ``ricllm.replay.adapters``): constrained, behind the adapter's own short system
prompt, under the adapter. Rows: those of the window the replay scores (``pacing``: an adapter
trained on a trace's rows never saw them), where a threshold trigger that names the template fires
(the traffic the template gets), else a seeded sample of them. Each variant's time to decision is
the median E2E of its first requests sent one at a time. Each answer is judged as the replay report
judges it (valid: parses and matches the schema; correct: the policy's action for that row).
Then, on the first template with its examples, greedy and interleaved ``--repeats`` times:
- TTFT and E2E of one request at a time with prefix caching on (the template pinned) and off;
- engine steps with jump-forward on and off (forced tokens computed as one chunk or one per step);
- the per-step cost of masking: decode steps of N constrained streams vs N unconstrained ones.
The constrained variants without an adapter are asked again of llama.cpp (llama-cpp-python, greedy) on the
same GGUF, from the token ids ricllm renders, under a GBNF grammar of the same constraint
(``llamacpp_decisions.py``): its validity, correctness and time to decision beside ricllm's, and a table of
the two times. Greedy decoding, each model in its default runtime and weights on a CPU; `--models` names the models (SmolLM2-135M
and Gemma 3 270M by default), `--scenarios` the scenarios (every template with a policy), and each row gives the
majority class beside the model's figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # last: no folder of ours shadows an installed package

from benchmarks.engine_steps import full_decode_step_ms
from benchmarks.results import publish
from ricllm import LLM, LoRARequest, SamplingParams
from ricllm.model.loader import resolve_model_path
from ricllm.replay.adapters import TemplateAdapter, scenario_adapters
from ricllm.replay.expressions import Threshold
from ricllm.replay.loading import load_scenario, load_scenario_trace
from ricllm.replay.prompts import jinja_env, prompt_context
from ricllm.replay.templates import answer_check, scenario_policies, scenario_templates
from ricllm.structured.spec import StructuredSpec

# a reason of 20 to 400 characters: every token of it a sampling decision under the mask; only steps in
# which every stream decodes are timed, so constrained and unconstrained batches are the same size
FREE_TEXT = {"json": {"type": "object", "properties": {"reason": {"type": "string", "minLength": 20,
                                                                  "maxLength": 400}},
                      "required": ["reason"], "additionalProperties": False}}


@dataclass
class Case:
    user: str
    expected: dict


def template_cases(scenario, name: str, rows: list, limit: int, seed: int) -> list[Case]:
    policy = scenario_policies(scenario)[name]
    fires = [Threshold(t.threshold, scenario.trace_kpis()) for t in scenario.triggers
             if t.template == name and t.threshold]
    chosen = [r for r in rows if any(f(r.kpis) for f in fires)] if fires else list(rows)
    random.Random(seed).shuffle(chosen)
    prompt = jinja_env().from_string(scenario.prompts.user_prompt)
    return [Case(prompt.render(**prompt_context(r, template=name)), policy.expected(r.kpis)) for r in chosen[:limit]]


def scored_rows(scenario, rows: list) -> list:
    """The rows of the window the replay scores (``pacing.start_s`` on, for ``duration_s``)."""
    pacing = scenario.pacing
    end = math.inf if pacing.duration_s is None else pacing.start_s + pacing.duration_s
    return [r for r in rows if pacing.start_s <= r.time_s < end]


def judge(outputs, cases: list[Case], check) -> tuple[float, float]:
    valid = correct = 0
    for out, case in zip(outputs, cases):
        answer, problem = check.parse(out.text.strip()) if out.finish_reason == "stop" else (None, "length")
        valid += problem is None
        correct += problem is None and all(answer.get(k) == v for k, v in case.expected.items())
    return valid / len(cases), correct / len(cases)


TIMED_CASES = 8  # requests sent one at a time per variant for its time to decision
MAX_TOKENS = 32
THREADS = 2
RESULT_MARK = "DECISIONS_RESULT "  # llamacpp_decisions.py's result line
LLAMACPP_KINDS = ("json", "choice")  # constraints llamacpp_decisions.py turns into GBNF


@dataclass
class Variant:
    """One way of asking a template: its conversations, constraint and adapter."""

    shots: str
    label: str
    conversations: list
    structured: dict | None
    lora: LoRARequest | None = None


@dataclass
class Scored:
    """A variant's answers judged: one row of the accuracy table."""

    model: str
    engine: str
    scenario: str
    template: str
    variant: Variant
    rows: int
    majority: float
    valid: float
    correct: float
    decision_ms: float

    def row(self) -> str:
        error = math.sqrt(self.correct * (1 - self.correct) / self.rows)
        return (f"| {self.model} | {self.engine} | {self.scenario} | {self.template} | {self.variant.shots} | "
                f"{self.variant.label} | {self.rows} | {self.majority:.1%} | {self.valid:.1%} | "
                f"{self.correct:.1%} ± {error:.1%} | {self.decision_ms:.1f} |")


def template_variants(template, cases: list[Case], adapter: TemplateAdapter | None) -> list[Variant]:
    variants = [Variant(shots, label, [prefix + [{"role": "user", "content": c.user}] for c in cases], structured)
                for shots, prefix in (("zero-shot", template.message_list[:1]),
                                      (f"{template.num_examples} examples", template.message_list))
                for label, structured in (("unconstrained", None), ("constrained", template.structured))]
    if adapter is not None:
        system = [{"role": "system", "content": adapter.system_prompt}]
        variants.append(Variant(f"adapter {adapter.name}", "constrained",
                                [system + [{"role": "user", "content": c.user}] for c in cases], template.structured,
                                LoRARequest(adapter.name, str(adapter.folder))))
    return variants


def ask_template(llm: LLM, model: str, scenario, name: str, cases: list[Case],
                 adapter: TemplateAdapter | None) -> list[Scored]:
    template, check = scenario_templates(scenario)[name], answer_check(scenario.prompts.templates[name])
    scored = []
    for variant in template_variants(template, cases, adapter):
        params = SamplingParams(max_tokens=MAX_TOKENS, structured=variant.structured)
        outs = llm.chat(variant.conversations, params, lora_request=variant.lora)
        valid, correct = judge(outs, cases, check)
        decision_ms = statistics.median(
            llm.chat([c], params, lora_request=variant.lora)[0].e2e_s * 1000
            for c in variant.conversations[:TIMED_CASES])
        scored.append(Scored(model, f"ricllm {llm.engine.runtime.name}", scenario.name, name, variant, len(cases),
                             majority_share(cases), valid, correct, decision_ms))
    return scored


@dataclass
class Answer:
    """llama.cpp's answer, judged as ricllm's outputs are."""

    text: str
    finish_reason: str


def llamacpp_scores(python: str, llm: LLM, path: Path, asked: list[Scored],
                    cases: dict) -> tuple[list[Scored], str]:
    """The constrained variants without an adapter asked again of llama.cpp on the same GGUF, from the same
    token ids (``llamacpp_decisions.py`` in a child under ``python``); its rows and its build."""
    chosen = [s for s in asked if s.variant.lora is None and s.variant.structured is not None
              and StructuredSpec.parse(s.variant.structured).kind in LLAMACPP_KINDS]
    spec = {"model": str(path), "threads": THREADS, "flash_attn": False, "timed": TIMED_CASES,
            "variants": [{"structured": StructuredSpec.parse(s.variant.structured).to_wire(), "max_tokens": MAX_TOKENS,
                          "prompts": [llm.render_chat(c, add_generation_prompt=True) for c in s.variant.conversations]}
                         for s in chosen]}
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    child = subprocess.run([python, str(Path(__file__).with_name("llamacpp_decisions.py"))], input=json.dumps(spec),
                           capture_output=True, text=True, env=env, check=False)
    line = next((x for x in child.stdout.splitlines() if x.startswith(RESULT_MARK)), None)
    if line is None:
        raise SystemExit(f"bench_decisions: the llama.cpp child failed (exit {child.returncode}): "
                         f"{child.stderr.strip()[-2000:]}")
    result = json.loads(line[len(RESULT_MARK):])
    scored = []
    for s, answers in zip(chosen, result["variants"]):
        named = cases[s.scenario][s.template]
        outs = [Answer(t, r) for t, r in zip(answers["texts"], answers["finish_reasons"])]
        valid, correct = judge(outs, named, answer_check(load_scenario(s.scenario).prompts.templates[s.template]))
        scored.append(Scored(s.model, f"llama.cpp {result['version']}", s.scenario, s.template, s.variant, s.rows,
                             s.majority, valid, correct, answers["decision_ms"]))
    return scored, f"llama.cpp {result['version']} under {python} ({result['system_info']})"


def decision_ratios(scored: list[Scored]) -> list[str]:
    """Time to decision of ricllm against llama.cpp, variant by variant."""
    peers = {(s.model, s.scenario, s.template, s.variant.shots): s for s in scored if s.engine.startswith("llama")}
    lines = []
    for s in scored:
        peer = peers.get((s.model, s.scenario, s.template, s.variant.shots))
        if s.engine.startswith("ricllm") and peer is not None and s.variant.label == "constrained":
            lines.append(f"| {s.model} | {s.scenario} | {s.template} | {s.variant.shots} | {s.decision_ms:.1f} | "
                         f"{peer.decision_ms:.1f} | {peer.decision_ms / s.decision_ms:.2f}× | "
                         f"{s.correct:.1%} | {peer.correct:.1%} |")
    return lines


def majority_share(cases: list[Case]) -> float:
    counts: dict[str, int] = {}
    for case in cases:
        key = repr(sorted(case.expected.items()))
        counts[key] = counts.get(key, 0) + 1
    return max(counts.values()) / len(cases)


def timed_one_by_one(llm: LLM, conversations: list, params: SamplingParams) -> tuple[float, float]:
    ttft, e2e = [], []
    for conversation in conversations:
        out = llm.chat([conversation], params)[0]
        ttft.append(out.ttft_s * 1000)
        e2e.append(out.e2e_s * 1000)
    return statistics.median(ttft), statistics.median(e2e)


def prefix_caching(scenario, name: str, cases: list[Case], repeats: int, model: str) -> list[str]:
    template = scenario_templates(scenario)[name]
    params = SamplingParams(max_tokens=32, structured=template.structured)
    conversations = [template.message_list + [{"role": "user", "content": c.user}] for c in cases[:12]]
    engines = {on: LLM(model=str(resolve_model_path(model)), enable_prefix_caching=on) for on in (True, False)}
    engines[True].pin_prefix(template)
    engines[False].engine.compile_structured(template.structured)
    results = {True: [], False: []}
    for _ in range(repeats):
        for on, llm in engines.items():
            results[on].append(timed_one_by_one(llm, conversations, params))
    return [_timing_row(name, "on (template pinned)" if on else "off", results[on], results[True])
            for on in (True, False)]


def _timing_row(name: str, label: str, runs: list, baseline: list) -> str:
    ttft, e2e = [r[0] for r in runs], [r[1] for r in runs]
    ratio = statistics.median(ttft) / statistics.median([r[0] for r in baseline])
    return (f"| {name} | {label} | {statistics.median(ttft):.1f} [{min(ttft):.1f}-{max(ttft):.1f}] | "
            f"{statistics.median(e2e):.1f} [{min(e2e):.1f}-{max(e2e):.1f}] | {ratio:.2f}x |")


def forced_tokens(scenario, name: str, cases: list[Case], repeats: int, model: str) -> list[str]:
    template = scenario_templates(scenario)[name]
    params = SamplingParams(max_tokens=32, structured=template.structured)
    conversations = [template.message_list + [{"role": "user", "content": c.user}] for c in cases[:24]]
    engines = {on: LLM(model=str(resolve_model_path(model)), jump_forward=on) for on in (True, False)}
    steps, seconds, forced, tokens = {True: [], False: []}, {True: [], False: []}, 0, 0
    for _ in range(repeats):
        for on, llm in engines.items():
            before, started = llm.engine.snapshot().steps, time.perf_counter()
            outs = llm.chat(conversations, params)
            seconds[on].append(time.perf_counter() - started)
            steps[on].append(llm.engine.snapshot().steps - before)
            forced, tokens = sum(o.num_forced_tokens for o in outs), sum(len(o.token_ids) for o in outs)
    return [f"| {name} | {'on' if on else 'off'} | {statistics.median(steps[on]):.0f} | "
            f"{statistics.median(seconds[on]):.2f} [{min(seconds[on]):.2f}-{max(seconds[on]):.2f}] | "
            f"{forced} of {tokens} |" for on in (True, False)]


def masking_cost(repeats: int, model: str, streams: tuple[int, ...] = (1, 8, 32), tokens: int = 48) -> list[str]:
    llm = LLM(model=str(resolve_model_path(model)), max_num_seqs=64)
    llm.engine.compile_structured(FREE_TEXT)
    prompts = [f"Describe cell {i} of the network." for i in range(max(streams))]
    per_step: dict[tuple, list[float]] = {}
    for constrained in (False, True):  # warm-up: first steps build kernels and caches
        warm_up = SamplingParams(max_tokens=tokens, structured=FREE_TEXT if constrained else None)
        _decode_step_ms(llm, prompts[:2], warm_up)
    for _ in range(repeats):
        for n in streams:
            for temperature in (0.0, 0.8):
                for constrained in (False, True):
                    params = SamplingParams(max_tokens=tokens, ignore_eos=not constrained, temperature=temperature,
                                            seed=7, structured=FREE_TEXT if constrained else None)
                    key = (n, temperature, constrained)
                    per_step.setdefault(key, []).append(_decode_step_ms(llm, prompts[:n], params))
    return [_masking_row(n, t, per_step[(n, t, False)], per_step[(n, t, True)])
            for t in (0.0, 0.8) for n in streams]


def _masking_row(n: int, temperature: float, free: list[float], masked: list[float]) -> str:
    overhead = statistics.median(masked) / statistics.median(free) - 1
    sampling = "greedy" if temperature == 0 else f"sampled (T={temperature})"
    return (f"| {n} | {sampling} | {statistics.median(free):.2f} [{min(free):.2f}-{max(free):.2f}] | "
            f"{statistics.median(masked):.2f} [{min(masked):.2f}-{max(masked):.2f}] | {overhead:+.1%} |")


def _decode_step_ms(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    """Median wall time of the steps in which every stream decodes (masking, sampling, grammar included)."""
    engine = llm.engine
    seqs = [engine.add_request(p, params) for p in prompts]
    times = full_decode_step_ms(engine, seqs, "bench_decisions (masking cost)")
    return statistics.median(times)


def cpu_flags() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    return "with AMX" if cpuinfo.exists() and "amx_tile" in cpuinfo.read_text() else "without AMX"


def model_accuracy(model: str, scenarios: list, cases: dict, use_adapters: bool,
                   llamacpp_python: str | None) -> tuple[list[Scored], list[str]]:
    """Every scenario's templates asked of one model; its rows and how it ran. Adapters are trained
    for this model as base (each model with its own)."""
    path = resolve_model_path(model)
    llm = LLM(model=str(path))
    scored = []
    for scenario in scenarios:
        adapters = scenario_adapters(scenario, path) if use_adapters else {}
        scored += [s for name, named in cases[scenario.name].items()
                   for s in ask_template(llm, model, scenario, name, named, adapters.get(name))]
    runtime = llm.engine.runtime
    how = [f"{model}: ricllm {runtime.name} runtime, weights {runtime.weight_formats[0]}"]
    if llamacpp_python is not None:
        peer, build = llamacpp_scores(llamacpp_python, llm, path, scored, cases)
        scored += peer
        how.append(f"{model}: {build}")
    return scored, how


def llamacpp_python_of(args) -> str | None:
    """The interpreter that runs llama.cpp, or None (said) where none does."""
    python = args.llamacpp_python or sys.executable
    check = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True, check=False)
    if check.returncode == 0:
        return python
    if args.llamacpp_python:
        raise SystemExit(f"bench_decisions: `import llama_cpp` fails under {python}; install llama-cpp-python there "
                         "(`bash scripts/setup.sh --bench` does for this venv)")
    print(f"bench_decisions: no llama.cpp under {python} (`bash scripts/setup.sh --bench` installs it, "
          "--llamacpp-python names another interpreter): its rows are left out", file=sys.stderr)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=["default"],
                        help="scenarios whose templates are asked, e.g. default templates link (default: "
                             "%(default)s); the timed parts use the first one's first template")
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"],
                        help="models asked, installed names or GGUF files (default: %(default)s); the timed parts "
                             "use the first")
    parser.add_argument("--rows", type=int, default=80, help="KPI rows asked per template (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the timed parts")
    parser.add_argument("--no-append", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--no-adapters", action="store_true",
                        help="leave out the adapter variant (templates that name an adapter are not trained)")
    parser.add_argument("--accuracy-only", action="store_true", help="only the accuracy table, not the timed parts")
    parser.add_argument("--llamacpp-python", help="an interpreter with llama-cpp-python for the llama.cpp rows "
                        "(default: this one, where it has llama-cpp-python)")
    parser.add_argument("--skip-llamacpp", action="store_true", help="leave out the llama.cpp rows")
    args = parser.parse_args()
    scenarios = [load_scenario(name) for name in args.scenarios]
    cases = {}
    for scenario in scenarios:
        rows = scored_rows(scenario, load_scenario_trace(scenario).rows)
        cases[scenario.name] = {name: template_cases(scenario, name, rows, args.rows, seed=i)
                                for i, name in enumerate(scenario_policies(scenario))}
    llamacpp = None if args.skip_llamacpp else llamacpp_python_of(args)
    scored, ran = [], []
    for model in args.models:
        rows, how = model_accuracy(model, scenarios, cases, not args.no_adapters, llamacpp)
        scored += rows
        ran += how
    ratios = decision_ratios(scored)
    body = "\n".join([
        ("Accuracy (greedy; valid = parses and matches the schema; correct = the policy's action, ± its "
         "standard error; majority = always answering the rows' most common action; decision ms = median E2E "
         f"of {TIMED_CASES} requests sent one at a time, after the pass over every row). llama.cpp reads the same "
         "token ids under a GBNF grammar of the same constraint.\n"),
        "| model | engine | scenario | template | prompt | output | rows | majority | valid | correct | decision ms |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|", *[s.row() for s in scored],
    ] + ([] if not ratios else [
        "\nTime to decision, constrained, one request at a time (ms; llama.cpp ÷ ricllm > 1: ricllm decides sooner):\n",
        "| model | scenario | template | prompt | ricllm ms | llama.cpp ms | llama.cpp ÷ ricllm | ricllm correct | "
        "llama.cpp correct |", "|---|---|---|---|---:|---:|---:|---:|---:|", *ratios,
    ]) + ([] if args.accuracy_only else timed_parts(scenarios[0], cases[scenarios[0].name], args.models[0],
                                                     args.repeats)))
    publish("Decisions: accuracy and the cost of constraints",
            f"CPU {cpu_flags()}; scenarios {', '.join(args.scenarios)}; " + "; ".join(ran) + ".",
            body, append=not args.no_append)


def timed_parts(scenario, cases: dict, model: str, repeats: int) -> list[str]:
    first = next(iter(cases))
    return [
        (f"\nPrefix caching, one request at a time ({model}, {first} with its examples; ms, median [range] of "
         f"{repeats} interleaved runs of 12 requests):\n"),
        "| template | prefix caching | TTFT ms | E2E ms | TTFT vs on |", "|---|---|---:|---:|---:|",
        *prefix_caching(scenario, first, cases[first], repeats, model),
        f"\nForced tokens ({first}, 24 requests in one batch; seconds median [range] of {repeats}):\n",
        "| template | jump-forward | engine steps | seconds | forced of all output tokens |",
        "|---|---|---:|---:|---:|", *forced_tokens(scenario, first, cases[first], repeats, model),
        (f"\nMasking cost per decode step (a JSON string of 20-400 characters, vs unconstrained; steps where all "
         f"streams decode; ms per step, median [range] of {repeats}):\n"),
        "| streams | sampling | unconstrained ms | constrained ms | overhead |", "|---:|---|---:|---:|---:|",
        *masking_cost(repeats, model),
    ]


if __name__ == "__main__":
    main()
