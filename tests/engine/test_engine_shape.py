"""The engine reads like its algorithm: ``step`` names its phases (schedule → run → process
outputs) in a few lines, and ``LLMEngine`` stays small, its work done by collaborators that own
their state (request checks, constrained decoding, output processing, step recording).

Read from the source with ``ast``, so the shape is kept as the engine changes."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "ricllm" / "engine" / "llm_engine.py"
MAX_METHODS = 23
MAX_STEP_LINES = 15


def _engine_class() -> ast.ClassDef:
    tree = ast.parse(ENGINE.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")


def _methods(cls: ast.ClassDef) -> list[ast.FunctionDef]:
    """Every function defined in the class body: methods, properties, static and class methods."""
    return [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _code_lines(func: ast.FunctionDef) -> int:
    """Lines from ``def`` to the end, less the docstring's."""
    lines = func.end_lineno - func.lineno + 1
    first = func.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_the_engine_has_at_most_23_methods():
    names = [m.name for m in _methods(_engine_class())]
    assert len(names) <= MAX_METHODS, f"{len(names)} methods: {names}"


def test_step_is_at_most_15_lines_naming_its_phases():
    step = next(m for m in _methods(_engine_class()) if m.name == "step")
    assert _code_lines(step) <= MAX_STEP_LINES
    called = [n.func.attr for n in ast.walk(step) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    phases = ["_schedule", "_run", "append"]  # schedule → run → process outputs (the output processor)
    assert [c for c in called if c in phases] == phases


def test_output_processing_and_constrained_decoding_live_outside_the_engine():
    """Nothing in the engine's class detokenizes, matches stop strings, builds outputs, masks
    logits or walks a grammar: its collaborators do."""
    source = ast.get_source_segment(ENGINE.read_text(), _engine_class())
    for owned_elsewhere in ("detokenizer", "RequestOutput(", "params.stop", ".guide", "allowed_tokens",
                            "forced_tokens", "GrammarCompiler", ".mask("):
        assert owned_elsewhere not in source, owned_elsewhere


def test_the_count_sees_a_large_class(tmp_path):
    many = "class LLMEngine:\n" + "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_METHODS + 1))
    assert len(_methods(ast.parse(many).body[0])) > MAX_METHODS
    long_step = ast.parse("def step(self):\n    '''doc'''\n" + "    x = 1\n" * MAX_STEP_LINES).body[0]
    assert _code_lines(long_step) > MAX_STEP_LINES
