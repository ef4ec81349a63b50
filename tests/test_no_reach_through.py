"""The fronts (``serve/``, ``replay/``, ``cli/``) use the engine through its public methods: none of
them reaches into its scheduler, its KV cache manager or a private name, so the engine can change
what lies behind ``queue_position``, ``is_pinned`` or ``abort_all`` without them.

Read from the sources with ``ast``: an attribute access ``<x>.engine.<name>`` or ``engine.<name>``
whose ``<name>`` is one of ``INTERNALS`` or starts with an underscore is a reach-through."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRONTS = ("serve", "replay", "cli")
INTERNALS = {"scheduler", "cache"}


def _names_engine(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine")


def reach_throughs(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and _names_engine(node.value) and (
                node.attr in INTERNALS or (node.attr.startswith("_") and not node.attr.startswith("__"))):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: engine.{node.attr}")
    return found


def test_the_fronts_reach_no_engine_internals():
    found = [hit for front in FRONTS for path in sorted((ROOT / "ricllm" / front).rglob("*.py"))
             for hit in reach_throughs(path)]
    assert not found, "use the engine's public methods instead:\n" + "\n".join(found)


def test_the_check_sees_a_reach_through(tmp_path):
    sample = ROOT / "tests" / "_reach_sample.py"
    sample.write_text("def f(self, engine):\n    return self.engine.scheduler.waiting, engine._idle_at(0)\n")
    try:
        assert [hit.split(": ")[1] for hit in reach_throughs(sample)] == ["engine.scheduler", "engine._idle_at"]
    finally:
        sample.unlink()
