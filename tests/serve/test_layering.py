"""The socket and engine threads share a ``ServerState``, never the ``Server``: neither module
imports ``ricllm.serve.server``, at any level (module, function, ``TYPE_CHECKING``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVE = Path(__file__).resolve().parents[2] / "ricllm" / "serve"


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` anywhere in the file names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", ["frontend.py", "worker.py", "state.py", "handoff.py", "intake.py", "openai_routes.py"])
def test_the_threads_modules_do_not_import_the_server(module):
    assert "ricllm.serve.server" not in imported_modules(SERVE / module)


def test_the_engine_loop_does_not_import_serve():
    engine_loop = SERVE.parent / "engine" / "engine_loop.py"
    assert not any(name.startswith("ricllm.serve") for name in imported_modules(engine_loop))
